//! A P/D deployment's settings reach every process it starts: `tandem serve` with `deployment.mode: pd`,
//! a non-default `engine.kv_cache_memory` and `cuda: {graphs: false}` (the section parses on CPU builds),
//! and a two-stage pipeline on the decode role. Each child logs the engine and CUDA settings it received
//! at start (`worker settings`, `stage settings`); the prefill worker, the decode worker and the decode
//! worker's stage must each report both. Skips without the default model.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// A KV budget no default equals.
const KV_BYTES: u64 = 48 << 20;

/// Kills the head (its children exit when their stdin pipe closes) however the test ends.
struct Head(std::process::Child);

impl Drop for Head {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_child_of_a_pd_deployment_receives_the_engine_and_cuda_settings() {
    let Some(model) = tandem_testkit::model_path() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("tandem-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("pd.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {}\nserver: {{port: 0}}\n\
             engine: {{block_size: 16, kv_cache_memory: {KV_BYTES}, threads: 1, max_num_seqs: 8}}\n\
             cuda: {{graphs: false}}\n\
             deployment:\n  mode: pd\n  prefill: {{replicas: 1}}\n  \
             decode: {{replicas: 1, engine: {{pipeline_parallel_size: 2}}}}\n  \
             kv_transfer: {{transport: tcp}}\n",
            model.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--log-format", "json", "--config"])
        .arg(&config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting tandem serve");
    let (stdout, stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let _head = Head(child);
    let (tx, rx) = mpsc::channel::<String>();
    let out_tx = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = out_tx.send(line);
        }
    });
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });

    let want = ["prefill-0", "decode-0", "decode-0/stage-1"];
    let mut seen: Vec<(String, Value, Value)> = Vec::new();
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(240);
    while seen.len() < want.len() {
        let wait = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = rx.recv_timeout(wait) else {
            panic!(
                "only {:?} reported settings; the log:\n{}",
                seen.iter().map(|s| &s.0).collect::<Vec<_>>(),
                log.join("\n")
            );
        };
        log.push(line.clone());
        let Some(at) = line.find('{') else { continue };
        let Ok(event) = serde_json::from_str::<Value>(&line[at..]) else {
            continue;
        };
        let message = event["message"].as_str().unwrap_or_default();
        if message != "worker settings" && message != "stage settings" {
            continue;
        }
        let field = |key: &str| -> Value {
            serde_json::from_str(event[key].as_str().expect("a JSON document")).unwrap()
        };
        let name = event["worker"].as_str().unwrap_or_default().to_owned();
        seen.push((name, field("engine"), field("cuda")));
    }
    for name in want {
        let (_, engine, cuda) = seen
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("{name} did not report its settings: {seen:?}"));
        assert_eq!(engine["kv_cache_memory"], KV_BYTES, "{name}: {engine}");
        assert_eq!(cuda["graphs"], false, "{name}: {cuda}");
    }
    eprintln!("settings the children received: {seen:?}");
    let stage = &seen.iter().find(|s| s.0 == "decode-0/stage-1").unwrap().1;
    assert_eq!(
        stage["max_num_seqs"], 8,
        "the worker's step limits: {stage}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
