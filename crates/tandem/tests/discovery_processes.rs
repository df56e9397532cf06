//! Membership with real processes on loopback: `serve --check-config`, a decode worker drained by SIGTERM
//! mid-stream, DNS discovery following a worker that comes and goes behind `localhost:PORT`, and workers
//! started with `--register` coming back to a restarted head. Workers are started by hand here (as on
//! other hosts), so the tests see their exit status. Without the default model the process tests skip.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_cluster::{Role, WorkerLoad, WorkerStatus};
use tandem_testkit::{
    default_model, free_port, health_status, model_path, signal, text, Server, Worker,
    DEFAULT_MODEL_NAME, PROMPTS,
};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// Serializes the tests: each loads the model several times on a machine with few cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This test's turn (held until it ends), or `None` when the default model is absent and it skips.
async fn turn() -> Option<tokio::sync::MutexGuard<'static, ()>> {
    model_path()?;
    Some(SERIAL.lock().await)
}

/// A head with one local prefill worker and no decode worker of its own; `discovery` is the YAML flow
/// map of `deployment.discovery`.
fn head_yaml(discovery: &str) -> String {
    format!(
        "model: {}\nengine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 8}}\n\
         deployment:\n  mode: pd\n  prefill: {{replicas: 1}}\n  decode: {{replicas: 0}}\n  \
         discovery: {discovery}\n  kv_transfer: {{transport: tcp, pin_timeout_secs: 20}}\n  \
         routing: {{local_prefill_threshold: 16}}\n  timeouts: {{poll_interval_secs: 0.2}}\n",
        default_model().display()
    )
}

async fn workers(head: &Server) -> Vec<WorkerStatus> {
    head.get_json("/v1/cluster/workers").await
}

async fn load(head: &Server, worker_url: &str) -> WorkerLoad {
    head.get_json(&format!("{worker_url}/v1/worker/load")).await
}

