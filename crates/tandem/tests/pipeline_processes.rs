//! Pipeline parallelism across real processes on loopback: `tandem serve` with `pipeline_parallel_size: 2`
//! starts a `tandem stage` process for layers 15..30 and must answer the OpenAI API with the same greedy
//! tokens as the unsplit model, colocated and in a P/D deployment whose prefill and decode workers are
//! both pipelined (so KV of the remote stage's layers is exported and imported through the stage links).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_testkit::{greedy_body, model_path, signal, text, Server, PROMPTS};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// Starts `tandem serve --config <dir>/<name>.yaml` with `yaml` written there.
fn serve(dir: &Path, name: &str, yaml: &str) -> Server {
    let config = dir.join(format!("{name}.yaml"));
    std::fs::write(&config, yaml).unwrap();
    Server::start(
        BIN,
        &[Path::new("--config"), config.as_path()],
        &dir.join(format!("{name}.log")),
    )
}

/// Runs `f` to completion on a runtime of its own (these tests are synchronous).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// One greedy completion of `max_tokens` tokens: its HTTP status and body.
fn complete(server: &Server, prompt: &str, max_tokens: usize) -> (reqwest::StatusCode, Value) {
    block_on(server.post_completion(greedy_body(prompt, max_tokens)))
}

/// The greedy completions of `PROMPTS`, all sent at once so the engine batches (and micro-batches) them.
fn answers(server: &Server) -> Vec<String> {
    block_on(async {
        let calls = PROMPTS
            .iter()
            .map(|p| async { text(&server.complete_with(greedy_body(p, 12)).await) });
        futures::future::join_all(calls).await
    })
}

/// Child process ids of `pid` (Linux: /proc/PID/task/*/children).
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = task.unwrap().path().join("children");
        let text = std::fs::read_to_string(path).unwrap_or_default();
        out.extend(text.split_whitespace().map(|p| p.parse::<u32>().unwrap()));
    }
    out
}

const ENGINE: &str =
    "engine: {block_size: 16, kv_cache_memory: 64MiB, threads: 2, max_num_seqs: 8}\n";

#[test]
fn pipeline_parallel_2_answers_like_pipeline_parallel_1() {
    let Some(model) = model_path() else { return };
    let dir = std::env::temp_dir().join(format!("tandem-pp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let colocated = |pp: usize| {
        format!(
            "model: {}\n{}deployment: {{mode: colocated}}\n",
            model.display(),
            ENGINE.replace(
                "max_num_seqs: 8",
                &format!("max_num_seqs: 8, pipeline_parallel_size: {pp}")
            )
        )
    };
    let want = answers(&serve(&dir, "pp1", &colocated(1)));
    assert!(want.iter().all(|t| !t.is_empty()), "{want:?}");

    let pp2 = serve(&dir, "pp2", &colocated(2));
    assert_eq!(answers(&pp2), want, "colocated pipeline_parallel_size 2");
    let log = pp2.log();
    assert!(log.contains("pipeline stage connected"), "{log}");
    // Killing the stage process mid-generation fails the request promptly instead of hanging it.
    let stage = children(pp2.child.id());
    assert_eq!(stage.len(), 1, "one stage process: {stage:?}");
    let t = Instant::now();
    let (status, body) = std::thread::scope(|s| {
        let req = s.spawn(|| complete(&pp2, PROMPTS[0], 2000));
        std::thread::sleep(Duration::from_millis(1500));
        signal(stage[0], "-9");
        req.join().unwrap()
    });
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    assert!(!status.is_success(), "{status}: {body}");
    // The client is told which stage failed, and the engine logs it as a lost worker and stops serving.
    assert!(
        body.to_string().contains("pipeline stage 1"),
        "{status}: {body}"
    );
    let log = pp2.log();
    assert!(
        log.contains("backend unusable")
            && log.contains("WorkerLost")
            && log.contains("pipeline stage 1"),
        "{log}"
    );
    drop(pp2);

    let pd = format!(
        "model: {}\n{ENGINE}deployment:\n  mode: pd\n  \
         prefill: {{replicas: 1, engine: {{pipeline_parallel_size: 2}}}}\n  \
         decode: {{replicas: 1, engine: {{pipeline_parallel_size: 2, pipeline_micro_batches: 3}}}}\n  \
         kv_transfer: {{transport: tcp, pin_timeout_secs: 20}}\n  routing: {{local_prefill_threshold: 16}}\n",
        model.display()
    );
    let pd = serve(&dir, "pd", &pd);
    assert_eq!(answers(&pd), want, "P/D with pipelined prefill and decode");
    let log = pd.log();
    assert_eq!(
        log.matches("pipeline stage connected").count(),
        2,
        "both workers pipelined:\n{log}"
    );
    for stage in ["[prefill-0/stage-1] ", "[decode-0/stage-1] "] {
        assert!(
            log.lines().any(|l| l.starts_with(stage)),
            "a stage's lines name the worker that started it ({stage}):\n{log}"
        );
    }
    drop(pd);
    let _ = std::fs::remove_dir_all(&dir);
}
