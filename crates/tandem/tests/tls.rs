//! TLS with real processes on loopback: the embedded P/D default with `server.tls` and
//! `deployment.cluster_tls` answers a chat completion over HTTPS end to end (the KV moving over the
//! mutual-TLS TCP transport), while a client with a certificate from another CA, or with none, is refused
//! on a worker's control port and on the prefill worker's KV port, and plain HTTP to a TLS port gets no
//! answer; `tandem probe https://…` passes as a member and is refused as a stranger. `tandem chat`,
//! `bench` and `probe` reach an HTTPS server of a private CA with `--ca-cert`. Bad certificate files stop
//! `tandem serve` at start, naming the setting. Without the default model the end-to-end tests skip.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tandem_cluster::protocol::{PrefillRequest, PrefillResponse, WorkerInfo, WorkerLoad};
use tandem_engine::SamplingParams;
use tandem_kv::mem::MemSink;
use tandem_kv::{ClusterKey, ClusterTls, ClusterTlsPaths, KvClient, TcpConfig, TcpTransport};
use tandem_testkit::{
    default_model, json_of, model_path, spawn_ready, worker_urls, Server, TestPki,
    DEFAULT_MODEL_NAME,
};

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

/// `tandem probe URL`, with `cluster` (CA, certificate, key) as its environment's cluster TLS and
/// `--ca-cert` when given.
fn probe(url: &str, cluster: Option<[&Path; 3]>, ca_cert: Option<&Path>) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(["probe", url]);
    if let Some([ca, cert, key]) = cluster {
        cmd.env("TANDEM_CLUSTER_TLS_CA", ca)
            .env("TANDEM_CLUSTER_TLS_CERT", cert)
            .env("TANDEM_CLUSTER_TLS_KEY", key);
    }
    if let Some(ca) = ca_cert {
        cmd.arg("--ca-cert").arg(ca);
    }
    cmd.output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A client speaking the cluster's mutual TLS with `tls`.
fn member_client(tls: &ClusterTls) -> reqwest::Client {
    tandem_cluster::with_cluster_tls(reqwest::Client::builder(), Some(tls))
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
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
    let server = Server::with_tls_config(BIN, &yaml(&pki), &pki.ca);
    let url = server.url.clone();
    let api = &server.http;

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
            .get(url.replacen("https://", "http://", 1) + "/health")
            .send()
            .await
            .is_err(),
        "plain HTTP answered on the TLS port"
    );

    let listing = format!("{url}/v1/cluster/workers");
    let workers: Vec<Value> = json_of(api.get(&listing).bearer_auth(TOKEN)).await;
    let (prefill, decode) = worker_urls(&workers);
    assert!(prefill.starts_with("https://"), "{prefill}");

    // The prefill worker moved the completion's KV over its TLS'd KV port.
    let member = member_client(&cluster_tls(&pki.ca, &pki.cert, &pki.key));
    let load: WorkerLoad = json_of(
        member
            .get(format!("{prefill}/v1/worker/load"))
            .bearer_auth(TOKEN),
    )
    .await;
    assert!(
        load.kv.bytes_sent > 0,
        "no KV left the prefill worker: {load:?}"
    );

    // Strangers on the control ports: another CA's certificate, the right CA but no certificate, plain
    // HTTP. Each is refused before any HTTP answer, even with the token.
    let wrong_ca = member_client(&cluster_tls(&pki.wrong_ca, &pki.wrong_cert, &pki.wrong_key));
    let wrong_cert = member_client(&cluster_tls(&pki.ca, &pki.wrong_cert, &pki.wrong_key));
    let no_cert = api.clone();
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

    // `tandem probe` over TLS, as the Helm chart's worker probes run it in the pod: with the cluster TLS
    // in its environment it is answered; with another CA's, or trusting the CA but with no certificate of
    // its own (`--ca-cert`, how it probes the head's HTTPS API), it is refused in the handshake.
    let member_env = [pki.ca.as_path(), &pki.cert, &pki.key];
    for worker in [&prefill, &decode] {
        let health = format!("{worker}/health");
        let out = probe(&health, Some(member_env), None);
        assert!(out.status.success(), "{}", stderr(&out));
        let out = probe(
            &health,
            Some([pki.wrong_ca.as_path(), &pki.wrong_cert, &pki.wrong_key]),
            None,
        );
        assert!(!out.status.success(), "a stranger's probe passed");
        let out = probe(&health, None, Some(&pki.ca));
        assert!(
            !out.status.success(),
            "a probe without a certificate passed"
        );
        assert!(
            stderr(&out).contains("CertificateRequired"),
            "{}",
            stderr(&out)
        );
    }
    let out = probe(&format!("{url}/health"), None, Some(&pki.ca));
    assert!(out.status.success(), "{}", stderr(&out));
    let out = probe(&format!("{url}/health"), None, Some(&pki.wrong_ca));
    assert!(
        !out.status.success(),
        "the head's API passed a probe trusting another CA"
    );

    // A member pins a prompt's KV; a stranger cannot pull it from the KV port.
    let info: WorkerInfo = json_of(
        member
            .get(format!("{prefill}/v1/worker/info"))
            .bearer_auth(TOKEN),
    )
    .await;
    let pinned: PrefillResponse = json_of(
        member
            .post(format!("{prefill}/v1/worker/prefill"))
            .bearer_auth(TOKEN)
            .json(&PrefillRequest {
                prompt: (1..40).collect(),
                params: SamplingParams::greedy(4),
            }),
    )
    .await;
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

