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

/// Greedy completions of `PROMPTS`, sent at once so the engine batches them, with their prompts' lengths.
async fn answers(server: &Server) -> Vec<(String, usize)> {
    join_all(PROMPTS.iter().map(|p| async {
        let mut body = greedy_body(p, 12);
        body["model"] = SERVED.into();
        let v = server.complete_with(body).await;
        let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        (text(&v), prompt_tokens)
    }))
    .await
}

/// The tiny Gemma 3 fixtures' KV geometry: `ENGINE`'s 4-token blocks of 2 kv heads × 32 dims in f32 (a
/// layer's block is 2,048 bytes), layers 0–4 attending through a window of 8 positions, layer 5 global.
const GEMMA_BLOCK_BYTES: u64 = 2 * 2 * 4 * 32 * 4;
const GEMMA_WINDOW: usize = 8;
const GEMMA_WINDOWED_LAYERS: u64 = 5;

/// KV bytes a decode worker pulls for an `n`-token tiny-Gemma-3 prompt: every block of the global
/// layer, and of each windowed layer only the blocks from the one holding position `n + 1 - window`
/// (the first the next query sees).
fn gemma_pull_bytes(n: usize) -> (u64, u64) {
    let blocks = n.div_ceil(4) as u64;
    let windowed = blocks - ((n + 1).saturating_sub(GEMMA_WINDOW) / 4) as u64;
    let pulled = (blocks + GEMMA_WINDOWED_LAYERS * windowed) * GEMMA_BLOCK_BYTES;
    let global_only = blocks * (GEMMA_WINDOWED_LAYERS + 1) * GEMMA_BLOCK_BYTES;
    (pulled, global_only)
}

/// The value of the series `name` (the whole line before the value) in a Prometheus text page.
fn series_value(page: &str, name: &str) -> u64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{name} missing in\n{page}")) as u64
}

/// Each token row the server computed went to exactly `top_k` experts of each layer in `moe_layers`,
/// and no other layer has a series. Polled for a few seconds: the engine publishes its counts after
/// the step that answered, and a pipeline's later stages' when it next rests.
async fn assert_expert_tokens(server: &Server, moe_layers: &[usize], top_k: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match expert_tokens_differ(server, moe_layers, top_k).await {
            None => return,
            Some(why) if std::time::Instant::now() > deadline => panic!("{why}"),
            Some(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    }
}

/// How the server's expert series differ from `assert_expert_tokens`' expectation, if they do.
async fn expert_tokens_differ(server: &Server, moe_layers: &[usize], top_k: u64) -> Option<String> {
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
    (per_layer != want).then(|| format!("{per_layer:?} != {want:?} in\n{page}"))
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
    // Qwen3-MoE: three layers, the middle one dense (`mlp_only_layers: [1]`), two experts a token;
    // Qwen2-MoE: three MoE layers, two experts a token.
    let moe_layers: &[usize] = if model.ends_with("tiny-qwen3-moe") {
        &[0, 2]
    } else if model.to_string_lossy().contains("qwen2-moe") {
        &[0, 1, 2]
    } else {
        &[]
    };
    if !moe_layers.is_empty() {
        assert_expert_tokens(&colocated, moe_layers, 2).await;
    }
    drop(colocated);
    assert!(want.iter().all(|(t, _)| !t.is_empty()), "{want:?}");
    if !moe_layers.is_empty() {
        // Split into two stages, the `tandem stage` process's layers are counted too, each once.
        let pipelined = Server::with_config(
            BIN,
            &format!(
                "model: {}\nserved_model_name: {SERVED}\n{}deployment: {{mode: colocated}}\n",
                model.display(),
                ENGINE.replace(
                    "max_num_seqs: 8",
                    "max_num_seqs: 8, pipeline_parallel_size: 2"
                )
            ),
        );
        assert_eq!(answers(&pipelined).await, want, "{}", model.display());
        assert_expert_tokens(&pipelined, moe_layers, 2).await;
    }

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
    if model.to_string_lossy().contains("gemma3") {
        // The windowed layers' blocks behind the window stayed on the prefill worker, and decoding
        // without them still matched colocated, token for token.
        let (pulled, global_only): (u64, u64) = want
            .iter()
            .map(|&(_, n)| gemma_pull_bytes(n))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        assert!(pulled * 2 < global_only, "{pulled} of {global_only}");
        let page = pd.metrics().await;
        assert_eq!(
            series_value(&page, "tandem:kv_transfer_bytes_total"),
            pulled,
            "{page}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma3_gguf_through_pipelined_pd() {
    pd_pipelined_matches_colocated("tiny-gemma3-gguf/model.gguf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma3_hf_through_pipelined_pd() {
    pd_pipelined_matches_colocated("tiny-gemma3").await;
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

/// Gemma 3 270M (`scripts/fetch-model.sh gemma3`; skipped without a word when absent) served through
/// 1P1D with `engine.llamacpp_orders`: the workers' kernels sum as llama.cpp's do at each step size, so
/// greedy continuations equal llama.cpp's recorded ones token for token
/// (tests/fixtures/llamacpp-gemma3/ref.json). The prompts are ones whose continuations part from
/// llama.cpp's with the setting off, so an engine or worker that dropped it fails here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma3_270m_through_pd_equals_llamacpp_with_its_orders() {
    let root = tandem_testkit::root();
    let model = root.join("models/gemma-3-270m-q4_k_m.gguf");
    if !model.exists() {
        eprintln!("skipped: {} is absent", model.display());
        return;
    }
    let _turn = SERIAL.lock().await;
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/llamacpp-gemma3/ref.json")).unwrap(),
    )
    .unwrap();
    let server = Server::with_config(
        BIN,
        &format!(
            "model: {}\nserved_model_name: {SERVED}\n\
             engine: {{threads: 1, kv_cache_memory: 64MiB, llamacpp_orders: true}}\n\
             deployment:\n  mode: pd\n  prefill: {{replicas: 1}}\n  decode: {{replicas: 1}}\n  \
             routing: {{local_prefill_threshold: 0}}\n",
            model.display()
        ),
    );
    for name in GEMMA_PROMPTS_APART_WITHOUT_ORDERS {
        let prompt = reference["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == *name)
            .unwrap_or_else(|| panic!("prompt {name} in ref.json"));
        let greedy = &prompt["greedy"];
        // One request at a time: every decode step holds one token, as llama.cpp's run did.
        let mut body = greedy_body("", greedy.as_array().unwrap().len());
        body["prompt"] = prompt["token_ids"].clone();
        body["model"] = SERVED.into();
        let got = text(&server.complete_with(body).await);
        let want = server
            .post_json("/detokenize", serde_json::json!({"tokens": greedy}))
            .await;
        assert_eq!(got, want["prompt"].as_str().unwrap(), "prompt {name}");
    }
    server
        .assert_metrics(&["tandem:pd_requests_total{prefill=\"remote\"} 2"])
        .await;
}

/// Prompts of the Gemma 3 reference whose greedy continuations part from llama.cpp's when tandem's
/// kernels keep one summation order per kernel (the serving default).
const GEMMA_PROMPTS_APART_WITHOUT_ORDERS: [&str; 2] = ["capital", "village"];
