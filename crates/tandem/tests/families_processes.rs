//! The model families beyond Llama through real processes on loopback: each tiny fixture (Gemma 3's
//! local/global layers, Qwen3's q/k norms, Qwen3-MoE's and Qwen2-MoE's experts; from GGUF and from HF
//! folders) answers through P/D with both workers split into two pipeline stages exactly as it answers
//! colocated on one worker, and the decode worker pulls every prompt's KV instead of prefilling.

use std::path::PathBuf;

use futures::future::join_all;
use tandem_testkit::{greedy_body, text, Server, PROMPTS};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// Serializes the tests: each starts five processes on a machine with few cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const ENGINE: &str =
    "engine: {block_size: 4, kv_cache_memory: 16MiB, threads: 1, max_num_seqs: 8}\n";

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(path)
}

/// The name every deployment below serves its fixture under.
const SERVED: &str = "tiny";

/// Greedy completions of `PROMPTS`, sent at once so the engine batches them.
async fn answers(server: &Server) -> Vec<String> {
    join_all(PROMPTS.iter().map(|p| async {
        let mut body = greedy_body(p, 12);
        body["model"] = SERVED.into();
        text(&server.complete_with(body).await)
    }))
    .await
}

/// The value of the series `name` (the whole line before the value) in a Prometheus text page.
fn series_value(page: &str, name: &str) -> u64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{name} missing in\n{page}")) as u64
}

/// Each token row the server computed went to exactly `top_k` experts of each layer in `moe_layers`,
/// and no other layer has a series.
async fn assert_expert_tokens(server: &Server, moe_layers: &[usize], top_k: u64) {
    let page = server.metrics().await;
    let rows = series_value(&page, "tandem:prompt_tokens_total")
        - series_value(&page, "tandem:prefix_cache_hits_total")
        + series_value(&page, "tandem:generation_tokens_total")
        - PROMPTS.len() as u64;
    let mut per_layer = std::collections::BTreeMap::<usize, u64>::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("tandem:moe_expert_tokens_total{") else {
            continue;
        };
        let layer: usize = rest
            .split("layer=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        *per_layer.entry(layer).or_default() += value as u64;
    }
    let want: std::collections::BTreeMap<usize, u64> =
        moe_layers.iter().map(|&l| (l, rows * top_k)).collect();
    assert_eq!(per_layer, want, "{page}");
}

async fn pd_pipelined_matches_colocated(model: &str) {
    let _turn = SERIAL.lock().await;
    let model = fixture(model);
    let colocated = Server::with_config(
        BIN,
        &format!(
            "model: {}\nserved_model_name: {SERVED}\n{ENGINE}deployment: {{mode: colocated}}\n",
            model.display()
        ),
    );
    let want = answers(&colocated).await;
    if model.ends_with("tiny-qwen3-moe") {
        // Its config: three layers, the middle one dense (`mlp_only_layers: [1]`), two experts a token.
        assert_expert_tokens(&colocated, &[0, 2], 2).await;
    }
    drop(colocated);
    assert!(want.iter().all(|t| !t.is_empty()), "{want:?}");

    let pd = Server::with_config(
        BIN,
        &format!(
            "model: {}\nserved_model_name: {SERVED}\n{ENGINE}deployment:\n  mode: pd\n  \
             prefill: {{replicas: 1, engine: {{pipeline_parallel_size: 2}}}}\n  \
             decode: {{replicas: 1, engine: {{pipeline_parallel_size: 2}}}}\n  \
             kv_transfer: {{transport: tcp, pin_timeout_secs: 20}}\n  routing: {{local_prefill_threshold: 4}}\n",
            model.display()
        ),
    );
    assert_eq!(answers(&pd).await, want, "{}", model.display());
    pd.assert_metrics(&["tandem:pd_requests_total{prefill=\"remote\"} 3"])
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma3_gguf_through_pipelined_pd() {
    pd_pipelined_matches_colocated("tiny-gemma3-gguf/model.gguf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_hf_through_pipelined_pd() {
    pd_pipelined_matches_colocated("tiny-qwen3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_moe_hf_through_pipelined_pd() {
    pd_pipelined_matches_colocated("tiny-qwen3-moe").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen2_moe_gguf_through_pipelined_pd() {
    pd_pipelined_matches_colocated("tiny-qwen2-moe-gguf/model.gguf").await;
}
