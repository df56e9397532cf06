//! The cluster token with real processes on loopback: a P/D deployment whose token comes from a mounted
//! file serves end to end, while a stranger (no token, a wrong one) can neither call a worker's control
//! API (info, load, prefill, decode, release) nor the head's registration, nor pull a pinned KV block
//! from the prefill worker's KV port; a pipeline stage serves only an engine proving the token;
//! `--check-config` and the logs never show the token. Without the default model the tests skip.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_cluster::protocol::{PrefillRequest, PrefillResponse, ReleaseRequest, WorkerInfo};
use tandem_engine::SamplingParams;
use tandem_kv::mem::MemSink;
use tandem_kv::{ClusterKey, KvClient, TcpConfig, TcpTransport};
use tandem_testkit::{default_model, model_path, spawn_ready, worker_urls, Server};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

const TOKEN: &str = "s3cret-cluster-token-4711";

/// A cluster member's call (the token as bearer), its answer as JSON of type `T`.
async fn member_json<T: serde::de::DeserializeOwned>(req: reqwest::RequestBuilder) -> T {
    tandem_testkit::json_of(req.bearer_auth(TOKEN)).await
}

fn yaml(token_line: &str) -> String {
    format!(
        "model: {}\nengine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 8}}\n\
         deployment:\n  mode: pd\n  {token_line}\n  prefill: {{replicas: 1}}\n  decode: {{replicas: 1}}\n  \
         kv_transfer: {{transport: tcp, pin_timeout_secs: 30}}\n  routing: {{local_prefill_threshold: 4}}\n  \
         timeouts: {{poll_interval_secs: 0.2}}\n",
        default_model().display()
    )
}

#[test]
fn check_config_never_prints_the_token() {
    let dir = std::env::temp_dir().join(format!("tandem-token-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("pd.yaml");
    std::fs::write(&config, yaml(&format!("cluster_token: {TOKEN}"))).unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--check-config"])
        .arg(&config)
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(printed.contains("cluster_token: (set)"), "{printed}");
    assert!(!printed.contains(TOKEN), "{printed}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_and_the_deployment_with_the_token_serves() {
    if model_path().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tandem-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("cluster-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let server = Server::with_config(
        BIN,
        &yaml(&format!("cluster_token_file: {}", token_file.display())),
    );

    // End to end through the head: prefill, KV pull over the challenged connection, decode.
    let prompt = "The history of the printing press begins in the fifteenth century, when";
    let first = server.complete(prompt, 8).await;
    assert_eq!(
        server.complete(prompt, 8).await["choices"],
        first["choices"]
    );

    let http = reqwest::Client::new();
    let listing = format!("{}/v1/cluster/workers", server.url);
    assert_eq!(http.get(&listing).send().await.unwrap().status(), 401);
    let workers: Vec<Value> = member_json(http.get(&listing)).await;
    assert_eq!(workers.len(), 2, "{workers:?}");
    let register = http
        .post(&listing)
        .json(&json!({"url": workers[0]["url"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        register.status(),
        401,
        "a stranger cannot register a worker"
    );

    let (prefill, decode) = worker_urls(&workers);
    let request = PrefillRequest {
        prompt: (1..40).collect(),
        params: SamplingParams::greedy(4),
    };

    // A stranger, without a token or with a wrong one, gets 401 from every control route.
    for auth in [None, Some("guess")] {
        for url in [&prefill, &decode] {
            for path in ["/v1/worker/info", "/v1/worker/load"] {
                let mut r = http.get(format!("{url}{path}"));
                if let Some(t) = auth {
                    r = r.bearer_auth(t);
                }
                assert_eq!(r.send().await.unwrap().status(), 401, "{url}{path}");
            }
            for path in [
                "/v1/worker/prefill",
                "/v1/worker/decode",
                "/v1/worker/release",
            ] {
                let mut r = http.post(format!("{url}{path}")).json(&request);
                if let Some(t) = auth {
                    r = r.bearer_auth(t);
                }
                assert_eq!(r.send().await.unwrap().status(), 401, "{url}{path}");
            }
        }
    }

    // A cluster member pins a prompt's KV on the prefill worker...
    let info: WorkerInfo = member_json(http.get(format!("{prefill}/v1/worker/info"))).await;
    let pinned: PrefillResponse = member_json(
        http.post(format!("{prefill}/v1/worker/prefill"))
            .json(&request),
    )
    .await;
    let handle = pinned.handle.expect("KV pinned");

    // ...which a stranger on the KV port cannot pull, with no key or a wrong one.
    let pull = |key: Option<&str>| {
        let transport = TcpTransport::new(
            info.peer.clone(),
            TcpConfig {
                cluster_key: key.and_then(ClusterKey::new),
                ..TcpConfig::default()
            },
        );
        let sink = Arc::new(MemSink::new(handle.layout, handle.block_ids.len()));
        let handle = handle.clone();
        async move { KvClient::new(Arc::new(transport)).pull(&handle, sink).await }
    };
    for key in [None, Some("guess")] {
        let err = pull(key).await.unwrap_err();
        assert!(err.to_string().contains("cluster token"), "{key:?}: {err}");
    }
    // The pin survived the strangers: the member pulls it (and its ack releases it).
    let stats = pull(Some(TOKEN)).await.expect("a member pulls");
    assert_eq!(stats.bytes, handle.total_bytes());
    let released = http
        .post(format!("{prefill}/v1/worker/release"))
        .bearer_auth(TOKEN)
        .json(&ReleaseRequest {
            transfer_id: handle.transfer_id,
        })
        .send()
        .await
        .unwrap();
    assert!(released.status().is_success());

    assert_eq!(
        server.complete(prompt, 8).await["choices"],
        first["choices"]
    );
    let log = server.log();
    assert!(!log.contains(TOKEN), "the token was logged:\n{log}");
    assert!(log.contains("without the cluster token refused"), "{log}");
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stage_serves_only_an_engine_proving_the_token() {
    let Some(model) = model_path() else { return };
    let (_stage, addr) = spawn_ready(
        Command::new(BIN)
            .args(["stage", "--stage", "1", "--stages", "2", "--threads", "1"])
            .arg("--model")
            .arg(&model)
            .env("TANDEM_CLUSTER_TOKEN", TOKEN)
            .stderr(Stdio::null()),
        "TANDEM_STAGE_READY ",
    );
    let dir = std::env::temp_dir().join(format!("tandem-token-pp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = |token: &str| {
        format!(
            "model: {}
engine: {{block_size: 16, kv_cache_memory: 64MiB, threads: 1, max_num_seqs: 4, \
             pipeline_parallel_size: 2, pipeline_stages: ['{addr}']}}
deployment: {{mode: colocated{token}}}\n",
            model.display()
        )
    };

    // Without the token the engine cannot link its stage, and says why.
    let stranger = dir.join("stranger.yaml");
    std::fs::write(&stranger, config("")).unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--port", "0", "--config"])
        .arg(&stranger)
        .env_remove("TANDEM_CLUSTER_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "serve without the token kept running"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("requires the cluster token"), "{err}");

    // With it (from the YAML), the same stage serves, its pool sized by this engine, not the stranger.
    let server = Server::with_config(BIN, &config(&format!(", cluster_token: {TOKEN}")));
    let answer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(server.complete("The capital of France is", 6));
    assert!(answer["choices"][0]["text"].as_str().is_some(), "{answer}");
    assert!(!server.log().contains(TOKEN));
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
