//! End-to-end tests of the disaggregated deployment with real processes on loopback (the `tandem` binary
//! cargo built for these tests). Each test starts its own topology with a small KV cache and one thread
//! per worker, one test at a time; without the default model they skip.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use tandem_cluster::{Role, WorkerLoad, WorkerStatus};
use tandem_testkit::{
    default_model, model_path, signal, text, Server, DEFAULT_MODEL_NAME, PROMPTS,
};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// Serializes the tests: the machine has few cores and each topology loads the model three times.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This test's turn (held until it ends), or `None` when the default model is absent and it skips.
async fn turn() -> Option<tokio::sync::MutexGuard<'static, ()>> {
    model_path()?;
    Some(SERIAL.lock().await)
}

const ENGINE: &str =
    "engine: {block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 8}\n";

fn pd_yaml(prefill: usize) -> String {
    pd_yaml_with(prefill, 1)
}

fn pd_yaml_with(prefill: usize, decode: usize) -> String {
    pd_yaml_timeouts(prefill, decode, "poll_interval_secs: 0.2")
}

/// Open on loopback (`allow_unauthenticated`: no generated token): the tests list and call the workers
/// directly, and register workers started by hand. Prompts that continue a cached prefix go to the
/// prefill worker like any other (`local_continuation_threshold: 0`), so these tests see transfers;
/// [`pd_yaml_continuations`] keeps the default rule.
fn pd_yaml_timeouts(prefill: usize, decode: usize, timeouts: &str) -> String {
    pd_yaml_routing(
        prefill,
        decode,
        timeouts,
        "local_prefill_threshold: 16, local_continuation_threshold: 0",
    )
}

/// One prefill and one decode worker with the default rule for continuations.
fn pd_yaml_continuations() -> String {
    pd_yaml_routing(
        1,
        1,
        "poll_interval_secs: 0.2",
        "local_prefill_threshold: 16",
    )
}

fn pd_yaml_routing(prefill: usize, decode: usize, timeouts: &str, routing: &str) -> String {
    format!(
        "model: {}\n{ENGINE}deployment:\n  mode: pd\n  allow_unauthenticated: true\n  prefill: {{replicas: {prefill}}}\n  decode: {{replicas: {decode}}}\n  \
         kv_transfer: {{transport: tcp, pin_timeout_secs: 20}}\n  routing: {{{routing}}}\n  \
         timeouts: {{{timeouts}}}\n",
        default_model().display()
    )
}

fn colocated_yaml() -> String {
    format!(
        "model: {}\n{ENGINE}deployment: {{mode: colocated}}\n",
        default_model().display()
    )
}

/// The cluster view of a P/D server: its workers and their load.
trait Cluster {
    /// The registered workers.
    async fn workers(&self) -> Vec<WorkerStatus>;
    /// The first worker of `role`.
    async fn worker(&self, role: Role) -> WorkerStatus;
    /// The load a worker reports on its own RPC.
    async fn load(&self, worker_url: &str) -> WorkerLoad;
}

impl Cluster for Server {
    async fn workers(&self) -> Vec<WorkerStatus> {
        self.get_json("/v1/cluster/workers").await
    }

    async fn worker(&self, role: Role) -> WorkerStatus {
        self.workers()
            .await
            .into_iter()
            .find(|w| w.info.role == role)
            .expect("a worker of that role")
    }

    async fn load(&self, worker_url: &str) -> WorkerLoad {
        self.get_json(&format!("{worker_url}/v1/worker/load")).await
    }
}

/// Asserts that between two load snapshots of a decode worker it pulled KV `pulls` times and prefilled
/// nothing itself.
fn assert_pulled_without_prefilling(before: &WorkerLoad, after: &WorkerLoad, pulls: u64) {
    assert_eq!(
        after.engine.prefill_tokens_computed, before.engine.prefill_tokens_computed,
        "decode worker prefilled"
    );
    assert_eq!(after.kv.pulls_ok - before.kv.pulls_ok, pulls);
}