#[test]
fn a_stage_under_cluster_tls_serves_only_an_engine_of_its_ca() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let (_stage, addr) = spawn_ready(
        Command::new(BIN)
            .args(["stage", "--stage", "1", "--stages", "2", "--threads", "1"])
            .arg("--model")
            .arg(&model)
            .env("TANDEM_CLUSTER_TLS_CA", &pki.ca)
            .env("TANDEM_CLUSTER_TLS_CERT", &pki.cert)
            .env("TANDEM_CLUSTER_TLS_KEY", &pki.key)
            .stderr(Stdio::null()),
        "TANDEM_STAGE_READY ",
    );
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
    let server = Server::with_config(BIN, &config(&pki.ca, &pki.cert, &pki.key));
    let answer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(server.complete("The capital of France is", 6));
    assert!(answer["choices"][0]["text"].as_str().is_some(), "{answer}");
    drop(server);
}

#[test]
fn chat_bench_and_probe_trust_a_private_ca() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let config = format!(
        "model: {}\nengine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 4}}\n\
         server:\n  tls: {{cert: {}, key: {}}}\n",
        model.display(),
        pki.cert.display(),
        pki.key.display()
    );
    let server = Server::with_tls_config(BIN, &config, &pki.ca);
    let url = server.url.as_str();
    let run = |args: &[&str], ca: Option<&Path>, stdin: &str| {
        use std::io::Write;
        let mut cmd = Command::new(BIN);
        cmd.args(args);
        if let Some(ca) = ca {
            cmd.arg("--ca-cert").arg(ca);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };

    let chat = [
        "chat",
        "--url",
        url,
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ];
    let out = run(&chat, Some(&pki.ca), "Name a colour.\n");
    assert!(out.status.success(), "{}", stderr(&out));
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(!answer.trim().is_empty(), "no answer: {}", stderr(&out));
    for ca in [None, Some(pki.wrong_ca.as_path())] {
        let out = run(&chat, ca, "Name a colour.\n");
        assert!(!out.status.success(), "chat trusted a server of another CA");
    }

    let bench = [
        "bench",
        "--base-url",
        url,
        "--num-prompts",
        "2",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--warmup",
        "0",
        "--no-progress",
    ];
    let out = run(&bench, Some(&pki.ca), "");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{report}{}", stderr(&out));
    let ok = report
        .lines()
        .find_map(|l| l.strip_prefix("Successful requests:"))
        .map(str::trim);
    assert_eq!(ok, Some("2"), "{report}");
    let out = run(&bench, Some(&pki.wrong_ca), "");
    assert!(
        !out.status.success(),
        "bench trusted a server of another CA"
    );

    let out = run(&["probe", &format!("{url}/health")], Some(&pki.ca), "");
    assert!(out.status.success(), "{}", stderr(&out));
    drop(server);
}
