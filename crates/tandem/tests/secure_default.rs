//! Secure by default, with real processes on loopback: the embedded P/D deployment of `examples/pd.yaml`
//! (what `scripts/serve.sh` starts), given no token at all, makes one up for its workers, so a stranger
//! gets 401 from every worker control route and is refused by the prefill worker's KV port, while the
//! deployment serves; a worker or stage bound beyond loopback without a token refuses to start, naming the
//! settings, unless `--allow-unauthenticated` says the user chose it. Without the default model the tests
//! that load it skip.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tandem_cluster::protocol::PrefillRequest;
use tandem_engine::SamplingParams;
use tandem_kv::wire::{client_handshake, FrameReader};
use tandem_kv::{ClusterKey, PeerInfo, WireDtype, WireLayout};
use tandem_testkit::{default_model, model_path, root, spawn_ready, Server};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// The cluster token's variable, emptied for every process here: "no configuration" must hold even
/// where the test runner's environment has one.
const TOKEN_ENV: &str = "TANDEM_CLUSTER_TOKEN";

/// What a worker announces once it serves, in the head's log: its role, RPC URL and KV endpoint.
struct Announced {
    role: String,
    url: String,
    kv: String,
}

/// The value of `key=` on a text log line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .map(|v| v.trim_matches('"'))
}

/// The workers' "worker serving" lines in `log` (their stderr is the head's).
fn announced(log: &str) -> Vec<Announced> {
    log.lines()
        .filter(|l| l.contains("worker serving"))
        .filter_map(|l| {
            Some(Announced {
                role: field(l, "role")?.to_owned(),
                url: field(l, "url")?.to_owned(),
                kv: field(l, "kv")?.to_owned(),
            })
        })
        .collect()
}

/// `examples/pd.yaml` as it is, but for the model's path (the file names it relative to the repository).
fn embedded_default_yaml() -> String {
    let yaml = std::fs::read_to_string(root().join("examples/pd.yaml")).unwrap();
    assert!(
        yaml.contains("\nmodel: models/"),
        "examples/pd.yaml names its model otherwise:\n{yaml}"
    );
    yaml.replacen(
        "\nmodel: models/SmolLM2-135M-Instruct.Q4_1.gguf",
        &format!("\nmodel: {}", default_model().display()),
        1,
    )
}

