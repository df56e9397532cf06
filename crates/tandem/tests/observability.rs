//! End-to-end tests of what a person or a log collector sees, on the `tandem` binary cargo built: one
//! request followed by its id through the head and both workers of the embedded P/D deployment, JSON
//! log lines, `/health`'s body, and ordinary mistakes (a busy port, no server, config typos) reported
//! with a hint and without a backtrace. The P/D tests skip without the default model; the others need
//! none.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_testkit::{default_model, free_port, model_path, Server, DEFAULT_MODEL_NAME, PROMPTS};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// Serializes the deployments: the machine has few cores and each loads the model three times.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The embedded P/D deployment of `examples/pd.yaml` on the default model, with `extra` top-level keys,
/// run open on loopback (`allow_unauthenticated`: no generated token) so the test reads worker routes.
fn pd_yaml(extra: &str) -> String {
    format!(
        "model: {}\n{extra}engine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 8}}\n\
         deployment:\n  mode: pd\n  allow_unauthenticated: true\n  prefill: {{replicas: 1}}\n  decode: {{replicas: 1}}\n  \
         kv_transfer: {{transport: tcp}}\n  routing: {{local_prefill_threshold: 16}}\n  \
         timeouts: {{poll_interval_secs: 0.2}}\n",
        default_model().display()
    )
}

/// Sends a greedy 8-token completion of a prompt long enough to go to the prefill worker, with
/// `X-Request-Id: id` when given; returns the answer's status, request id header and body text.
async fn complete(server: &Server, id: Option<&str>, stream: bool) -> (u16, String, String) {
    let mut req = server
        .http
        .post(format!("{}/v1/completions", server.url))
        .json(&json!({
            "model": DEFAULT_MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 8,
            "temperature": 0, "stream": stream,
        }));
    if let Some(id) = id {
        req = req.header("x-request-id", id);
    }
    let resp = req.send().await.expect("the head answers");
    let status = resp.status().as_u16();
    let echoed = resp.headers()["x-request-id"]
        .to_str()
        .expect("an ASCII id")
        .to_owned();
    (status, echoed, resp.text().await.expect("a whole body"))
}

