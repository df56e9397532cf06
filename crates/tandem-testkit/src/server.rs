//! A `tandem serve` child process for end-to-end tests, killed on drop, with HTTP helpers that assert on
//! its answers (and show its log when one fails); free loopback ports; health polling without a runtime.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::model::DEFAULT_MODEL_NAME;
use Listen::{Https, Plain};

/// How long a server may take to answer `/health` (it loads the model, and P/D workers load it again).
const STARTUP: Duration = Duration::from_secs(300);

/// A loopback port free at the time of the call.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether `GET /health` at `url` answers 200: a raw HTTP/1.1 request over loopback, so polling needs no
/// runtime.
pub fn healthy(url: &str) -> bool {
    health_status(url) == Some(200)
}

/// The status `GET /health` at `url` answers, `None` when nothing answers (a raw HTTP/1.1 request).
pub fn health_status(url: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let req = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// Sends `signal` (e.g. `-9`, `-STOP`) to the process `pid` and asserts that `kill` succeeded.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// The body of a greedy completion of exactly `max_tokens` tokens (EOS ignored), the deterministic HTTP
/// request that tests compare between deployments.
pub fn greedy_body(prompt: &str, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

/// The text of a completion's first choice.
pub fn text(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .expect("choice text")
        .to_owned()
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Where a server listens: plain HTTP on a port, or HTTPS on a port with the PEM CA its certificate
/// chains to.
enum Listen<'a> {
    Plain(u16),
    Https(u16, &'a Path),
}

/// A running `tandem serve`, killed on drop (its workers and stages exit when their pipes close).
pub struct Server {
    /// The server process.
    pub child: Child,
    /// Its base URL on loopback.
    pub url: String,
    /// Where its stderr goes.
    pub log: PathBuf,
    /// A client for the async helpers (and for tests that send requests of their own).
    pub http: reqwest::Client,
    _dir: Option<TempDir>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `BIN serve <args> --host 127.0.0.1 --port <free>` with stderr in `log` and waits (up to
    /// 300 s) until it answers `/health`; panics with its log when it exits first. `bin` is the `tandem`
    /// binary (`env!("CARGO_BIN_EXE_tandem")` in the binary's tests).
    pub fn start<S: AsRef<OsStr>>(bin: &str, args: &[S], log: &Path) -> Server {
        let port = free_port();
        Self::spawn(bin, args, &[], log, None, Plain(port), &healthy)
    }

    /// Like [`Server::with_config`] on `port`, but returns as soon as `/health` answers at all: a P/D
    /// head waiting for its workers (to register, or to be discovered) answers 503 until one is there.
    pub fn starting(bin: &str, yaml: &str, port: u16) -> Server {
        Self::with_config_on(bin, yaml, &[], Plain(port), &|url| {
            health_status(url).is_some()
        })
    }

    /// Starts `BIN serve --config <yaml written to a scratch directory>` like [`Server::start`]; the
    /// directory (config and log) goes when the server does.
    pub fn with_config(bin: &str, yaml: &str) -> Server {
        Self::with_config_on(bin, yaml, &[], Plain(free_port()), &healthy)
    }

    /// Like [`Server::with_config`], with environment variables set for the server and the processes it
    /// starts (e.g. `RUST_LOG` for a test that reads debug lines).
    pub fn with_config_env(bin: &str, yaml: &str, env: &[(&str, &str)]) -> Server {
        Self::with_config_on(bin, yaml, env, Plain(free_port()), &healthy)
    }

    /// Like [`Server::with_config`] for a `yaml` with `server.tls`: the URL is `https://`, [`Server::http`]
    /// trusts only the PEM CA `ca`, and readiness is `BIN probe --ca-cert CA` answering 2xx.
    pub fn with_tls_config(bin: &str, yaml: &str, ca: &Path) -> Server {
        let ready = |url: &str| {
            Command::new(bin)
                .args(["probe", "--ca-cert"])
                .arg(ca)
                .arg(format!("{url}/health"))
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        Self::with_config_on(bin, yaml, &[], Https(free_port(), ca), &ready)
    }

    fn with_config_on(
        bin: &str,
        yaml: &str,
        env: &[(&str, &str)],
        listen: Listen,
        ready: &dyn Fn(&str) -> bool,
    ) -> Server {
        let dir = std::env::temp_dir().join(format!(
            "tandem-test-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("config.yaml");
        std::fs::write(&config, yaml).unwrap();
        let log = dir.join("serve.log");
        Self::spawn(
            bin,
            &[OsStr::new("--config"), config.as_os_str()],
            env,
            &log,
            Some(TempDir(dir)),
            listen,
            ready,
        )
    }

    fn spawn<S: AsRef<OsStr>>(
        bin: &str,
        args: &[S],
        env: &[(&str, &str)],
        log: &Path,
        dir: Option<TempDir>,
        listen: Listen,
        ready: &dyn Fn(&str) -> bool,
    ) -> Server {
        let (port, url, http) = match listen {
            Plain(port) => (
                port,
                format!("http://127.0.0.1:{port}"),
                reqwest::Client::new(),
            ),
            Https(port, ca) => {
                let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).expect("the test CA"))
                    .expect("a PEM CA");
                let http = reqwest::Client::builder()
                    .add_root_certificate(ca)
                    .build()
                    .expect("an HTTPS client");
                (port, format!("https://127.0.0.1:{port}"), http)
            }
        };
        let child = Command::new(bin)
            .arg("serve")
            .args(args)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("tandem serve starts");
        let mut server = Server {
            child,
            url,
            log: log.to_path_buf(),
            http,
            _dir: dir,
        };
        let deadline = Instant::now() + STARTUP;
        loop {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!("tandem serve exited with {status}:\n{}", server.log());
            }
            if ready(&server.url) {
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "tandem serve never became healthy:\n{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// What the server wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A greedy completion of `prompt`; panics (with the server's log) on an error answer.
    pub async fn complete(&self, prompt: &str, max_tokens: usize) -> Value {
        self.complete_with(json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
            .await
    }

    /// A greedy completion of a prompt given as token ids.
    pub async fn complete_ids(&self, prompt: &[u32], max_tokens: usize) -> Value {
        self.complete_with(json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
            .await
    }

    /// A completion with the given body (the default model's name filled in where it names none); panics on
    /// an error answer.
    pub async fn complete_with(&self, body: Value) -> Value {
        let (status, v) = self.post_completion(body).await;
        assert!(status.is_success(), "{status}: {v}\n{}", self.log());
        v
    }

    /// Sends a completion with the given body (the default model's name filled in where it names none): its
    /// status and body.
    pub async fn post_completion(&self, body: Value) -> (reqwest::StatusCode, Value) {
        self.spawn_completion(body).await.expect("completion task")
    }

    /// [`Server::post_completion`] on a task of its own, for a test that acts while the request runs.
    pub fn spawn_completion(
        &self,
        mut body: Value,
    ) -> tokio::task::JoinHandle<(reqwest::StatusCode, Value)> {
        if body.get("model").is_none() {
            body["model"] = json!(DEFAULT_MODEL_NAME);
        }
        let (http, url) = (self.http.clone(), format!("{}/v1/completions", self.url));
        tokio::spawn(async move {
            let r = http
                .post(url)
                .json(&body)
                .send()
                .await
                .expect("completion sent");
            let status = r.status();
            (status, r.json().await.expect("JSON answer"))
        })
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Asserts that `/metrics` holds every line fragment of `wanted` (the whole text in the message).
    pub async fn assert_metrics(&self, wanted: &[&str]) {
        let metrics = self.metrics().await;
        for w in wanted {
            assert!(metrics.contains(w), "{w} missing from:\n{metrics}");
        }
    }

    /// `GET <path>` on this server (or a full URL) as JSON of type `T`.
    pub async fn get_json<T: serde::de::DeserializeOwned>(&self, path_or_url: &str) -> T {
        let url = if path_or_url.starts_with("http") {
            path_or_url.to_owned()
        } else {
            format!("{}{path_or_url}", self.url)
        };
        json_of(self.http.get(url)).await
    }

    /// `POST <path>` of `body` on this server, answered as JSON (`/tokenize`, `/detokenize`, ...).
    pub async fn post_json(&self, path: &str, body: Value) -> Value {
        json_of(self.http.post(format!("{}{path}", self.url)).json(&body)).await
    }
}

/// The URLs of the prefill and the decode worker in a head's `/v1/cluster/workers` listing (the first
/// of each role); panics when a role is missing.
pub fn worker_urls(workers: &[Value]) -> (String, String) {
    let url_of = |role: &str| {
        workers
            .iter()
            .find(|w| w["info"]["role"] == role)
            .and_then(|w| w["url"].as_str())
            .unwrap_or_else(|| panic!("no {role} worker in {workers:?}"))
            .to_owned()
    };
    (url_of("prefill"), url_of("decode"))
}

/// Sends `req` and reads its answer as JSON of type `T`, panicking on a transport or parse failure.
pub async fn json_of<T: serde::de::DeserializeOwned>(req: reqwest::RequestBuilder) -> T {
    req.send()
        .await
        .expect("request sent")
        .json()
        .await
        .expect("JSON answer")
}
