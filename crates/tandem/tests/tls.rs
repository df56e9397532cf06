//! TLS with real processes on loopback: the embedded P/D default with `server.tls` and
//! `deployment.cluster_tls` answers a chat completion over HTTPS end to end (the KV moving over the
//! mutual-TLS TCP transport), while a client with a certificate from another CA, or with none, is refused
//! on a worker's control port and on the prefill worker's KV port, and plain HTTP to a TLS port gets no
//! answer. Bad certificate files stop `tandem serve` at start, naming the setting. Without the default
//! model the end-to-end test skips.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_cluster::protocol::{PrefillRequest, PrefillResponse, WorkerInfo, WorkerLoad};
use tandem_cluster::Role;
use tandem_engine::SamplingParams;
use tandem_kv::mem::MemSink;
use tandem_kv::{ClusterKey, ClusterTls, ClusterTlsPaths, KvClient, TcpConfig, TcpTransport};
use tandem_testkit::{default_model, free_port, model_path, TestPki, DEFAULT_MODEL_NAME};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

const TOKEN: &str = "tls-test-cluster-token-0815";

fn yaml(pki: &TestPki) -> String {
    format!(
        "model: {model}\nengine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 8}}\n\
         server:\n  tls: {{cert: {cert}, key: {key}}}\n\
         deployment:\n  mode: pd\n  cluster_token: {TOKEN}\n  \
         cluster_tls: {{ca: {ca}, cert: {cert}, key: {key}}}\n  \
         prefill: {{replicas: 1}}\n  decode: {{replicas: 1}}\n  \
         kv_transfer: {{transport: tcp, pin_timeout_secs: 30}}\n  routing: {{local_prefill_threshold: 4}}\n  \
         timeouts: {{poll_interval_secs: 0.2}}\n",
        model = default_model().display(),
        ca = pki.ca.display(),
        cert = pki.cert.display(),
        key = pki.key.display(),
    )
}

/// The cluster TLS of `ca`, `cert`, `key`.
fn cluster_tls(ca: &Path, cert: &Path, key: &Path) -> ClusterTls {
    ClusterTls::load(&ClusterTlsPaths {
        ca: ca.to_owned(),
        cert: cert.to_owned(),
        key: key.to_owned(),
        server_name: None,
    })
    .unwrap()
}

/// An HTTPS client trusting only `ca` and presenting no certificate (what an API user runs).
fn api_client(ca: &Path) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap();
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(ca)
        .use_rustls_tls()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A client speaking the cluster's mutual TLS with `tls`.