/// The colocated deployment's greedy 12-token answers to [`PROMPTS`], the reference of the P/D tests.
async fn colocated_answers() -> Vec<Value> {
    let colocated = Server::with_config(BIN, &colocated_yaml());
    let mut want = Vec::new();
    for p in PROMPTS {
        want.push(colocated.complete(p, 12).await);
    }
    want
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_matches_colocated_and_decode_never_prefills() {
    let Some(_turn) = turn().await else { return };
    let want = colocated_answers().await;

    let pd = Server::with_config(BIN, &pd_yaml(1));
    let decode = pd.worker(Role::Decode).await;
    let before = pd.load(&decode.url).await;
    let mut expected_bytes = 0u64;
    let layout = decode.info.peer.layout;
    for (p, want) in PROMPTS.iter().zip(&want) {
        let got = pd.complete(p, 12).await;
        assert_eq!(text(&got), text(want), "prompt {p:?}");
        let prompt_tokens = got["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        assert!(
            prompt_tokens >= 32,
            "the prompt must exceed the local-prefill threshold"
        );
        expected_bytes += (prompt_tokens.div_ceil(layout.block_size)
            * layout.block_bytes()
            * layout.n_layers) as u64;
    }
    let after = pd.load(&decode.url).await;
    assert_pulled_without_prefilling(&before, &after, PROMPTS.len() as u64);
    assert_eq!(
        after.kv.bytes_received - before.kv.bytes_received,
        expected_bytes
    );
    pd.assert_metrics(&[
        &format!("tandem:kv_transfer_bytes_total {expected_bytes}"),
        "tandem:pd_requests_total{prefill=\"remote\"} 3",
    ])
    .await;
    // Logs for machines: no colour codes in a redirected log; the completions are INFO lines, the
    // scrapes and probes (the /metrics above, the health polls at start-up) are not.
    let log = pd.log();
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a redirected log:\n{log}"
    );
    if std::env::var_os("RUST_LOG").is_none() {
        assert!(log.contains("path=/v1/completions"), "{log}");
        assert!(
            log.contains("generation finished finish=\"length\" completion_tokens=12"),
            "{log}"
        );
        assert!(
            !log.contains("path=/metrics") && !log.contains("path=/health"),
            "{log}"
        );
    }
}

