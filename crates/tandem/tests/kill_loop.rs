//! Faults under load with real processes on loopback: streaming clients run without pause against a P/D
//! head while prefill and decode workers are killed with SIGKILL in a loop and started again (the
//! launcher does not restart workers, so this test starts them by hand with `--register`, as another host
//! would). Every request must end on its own: complete, or with an error event in its stream, or refused
//! with an OpenAI-shaped error before its stream began; none hangs past its deadline and no stream is cut
//! without an error. Afterwards the live workers are idle: nothing running, waiting, in flight or pinned,
//! no KV block in use.
//!
//! How many requests complete, fail or are resumed depends on timing and is printed, not asserted. The
//! size is set by `TANDEM_KILL_LOOP_ROUNDS` (kills, alternating prefill and decode; default 6) and
//! `TANDEM_KILL_LOOP_CLIENTS` (concurrent streaming clients; default 4). Without the default model the
//! test skips.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use tandem_cluster::{Role, WorkerLoad, WorkerStatus};
use tandem_testkit::{
    default_model, free_port, model_path, signal, Server, Worker, DEFAULT_MODEL_NAME, PROMPTS,
};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// Longest one request may take before it counts as hung: well past the head's own bounds on a request
/// that lost its workers (token stall, decode start, admission), so only a real hang reaches it.
const REQUEST_DEADLINE: Duration = Duration::from_secs(150);

/// A head with no workers of its own: every worker registers (`--register`), so the test can kill and
/// replace any of them. Short stall and start bounds keep a request that lost its worker from waiting long.
fn head_yaml() -> String {
    format!(
        "model: {}\nengine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 8}}\n\
         deployment:\n  mode: pd\n  prefill: {{replicas: 0}}\n  decode: {{replicas: 0}}\n  \
         kv_transfer: {{transport: tcp, pin_timeout_secs: 20}}\n  routing: {{local_prefill_threshold: 16}}\n  \
         timeouts: {{poll_interval_secs: 0.2, token_stall_secs: 15, prefill_secs: 60, \
         decode_start_secs: 60, admission_secs: 60}}\n",
        default_model().display()
    )
}

/// A setting from the environment, or `default`.
fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// How one request ended.
#[derive(Debug)]
enum Outcome {
    /// The stream ended with a finish reason and `[DONE]`.
    Completed,
    /// The stream carried an error event (then `[DONE]`).
    Failed(String),
    /// Refused before its stream began, with an OpenAI-shaped error.
    Refused(u16, String),
    /// Anything else: a hang, a stream cut without an error, an answer that is not OpenAI-shaped.
    Unclean(String),
}

/// One streaming completion of a long prompt (remote prefill), read to its end.
async fn one_request(http: &reqwest::Client, url: &str, n: usize) -> Outcome {
    let prompt = format!("{} (request {n})", PROMPTS[n % PROMPTS.len()]);
    let body = json!({"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 16 + n % 32,
                      "temperature": 0, "ignore_eos": true, "stream": true});
    let resp = match http
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return Outcome::Unclean(format!("the head did not answer: {e}")),
    };
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text).ok().and_then(|v| {
            v["error"]["message"]
                .as_str()
                .filter(|m| !m.is_empty())
                .map(str::to_owned)
        });
        return match message {
            Some(m) => Outcome::Refused(status.as_u16(), m),
            None => Outcome::Unclean(format!("{status} without an OpenAI error: {text}")),
        };
    }
    let mut stream = resp.bytes_stream();
    let mut buffer = String::new();
    let (mut finished, mut error, mut done) = (false, None, false);
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return Outcome::Unclean(format!("stream cut: {e}")),
        };
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(e) => return Outcome::Unclean(format!("bad event {data:?}: {e}")),
            };
            if let Some(m) = v["error"]["message"].as_str() {
                error = Some(m.to_owned());
            } else if !v["choices"][0]["finish_reason"].is_null() {
                finished = true;
            }
        }
    }
    match (done, error, finished) {
        (true, Some(m), _) => Outcome::Failed(m),
        (true, None, true) => Outcome::Completed,
        (done, error, finished) => Outcome::Unclean(format!(
            "stream ended: [DONE] {done}, error {error:?}, finish reason {finished}"
        )),
    }
}

/// A client sending one streaming request after another until `stop`, each under [`REQUEST_DEADLINE`].
async fn client(
    http: reqwest::Client,
    url: String,
    id: usize,
    stop: Arc<AtomicBool>,
) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut n = id * 1000;
    while !stop.load(Ordering::SeqCst) {
        let outcome = tokio::time::timeout(REQUEST_DEADLINE, one_request(&http, &url, n))
            .await
            .unwrap_or_else(|_| Outcome::Unclean(format!("hung past {REQUEST_DEADLINE:?}")));
        if matches!(outcome, Outcome::Refused(..)) {
            // A refusal comes at once; do not spin while the head has no worker of a role.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        outcomes.push(outcome);
        n += 1;
    }
    outcomes
}

async fn workers(head: &Server) -> Vec<WorkerStatus> {
    head.get_json("/v1/cluster/workers").await
}

