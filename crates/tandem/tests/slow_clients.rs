//! Slow and numerous clients against real `tandem serve` processes on loopback: slowloris connections
//! (a request header sent one line per second, never finished) are closed within
//! `server.header_read_timeout_secs` while normal and streaming requests are served; a body that does not
//! arrive in time gets 408; a connection over `server.max_connections` gets a quick 503 and a slot frees
//! within the header timeout. The P/D test covers the head and a worker's RPC listener, whose limits the
//! launcher hands down. Without the default model the tests skip.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use tandem_testkit::{default_model, model_path, Server, DEFAULT_MODEL_NAME};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// The header and body read timeout the tests configure.
const TIMEOUT: Duration = Duration::from_secs(2);

/// Slack on top of [`TIMEOUT`] for a loaded machine (the timer fires, the close reaches the client).
const SLACK: Duration = Duration::from_secs(3);

/// Serializes the tests: each loads the model, some three times, on a machine with few cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This test's turn (held until it ends), or `None` when the default model is absent and it skips.
async fn turn() -> Option<tokio::sync::MutexGuard<'static, ()>> {
    model_path()?;
    Some(SERIAL.lock().await)
}

/// `host:port` of a server URL.
fn authority(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

/// A slowloris client: connects, sends a request line, then one header line per second and never the
/// blank line. Returns how long the server kept the connection open, or `None` when it was still open
/// after `give_up`.
async fn slowloris(addr: String, give_up: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut s = TcpStream::connect(&addr).await.expect("connects");
    s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        .await
        .expect("first line");
    let mut buf = [0u8; 512];
    let mut line = 0;
    while started.elapsed() < give_up {
        tokio::select! {
            read = s.read(&mut buf) => match read {
                Ok(0) | Err(_) => return Some(started.elapsed()),
                Ok(_) => {}
            },
            () = tokio::time::sleep(Duration::from_secs(1)) => {
                line += 1;
                let header = format!("x-slow-{line}: 1\r\n");
                if s.write_all(header.as_bytes()).await.is_err() {
                    return Some(started.elapsed());
                }
            }
        }
    }
    None
}

/// Asserts every slowloris connection was closed within the header timeout (plus [`SLACK`]).
async fn assert_all_cut(held: Vec<tokio::task::JoinHandle<Option<Duration>>>, log: &str) {
    let held: Vec<Option<Duration>> = futures::future::join_all(held)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for (i, open) in held.iter().enumerate() {
        let open = open.unwrap_or_else(|| panic!("slowloris {i} never closed\n{log}"));
        assert!(
            open <= TIMEOUT + SLACK,
            "slowloris {i} held {open:?}\n{log}"
        );
        assert!(
            open + Duration::from_millis(300) >= TIMEOUT,
            "slowloris {i} closed after {open:?}, before the timeout"
        );
    }
}

/// A streamed greedy completion of `max_tokens` tokens (EOS ignored): the text, after `[DONE]`.
async fn stream(server: &Server, prompt: &str, max_tokens: usize) -> String {
    let response = server
        .http
        .post(format!("{}/v1/completions", server.url))
        .json(
            &json!({"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                      "temperature": 0, "stream": true, "ignore_eos": true}),
        )
        .send()
        .await
        .expect("stream starts");
    assert!(response.status().is_success(), "{}", response.status());
    let mut body = response.bytes_stream();
    let mut raw = String::new();
    while let Some(chunk) = body.next().await {
        raw.push_str(&String::from_utf8_lossy(&chunk.expect("stream chunk")));
    }
    assert!(raw.trim_end().ends_with("data: [DONE]"), "{raw}");
    let mut text = String::new();
    for data in raw.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if let Ok(v) = serde_json::from_str::<Value>(data) {
            text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
        }
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_slowloris_connections_are_closed_while_others_are_served() {
    let Some(_turn) = turn().await else { return };
    let log = std::env::temp_dir().join(format!("tandem-slowloris-{}.log", std::process::id()));
    let model = default_model();
    let server = Server::start(
        BIN,
        &[
            model.to_str().unwrap(),
            "--threads",
            "1",
            "--kv-cache-memory",
            "64MiB",
            "--header-read-timeout-secs",
            "2",
            "--body-read-timeout-secs",
            "2",
            "--max-connections",
            "256",
        ],
        &log,
    );
    let addr = authority(&server.url);
    let held: Vec<_> = (0..100)
        .map(|_| tokio::spawn(slowloris(addr.clone(), Duration::from_secs(20))))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Served meanwhile: a plain completion and a stream that outlasts both read timeouts.
    let started = Instant::now();
    let answer = server.complete("The capital of France is", 8).await;
    assert!(answer["choices"][0]["text"].as_str().is_some(), "{answer}");
    assert!(
        started.elapsed() < TIMEOUT,
        "a normal request waited {:?} behind the slowloris connections",
        started.elapsed()
    );
    let started = Instant::now();
    let text = stream(&server, "Once upon a time", 160).await;
    println!(
        "a 160-token stream took {:?} beside 100 slowloris connections",
        started.elapsed()
    );
    assert!(!text.is_empty());

    assert_all_cut(held, &server.log()).await;

    // A body that stops arriving gets 408 within the body timeout.
    let started = Instant::now();
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 1000\r\n\r\n{\"prompt\": \"a",
    )
    .await
    .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(TIMEOUT + SLACK, s.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(started.elapsed() <= TIMEOUT + SLACK);

    // A slow but steady client still gets its (complete) request through.
    let stream_text = stream(&server, "Once upon a time", 16).await;
    assert!(
        text.starts_with(&stream_text),
        "{stream_text:?} vs {text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_head_refuses_over_the_limit_quickly_and_workers_cut_slowloris() {
    let Some(_turn) = turn().await else { return };
    // Open on loopback (no generated token): the test lists the workers and calls them directly.
    let yaml = format!(
        "model: {}\nserver: {{header_read_timeout_secs: 2, body_read_timeout_secs: 2, max_connections: 8}}\n\
         engine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 8}}\n\
         deployment:\n  mode: pd\n  allow_unauthenticated: true\n  prefill: {{replicas: 1}}\n  decode: {{replicas: 1}}\n  \
         kv_transfer: {{transport: tcp, pin_timeout_secs: 20}}\n  routing: {{local_prefill_threshold: 4}}\n  \
         timeouts: {{poll_interval_secs: 0.2}}\n",
        default_model().display()
    );
    let server = Server::with_config(BIN, &yaml);
    let prompt = "The history of the printing press begins in the fifteenth century, when";
    let want = server.complete(prompt, 8).await;
    let workers: Vec<Value> = server.get_json("/v1/cluster/workers").await;
    let worker_urls: Vec<String> = workers
        .iter()
        .map(|w| w["url"].as_str().expect("worker url").to_owned())
        .collect();
    assert_eq!(worker_urls.len(), 2, "{workers:?}");

    // Once the test client's idle pooled connection was closed (after the header timeout), eight slowloris
    // connections fill the head; the ninth is refused at once, not left waiting.
    tokio::time::sleep(TIMEOUT + Duration::from_millis(500)).await;
    let addr = authority(&server.url);
    let held: Vec<_> = (0..8)
        .map(|_| tokio::spawn(slowloris(addr.clone(), Duration::from_secs(20))))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fresh = reqwest::Client::new();
    let started = Instant::now();
    let refused = fresh
        .post(format!("{}/v1/completions", server.url))
        .json(&json!({"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}))
        .send()
        .await
        .expect("an answer, not a hang");
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_connections", "{body}");
    assert!(started.elapsed() < Duration::from_secs(1));

    // The held slots free within the header timeout, and the same request is served again.
    let served = loop {
        let (status, v) = server
            .post_completion(json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}))
            .await;
        if status.is_success() {
            break v;
        }
        assert_eq!(status, 503, "{v}");
        assert!(
            started.elapsed() < TIMEOUT + SLACK,
            "still refused after {:?}\n{}",
            started.elapsed(),
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(served["choices"], want["choices"]);
    assert_all_cut(held, &server.log()).await;

    // Each worker's RPC listener got the head's limits: slowloris there are cut as well.
    for url in &worker_urls {
        let held: Vec<_> = (0..6)
            .map(|_| tokio::spawn(slowloris(authority(url), Duration::from_secs(20))))
            .collect();
        assert_all_cut(held, &server.log()).await;
    }
    // The ingress's pooled connections to the workers were closed idle meanwhile; it still routes.
    let again = server.complete(prompt, 8).await;
    assert_eq!(again["choices"], want["choices"]);
}