/// A KV handshake from a stranger (a made-up peer, `key` its guess at the token, if any) against the KV
/// server at `endpoint`: the error it ends with.
async fn stranger_handshake(endpoint: &str, key: Option<&str>) -> String {
    let stream = tokio::net::TcpStream::connect(endpoint).await.unwrap();
    let io = Duration::from_secs(10);
    let mut reader = FrameReader::new(stream, io);
    let stranger = PeerInfo {
        model_id: "a stranger".into(),
        layout: WireLayout {
            n_layers: 1,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 64,
            block_size: 16,
            dtype: WireDtype::F32,
        },
    };
    let key = key.and_then(ClusterKey::new);
    match client_handshake(&mut reader, &stranger, key.as_ref(), io).await {
        Ok(()) => panic!("the KV server at {endpoint} shook hands with a stranger"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_default_refuses_a_stranger_with_no_configuration() {
    if model_path().is_none() {
        return;
    }
    let server = Server::with_config_env(BIN, &embedded_default_yaml(), &[(TOKEN_ENV, "")]);

    // It serves end to end (a long prompt: prefill worker, authenticated KV pull, decode worker).
    let prompt = "The history of the printing press begins in the fifteenth century, when";
    let answer = server.complete(prompt, 8).await;
    assert!(answer["choices"][0]["text"].as_str().is_some(), "{answer}");

    let log = server.log();
    assert!(
        log.contains("this head generated one for the workers it started"),
        "{log}"
    );
    let workers = announced(&log);
    assert_eq!(workers.len(), 2, "two workers announced:\n{log}");
    let http = reqwest::Client::new();
    let listing = http
        .get(format!("{}/v1/cluster/workers", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(listing.status(), 401, "the head's worker listing");

    let request = PrefillRequest {
        prompt: (1..40).collect(),
        params: SamplingParams::greedy(4),
    };
    for worker in &workers {
        let url = &worker.url;
        // Reachable (so a 401 below is the token's doing)...
        let health = http.get(format!("{url}/health")).send().await.unwrap();
        assert_eq!(health.status(), 200, "{url}/health");
        // ...but every control route is closed to a stranger, without a token or with a guess.
        for bearer in [None, Some("guess")] {
            for path in ["/v1/worker/info", "/v1/worker/load"] {
                let mut r = http.get(format!("{url}{path}"));
                if let Some(t) = bearer {
                    r = r.bearer_auth(t);
                }
                let status = r.send().await.unwrap().status();
                assert_eq!(status, 401, "{} {url}{path} ({bearer:?})", worker.role);
            }
            for path in [
                "/v1/worker/prefill",
                "/v1/worker/decode",
                "/v1/worker/release",
            ] {
                let mut r = http.post(format!("{url}{path}")).json(&request);
                if let Some(t) = bearer {
                    r = r.bearer_auth(t);
                }
                let status = r.send().await.unwrap().status();
                assert_eq!(status, 401, "{} {url}{path} ({bearer:?})", worker.role);
            }
        }
    }

    // The prefill worker's KV port challenges a stranger, who cannot answer without the token...
    let prefill = workers
        .iter()
        .find(|w| w.role == "prefill")
        .expect("a prefill worker");
    let err = stranger_handshake(&prefill.kv, None).await;
    assert!(err.contains("requires the cluster token"), "{err}");
    // ...nor with a guess.
    let err = stranger_handshake(&prefill.kv, Some("guess")).await;
    assert!(err.contains("failed the cluster token challenge"), "{err}");

    // The strangers changed nothing for the members.
    let again = server.complete(prompt, 8).await;
    assert_eq!(again["choices"], answer["choices"]);
}

/// Runs `tandem <args>` without a cluster token until it exits (at most 60 s): its status and stderr.
fn refused(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env_remove(TOKEN_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("`tandem {}` kept running without a token", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that a refusal names every way to give the token and the way to run open.
fn names_the_settings(stderr: &str) {
    for named in [
        "deployment.cluster_token",
        "cluster_token_file",
        "TANDEM_CLUSTER_TOKEN",
        "--allow-unauthenticated",
    ] {
        assert!(
            stderr.contains(named),
            "the refusal lacks {named}:\n{stderr}"
        );
    }
}

#[test]
fn a_worker_or_stage_bound_beyond_loopback_needs_a_token_or_the_users_choice() {
    let Some(model) = model_path() else { return };
    let model = model.display().to_string();
    let worker = |extra: &[&str]| {
        let mut args = vec![
            "worker",
            "--role",
            "prefill",
            "--model",
            &model,
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--kv-port",
            "0",
            "--advertise-host",
            "127.0.0.1",
            "--threads",
            "1",
            "--kv-cache-memory",
            "64MiB",
        ];
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };

    let args = worker(&[]);
    let (status, stderr) = refused(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("the worker's RPC port"), "{stderr}");
    names_the_settings(&stderr);

    let (status, stderr) = refused(&[
        "stage",
        "--stage",
        "1",
        "--stages",
        "2",
        "--model",
        &model,
        "--listen",
        "0.0.0.0:0",
    ]);
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("the stage's port"), "{stderr}");
    names_the_settings(&stderr);

    // The user's choice: the same worker starts and serves (its ready line), open.
    let (_worker, url) = spawn_ready(
        Command::new(BIN)
            .args(worker(&["--allow-unauthenticated"]))
            .env_remove(TOKEN_ENV)
            .stderr(Stdio::null()),
        "TANDEM_WORKER_READY ",
    );
    assert!(url.starts_with("http://"), "{url}");
}
