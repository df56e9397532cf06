//! `tandem bench` end to end: a real `tandem serve` (colocated, default model) on a free loopback port, a
//! short concurrency sweep and a short bursty run against it, then `tandem bench plot` over both result
//! files. Checks request and token counts, that nothing failed, and that the charts are PNG files.

use std::path::Path;

use serde_json::Value;
use tandem_testkit::{model_path, Server};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// `tandem serve` on `model` with a small KV cache, its log in `dir`.
fn serve(model: &Path, dir: &Path) -> Server {
    Server::start(
        BIN,
        &[
            model.as_os_str(),
            "--kv-cache-memory".as_ref(),
            "64MiB".as_ref(),
        ],
        &dir.join("serve.log"),
    )
}

/// Runs `tandem <args>` to completion; panics with its output when it fails.
fn tandem(args: &[&str]) -> String {
    tandem_testkit::run_ok(BIN, args)
}

fn load(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        bytes.starts_with(b"\x89PNG"),
        "{} is no PNG",
        path.display()
    );
}

#[test]
fn bench_sweeps_bursts_and_plots_against_a_live_server() {
    let Some(model) = model_path() else { return };
    let dir = std::env::temp_dir().join(format!("tandem-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let server = serve(&model, &dir);
    let tokenizer = model.to_str().unwrap();

    let sweep = dir.join("sweep.json");
    let plots = dir.join("plots");
    let stdout = tandem(&[
        "bench",
        "--base-url",
        &server.url,
        "--tokenizer",
        tokenizer,
        "--num-prompts",
        "6",
        "--input-len",
        "24",
        "--output-len",
        "8",
        "--concurrencies",
        "1,4",
        "--warmup",
        "1",
        "--prompt-format",
        "tokens",
        "--goodput",
        "ttft:600000",
        "--no-progress",
        "--output",
        sweep.to_str().unwrap(),
        "--plot-dir",
        plots.to_str().unwrap(),
    ]);
    assert!(stdout.contains("Output token throughput"), "{stdout}");
    let file = load(&sweep);
    let runs = file["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for run in runs {
        let s = &run["summary"];
        assert_eq!(s["completed"], 6, "{s}");
        assert_eq!(s["failed"], 0, "{s}");
        assert_eq!(s["total_input_tokens"], 6 * 24);
        // ignore_eos makes every request generate exactly max_tokens.
        assert_eq!(s["total_output_tokens"], 6 * 8);
        assert_eq!(
            s["prompt_len_mismatches"], 0,
            "token prompts are counted alike"
        );
        assert_eq!(s["itl_ms"]["count"], 6 * 7);
        assert_eq!(s["tpot_ms"]["count"], 6);
        assert_eq!(s["good_requests"], 6);
        assert!(s["ttft_ms"]["median"].as_f64().unwrap() > 0.0);
        assert_eq!(run["requests"].as_array().unwrap().len(), 6);
    }
    assert_eq!(runs[1]["config"]["max_concurrency"], 4);
    assert_png(&plots.join("latency_throughput.png"));

    let bursty = dir.join("bursty.json");
    tandem(&[
        "bench",
        "--base-url",
        &server.url,
        "--tokenizer",
        tokenizer,
        "--workload",
        "bursty",
        "--num-prompts",
        "6",
        "--request-rate",
        "10",
        "--input-len",
        "16",
        "--output-len",
        "6",
        "--burst-interval",
        "0.2",
        "--burst-size",
        "2",
        "--burst-input-len",
        "64",
        "--burst-output-len",
        "2",
        "--warmup",
        "0",
        "--no-progress",
        "--output",
        bursty.to_str().unwrap(),
    ]);
    let run = &load(&bursty)["runs"][0];
    let bursts = run["burst_times_s"].as_array().unwrap().len();
    let requests = run["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 6 + 2 * bursts);
    assert_eq!(run["summary"]["failed"], 0, "{}", run["summary"]);
    let steady = requests.iter().filter(|r| r["class"] == "steady").count();
    assert_eq!(steady, 6);

    let out = dir.join("combined");
    let table = tandem(&[
        "bench",
        "plot",
        sweep.to_str().unwrap(),
        bursty.to_str().unwrap(),
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        table
            .lines()
            .filter(|l| l.starts_with("| 127.0.0.1"))
            .count(),
        3,
        "{table}"
    );
    assert_png(&out.join("latency_throughput.png"));
    assert_png(&out.join("itl_over_time.png"));
    assert!(out.join("results.md").is_file());

    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