/// The server's log once `done` holds for it (the access line is written when the body ends, a moment
/// after the client has read it); panics with the log after 10 s.
fn log_when(server: &Server, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = server.log();
        if done(&log) {
            return log;
        }
        assert!(Instant::now() < deadline, "{what}:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of `key=` in a text log line (up to the next space, `}` or `:`).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(&format!(" {key}="))? + key.len() + 2;
    let rest = &line[start..];
    let end = rest.find([' ', '}', ':']).unwrap_or(rest.len());
    Some(&rest[..end])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_followed_through_the_head_and_both_workers() {
    if model_path().is_none() {
        return;
    }
    let _turn = SERIAL.lock().await;
    // The engine thread's lines about a request are at DEBUG.
    let pd = Server::with_config_env(
        BIN,
        &pd_yaml(""),
        &[("RUST_LOG", "tandem_engine=debug,info")],
    );

    let (status, echoed, _) = complete(&pd, Some("abc"), false).await;
    assert_eq!((status, echoed.as_str()), (200, "abc"));
    let log = log_when(&pd, "every process logs request abc", |log| {
        let tagged = |tag: &str, what: &str| {
            log.lines()
                .any(|l| l.starts_with(tag) && l.contains("request_id=abc") && l.contains(what))
        };
        tagged("[head] ", "finished processing request")
            && tagged("[prefill-0] ", "prefilled")
            && tagged("[decode-0] ", "decoded")
            // The engine threads' lines carry it too, through the span the RPC submitted in.
            && tagged("[prefill-0] ", "tandem_engine::worker: request scheduled")
            && tagged("[prefill-0] ", "tandem_engine::kv_manager: KV export started")
            && tagged("[decode-0] ", "tandem_engine::kv_manager: KV import planned")
            && tagged("[decode-0] ", "tandem_engine::kv_manager: KV imported: decoding starts")
            && tagged("[decode-0] ", "tandem_engine::worker: request finished on the engine")
    });
    assert!(
        log.lines()
            .filter(|l| l.contains("tandem_engine::") && l.contains(" id="))
            .all(|l| l.contains("request_id=")),
        "every engine line about a request names its request id:\n{log}"
    );
    let access = log
        .lines()
        .find(|l| l.contains("request_id=abc") && l.contains("finished processing request"))
        .unwrap();
    assert_eq!(field(access, "status"), Some("200"), "{access}");
    assert_eq!(field(access, "completion_tokens"), Some("8"), "{access}");
    assert!(
        log.lines()
            .filter(|l| l.contains("loaded GGUF model") || l.contains("worker serving"))
            .all(|l| l.starts_with('[')),
        "every process's start-up lines say which process wrote them:\n{log}"
    );

    // A stream's access line comes when the stream ends: its real duration and tokens.
    let (status, echoed, body) = complete(&pd, Some("stream-1"), true).await;
    assert_eq!((status, echoed.as_str()), (200, "stream-1"));
    assert!(body.contains("data: [DONE]"), "{body}");
    let log = log_when(&pd, "the stream's access line", |log| {
        log.lines()
            .any(|l| l.contains("request_id=stream-1") && l.contains("finished processing"))
    });
    let access = log
        .lines()
        .find(|l| l.contains("request_id=stream-1") && l.contains("finished processing"))
        .unwrap();
    assert_eq!(field(access, "completion_tokens"), Some("8"), "{access}");
    assert_eq!(field(access, "complete"), Some("true"), "{access}");
    let ms: u64 = field(access, "ms").unwrap().parse().unwrap();
    assert!(ms > 0, "a stream of 8 tokens takes time: {access}");

    // An id that is not printable ASCII (a space here) is replaced; a request without one gets one;
    // error answers carry theirs too.
    let (_, minted, _) = complete(&pd, Some("two words"), false).await;
    assert!(minted.starts_with("req-") && minted.len() == 36, "{minted}");
    let (_, minted, _) = complete(&pd, None, false).await;
    assert!(minted.starts_with("req-"), "{minted}");
    let bad = pd
        .http
        .post(format!("{}/v1/completions", pd.url))
        .header("x-request-id", "bad-1")
        .json(&json!({"model": DEFAULT_MODEL_NAME, "prompt": "x", "max_tokens": -1}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert_eq!(bad.headers()["x-request-id"], "bad-1");

    // /health says what answers, on the head and on a worker.
    let health: Value = pd.get_json("/health").await;
    assert_eq!(
        health,
        json!({"status": "ok", "role": "head", "model": DEFAULT_MODEL_NAME})
    );
    let workers: Value = pd.get_json("/v1/cluster/workers").await;
    let decode = workers
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["info"]["role"] == "decode")
        .expect("a decode worker");
    let url = decode["url"].as_str().unwrap();
    let health: Value = pd.get_json(&format!("{url}/health")).await;
    assert_eq!(health["status"], "ok");
    assert_eq!(health["role"], "decode");
    assert_eq!(health["worker"], "decode-0");
    assert!(health["model"].as_str().is_some_and(|m| !m.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_a_line_from_every_process() {
    if model_path().is_none() {
        return;
    }
    let _turn = SERIAL.lock().await;
    let pd = Server::with_config(BIN, &pd_yaml("log_format: json\n"));
    let (status, echoed, _) = complete(&pd, Some("json-1"), false).await;
    assert_eq!((status, echoed.as_str()), (200, "json-1"));
    let log = log_when(&pd, "every process logs request json-1", |log| {
        ["head", "prefill-0", "decode-0"].iter().all(|w| {
            log.contains(&format!("\"worker\":\"{w}\""))
                && log.contains("\"request_id\":\"json-1\"")
        }) && log.contains("finished processing request")
    });
    let lines: Vec<Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}\n{log}")))
        .collect();
    for worker in ["head", "prefill-0", "decode-0"] {
        assert!(
            lines
                .iter()
                .any(|l| l["worker"] == worker && l["request_id"] == "json-1"),
            "no line of {worker} about json-1:\n{log}"
        );
    }
    let access = lines
        .iter()
        .find(|l| l["request_id"] == "json-1" && l["message"] == "finished processing request")
        .unwrap();
    assert_eq!(access["completion_tokens"], 8, "{access}");
    assert_eq!(access["status"], 200, "{access}");
    assert_eq!(access["path"], "/v1/completions", "{access}");
    assert_eq!(access["role"], "head", "{access}");
}

/// Runs the binary with `args` and RUST_BACKTRACE=1 (which makes anyhow's default report print a
/// backtrace), no stdin, for at most 60 s.
fn run_failing(args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let out = Command::new(BIN)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env_remove("TANDEM_LOG_FORMAT")
        .stdin(Stdio::null())
        .output()
        .expect("the binary runs");
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
    (out, took)
}

/// Asserts a user error's report: the error, the hint, and no backtrace.
fn assert_reported(out: &Output, error: &str, hint: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(error), "{error:?} not in:\n{stderr}");
    assert!(
        stderr.contains(&format!("hint: {hint}")),
        "{hint:?} not in:\n{stderr}"
    );
    assert!(
        !stderr.to_lowercase().contains("backtrace"),
        "a backtrace for a user error:\n{stderr}"
    );
}

#[test]
fn a_busy_port_fails_at_once_with_a_hint_and_no_backtrace() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let dir = std::env::temp_dir().join(format!("tandem-busy-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A model that does not exist: the port is taken before any model is looked at.
    let missing = dir.join("missing.gguf");
    let missing = missing.to_str().unwrap();
    let (out, took) = run_failing(&["serve", missing, "--host", "127.0.0.1", "--port", &port]);
    assert_reported(
        &out,
        &format!("binding 127.0.0.1:{port}"),
        "that port is in use",
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");

    // The P/D launcher takes its port before it starts any worker.
    let pd = dir.join("pd.yaml");
    std::fs::write(
        &pd,
        format!("model: {missing}\ndeployment: {{mode: pd, prefill: {{replicas: 1}}, decode: {{replicas: 1}}}}\n"),
    )
    .unwrap();
    let (out, _) = run_failing(&[
        "serve",
        "--config",
        pd.to_str().unwrap(),
        "--host",
        "127.0.0.1",
        "--port",
        &port,
    ]);
    assert_reported(&out, "in use", "that port is in use");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("worker started"),
        "{out:?}"
    );

    // So does a worker started by hand, with its RPC port.
    let (out, _) = run_failing(&[
        "worker",
        "--role",
        "decode",
        "--model",
        missing,
        "--host",
        "127.0.0.1",
        "--port",
        &port,
    ]);
    assert_reported(&out, "in use", "that port is in use");

    // And a prefill worker its KV port.
    let (out, took) = run_failing(&[
        "worker",
        "--role",
        "prefill",
        "--model",
        missing,
        "--host",
        "127.0.0.1",
        "--kv-port",
        &port,
    ]);
    assert_reported(&out, "the KV port (--kv-port)", "that port is in use");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn clients_without_a_server_say_so_with_a_hint() {
    let nobody = format!("http://127.0.0.1:{}", free_port());
    let (out, _) = run_failing(&["probe", &format!("{nobody}/health")]);
    assert_reported(&out, "GET", "nothing answers there");
    let (out, _) = run_failing(&["chat", "--url", &nobody]);
    assert_reported(&out, "is the server running?", "nothing answers there");
    // `tandem bench` reads the default model's tokenizer before it connects.
    if model_path().is_none() {
        return;
    }
    let (out, _) = run_failing(&[
        "bench",
        "--base-url",
        &nobody,
        "--num-prompts",
        "1",
        "--no-progress",
    ]);
    assert_reported(&out, "nothing answers", "nothing answers there");
}

#[test]
fn config_mistakes_are_reported_all_at_once() {
    let dir = std::env::temp_dir().join(format!("tandem-typos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("typos.yaml");
    std::fs::write(
        &file,
        "engine: {blok_size: 16, max_num_seqs: many}\nserver: {port: 8000}\nlog_fromat: json\n",
    )
    .unwrap();
    let (out, _) = run_failing(&["serve", "--check-config", file.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for want in [
        "3 problems in the settings",
        "line 1, column 10: engine.blok_size: unknown key, did you mean `block_size`?",
        "line 1, column 39: engine.max_num_seqs: invalid type",
        "line 3, column 1: log_fromat: unknown key, did you mean `log_format`?",
    ] {
        assert!(stderr.contains(want), "{want:?} not in:\n{stderr}");
    }
    assert!(!stderr.to_lowercase().contains("backtrace"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