/// Waits up to `secs` for `check` on the head's worker list; panics with the head's log otherwise.
async fn until(head: &Server, secs: u64, what: &str, check: impl Fn(&[WorkerStatus]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let listed = workers(head).await;
        if check(&listed) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {listed:#?}\n{}",
            head.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (up to 5 s: a worker publishes its stats a step behind its tokens) until the worker at `url`
/// has finished `n` requests; how many it has finished then.
async fn finished_reaches(head: &Server, url: &str, n: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let done = load(head, url).await.engine.requests_finished_total;
        if done >= n || Instant::now() >= deadline {
            return done;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The routable decode workers' URLs.
fn decoders(listed: &[WorkerStatus]) -> Vec<&str> {
    listed
        .iter()
        .filter(|w| w.info.role == Role::Decode && w.healthy && !w.draining)
        .map(|w| w.url.as_str())
        .collect()
}

#[test]
fn check_config_prints_the_resolved_settings_and_names_a_bad_key() {
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let out = Command::new(BIN)
        .args(["serve", "--check-config"])
        .arg(examples.join("pd-dns.yaml"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Value = serde_yaml::from_str(&stdout).unwrap();
    let d = &printed["deployment"];
    assert_eq!(d["discovery"]["mode"], "dns", "{stdout}");
    assert_eq!(d["discovery"]["prefill"], "prefill:8100");
    assert_eq!(d["discovery"]["decode"], "decode:8100");
    assert_eq!(d["discovery"]["interval_secs"], 3.0);
    assert_eq!(d["decode"]["replicas"], 0);
    assert_eq!(
        d["timeouts"]["token_stall_secs"], 120.0,
        "defaults are filled in"
    );

    let dir = std::env::temp_dir().join(format!("tandem-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (yaml, key) in [
        (
            "deployment: {mode: pd, discovery: {mode: dns, decode: decode}}",
            "deployment.discovery.decode",
        ),
        (
            "deployment: {mode: pd, discovery: {mode: dns, interval: 3}}",
            "interval",
        ),
        ("deployment: {mode: pd, decode: {replica: 1}}", "replica"),
        ("server: {port: eighty}", "port"),
    ] {
        let file = dir.join("bad.yaml");
        std::fs::write(&file, yaml).unwrap();
        let out = Command::new(BIN)
            .args(["serve", "--check-config"])
            .arg(&file)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{yaml} passed");
        assert!(out.stdout.is_empty(), "{yaml}: printed settings");
        assert!(
            stderr.contains(key),
            "{yaml}: the error must name {key}:\n{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM on a decode worker mid-stream: it reports draining (readiness 503), the stream it serves
/// completes there (nothing resumed elsewhere), new requests go to the other worker, and it exits 0; the
/// head then drops it from its list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_decode_worker_mid_stream_and_it_exits_0() {
    let Some(_turn) = turn().await else { return };
    let head = Server::starting(BIN, &head_yaml("{mode: static}"), free_port());
    // A grace beyond the 800-token stream's time on a loaded machine: the stream must finish on the
    // draining worker, not be cut off at the default 30 s and resumed elsewhere.
    let args = ["--register", &head.url, "--drain-grace-secs", "120"];
    let mut pair = [
        Worker::start(BIN, "decode", "127.0.0.1", 0, &args),
        Worker::start(BIN, "decode", "127.0.0.1", 0, &args),
    ];
    until(&head, 30, "both decode workers registered", |l| {
        decoders(l).len() == 2
    })
    .await;
    let body = json!({"model": DEFAULT_MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 800,
                      "temperature": 0, "ignore_eos": true});
    let want = head.complete_with(body.clone()).await;

    let mut before = Vec::new();
    for w in &pair {
        before.push(load(&head, &w.url).await.engine.generation_tokens_total);
    }
    let request = head.spawn_completion(body.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    let victim = 'found: loop {
        for (i, (w, &b)) in pair.iter().zip(&before).enumerate() {
            if load(&head, &w.url).await.engine.generation_tokens_total >= b + 4 {
                break 'found i;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no decode worker started generating"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let other = 1 - victim;
    signal(pair[victim].child.id(), "-TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while health_status(&pair[victim].url) != Some(503) {
        assert!(
            Instant::now() < deadline,
            "readiness did not fail:\n{}",
            pair[victim].log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(load(&head, &pair[victim].url).await.draining);
    // Two load polls later the head routes around it.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        !request.is_finished(),
        "the stream ended before new requests could be sent"
    );
    let finished = load(&head, &pair[other].url)
        .await
        .engine
        .requests_finished_total;
    for p in &PROMPTS[..2] {
        head.complete(p, 4).await;
    }
    assert_eq!(
        finished_reaches(&head, &pair[other].url, finished + 2).await,
        finished + 2,
        "new requests must go to the worker that is not draining"
    );

    let (status, got) = tokio::time::timeout(Duration::from_secs(120), request)
        .await
        .expect("the drained stream ended")
        .unwrap();
    assert!(status.is_success(), "{status}: {got}\n{}", head.log());
    assert_eq!(got["choices"][0]["finish_reason"], "length", "{got}");
    assert_eq!(text(&got), text(&want), "the stream completed unchanged");
    head.assert_metrics(&["tandem:decode_resumes_total 0"])
        .await;

    let status = pair[victim]
        .exited(Duration::from_secs(40))
        .unwrap_or_else(|| panic!("the drained worker did not exit:\n{}", pair[victim].log()));
    assert!(status.success(), "{status}:\n{}", pair[victim].log());
    let gone = pair[victim].url.clone();
    until(&head, 10, "the drained worker leaves the list", |l| {
        l.iter().all(|w| w.url != gone)
    })
    .await;
    head.complete(PROMPTS[0], 4).await;
}

/// DNS discovery of `localhost:PORT`: the head serves once a worker appears at the address, lets it go
/// when it drains away, and takes the next process at the same address after its handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_follows_a_worker_that_appears_and_goes() {
    let Some(_turn) = turn().await else { return };
    let port = free_port();
    let head = Server::starting(
        BIN,
        &head_yaml(&format!(
            "{{mode: dns, decode: \"localhost:{port}\", interval_secs: 0.5}}"
        )),
        free_port(),
    );
    assert_eq!(health_status(&head.url), Some(503), "no decode worker yet");
    let not_ready = head
        .http
        .get(format!("{}/health", head.url))
        .send()
        .await
        .unwrap();
    assert_eq!(not_ready.status(), 503);
    let body: Value = not_ready.json().await.unwrap();
    assert_eq!(body["status"], "unavailable", "{body}");
    assert_eq!(body["role"], "head", "{body}");
    assert_eq!(body["model"], DEFAULT_MODEL_NAME, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("decode")),
        "it says why: {body}"
    );
    for round in 0..2 {
        let mut w = Worker::start(BIN, "decode", "127.0.0.1", port, &[]);
        until(&head, 30, "the worker at the name is discovered", |l| {
            decoders(l) == [w.url.as_str()]
        })
        .await;
        let listed = workers(&head).await;
        let found = listed.iter().find(|s| s.url == w.url).unwrap();
        assert_eq!(
            found.info.pid,
            w.child.id(),
            "round {round}: the new process"
        );
        let before = load(&head, &w.url).await.engine.requests_finished_total;
        let got = head.complete(PROMPTS[1], 6).await;
        assert_eq!(got["choices"][0]["finish_reason"], "length");
        assert_eq!(
            finished_reaches(&head, &w.url, before + 1).await,
            before + 1
        );
        signal(w.child.id(), "-TERM");
        let status = w
            .exited(Duration::from_secs(30))
            .unwrap_or_else(|| panic!("the worker did not exit:\n{}", w.log()));
        assert!(status.success(), "{status}:\n{}", w.log());
        until(&head, 15, "the gone worker leaves the list", |l| {
            l.iter().all(|s| s.info.role != Role::Decode)
        })
        .await;
        let (status, _) = head
            .post_completion(json!({"prompt": "hi", "max_tokens": 2}))
            .await;
        assert_eq!(status.as_u16(), 503, "no decode worker is left");
    }
}

/// A head restart loses no worker started with `--register`: unpolled, it registers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_head_gets_its_registered_worker_back() {
    let Some(_turn) = turn().await else { return };
    let port = free_port();
    let yaml = head_yaml("{mode: static}");
    let head = Server::starting(BIN, &yaml, port);
    let w = Worker::start(BIN, "decode", "127.0.0.1", 0, &["--register", &head.url]);
    until(&head, 30, "registered", |l| decoders(l) == [w.url.as_str()]).await;
    head.complete(PROMPTS[0], 4).await;
    drop(head);
    let head = Server::starting(BIN, &yaml, port);
    until(&head, 40, "registered again after the restart", |l| {
        decoders(l) == [w.url.as_str()]
    })
    .await;
    head.complete(PROMPTS[0], 4).await;
    assert!(w.log().contains("registering again"), "{}", w.log());
}