/// Prefill split over 2 tensor-parallel ranks, decode over 3: the KV crosses in the canonical all-heads
/// layout, so the answer equals the colocated single-rank one and decode still prefills nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_across_different_tensor_parallel_sizes_matches_colocated() {
    let Some(_turn) = turn().await else { return };
    let want = colocated_answers().await;

    let yaml = pd_yaml(1).replace(
        "prefill: {replicas: 1}",
        "prefill: {replicas: 1, engine: {tensor_parallel_size: 2}}",
    );
    let yaml = yaml.replace(
        "decode: {replicas: 1}",
        "decode: {replicas: 1, engine: {tensor_parallel_size: 3}}",
    );
    let pd = Server::with_config(BIN, &yaml);
    let decode = pd.worker(Role::Decode).await;
    let before = pd.load(&decode.url).await;
    for (p, want) in PROMPTS.iter().zip(&want) {
        assert_eq!(text(&pd.complete(p, 12).await), text(want), "prompt {p:?}");
    }
    let after = pd.load(&decode.url).await;
    assert_pulled_without_prefilling(&before, &after, PROMPTS.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_cached_on_the_decode_worker_is_not_transferred_again() {
    let Some(_turn) = turn().await else { return };
    // Token-id prompts, so the shared head is exactly 4 blocks of 16 whatever the tokenizer does.
    let head: Vec<u32> = (0..64u32).map(|i| 300 + (i * 131) % 4000).collect();
    let first: Vec<u32> = head
        .iter()
        .copied()
        .chain((0..20).map(|i| 5000 + i * 7))
        .collect();
    let second: Vec<u32> = head
        .iter()
        .copied()
        .chain((0..40).map(|i| 7000 + i * 11))
        .collect();
    // Sampled with a seed: the prefill worker draws the first token, the decode worker the rest (after
    // pulling the 2 blocks past the cached head: 94 tokens).
    let third: Vec<u32> = head
        .iter()
        .copied()
        .chain((0..30).map(|i| 9000 + i * 5))
        .collect();
    let sampled =
        json!({"prompt": third, "max_tokens": 16, "temperature": 0.8, "top_k": 40, "seed": 1234});
    let colocated = Server::with_config(BIN, &colocated_yaml());
    let want = [
        colocated.complete_ids(&first, 10).await,
        colocated.complete_ids(&second, 10).await,
    ];
    let want_sampled = colocated.complete_with(sampled.clone()).await;
    drop(colocated);

    let pd = Server::with_config(BIN, &pd_yaml(1));
    let decode = pd.worker(Role::Decode).await;
    let layout = decode.info.peer.layout;
    assert_eq!(layout.block_size, 16);
    let block_bytes = (layout.block_bytes() * layout.n_layers) as u64;
    // first: 84 tokens = 6 blocks, nothing cached; second: 104 tokens = 7 blocks, the 4 head blocks cached.
    for ((prompt, want), (pulled, skipped)) in [&first, &second]
        .iter()
        .zip(&want)
        .zip([(6u64, 0u64), (3, 4)])
    {
        let before = pd.load(&decode.url).await;
        let got = pd.complete_ids(prompt, 10).await;
        assert_eq!(text(&got), text(want), "{}", pd.log());
        assert_eq!(
            got["usage"]["prompt_tokens"].as_u64(),
            Some(prompt.len() as u64)
        );
        let after = pd.load(&decode.url).await;
        assert_eq!(
            after.kv.bytes_received - before.kv.bytes_received,
            pulled * block_bytes,
            "KV bytes moved for a {}-token prompt",
            prompt.len()
        );
        assert_eq!(
            (
                after.kv.blocks_pulled - before.kv.blocks_pulled,
                after.kv.blocks_skipped - before.kv.blocks_skipped
            ),
            (pulled, skipped)
        );
        assert_pulled_without_prefilling(&before, &after, 1);
    }
    let sampled = pd.complete_with(sampled).await;
    assert_eq!(
        text(&sampled),
        text(&want_sampled),
        "seeded sampling P/D vs colocated"
    );
    pd.assert_metrics(&[
        "tandem:kv_transfer_blocks_skipped_total 8",
        "tandem:kv_transfer_blocks_total 11",
        &format!(
            "tandem:kv_transfer_bytes_total {}",
            (6 + 3 + 2) * block_bytes
        ),
        "tandem:pd_requests_total{prefill=\"remote\"} 3",
    ])
    .await;
}

/// The ids `text` encodes to (no special tokens), as a chat client re-encodes an answer.
async fn encode(server: &Server, text: &str) -> Vec<u32> {
    let v = server
        .post_json(
            "/tokenize",
            json!({"prompt": text, "add_special_tokens": false}),
        )
        .await;
    serde_json::from_value(v["tokens"].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversations_next_turn_is_prefilled_on_the_decode_worker_that_holds_it() {
    let Some(_turn) = turn().await else { return };
    // Turn 1: 100 token ids (prefilled remotely); turn 2: turn 1, its answer, and a 40-token user turn.
    let first: Vec<u32> = (0..100u32).map(|i| 400 + (i * 97) % 3000).collect();
    let user: Vec<u32> = (0..40u32).map(|i| 6000 + i * 13).collect();
    let colocated = Server::with_config(BIN, &colocated_yaml());
    let answer = text(&colocated.complete_ids(&first, 12).await);
    let second: Vec<u32> = first
        .iter()
        .copied()
        .chain(encode(&colocated, &answer).await)
        .chain(user.iter().copied())
        .collect();
    let want = text(&colocated.complete_ids(&second, 12).await);
    drop(colocated);

    let pd = Server::with_config(BIN, &pd_yaml_continuations());
    let decode = pd.worker(Role::Decode).await;
    assert_eq!(text(&pd.complete_ids(&first, 12).await), answer);
    let before = pd.load(&decode.url).await;
    assert_eq!(
        text(&pd.complete_ids(&second, 12).await),
        want,
        "{}",
        pd.log()
    );
    let after = pd.load(&decode.url).await;
    assert_eq!(after.kv.pulls_ok, before.kv.pulls_ok, "turn 2 pulled KV");
    let computed = after.engine.prefill_tokens_computed - before.engine.prefill_tokens_computed;
    let cached = after.engine.prefix_cache_hits - before.engine.prefix_cache_hits;
    assert!(
        cached >= 96 && computed > 0 && computed as usize <= second.len() - 96,
        "turn 2 on the decode worker: {cached} cached, {computed} computed of {}",
        second.len()
    );
    pd.assert_metrics(&[
        "tandem:pd_requests_total{prefill=\"remote\"} 1",
        "tandem:pd_requests_total{prefill=\"local\"} 1",
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_prefill_worker_mid_request_still_answers() {
    let Some(_turn) = turn().await else { return };
    let pd = Server::with_config(BIN, &pd_yaml(1));
    let prefill = pd.worker(Role::Prefill).await;
    let long: String = PROMPTS
        .iter()
        .cycle()
        .take(12)
        .copied()
        .collect::<Vec<_>>()
        .join(" ");
    let request = {
        let (http, url, long) = (pd.http.clone(), pd.url.clone(), long.clone());
        tokio::spawn(async move {
            let body = json!({"model": DEFAULT_MODEL_NAME, "prompt": long, "max_tokens": 8, "temperature": 0});
            http.post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        })
    };
    // Wait until the prefill worker is busy with it, then kill it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while pd.load(&prefill.url).await.in_flight == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    signal(prefill.info.pid, "-9");
    let got = request.await.unwrap();
    let finish = got["choices"][0]["finish_reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        finish == "length" || finish == "stop",
        "incomplete answer: {got}\n{}",
        pd.log()
    );
    // The same prompt now goes to the decode worker alone; greedy answers must agree.
    let again = pd.complete(&long, 8).await;
    assert_eq!(text(&got), text(&again));
    let metrics = pd.metrics().await;
    assert!(
        !metrics.contains("tandem:pd_requests_total{prefill=\"fallback\"} 0"),
        "{metrics}"
    );
}

/// Starts a long greedy completion in the background, waits until a decode worker has generated a few of
/// its tokens, and SIGKILLs that worker; returns the answer's status and body.
async fn kill_the_decoder_mid_request(pd: &Server, body: Value) -> (reqwest::StatusCode, Value) {
    let (status, body, _) = signal_the_decoder_mid_request(pd, body, "-KILL").await;
    (status, body)
}

/// Like [`kill_the_decoder_mid_request`] with any signal (`-STOP` freezes the worker); also returns the
/// signalled worker's pid.
async fn signal_the_decoder_mid_request(
    pd: &Server,
    body: Value,
    signal_name: &str,
) -> (reqwest::StatusCode, Value, u32) {
    let decoders: Vec<WorkerStatus> = pd
        .workers()
        .await
        .into_iter()
        .filter(|w| w.info.role == Role::Decode && w.healthy)
        .collect();
    let mut before = Vec::new();
    for d in &decoders {
        before.push(pd.load(&d.url).await.engine.generation_tokens_total);
    }
    let request = pd.spawn_completion(body);
    let deadline = Instant::now() + Duration::from_secs(60);
    let victim = 'found: loop {
        for (d, &b) in decoders.iter().zip(&before) {
            if pd.load(&d.url).await.engine.generation_tokens_total >= b + 4 {
                break 'found d;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no decode worker started generating"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    signal(victim.info.pid, signal_name);
    // Never a hang: the answer comes, complete or failed, well within the bound.
    let (status, body) = tokio::time::timeout(Duration::from_secs(120), request)
        .await
        .expect("the request ended after its decode worker was signalled")
        .unwrap();
    (status, body, victim.info.pid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_decode_worker_mid_stream_resumes_elsewhere_or_fails_cleanly() {
    let Some(_turn) = turn().await else { return };
    let pd = Server::with_config(BIN, &pd_yaml_with(1, 2));
    let body = json!({"model": DEFAULT_MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 160,
                      "temperature": 0, "ignore_eos": true});
    let want = pd.complete_with(body.clone()).await;
    // Two decode workers: the survivor recomputes prompt + delivered tokens and finishes the answer.
    let (status, got) = kill_the_decoder_mid_request(&pd, body.clone()).await;
    assert!(status.is_success(), "{status}: {got}\n{}", pd.log());
    assert_eq!(got["choices"][0]["finish_reason"], "length", "{got}");
    assert_eq!(
        text(&got),
        text(&want),
        "the resumed answer continues the same tokens"
    );
    pd.assert_metrics(&["tandem:decode_resumes_total 1"]).await;
    // No decode worker left to resume on: the request fails with an error instead of hanging.
    let (status, got) = kill_the_decoder_mid_request(&pd, body).await;
    assert!(status.is_server_error(), "{status}: {got}");
    assert!(
        got["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{got}"
    );
}

/// A decode worker that freezes (SIGSTOP: its connections stay open, no token ever comes) is given up
/// after `timeouts.token_stall_secs` and the request finishes on the other decode worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_decode_worker_is_given_up_after_the_stall_timeout() {
    let Some(_turn) = turn().await else { return };
    let pd = Server::with_config(
        BIN,
        &pd_yaml_timeouts(1, 2, "poll_interval_secs: 0.2, token_stall_secs: 3"),
    );
    let body = json!({"model": DEFAULT_MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 160,
                      "temperature": 0, "ignore_eos": true});
    let want = pd.complete_with(body.clone()).await;
    let (status, got, frozen) = signal_the_decoder_mid_request(&pd, body, "-STOP").await;
    // A stopped process only dies by SIGKILL; do it before any assertion can leave it behind.
    let _ = Command::new("kill")
        .args(["-KILL", &frozen.to_string()])
        .status();
    assert!(status.is_success(), "{status}: {got}\n{}", pd.log());
    assert_eq!(
        text(&got),
        text(&want),
        "the resumed answer continues the same tokens"
    );
    pd.assert_metrics(&["tandem:decode_resumes_total 1"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_abort_frees_blocks_on_both_sides() {
    let Some(_turn) = turn().await else { return };
    let pd = Server::with_config(BIN, &pd_yaml(1));
    let prefill = pd.worker(Role::Prefill).await;
    let decode = pd.worker(Role::Decode).await;
    let body = json!({"model": DEFAULT_MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": true, "ignore_eos": true});
    let resp = pd
        .http
        .post(format!("{}/v1/completions", pd.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    let mut body = resp.bytes_stream();
    let mut chunks = 0;
    while chunks < 4 {
        let chunk = body.next().await.expect("stream continues").unwrap();
        chunks += String::from_utf8_lossy(&chunk).matches("data:").count();
    }
    assert!(
        pd.load(&decode.url).await.engine.kv_blocks_used > 0,
        "the decode worker holds the sequence"
    );
    drop(body);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (p, d) = (pd.load(&prefill.url).await, pd.load(&decode.url).await);
        let freed = p.engine.kv_blocks_used == 0
            && p.pinned_blocks == 0
            && d.engine.kv_blocks_used == 0
            && d.engine.running == 0;
        if freed {
            assert!(
                d.engine.generation_tokens_total < 2000,
                "the request ran to the end instead of aborting"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "blocks not freed: prefill {p:?}, decode {d:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_another_block_size_is_refused_naming_the_field() {
    let Some(_turn) = turn().await else { return };
    let pd = Server::with_config(BIN, &pd_yaml(1));
    let out = Command::new(BIN)
        .args([
            "worker",
            "--role",
            "decode",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "64MiB",
            "--threads",
            "1",
        ])
        .arg("--model")
        .arg(default_model())
        .args(["--register", &pd.url])
        .stdin(Stdio::null())
        .output()
        .expect("worker runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a mismatched worker must not stay up:\n{stderr}"
    );
    assert!(
        stderr.contains("block_size"),
        "the refusal must name block_size:\n{stderr}"
    );
    assert_eq!(
        pd.workers().await.len(),
        2,
        "the refused worker must not be registered"
    );
}

/// `transport: nixl` where NIXL cannot be loaded fails at start-up, naming the library it tried —
/// never a deployment that comes up and fails (or silently falls back) at request time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_nixl_library_fails_at_start_naming_it() {
    let Some(_turn) = turn().await else { return };
    let dir = std::env::temp_dir().join(format!("tandem-no-nixl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = pd_yaml(1).replace(
        "kv_transfer: {transport: tcp,",
        &format!(
            "kv_transfer: {{transport: nixl, nixl_library: {},",
            dir.display()
        ),
    );
    let config = dir.join("pd.yaml");
    std::fs::write(&config, yaml).unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--port", "0", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .output()
        .expect("tandem serve runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it must not serve:\n{stderr}");
    assert!(
        stderr.contains(&dir.display().to_string()) && stderr.contains("libnixl_capi"),
        "the error must name the library path tried:\n{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// P/D over NIXL (the unpacked `nixl-cu13` wheel named by `TANDEM_TEST_NIXL_LIB`, as `scripts/test.sh` sets
/// it): the same greedy tokens as colocated, the KV pulled, nothing prefilled on the decode worker — both
/// in place (the default: prefill exports into registered staging memory, decode READs into its own, no
/// copy into a transfer buffer on either side) and, with `staging_mib: 0`, through registered buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_over_nixl_matches_colocated() {
    let Some(lib) = std::env::var_os("TANDEM_TEST_NIXL_LIB") else {
        eprintln!("skipped: TANDEM_TEST_NIXL_LIB is unset (scripts/test.sh sets it to the unpacked nixl-cu13 wheel)");
        return;
    };
    let Some(_turn) = turn().await else { return };
    let want = colocated_answers().await;
    for (staging, in_place) in [("", PROMPTS.len() as u64), (" staging_mib: 0,", 0)] {
        let yaml = pd_yaml(1).replace(
            "kv_transfer: {transport: tcp,",
            &format!(
                "kv_transfer: {{transport: nixl, nixl_library: {},{staging}",
                std::path::Path::new(&lib).display()
            ),
        );
        let pd = Server::with_config(BIN, &yaml);
        let decode = pd.worker(Role::Decode).await;
        let prefill = pd.worker(Role::Prefill).await;
        let before = pd.load(&decode.url).await;
        for (p, want) in PROMPTS.iter().zip(&want) {
            let got = pd.complete(p, 12).await;
            assert_eq!(text(&got), text(want), "prompt {p:?} ({staging:?})");
        }
        let after = pd.load(&decode.url).await;
        assert_pulled_without_prefilling(&before, &after, PROMPTS.len() as u64);
        let served = pd.load(&prefill.url).await.kv;
        assert_eq!(
            served.served_in_place, in_place,
            "pulls READ in place from staging ({staging:?})"
        );
        assert_eq!(served.released_ack, PROMPTS.len() as u64, "every pin acked");
        for w in [&prefill, &decode] {
            let l = pd.load(&w.url).await;
            assert_eq!(
                l.staging_free_bytes, l.staging_bytes,
                "every staging slice returned ({staging:?}, {:?})",
                w.info.role
            );
            assert_eq!(l.staging_bytes > 0, staging.is_empty());
        }
    }
}
