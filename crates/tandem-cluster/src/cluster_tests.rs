//! The whole P/D path in one process over loopback, with the engine's mock model (no model file).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tandem_api::{GenerateBackend, GenerateRequest};
use tandem_engine::{Backend, Engine, EngineConfig, EngineHandle, SamplingParams, TokenOutput};
use tandem_kv::KvError;
use tandem_testkit::{mock_guide, mock_text, MockBackend};

use crate::protocol::{PrefillRequest, Role};
use crate::{
    ClusterError, Ingress, KvTransferConfig, RoutingConfig, TimeoutConfig, WorkerConfig,
    WorkerService,
};

pub(crate) const BLOCK: usize = 4;

pub(crate) fn engine(block_size: usize) -> EngineHandle {
    engine_on(MockBackend::new(block_size, 64))
}

fn engine_on(mock: MockBackend) -> EngineHandle {
    let config = EngineConfig {
        block_size: mock.kv_layout().block_size,
        max_num_seqs: 8,
        ..EngineConfig::default()
    };
    Engine::start_guided(mock, config, Some(mock_guide())).expect("engine starts")
}

/// A worker serving on loopback; abort the task to make it vanish like a killed process.
pub(crate) struct TestWorker {
    pub(crate) url: String,
    pub(crate) engine: EngineHandle,
    pub(crate) service: Arc<WorkerService>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

pub(crate) async fn worker(role: Role, block_size: usize) -> TestWorker {
    worker_on(role, engine(block_size)).await
}

pub(crate) async fn worker_on(role: Role, engine: EngineHandle) -> TestWorker {
    worker_keyed(role, engine, None).await
}

/// A worker requiring `key` (when set) of its callers and KV peers.
pub(crate) async fn worker_keyed(
    role: Role,
    engine: EngineHandle,
    key: Option<crate::ClusterKey>,
) -> TestWorker {
    worker_with(role, engine, key, false).await
}

/// [`worker_keyed`], with `/metrics` behind the token when `metrics_need_token`.
pub(crate) async fn worker_with(
    role: Role,
    engine: EngineHandle,
    key: Option<crate::ClusterKey>,
    metrics_need_token: bool,
) -> TestWorker {
    let peer = crate::peer_info(&engine, "mock".into(), 2);
    let config = WorkerConfig {
        worker_id: format!("{role}-test"),
        role,
        kv_listen: "127.0.0.1:0".into(),
        kv_advertise_host: None,
        kv: KvTransferConfig {
            pin_timeout_secs: 5.0,
            ..KvTransferConfig::default()
        },
        max_num_seqs: 8,
        gpu: false,
        cluster_key: key,
        tls: None,
        metrics_need_token,
    };
    let service = WorkerService::start(engine.clone(), peer, config)
        .await
        .expect("worker starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = closing(Arc::clone(&service).router());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    TestWorker {
        url,
        engine,
        service,
        task,
    }
}

/// `router` answering with `Connection: close`: aborting a test worker's server task then leaves no
/// kept-alive connection answering for it, as none would for a dead process.
pub(crate) fn closing(router: axum::Router) -> axum::Router {
    router.layer(axum::middleware::map_response(
        |mut r: axum::response::Response| async move {
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            r
        },
    ))
}

/// An ingress whose local-prefill rule is `threshold` alone: prompts continuing a prefix the decode
/// worker caches go to a prefill worker like any other (the continuation rule has its own tests in
/// `routing` and `tests/pd_processes.rs`), so these tests see the prefill workers' prefix affinity.
pub(crate) fn ingress(threshold: usize) -> Ingress {
    let routing = RoutingConfig {
        local_prefill_threshold: threshold,
        local_continuation_threshold: 0,
        ..RoutingConfig::default()
    };
    Ingress::new(
        routing,
        TimeoutConfig::default(),
        Some("mock".into()),
        None,
        tandem_api::ServeLimits::default().header_read_timeout,
    )
    .unwrap()
}

/// An ingress (local-prefill threshold `threshold`) with `workers` registered, in order.
async fn registered(threshold: usize, workers: &[&TestWorker]) -> Ingress {
    let ingress = ingress(threshold);
    for w in workers {
        ingress.register(&w.url).await.unwrap();
    }
    ingress
}

/// The test cluster: one worker of block size [`BLOCK`] per role, started in order, all registered with
/// an ingress of local-prefill threshold `threshold`.
async fn cluster<const N: usize>(threshold: usize, roles: [Role; N]) -> ([TestWorker; N], Ingress) {
    let mut workers = Vec::with_capacity(N);
    for role in roles {
        workers.push(worker(role, BLOCK).await);
    }
    let ingress = registered(threshold, &workers.iter().collect::<Vec<_>>()).await;
    let workers = workers.try_into().ok().expect("one worker per role");
    (workers, ingress)
}

pub(crate) fn prompt(seed: u32) -> Vec<u32> {
    (0..23).map(|i| (i * 7 + seed) % 60).collect()
}

pub(crate) async fn collect(
    backend: &dyn GenerateBackend,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> Vec<TokenOutput> {
    backend
        .submit(GenerateRequest::new(1, prompt, params))
        .expect("accepted")
        .map(|o| o.expect("generation succeeds"))
        .collect()
        .await
}

/// A prefill on `p` that leaves its KV pinned for a pull: the transfer handle.
async fn pinned_prefill(
    p: &TestWorker,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> tandem_kv::TransferHandle {
    p.service
        .prefill(PrefillRequest { prompt, params })
        .await
        .unwrap()
        .handle
        .expect("pinned")
}

/// Asks `p` over its RPC to release an unpulled pin: whether it held one.
async fn release(p: &TestWorker, transfer_id: u64) -> bool {
    tandem_testkit::json_of(
        reqwest::Client::new()
            .post(format!("{}{}", p.url, crate::protocol::PATH_RELEASE))
            .json(&crate::protocol::ReleaseRequest { transfer_id }),
    )
    .await
}

/// Waits until the worker's engine holds no block (pinned or in use) and the KV server no transfer.
async fn drained(w: &TestWorker) {
    for _ in 0..200 {
        let load = w.service.load();
        let stats = w.engine.checked_stats().wait().await.unwrap();
        if stats.kv_blocks_used == 0 && load.pinned_blocks == 0 && load.pinned_transfers == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{} did not drain: {:?}", w.url, w.service.load());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_tokens_match_colocated_and_decode_never_prefills() {
    let colocated = engine(BLOCK);
    let ([p, d], ingress) = cluster(BLOCK, [Role::Prefill, Role::Decode]).await;
    for seed in 0..3 {
        let want = collect(&colocated, prompt(seed), SamplingParams::greedy(9)).await;
        let got = collect(&ingress, prompt(seed), SamplingParams::greedy(9)).await;
        assert_eq!(got, want, "seed {seed}");
    }
    let load = d.service.load();
    assert_eq!(load.engine.prefill_tokens_computed, 0);
    let layout = d.service.info().peer.layout;
    let blocks = prompt(0).len().div_ceil(BLOCK);
    assert_eq!(
        load.kv.bytes_received,
        3 * (blocks * layout.block_bytes() * layout.n_layers) as u64
    );
    assert!(ingress
        .extra_metrics()
        .contains("tandem:pd_requests_total{prefill=\"remote\"} 3"));
    let view = ingress.cluster();
    let roles: Vec<&str> = view.workers.iter().map(|w| w.role.as_str()).collect();
    assert_eq!(roles, ["prefill", "decode"]);
    assert_eq!(view.workers[1].address, d.url);
    assert_eq!(view.routing.remote, 3);
    assert_eq!(view.kv_bytes_moved, load.kv.bytes_received);
    drained(&p).await;
    drained(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_uncached_prompts_are_prefilled_on_the_decode_worker() {
    let colocated = engine(BLOCK);
    let ([p, d], ingress) = cluster(100, [Role::Prefill, Role::Decode]).await;
    let want = collect(&colocated, prompt(1), SamplingParams::greedy(5)).await;
    assert_eq!(
        collect(&ingress, prompt(1), SamplingParams::greedy(5)).await,
        want
    );
    assert_eq!(
        p.engine.stats().prompt_tokens_total,
        0,
        "the prefill worker was bypassed"
    );
    assert!(d.engine.stats().prefill_tokens_computed > 0);
    assert!(ingress
        .extra_metrics()
        .contains("tandem:pd_requests_total{prefill=\"local\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_worker_falls_back_to_the_next_then_to_decode() {
    let colocated = engine(BLOCK);
    let ([p1, p2, d], ingress) = cluster(BLOCK, [Role::Prefill, Role::Prefill, Role::Decode]).await;
    let want = collect(&colocated, prompt(2), SamplingParams::greedy(6)).await;
    // Stop accepting and fail everything in flight, like a crashed process (pooled connections survive
    // the listener task, so the engine is stopped too).
    p1.task.abort();
    p1.engine.shutdown();
    assert_eq!(
        collect(&ingress, prompt(2), SamplingParams::greedy(6)).await,
        want,
        "retried on the other prefill worker"
    );
    p2.task.abort();
    p2.engine.shutdown();
    assert_eq!(
        collect(&ingress, prompt(3), SamplingParams::greedy(6)).await,
        collect(&colocated, prompt(3), SamplingParams::greedy(6)).await
    );
    assert!(ingress
        .extra_metrics()
        .contains("tandem:pd_requests_total{prefill=\"fallback\"} 1"));
    drained(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_stream_frees_both_sides_and_unpulled_pins_are_released() {
    let ([p, d], ingress) = cluster(BLOCK, [Role::Prefill, Role::Decode]).await;
    let mut stream = ingress
        .submit(GenerateRequest::new(
            1,
            prompt(4),
            SamplingParams::greedy(3000),
        ))
        .unwrap();
    for _ in 0..3 {
        stream.next().await.expect("tokens flow").unwrap();
    }
    drop(stream);
    drained(&p).await;
    drained(&d).await;
    assert!(
        d.engine.stats().generation_tokens_total < 3000,
        "the decode ran to the end instead of aborting"
    );

    // A prefill nobody pulls (the client vanished before decode) is released on request.
    let handle = pinned_prefill(&p, prompt(5), SamplingParams::greedy(4)).await;
    assert!(p.service.load().pinned_blocks > 0);
    assert!(release(&p, handle.transfer_id).await);
    drained(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_refuses_a_block_size_mismatch_naming_it() {
    let (p, d) = (
        worker(Role::Prefill, BLOCK).await,
        worker(Role::Decode, 2 * BLOCK).await,
    );
    let ingress = registered(BLOCK, &[&p]).await;
    match ingress.register(&d.url).await {
        Err(ClusterError::Refused {
            source: KvError::Mismatch { field, .. },
            ..
        }) => assert_eq!(field, "block_size"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let err = ingress.register(&d.url).await.unwrap_err().to_string();
    assert!(err.contains("block_size"), "{err}");
    assert_eq!(ingress.workers().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_sharing_a_prefix_go_to_the_prefill_worker_that_cached_it() {
    let colocated = engine(BLOCK);
    let ([p1, p2, _d], ingress) =
        cluster(BLOCK, [Role::Prefill, Role::Prefill, Role::Decode]).await;
    let base = prompt(6);
    let extended: Vec<u32> = base
        .iter()
        .copied()
        .chain((0..9).map(|i| (i * 5 + 1) % 60))
        .collect();
    collect(&ingress, base.clone(), SamplingParams::greedy(3)).await;
    let want = collect(&colocated, extended.clone(), SamplingParams::greedy(3)).await;
    assert_eq!(
        collect(&ingress, extended.clone(), SamplingParams::greedy(3)).await,
        want
    );
    let (a, b) = (p1.engine.stats(), p2.engine.stats());
    let expected = (base.len() + extended.len()) as u64;
    assert!(
        a.prompt_tokens_total == expected || b.prompt_tokens_total == expected,
        "both prompts must reach the same prefill worker: {} vs {}",
        a.prompt_tokens_total,
        b.prompt_tokens_total
    );
    assert!(
        a.prefix_cache_hits + b.prefix_cache_hits > 0,
        "the second prefill reused the cached prefix"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_worker_pulls_only_blocks_its_prefix_cache_lacks() {
    let colocated = engine(BLOCK);
    let ([p, d], ingress) = cluster(BLOCK, [Role::Prefill, Role::Decode]).await;
    let layout = d.service.info().peer.layout;
    let block_bytes = (layout.block_bytes() * layout.n_layers) as u64;
    // A 4-block shared head; `a` ends in a partial block, `b` diverges right after the head.
    let head: Vec<u32> = (0..16).map(|i| (i * 13 + 5) % 60).collect();
    let a: Vec<u32> = head.iter().copied().chain([1, 2, 3]).collect();
    let b: Vec<u32> = head
        .iter()
        .copied()
        .chain((0..9).map(|i| (i * 3 + 40) % 60))
        .collect();
    for (prompt, pulled, skipped) in [(&a, 5u64, 0u64), (&b, 3, 4)] {
        let before = d.service.load().kv;
        let want = collect(&colocated, prompt.clone(), SamplingParams::greedy(7)).await;
        assert_eq!(
            collect(&ingress, prompt.clone(), SamplingParams::greedy(7)).await,
            want
        );
        let after = d.service.load().kv;
        assert_eq!(
            after.bytes_received - before.bytes_received,
            pulled * block_bytes
        );
        assert_eq!(
            (
                after.blocks_pulled - before.blocks_pulled,
                after.blocks_skipped - before.blocks_skipped
            ),
            (pulled, skipped)
        );
    }
    let metrics = ingress.extra_metrics();
    assert!(
        metrics.contains("tandem:kv_transfer_blocks_skipped_total 4"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tandem:kv_transfer_blocks_total 8"),
        "{metrics}"
    );

    // Every block of the prompt cached on the decode side: nothing moves, but the pull still acks and
    // the prefill worker's pin is released.
    let acked = p.service.load().kv.released_ack;
    let params = SamplingParams::greedy(5);
    let resp = p
        .service
        .prefill(PrefillRequest {
            prompt: head.clone(),
            params: params.clone(),
        })
        .await
        .unwrap();
    let handle = resp.handle.expect("pinned");
    let (event, mut stream) = d
        .service
        .start_decode(crate::protocol::DecodeRequest {
            prompt: head.clone(),
            params: params.clone(),
            prefilled: Some(crate::protocol::Prefilled {
                first_token: resp.first.token,
                handle,
            }),
            resume: Vec::new(),
        })
        .await
        .unwrap();
    match event {
        Some(crate::protocol::StreamEvent::Transfer {
            bytes,
            blocks,
            skipped_blocks,
            ..
        }) => assert_eq!((bytes, blocks, skipped_blocks), (0, 0, 4)),
        other => panic!("expected a transfer event, got {other:?}"),
    }
    let mut got = Vec::new();
    while let Some(out) = stream.recv().await {
        got.push(out);
    }
    assert_eq!(got, collect(&colocated, head.clone(), params).await);
    drained(&p).await;
    drained(&d).await;
    assert_eq!(p.service.load().kv.released_ack, acked + 1);
    assert_eq!(d.engine.stats().prefill_tokens_computed, 0);
}

fn seeded(max_tokens: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 30,
        seed: Some(seed),
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_through_prefill_and_decode_matches_colocated() {
    let colocated = engine(BLOCK);
    let ([_p, d], ingress) = cluster(BLOCK, [Role::Prefill, Role::Decode]).await;
    // P samples the first token, D the rest: one RNG stream only if both index it by output position.
    for s in 0..3 {
        let want = collect(&colocated, prompt(s), seeded(12, 40 + s as u64)).await;
        let got = collect(&ingress, prompt(s), seeded(12, 40 + s as u64)).await;
        assert_eq!(got, want, "seed {}", 40 + s);
    }
    assert_ne!(
        collect(&colocated, prompt(0), seeded(12, 40)).await,
        collect(&colocated, prompt(0), seeded(12, 41)).await,
        "the sampling must depend on the seed for this test to mean anything"
    );
    assert!(ingress
        .extra_metrics()
        .contains("tandem:pd_requests_total{prefill=\"remote\"} 3"));
    assert_eq!(d.engine.stats().prefill_tokens_computed, 0);
}

/// Streams `prompt(8)` with `params` through a prefill worker and two slow decode workers, kills the
/// decode worker serving it after six tokens (like a crash: its engine fails its requests and it stops
/// answering), and returns every token the client got, the ingress, the prefill worker and the
/// surviving decode worker.
async fn lose_a_decode_worker_mid_stream(
    params: SamplingParams,
) -> (Vec<TokenOutput>, Ingress, TestWorker, TestWorker) {
    let slow = || MockBackend::new(BLOCK, 64).with_step_delay(Duration::from_millis(5));
    let p = worker(Role::Prefill, BLOCK).await;
    let d1 = worker_on(Role::Decode, engine_on(slow())).await;
    let d2 = worker_on(Role::Decode, engine_on(slow())).await;
    let ingress = registered(BLOCK, &[&p, &d1, &d2]).await;
    let mut stream = ingress
        .submit(GenerateRequest::new(1, prompt(8), params))
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..6 {
        got.push(stream.next().await.expect("tokens flow").unwrap());
    }
    let (lost, other) = if d1.service.load().in_flight > 0 {
        (d1, d2)
    } else {
        (d2, d1)
    };
    assert!(
        lost.service.load().in_flight > 0,
        "one decode worker serves"
    );
    lost.task.abort();
    lost.engine.shutdown();
    while let Some(out) = stream.next().await {
        got.push(out.expect("resumed, not failed"));
    }
    drop(stream);
    (got, ingress, p, other)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_lost_mid_stream_is_replaced_without_changing_the_answer() {
    let params = seeded(60, 9);
    let want = collect(&engine(BLOCK), prompt(8), params.clone()).await;
    let (got, ingress, p, other) = lose_a_decode_worker_mid_stream(params).await;
    assert_eq!(got, want, "the resumed stream continues the same tokens");
    assert!(
        other.engine.stats().prefill_tokens_computed > 0,
        "resumed by recompute"
    );
    let metrics = ingress.extra_metrics();
    assert!(
        metrics.contains("tandem:decode_failures_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tandem:decode_resumes_total 1"),
        "{metrics}"
    );
    drained(&other).await;
    drained(&p).await;
}

/// A JSON schema over the mock's vocabulary and a check of a text against it.
fn guided_params(seed: u64) -> SamplingParams {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["a", "ab", "x"]}, "minItems": 1, "maxItems": 4},
            "n": {"type": "integer", "minimum": -5, "maximum": 500}
        },
        "required": ["name", "tags", "n"],
        "additionalProperties": false
    });
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: 120,
        guidance: Some(tandem_engine::Guidance::JsonSchema(schema)),
        ..SamplingParams::default()
    }
}

fn assert_guided_valid(out: &[TokenOutput]) {
    let tokens: Vec<u32> = out.iter().map(|o| o.token).collect();
    let text = mock_text(&tokens);
    assert_eq!(
        out.last().and_then(|o| o.finish),
        Some(tandem_engine::FinishReason::Stop),
        "{text:?}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["n", "name", "tags"], "{text:?}");
    assert!(v["name"].as_str().unwrap().chars().count() <= 8, "{text:?}");
    let tags = v["tags"].as_array().unwrap();
    assert!((1..=4).contains(&tags.len()), "{text:?}");
    assert!(tags
        .iter()
        .all(|t| ["a", "ab", "x"].contains(&t.as_str().unwrap())));
    assert!((-5..=500).contains(&v["n"].as_i64().unwrap()), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guided_output_through_prefill_and_decode_satisfies_the_schema() {
    let colocated = engine(BLOCK);
    let ([_p, d], ingress) = cluster(BLOCK, [Role::Prefill, Role::Decode]).await;
    for s in 0..3 {
        let want = collect(&colocated, prompt(s), guided_params(70 + s as u64)).await;
        assert_guided_valid(&want);
        let got = collect(&ingress, prompt(s), guided_params(70 + s as u64)).await;
        assert_eq!(got, want, "seed {}", 70 + s);
    }
    assert!(ingress
        .extra_metrics()
        .contains("tandem:pd_requests_total{prefill=\"remote\"} 3"));
    assert_eq!(d.engine.stats().prefill_tokens_computed, 0);
    // With the model's vocabulary the ingress refuses a constraint that does not compile before
    // routing it (a 400), rather than letting the prefill worker fail it mid-request.
    ingress.check_guidance_with(mock_guide());
    let bad = SamplingParams {
        guidance: Some(tandem_engine::Guidance::Regex("(ab".into())),
        ..guided_params(1)
    };
    assert!(matches!(
        ingress.submit(GenerateRequest::new(1, prompt(0), bad)),
        Err(tandem_api::BackendError::Invalid(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guided_stream_resumed_after_a_lost_decode_worker_still_satisfies_the_schema() {
    let params = guided_params(90);
    let want = collect(&engine(BLOCK), prompt(8), params.clone()).await;
    assert_guided_valid(&want);
    assert!(want.len() > 10, "long enough to lose mid-stream");
    let (got, ingress, p, other) = lose_a_decode_worker_mid_stream(params).await;
    assert_guided_valid(&got);
    assert_eq!(got, want, "the resumed stream continues the same tokens");
    assert!(ingress
        .extra_metrics()
        .contains("tandem:decode_resumes_total 1"));
    drained(&other).await;
    drained(&p).await;
}

/// One slow or lost load poll does not drop a worker (under load its answer can be late); only
/// `DEAD_AFTER_FAILED_POLLS` failures in a row do, and one answer brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_dropped_only_after_consecutive_failed_polls() {
    let ([d], ingress) = cluster(0, [Role::Decode]).await;
    let healthy = |i: &Ingress| i.workers()[0].healthy;
    d.task.abort();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    for _ in 1..crate::registry::DEAD_AFTER_FAILED_POLLS {
        ingress.poll_once().await;
        assert!(
            healthy(&ingress),
            "dropped before {} failed polls",
            crate::registry::DEAD_AFTER_FAILED_POLLS
        );
    }
    ingress.poll_once().await;
    assert!(!healthy(&ingress));
}

/// A decode worker whose KV cache is full of running sequences queues imports, in order, up to its
/// engine's `max_waiting`, and refuses the rest with 503 (the ingress ends those requests as
/// overloaded, releasing the prefill pin) — it never recomputes a prompt for want of room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_decode_cache_queues_imports_up_to_max_waiting_then_refuses() {
    let p = worker(Role::Prefill, BLOCK).await;
    // 10 blocks: one request (23 prompt + 12 generated tokens = 9 blocks) at a time, each step slow
    // enough that the others arrive while it runs.
    let mock = MockBackend::new(BLOCK, 10).with_step_delay(Duration::from_millis(20));
    let config = EngineConfig {
        block_size: BLOCK,
        max_num_seqs: 8,
        max_waiting: 2,
        ..EngineConfig::default()
    };
    let d = worker_on(Role::Decode, Engine::start(mock, config).unwrap()).await;
    let ingress = registered(0, &[&p, &d]).await;
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(12)
    };
    let runs = (0..6).map(|seed| {
        let stream = ingress.submit(GenerateRequest::new(
            seed,
            prompt(seed as u32),
            params.clone(),
        ));
        async move {
            let outs: Vec<_> = stream.expect("accepted").collect().await;
            outs
        }
    });
    let (mut done, mut refused) = (0, 0);
    for outs in futures::future::join_all(runs).await {
        match outs.last() {
            Some(Ok(last)) if last.finish.is_some() => {
                assert_eq!(outs.len(), 12);
                done += 1;
            }
            Some(Err(tandem_api::BackendError::Unavailable(m))) => {
                assert!(m.contains("503"), "{m}");
                refused += 1;
            }
            other => panic!("neither finished nor refused: {other:?}"),
        }
    }
    // The first runs at once, at least one more waits its turn, and past two waiting the rest are
    // refused.
    assert!(done >= 2 && refused >= 1, "{done} done, {refused} refused");
    assert_eq!(done + refused, 6);
    let load = d.service.load();
    assert_eq!(load.engine.prefill_tokens_computed, 0);
    assert_eq!((load.imports_waiting, load.max_waiting), (0, 2));
    drained(&p).await;
    drained(&d).await;
}

/// With the decode worker's KV committed, requests wait at the head before their prefill instead of
/// pinning prompts whose imports would outwait half the pin's lifetime: every one completes, none is
/// recomputed, and the prefill worker never holds more than one unpulled prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_wait_at_the_head_for_decode_kv_room_instead_of_failing_their_import() {
    let p = worker(Role::Prefill, BLOCK).await;
    // 10 blocks: one request (23 prompt + 12 generated tokens = 9 blocks) at a time, 0.6 s each, so
    // the eighth would wait about 4 s for its import, past half the test workers' 5 s pin.
    let mock = MockBackend::new(BLOCK, 10).with_step_delay(Duration::from_millis(50));
    let config = EngineConfig {
        block_size: BLOCK,
        max_num_seqs: 8,
        ..EngineConfig::default()
    };
    let d = worker_on(Role::Decode, Engine::start(mock, config).unwrap()).await;
    let ingress = registered(0, &[&p, &d]).await;
    let poller = {
        let ingress = ingress.clone();
        tokio::spawn(async move {
            loop {
                ingress.poll_once().await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    ingress.poll_once().await;
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(12)
    };
    let most_pinned = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let watch = {
        let (service, most) = (Arc::clone(&p.service), Arc::clone(&most_pinned));
        tokio::spawn(async move {
            loop {
                most.fetch_max(
                    service.load().pinned_transfers,
                    std::sync::atomic::Ordering::Relaxed,
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let runs = (0..8).map(|seed| {
        let stream = ingress.submit(GenerateRequest::new(
            seed,
            prompt(seed as u32),
            params.clone(),
        ));
        async move { stream.expect("accepted").collect::<Vec<_>>().await }
    });
    for (seed, outs) in futures::future::join_all(runs)
        .await
        .into_iter()
        .enumerate()
    {
        assert_eq!(outs.len(), 12, "request {seed}: {:?}", outs.last());
        assert!(outs.iter().all(Result::is_ok), "request {seed}: {outs:?}");
    }
    poller.abort();
    watch.abort();
    assert_eq!(
        d.service.load().engine.prefill_tokens_computed,
        0,
        "recomputed on decode"
    );
    assert!(
        most_pinned.load(std::sync::atomic::Ordering::Relaxed) <= 2,
        "prompts piled up pinned on the prefill worker: {most_pinned:?}"
    );
    assert_eq!(ingress.inner.admission.waiting(), 0);
    let metrics = ingress.extra_metrics();
    assert!(
        metrics.contains("tandem:kv_transfer_failures_total 0"),
        "{metrics}"
    );
    drained(&p).await;
    drained(&d).await;
}

/// A request the decode worker refuses itself (here: a KV cache too small for the prompt) reaches the
/// client as its own error (400), not as a server failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_worker_refuses_is_the_clients_error() {
    let d = worker_on(Role::Decode, engine_on(MockBackend::new(BLOCK, 2))).await;
    let ingress = registered(1000, &[&d]).await;
    let outs: Vec<_> = ingress
        .submit(GenerateRequest::new(
            1,
            prompt(1),
            SamplingParams::greedy(4),
        ))
        .expect("accepted")
        .collect()
        .await;
    match outs.as_slice() {
        [Err(tandem_api::BackendError::Invalid(m))] => assert!(m.contains("KV"), "{m}"),
        other => panic!("expected the worker's 400 as Invalid, got {other:?}"),
    }
}

/// The ingress refuses a request up front (503 with Retry-After, like a full engine queue) only
/// when every decode worker last reported its waiting bound reached.
#[test]
fn saturation_is_read_from_the_reported_bound() {
    let mut load = crate::protocol::WorkerLoad::default();
    assert_eq!(load.saturated(), None, "no bound reported");
    load.max_waiting = 3;
    load.engine.waiting = 1;
    load.imports_waiting = 1;
    assert_eq!(load.saturated(), None);
    load.imports_waiting = 2;
    assert_eq!(load.saturated(), Some(3));
}

/// A draining worker fails readiness, reports it, gets no new work once the ingress polled it, and its
/// drain ends only when its pin is released; gone afterwards, it leaves the registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_gets_no_new_work_and_its_drain_waits_for_its_pin() {
    let ([p, d], ingress) = cluster(0, [Role::Prefill, Role::Decode]).await;
    // Registering again (a worker that re-registers) keeps the one entry.
    ingress.register(&d.url).await.unwrap();
    assert_eq!(ingress.workers().len(), 2);
    let pinned = pinned_prefill(&p, prompt(0), SamplingParams::greedy(5)).await;
    let http = reqwest::Client::new();
    let health = |url: String| {
        let http = http.clone();
        async move {
            http.get(format!("{url}/health"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(health(p.url.clone()).await, 200);
    let service = Arc::clone(&p.service);
    let drain = tokio::spawn(async move { service.drain(Duration::from_secs(30)).await });
    while !p.service.is_draining() {
        tokio::task::yield_now().await;
    }
    assert_eq!(health(p.url.clone()).await, 503);
    ingress.poll_once().await;
    ingress.poll_once().await;
    assert!(ingress.routable(Role::Prefill).is_empty());
    assert!(ingress
        .workers()
        .iter()
        .any(|w| w.url == p.url && w.draining));
    let before = p.service.load().engine.prompt_tokens_total;
    collect(&ingress, prompt(1), SamplingParams::greedy(4)).await;
    assert_eq!(
        p.service.load().engine.prompt_tokens_total,
        before,
        "a draining prefill worker got new work"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!drain.is_finished(), "the drain ended with a pin held");
    assert!(release(&p, pinned.transfer_id).await);
    assert!(drain.await.unwrap(), "drained with nothing left");
    p.task.abort();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..crate::registry::DEAD_AFTER_FAILED_POLLS {
        ingress.poll_once().await;
    }
    let left: Vec<String> = ingress.workers().into_iter().map(|w| w.url).collect();
    assert_eq!(left, [d.url.as_str()], "the drained worker was not removed");
}

/// A decode worker that no longer answers when a request starts on it (gone before any poll noticed)
/// costs no request: another decode worker takes it from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_unreachable_at_start_is_replaced() {
    let colocated = engine(BLOCK);
    let ([p, d1, d2], ingress) = cluster(BLOCK, [Role::Prefill, Role::Decode, Role::Decode]).await;
    d1.task.abort();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Routing picks either decode worker at random: go on until the dead one was tried (and marked down).
    for seed in 0..40 {
        let want = collect(&colocated, prompt(seed), SamplingParams::greedy(6)).await;
        assert_eq!(
            collect(&ingress, prompt(seed), SamplingParams::greedy(6)).await,
            want,
            "seed {seed}"
        );
        if ingress.routable(Role::Decode).len() == 1 {
            break;
        }
    }
    assert_eq!(
        ingress.routable(Role::Decode).len(),
        1,
        "the dead worker was never tried"
    );
    // The request never reached the dead worker, so its KV stayed pinned for the other to pull: nothing
    // was recomputed, no transfer failed and no stream was counted as broken.
    assert_eq!(
        d2.engine.stats().prefill_tokens_computed,
        0,
        "decode prefilled"
    );
    let metrics = ingress.extra_metrics();
    for zero in [
        "tandem:kv_transfer_failures_total 0",
        "tandem:decode_failures_total 0",
        "tandem:decode_resumes_total 0",
    ] {
        assert!(metrics.contains(zero), "{zero}: {metrics}");
    }
    drained(&p).await;
    drained(&d2).await;
}

/// A new process answering at a registered worker's address (a restarted container keeps its IP) is not
/// that worker: the polls mark the entry down until the newcomer passes the handshake itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_at_a_known_address_gets_no_work_before_its_handshake() {
    let ([d], ingress) = cluster(0, [Role::Decode]).await;
    ingress.poll_once().await;
    assert_eq!(ingress.routable(Role::Decode).len(), 1);
    d.task.abort();
    let _ = d.task.await;
    // Same address, another block size: its answers to load polls must not revive the old entry.
    let other = worker_on(Role::Decode, engine(BLOCK * 2)).await;
    let addr = d.url.trim_start_matches("http://").to_owned();
    let listener = loop {
        match tokio::net::TcpListener::bind(&addr).await {
            Ok(l) => break l,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let router = closing(Arc::clone(&other.service).router());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    ingress.poll_once().await;
    assert!(
        ingress.routable(Role::Decode).is_empty(),
        "the newcomer was taken for the old worker"
    );
    let err = ingress.register(&d.url).await.unwrap_err();
    assert!(err.to_string().contains("block_size"), "{err}");
    ingress.poll_once().await;
    assert!(ingress.routable(Role::Decode).is_empty());
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_never_meet_a_connection_the_worker_is_closing_for_idleness() {
    // A worker listener that closes connections idle for 60 ms, and requests sent at about that idle
    // age: with the client's default 90 s pool idle timeout about one in eight failed.
    let idle_close = Duration::from_millis(60);
    let limits = tandem_api::ServeLimits {
        header_read_timeout: idle_close,
        ..tandem_api::ServeLimits::default()
    };
    let router = axum::Router::new().route("/x", axum::routing::post(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/x", listener.local_addr().unwrap());
    tokio::spawn(tandem_api::serve_router(
        listener,
        router,
        limits,
        std::future::pending(),
    ));
    let ingress = Ingress::new(
        RoutingConfig::default(),
        TimeoutConfig::default(),
        Some("mock".into()),
        None,
        idle_close,
    )
    .unwrap();
    let mut failed = Vec::new();
    for i in 0..150u64 {
        if let Err(e) = ingress.inner.http.post(&url).body("a").send().await {
            failed.push(format!("{e:?}"));
        }
        tokio::time::sleep(Duration::from_micros(57_000 + (i % 7) * 1_000)).await;
    }
    assert!(
        failed.is_empty(),
        "{} of 150 failed: {:?}",
        failed.len(),
        failed.first()
    );
}

/// A head whose workers have not registered yet (started first, or restarted) assumes the served
/// model's context length: with none assumed the API checks prompts against a context of 0 and refuses
/// every request with a 400 no client retries, where the answer is the 503 of a head with no decode
/// worker. A registered worker's own limit replaces the assumption.
#[tokio::test]
async fn a_head_without_workers_assumes_the_model_context_instead_of_zero() {
    let ingress = ingress(0);
    assert_eq!(ingress.max_model_len(), 0, "nothing assumed yet");
    ingress.assume_max_model_len(1 << 20);
    assert_eq!(ingress.max_model_len(), 1 << 20);
    match ingress.submit(GenerateRequest::new(
        1,
        vec![1, 2, 3],
        SamplingParams::greedy(4),
    )) {
        Err(tandem_api::BackendError::Unavailable(m)) => {
            assert!(m.contains("no decode worker"), "{m}")
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted with no worker"),
    }
    let d = worker(Role::Decode, BLOCK).await;
    ingress.register(&d.url).await.unwrap();
    assert_eq!(ingress.max_model_len(), d.engine.max_model_len());
}
