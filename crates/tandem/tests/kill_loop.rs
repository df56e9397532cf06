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
//! `TANDEM_KILL_LOOP_CLIENTS` (concurrent streaming clients; default 4).
//!
//! The second test kills the head itself under load and starts it again on the same port: the workers
//! must drop the dead head's requests at once, register with the new one and end idle
//! (`TANDEM_HEAD_KILL_CLIENTS`, default 3). The tests run one at a time. Without the default model they
//! skip.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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

/// One streaming completion of a long prompt (remote prefill) of `max_tokens` tokens, read to its end;
/// each token event adds one to `received`.
async fn one_request(
    http: &reqwest::Client,
    url: &str,
    n: usize,
    max_tokens: usize,
    received: &AtomicUsize,
) -> Outcome {
    let prompt = format!("{} (request {n})", PROMPTS[n % PROMPTS.len()]);
    let body = json!({"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
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
            } else {
                received.fetch_add(1, Ordering::Relaxed);
                if !v["choices"][0]["finish_reason"].is_null() {
                    finished = true;
                }
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

/// A client sending one streaming request (16–47 tokens) after another until `stop`, each under
/// `deadline`; each outcome comes with when its request was sent.
async fn client(
    http: reqwest::Client,
    url: String,
    id: usize,
    stop: Arc<AtomicBool>,
    deadline: Duration,
) -> Vec<(Instant, Outcome)> {
    let mut outcomes = Vec::new();
    let mut n = id * 1000;
    let received = AtomicUsize::new(0);
    while !stop.load(Ordering::SeqCst) {
        let sent = Instant::now();
        let request = one_request(&http, &url, n, 16 + n % 32, &received);
        let outcome = tokio::time::timeout(deadline, request)
            .await
            .unwrap_or_else(|_| Outcome::Unclean(format!("{HUNG} {deadline:?}")));
        if !matches!(outcome, Outcome::Completed | Outcome::Failed(_)) {
            // A refusal (or, with the head down, a refused connection) comes at once; do not spin.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        outcomes.push((sent, outcome));
        n += 1;
    }
    outcomes
}

/// How an [`Outcome::Unclean`] of a request that outlived its deadline starts.
const HUNG: &str = "hung past";

async fn workers(head: &Server) -> Vec<WorkerStatus> {
    head.get_json("/v1/cluster/workers").await
}

/// The worker's load, asked of the worker itself (so also while no head runs).
async fn load(http: &reqwest::Client, worker_url: &str) -> Option<WorkerLoad> {
    let r = http
        .get(format!("{worker_url}/v1/worker/load"))
        .send()
        .await
        .ok()?;
    r.json().await.ok()
}

/// Starts a worker of `role` registering with `head`, off the runtime (it waits for the model to load),
/// and waits until the head lists it healthy.
async fn start_worker(head: &Server, role: Role) -> Worker {
    start_worker_with(head, role, &[]).await
}

/// [`start_worker`] with `extra` worker flags.
async fn start_worker_with(head: &Server, role: Role, extra: &[&'static str]) -> Worker {
    let url = head.url.clone();
    let extra = extra.to_vec();
    let worker = tokio::task::spawn_blocking(move || {
        let mut flags = vec!["--register", &url];
        flags.extend(extra);
        Worker::start(BIN, &role.to_string(), "127.0.0.1", 0, &flags)
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
        if let Some(l) = load(&head.http, url).await {
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

/// Runs one test's body on a runtime of its own, one test at a time: each starts a head and workers,
/// and two sets at once would starve each other of the CPU.
fn serial<F: std::future::Future>(body: F) -> F::Output {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("test runtime")
        .block_on(body)
}

#[test]
fn sigkill_loop_under_streaming_load_ends_every_request_cleanly() {
    serial(kill_loop());
}

async fn kill_loop() {
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
                REQUEST_DEADLINE,
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
        outcomes.extend(t.await.expect("client task").into_iter().map(|(_, o)| o));
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
    until_idle(&head, &live, Duration::from_secs(30), "after the loop").await;
}

/// Whether a worker's load shows no work at all: nothing running, waiting, in flight, pinned or waiting
/// to import, no KV block in use.
fn idle(l: &WorkerLoad) -> bool {
    l.engine.running == 0
        && l.engine.waiting == 0
        && l.in_flight == 0
        && l.pinned_blocks == 0
        && l.imports_waiting == 0
        && l.engine.kv_blocks_used == 0
}

/// Waits (up to `within`) until `head` lists every one of `live` healthy and each is [`idle`]; panics
/// naming the busy ones (`when` says at what point of the test).
async fn until_idle(head: &Server, live: &[&Worker], within: Duration, when: &str) {
    let deadline = Instant::now() + within;
    loop {
        let listed = workers(head).await;
        let mut busy = Vec::new();
        for w in live {
            let healthy = listed.iter().any(|s| s.url == w.url && s.healthy);
            let l = load(&head.http, &w.url).await;
            if !(healthy && l.as_ref().is_some_and(idle)) {
                busy.push((w.url.clone(), healthy, l));
            }
        }
        if busy.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "workers not idle {when}: {busy:#?}\n{}",
            head.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Tokens of the head-kill test's long stream: with a few hundred still to come when the head dies, a
/// decode worker that kept generating for a request nobody reads would show it in its token count.
const LONG_TOKENS: usize = 800;

/// Longest one request of the head-kill test may take: past its bounds on a request that waits for
/// workers to register with a restarted head (admission), so only a real hang reaches it.
const HEAD_KILL_DEADLINE: Duration = Duration::from_secs(90);

/// How soon after the head dies its workers must have dropped its requests: they see its connections
/// close at once; the bound leaves room for a starved machine.
const FREED_WITHIN: Duration = Duration::from_secs(10);

#[test]
fn sigkill_of_the_head_under_streaming_load_frees_its_requests_and_a_restarted_head_takes_over() {
    serial(head_kill());
}

/// The head (`tandem serve`, P/D, workers registering) is killed with SIGKILL while clients stream and
/// one long stream decodes, then started again on the same port. Every request ends (complete, refused,
/// or cut by the kill; none hangs); the workers drop the dead head's requests at once (nothing running,
/// waiting or in flight within [`FREED_WITHIN`], and the decode worker does not generate the rest of the
/// long stream for nobody); they register again with the new head, requests complete there, and both
/// end idle. Pins of prefills nobody will pull go at the workers' pin timeout (10 s here).
async fn head_kill() {
    if model_path().is_none() {
        return;
    }
    let clients = setting("TANDEM_HEAD_KILL_CLIENTS", 3);
    let port = free_port();
    let head = Server::starting(BIN, &head_yaml(), port);
    let (http, url) = (head.http.clone(), head.url.clone());
    let pin = ["--pin-timeout", "10"];
    let prefill = start_worker_with(&head, Role::Prefill, &pin).await;
    let decode = start_worker_with(&head, Role::Decode, &pin).await;

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..clients)
        .map(|id| {
            let (http, url, stop) = (http.clone(), url.clone(), stop.clone());
            tokio::spawn(client(http, url, id, stop, HEAD_KILL_DEADLINE))
        })
        .collect();
    let received = Arc::new(AtomicUsize::new(0));
    let long = tokio::spawn({
        let (http, url, received) = (http.clone(), url.clone(), received.clone());
        async move {
            let request = one_request(&http, &url, 7, LONG_TOKENS, &received);
            tokio::time::timeout(HEAD_KILL_DEADLINE, request)
                .await
                .unwrap_or_else(|_| Outcome::Unclean(format!("{HUNG} {HEAD_KILL_DEADLINE:?}")))
        }
    });
    // Kill once the long stream decodes (its first token comes from the prefill worker).
    let deadline = Instant::now() + Duration::from_secs(60);
    while received.load(Ordering::Relaxed) < 8 {
        assert!(
            Instant::now() < deadline,
            "the long stream never started:\n{}",
            head.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let generated = |l: Option<WorkerLoad>| l.map_or(0, |l| l.engine.generation_tokens_total);
    let generated_before = generated(load(&http, &decode.url).await);
    let long_before = received.load(Ordering::Relaxed);
    signal(head.child.id(), "-KILL");
    let killed = Instant::now();
    eprintln!(
        "killed the head at {:.1} s, the long stream at {long_before} of {LONG_TOKENS} tokens",
        started.elapsed().as_secs_f64()
    );
    let old_log = head.log();
    drop(head);

    // The workers drop the dead head's requests as its connections close.
    let freed = loop {
        let loads = [
            load(&http, &prefill.url).await,
            load(&http, &decode.url).await,
        ];
        let dropped = loads.iter().all(|l| {
            l.as_ref().is_some_and(|l| {
                l.engine.running == 0
                    && l.engine.waiting == 0
                    && l.in_flight == 0
                    && l.imports_waiting == 0
            })
        });
        if dropped {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < FREED_WITHIN,
            "the workers still work for the dead head after {FREED_WITHIN:?}: {loads:#?}\n{}\n{}",
            decode.log(),
            old_log
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let long_left = LONG_TOKENS - long_before;
    let generated_after =
        generated(load(&http, &decode.url).await).saturating_sub(generated_before);
    eprintln!(
        "the workers dropped the dead head's requests {:.2} s after the kill; the decode worker generated \
         {generated_after} tokens after it (the long stream alone had {long_left} to go)",
        freed.as_secs_f64()
    );
    assert!(
        generated_after < long_left as u64,
        "the decode worker generated {generated_after} tokens after the head died: it finished the \
         long stream ({long_left} to go) for nobody"
    );

    // A new head on the same port: the workers register again (unpolled for 10 s) and serve it.
    let head = Server::starting(BIN, &head_yaml(), port);
    let restarted = killed.elapsed();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = workers(&head).await;
        let back = [&prefill, &decode]
            .iter()
            .all(|w| listed.iter().any(|s| s.url == w.url && s.healthy));
        if back {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the workers never registered with the new head: {listed:#?}\n{}\n{}",
            prefill.log(),
            head.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let registered = Instant::now();
    let back_after = killed.elapsed();
    let fresh = AtomicUsize::new(0);
    for n in 0..3 {
        let request = one_request(&head.http, &head.url, 500 + n, 16, &fresh);
        match tokio::time::timeout(HEAD_KILL_DEADLINE, request).await {
            Ok(Outcome::Completed) => {}
            other => panic!("a request to the new head: {other:?}\n{}", head.log()),
        }
    }
    stop.store(true, Ordering::SeqCst);
    let long = long.await.expect("long stream task");
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(t.await.expect("client task"));
    }

    let (mut completed, mut cut, mut failed, mut refused, mut no_head) = (0, 0, 0, 0, 0);
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut wrong = Vec::new();
    for (sent, o) in &outcomes {
        match o {
            Outcome::Completed => completed += 1,
            Outcome::Failed(m) => {
                failed += 1;
                *reasons.entry(format!("error event: {m}")).or_default() += 1;
            }
            // A valid request is never the client's fault, whether workers are registered or not.
            Outcome::Refused(400, m) => wrong.push(format!("400: {m}")),
            Outcome::Refused(status, m) => {
                refused += 1;
                *reasons.entry(format!("{status}: {m}")).or_default() += 1;
            }
            Outcome::Unclean(m) if m.starts_with(HUNG) => wrong.push(m.clone()),
            // Sent to the dead head, or while no head listened: cut, or no answer at all.
            Outcome::Unclean(m) if *sent < registered => {
                if m.starts_with("the head did not answer") {
                    no_head += 1;
                } else {
                    cut += 1;
                }
            }
            Outcome::Unclean(m) => wrong.push(format!("after the workers were back: {m}")),
        }
    }
    eprintln!(
        "head kill: {clients} clients, {} requests: {completed} completed, {cut} cut by the kill, \
         {no_head} found no head, {refused} refused, {failed} ended with an error event; head back after \
         {:.1} s, workers registered after {:.1} s; the long stream: {long:?}",
        outcomes.len(),
        restarted.as_secs_f64(),
        back_after.as_secs_f64()
    );
    for (reason, n) in &reasons {
        eprintln!("  {n} x {reason}");
    }
    assert!(wrong.is_empty(), "{wrong:#?}\n{}", head.log());
    assert!(
        !matches!(long, Outcome::Completed)
            && !matches!(&long, Outcome::Unclean(m) if m.starts_with(HUNG)),
        "the long stream through the killed head: {long:?}"
    );
    until_idle(
        &head,
        &[&prefill, &decode],
        Duration::from_secs(30),
        "after the head's restart",
    )
    .await;
}