fn member_client(tls: &ClusterTls) -> reqwest::Client {
    tandem_cluster::with_cluster_tls(reqwest::Client::builder(), Some(tls))
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// `tandem serve` killed on drop, its stderr in a file.
struct Serve {
    child: Child,
    log: std::path::PathBuf,
}

impl Serve {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(dir: &Path, config: &str, port: u16) -> Serve {
    let path = dir.join("config.yaml");
    std::fs::write(&path, config).unwrap();
    let log = dir.join("serve.log");
    let child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&path)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Serve { child, log }
}

#[test]
fn bad_certificate_files_stop_serve_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let check = |config: String| {
        let path = dir.path().join("check.yaml");
        std::fs::write(&path, config).unwrap();
        let out = Command::new(BIN)
            .args(["serve", "--check-config"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success(), "a bad file passed the check");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let missing = dir.path().join("missing.pem");
    let err = check(format!(
        "server:\n  tls: {{cert: {}, key: {}}}\n",
        missing.display(),
        pki.key.display()
    ));
    assert!(
        err.contains("server.tls.cert") && err.contains("missing.pem"),
        "{err}"
    );
    let err = check(format!(
        "server:\n  tls: {{cert: {}, key: {}}}\n",
        pki.cert.display(),
        pki.wrong_key.display()
    ));
    assert!(err.contains("server.tls.key"), "{err}");
    let err = check(format!(
        "server:\n  tls: {{cert: {}}}\n",
        pki.cert.display()
    ));
    assert!(err.contains("server.tls.key"), "{err}");
    let err = check(format!(
        "deployment:\n  mode: pd\n  cluster_tls: {{ca: {}, cert: {}, key: {}}}\n",
        missing.display(),
        pki.cert.display(),
        pki.key.display()
    ));
    assert!(err.contains("deployment.cluster_tls.ca"), "{err}");
    let err = check(format!(
        "deployment:\n  mode: pd\n  cluster_tls: {{ca: {}, cert: {}, key: {}}}\n",
        pki.ca.display(),
        pki.cert.display(),
        pki.wrong_key.display()
    ));
    assert!(err.contains("deployment.cluster_tls.key"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_over_tls_serves_and_refuses_strangers() {
    if model_path().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let port = free_port();
    let server = serve(dir.path(), &yaml(&pki), port);
    let url = format!("https://127.0.0.1:{port}");
    let api = api_client(&pki.ca);

    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let up = api.get(format!("{url}/health")).send().await;
        if up.is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never healthy:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // A chat completion over HTTPS, through a prefill worker, the KV over mutual TLS, a decode worker.
    let prompt =
        "The history of the printing press begins in the fifteenth century, when Johannes \
                  Gutenberg, a goldsmith from Mainz, combined movable metal type with";
    let chat = api
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({
            "model": DEFAULT_MODEL_NAME,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8,
            "temperature": 0,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 200, "{}", server.log());
    let chat: Value = chat.json().await.unwrap();
    let content = chat["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.is_empty(), "{chat}");

    // Plain HTTP to the HTTPS port gets no HTTP answer.
    let plain = reqwest::Client::new();
    assert!(
        plain
            .get(format!("http://127.0.0.1:{port}/health"))
            .send()
            .await
            .is_err(),
        "plain HTTP answered on the TLS port"
    );

    let listing = format!("{url}/v1/cluster/workers");
    let workers: Vec<Value> = api
        .get(&listing)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let url_of = |role: Role| {
        workers
            .iter()
            .find(|w| w["info"]["role"] == json!(role))
            .map(|w| w["url"].as_str().unwrap().to_owned())
            .expect("a worker of that role")
    };
    let (prefill, decode) = (url_of(Role::Prefill), url_of(Role::Decode));
    assert!(prefill.starts_with("https://"), "{prefill}");

    // The prefill worker moved the completion's KV over its TLS'd KV port.
    let member = member_client(&cluster_tls(&pki.ca, &pki.cert, &pki.key));
    let load: WorkerLoad = member
        .get(format!("{prefill}/v1/worker/load"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        load.kv.bytes_sent > 0,
        "no KV left the prefill worker: {load:?}"
    );

    // Strangers on the control ports: another CA's certificate, the right CA but no certificate, plain
    // HTTP. Each is refused before any HTTP answer, even with the token.
    let wrong_ca = member_client(&cluster_tls(&pki.wrong_ca, &pki.wrong_cert, &pki.wrong_key));
    let wrong_cert = member_client(&cluster_tls(&pki.ca, &pki.wrong_cert, &pki.wrong_key));
    let no_cert = api_client(&pki.ca);
    for worker in [&prefill, &decode] {
        let info = format!("{worker}/v1/worker/info");
        for (who, client) in [
            ("wrong CA", &wrong_ca),
            ("wrong cert", &wrong_cert),
            ("no cert", &no_cert),
        ] {
            let r = client.get(&info).bearer_auth(TOKEN).send().await;
            assert!(
                r.is_err(),
                "{who} got an answer from {info}: {:?}",
                r.map(|r| r.status())
            );
        }
        let r = plain
            .get(info.replacen("https://", "http://", 1))
            .bearer_auth(TOKEN)
            .send()
            .await;
        assert!(r.is_err(), "plain HTTP answered on {info}");
    }

    // A member pins a prompt's KV; a stranger cannot pull it from the KV port.
    let info: WorkerInfo = member
        .get(format!("{prefill}/v1/worker/info"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let pinned: PrefillResponse = member
        .post(format!("{prefill}/v1/worker/prefill"))
        .bearer_auth(TOKEN)
        .json(&PrefillRequest {
            prompt: (1..40).collect(),
            params: SamplingParams::greedy(4),
        })
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let handle = pinned.handle.expect("KV pinned");
    let pull = |tls: Option<ClusterTls>| {
        let transport = TcpTransport::new(
            info.peer.clone(),
            TcpConfig {
                cluster_key: ClusterKey::new(TOKEN),
                tls: tls.map(Arc::new),
                ..TcpConfig::default()
            },
        );
        let sink = Arc::new(MemSink::new(handle.layout, handle.block_ids.len()));
        let handle = handle.clone();
        async move { KvClient::new(Arc::new(transport)).pull(&handle, sink).await }
    };
    for (who, tls) in [
        (
            "wrong CA",
            Some(cluster_tls(&pki.wrong_ca, &pki.wrong_cert, &pki.wrong_key)),
        ),
        (
            "wrong cert",
            Some(cluster_tls(&pki.ca, &pki.wrong_cert, &pki.wrong_key)),
        ),
        ("plain TCP", None),
    ] {
        assert!(pull(tls).await.is_err(), "{who} pulled KV");
    }
    let stats = pull(Some(cluster_tls(&pki.ca, &pki.cert, &pki.key)))
        .await
        .expect("a member pulls");
    assert_eq!(stats.bytes, handle.total_bytes());
    drop(server);
}

/// A child process killed on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_stage_under_cluster_tls_serves_only_an_engine_of_its_ca() {
    use std::io::{BufRead, BufReader};
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let mut stage = Killed(
        Command::new(BIN)
            .args(["stage", "--stage", "1", "--stages", "2", "--threads", "1"])
            .arg("--model")
            .arg(&model)
            .env("TANDEM_CLUSTER_TLS_CA", &pki.ca)
            .env("TANDEM_CLUSTER_TLS_CERT", &pki.cert)
            .env("TANDEM_CLUSTER_TLS_KEY", &pki.key)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(stage.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("TANDEM_STAGE_READY ")
        .unwrap_or_else(|| panic!("no ready line: {line:?}"))
        .to_owned();
    let config = |ca: &Path, cert: &Path, key: &Path| {
        format!(
            "model: {}\nengine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 4, \
             pipeline_parallel_size: 2, pipeline_stages: ['{addr}']}}\n\
             deployment: {{mode: colocated, cluster_tls: {{ca: {}, cert: {}, key: {}}}}}\n",
            model.display(),
            ca.display(),
            cert.display(),
            key.display()
        )
    };

    // An engine whose certificate another CA signed cannot link the stage, and stops.
    let stranger = dir.path().join("stranger.yaml");
    std::fs::write(
        &stranger,
        config(&pki.wrong_ca, &pki.wrong_cert, &pki.wrong_key),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--port", "0", "--config"])
        .arg(&stranger)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("TLS handshake"), "{err}");

    // One of the stage's CA links it and serves.
    let server = tandem_testkit::Server::with_config(BIN, &config(&pki.ca, &pki.cert, &pki.key));
    let answer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(server.complete("The capital of France is", 6));
    assert!(answer["choices"][0]["text"].as_str().is_some(), "{answer}");
    drop(server);
}