async fn load(head: &Server, worker_url: &str) -> Option<WorkerLoad> {
    let r = head
        .http
        .get(format!("{worker_url}/v1/worker/load"))
        .send()
        .await
        .ok()?;
    r.json().await.ok()
}

/// Starts a worker of `role` registering with `head`, off the runtime (it waits for the model to load),
/// and waits until the head lists it healthy.
async fn start_worker(head: &Server, role: Role) -> Worker {
    let url = head.url.clone();
    let worker = tokio::task::spawn_blocking(move || {
        Worker::start(
            BIN,
            &role.to_string(),
            "127.0.0.1",
            0,
            &["--register", &url],
        )
    })
    .await
    .expect("worker start");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !workers(head)
        .await
        .iter()
        .any(|w| w.url == worker.url && w.healthy)
    {
        assert!(
            Instant::now() < deadline,
            "{role} worker {} never listed healthy:\n{}\n{}",
            worker.url,
            worker.log(),
            head.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    worker
}

/// Waits (up to `within`) until the worker at `url` is busy with a request, so the kill lands mid-request
/// as often as the load allows; kills anyway after that.
async fn until_busy(head: &Server, url: &str, role: Role, within: Duration) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(l) = load(head, url).await {
            let busy = match role {
                Role::Prefill => l.in_flight > 0,
                _ => l.engine.running > 0,
            };
            if busy {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A value of the head's Prometheus text (0 when absent).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_loop_under_streaming_load_ends_every_request_cleanly() {
    if model_path().is_none() {
        return;
    }
    let rounds = setting("TANDEM_KILL_LOOP_ROUNDS", 6);
    let clients = setting("TANDEM_KILL_LOOP_CLIENTS", 4);
    let head = Server::starting(BIN, &head_yaml(), free_port());
    let mut prefill = vec![
        start_worker(&head, Role::Prefill).await,
        start_worker(&head, Role::Prefill).await,
    ];
    let mut decode = vec![
        start_worker(&head, Role::Decode).await,
        start_worker(&head, Role::Decode).await,
    ];

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..clients)
        .map(|id| {
            tokio::spawn(client(
                head.http.clone(),
                head.url.clone(),
                id,
                stop.clone(),
            ))
        })
        .collect();
    // Let the clients reach both roles before the first kill.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for round in 0..rounds {
        let (role, pool) = if round % 2 == 0 {
            (Role::Prefill, &mut prefill)
        } else {
            (Role::Decode, &mut decode)
        };
        let victim = (round / 2) % pool.len();
        until_busy(&head, &pool[victim].url, role, Duration::from_secs(10)).await;
        signal(pool[victim].child.id(), "-KILL");
        eprintln!(
            "round {round}: killed {role} worker {} at {:.1} s",
            pool[victim].url,
            started.elapsed().as_secs_f64()
        );
        // Replaced after the head had a poll or two to notice: requests meanwhile meet a dead worker.
        tokio::time::sleep(Duration::from_millis(500)).await;
        pool[victim] = start_worker(&head, role).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(t.await.expect("client task"));
    }
    let elapsed = started.elapsed();

    let metrics = head.metrics().await;
    let resumed = metric(&metrics, "tandem:decode_resumes_total");
    let (mut completed, mut failed, mut refused) = (0, 0, 0);
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut unclean = Vec::new();
    for o in &outcomes {
        match o {
            Outcome::Completed => completed += 1,
            Outcome::Failed(m) => {
                failed += 1;
                *reasons.entry(format!("error event: {m}")).or_default() += 1;
            }
            Outcome::Refused(s, m) => {
                refused += 1;
                *reasons.entry(format!("{s}: {m}")).or_default() += 1;
            }
            Outcome::Unclean(m) => unclean.push(m.clone()),
        }
    }
    eprintln!(
        "kill loop: {rounds} kills, {clients} clients, {:.1} s: {} requests, {completed} completed, \
         {failed} ended with an error event, {refused} refused, {} unclean, {resumed} decode resumes",
        elapsed.as_secs_f64(),
        outcomes.len(),
        unclean.len()
    );
    for (reason, n) in &reasons {
        eprintln!("  {n} x {reason}");
    }
    assert!(
        unclean.is_empty(),
        "requests that did not end cleanly: {unclean:#?}\n{}",
        head.log()
    );
    assert!(completed > 0, "no request completed:\n{}", head.log());

    // The live workers are listed healthy and end idle: nothing running, waiting, in flight or pinned.
    let live: Vec<&Worker> = prefill.iter().chain(&decode).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let listed = workers(&head).await;
        let mut busy = Vec::new();
        for w in &live {
            let healthy = listed.iter().any(|s| s.url == w.url && s.healthy);
            let l = load(&head, &w.url).await;
            let idle = l.as_ref().is_some_and(|l| {
                l.engine.running == 0
                    && l.engine.waiting == 0
                    && l.in_flight == 0
                    && l.pinned_blocks == 0
                    && l.imports_waiting == 0
                    && l.engine.kv_blocks_used == 0
            });
            if !(healthy && idle) {
                busy.push((w.url.clone(), healthy, l));
            }
        }
        if busy.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "workers not idle after the loop: {busy:#?}\n{}",
            head.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
