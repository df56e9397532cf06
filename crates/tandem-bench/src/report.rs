//! Result files and tables: one JSON file per invocation holding every run (sweep point × endpoint), a
//! vLLM-style block per run for the terminal, and a Markdown table over runs for comparisons.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::BenchError;
use crate::metrics::{RequestRecord, Stats, Summary};
use crate::workload::{PromptFormat, WorkloadSpec};

/// How one run was configured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// The endpoint's display name.
    pub endpoint: String,
    /// Its base URL.
    pub base_url: String,
    /// The model name sent.
    pub model: String,
    /// The workload.
    pub workload: WorkloadSpec,
    /// Requests of the run (steady ones for the bursty workload).
    pub num_prompts: usize,
    /// Poisson request rate; `None` means all at once.
    pub request_rate: Option<f64>,
    /// Requests in flight at most; `None` means unlimited.
    pub max_concurrency: Option<usize>,
    /// Requests sent and discarded before the run.
    pub warmup: usize,
    /// Seed of this run's prompts and arrivals.
    pub seed: u64,
    /// How prompts were sent.
    pub prompt_format: PromptFormat,
}

impl RunConfig {
    /// The sweep coordinate as a short label: `c16`, `r4`, `r=inf`.
    pub fn point_label(&self) -> String {
        match (self.max_concurrency, self.request_rate) {
            (Some(c), None) => format!("c{c}"),
            (Some(c), Some(r)) => format!("c{c} r{r}"),
            (None, Some(r)) => format!("r{r}"),
            (None, None) => "r=inf".into(),
        }
    }
}

/// One run: its configuration, when and where it ran, its summary and every request's record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Configuration.
    pub config: RunConfig,
    /// Start time, RFC 3339 UTC.
    pub started_at: String,
    /// 1-minute load average of the benchmarking machine before the run.
    pub load_avg_before: Option<f64>,
    /// 1-minute load average after the run.
    pub load_avg_after: Option<f64>,
    /// The figures.
    pub summary: Summary,
    /// Burst times in seconds after the start (bursty workload).
    #[serde(default)]
    pub burst_times_s: Vec<f64>,
    /// Every request, in completion order.
    pub requests: Vec<RequestRecord>,
}

/// The machine the benchmark ran on (the client's; on one host, also the servers').
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// Logical CPUs.
    pub nproc: usize,
    /// CPU model from /proc/cpuinfo.
    pub cpu_model: Option<String>,
    /// Host name.
    pub hostname: Option<String>,
}

impl Machine {
    /// Describes this machine.
    pub fn current() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string());
        Machine {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string()),
        }
    }
}

/// The 1-minute load average, where /proc/loadavg exists.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// What `--output` writes and `tandem bench plot` reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchFile {
    /// The tool and its version.
    pub tool: String,
    /// The machine.
    pub machine: Machine,
    /// The exact command line.
    pub command: String,
    /// Every run.
    pub runs: Vec<RunResult>,
}

impl BenchFile {
    /// Writes pretty JSON.
    pub fn save(&self, path: &Path) -> Result<(), BenchError> {
        let text = serde_json::to_string_pretty(self).expect("results serialize");
        std::fs::write(path, text).map_err(|e| BenchError::io(path, e))
    }

    /// Reads a file written by [`BenchFile::save`].
    pub fn load(path: &Path) -> Result<BenchFile, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
        serde_json::from_str(&text).map_err(|source| BenchError::ResultFile {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// A vLLM-style block of one run's figures for the terminal.
pub fn render_run(run: &RunResult) -> String {
    let s = &run.summary;
    let c = &run.config;
    let mut out = String::new();
    let title = format!(
        " {} · {} · {} ",
        c.endpoint,
        c.workload.kind(),
        c.point_label()
    );
    let _ = writeln!(out, "{title:=^60}");
    let mut line = |k: &str, v: String| {
        let _ = writeln!(out, "{k:<42}{v:>18}");
    };
    line("Successful requests:", s.completed.to_string());
    line("Failed requests:", s.failed.to_string());
    line("Benchmark duration (s):", format!("{:.2}", s.duration_s));
    line("Total input tokens:", s.total_input_tokens.to_string());
    line("Total generated tokens:", s.total_output_tokens.to_string());
    line(
        "Request throughput (req/s):",
        format!("{:.2}", s.request_throughput),
    );
    if let Some(g) = s.goodput {
        line("Request goodput (req/s):", format!("{g:.2}"));
    }
    line(
        "Output token throughput (tok/s):",
        format!("{:.2}", s.output_throughput),
    );
    line(
        "Total token throughput (tok/s):",
        format!("{:.2}", s.total_token_throughput),
    );
    for (name, stats) in [
        ("TTFT", &s.ttft_ms),
        ("TPOT", &s.tpot_ms),
        ("ITL", &s.itl_ms),
        ("E2E latency", &s.e2el_ms),
    ] {
        let _ = writeln!(out, "{:-^60}", format!(" {name} (ms) "));
        for (k, v) in [
            ("Mean", stats.mean),
            ("Median", stats.median),
            ("P90", stats.p90),
            ("P99", stats.p99),
        ] {
            let _ = writeln!(out, "{:<42}{:>18.2}", format!("{k} {name}:"), v);
        }
    }
    if s.prompt_len_mismatches > 0 {
        let _ = writeln!(
            out,
            "note: the server counted a different prompt length for {} requests (a BOS it adds?)",
            s.prompt_len_mismatches
        );
    }
    for e in &s.errors {
        let _ = writeln!(out, "error ×{}: {}", e.count, e.message);
    }
    let _ = write!(out, "{:=^60}", "");
    out
}

/// A Markdown table with one row per run.
pub fn markdown_table(runs: &[RunResult]) -> String {
    let mut out = String::from(
        "| endpoint | workload | point | ok/err | req/s | out tok/s | total tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | goodput req/s | load |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let pair = |s: &Stats| format!("{:.1} / {:.1}", s.median, s.p99);
    for run in runs {
        let s = &run.summary;
        let load = match (run.load_avg_before, run.load_avg_after) {
            (Some(a), Some(b)) => format!("{a:.1}–{b:.1}"),
            _ => "?".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {}/{} | {:.2} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} |",
            run.config.endpoint,
            run.config.workload.kind(),
            run.config.point_label(),
            s.completed,
            s.failed,
            s.request_throughput,
            s.output_throughput,
            s.total_token_throughput,
            pair(&s.ttft_ms),
            pair(&s.tpot_ms),
            pair(&s.itl_ms),
            pair(&s.e2el_ms),
            s.goodput.map_or("–".into(), |g| format!("{g:.2}")),
            load,
        );
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::metrics::{summarize, Slo};
    use crate::workload::{LengthSpec, RequestClass};

    /// A one-request run for tests of this crate.
    pub(crate) fn run() -> RunResult {
        let rec = RequestRecord {
            class: RequestClass::Main,
            start_s: 0.0,
            success: true,
            prompt_len: 8,
            server_prompt_tokens: Some(8),
            output_len: 3,
            ttft_s: 0.1,
            itl_s: vec![0.01, 0.03],
            e2e_s: 0.14,
            error: None,
        };
        RunResult {
            config: RunConfig {
                endpoint: "tandem".into(),
                base_url: "http://127.0.0.1:1".into(),
                model: "m".into(),
                workload: WorkloadSpec::Random {
                    input: LengthSpec::fixed(8),
                    output: LengthSpec::fixed(3),
                },
                num_prompts: 1,
                request_rate: None,
                max_concurrency: Some(4),
                warmup: 0,
                seed: 0,
                prompt_format: PromptFormat::Text,
            },
            started_at: "2026-01-01T00:00:00Z".into(),
            load_avg_before: Some(1.0),
            load_avg_after: Some(2.0),
            summary: summarize(std::slice::from_ref(&rec), 1.0, &Slo::default()),
            burst_times_s: vec![],
            requests: vec![rec],
        }
    }

    #[test]
    fn tables_show_the_figures() {
        let r = run();
        let block = render_run(&r);
        assert!(block.contains("tandem · random · c4"), "{block}");
        assert!(block.contains("Median TPOT:"), "{block}");
        assert!(block.contains("20.00"), "{block}"); // TPOT (140 − 100) / 2 ms
        let table = markdown_table(&[r]);
        assert_eq!(table.lines().count(), 3);
        assert!(
            table.contains("| tandem | random | c4 | 1/0 | 1.00 | 3.0 | 11.0 |"),
            "{table}"
        );
    }

    #[test]
    fn result_files_round_trip() {
        let file = BenchFile {
            tool: "tandem bench".into(),
            machine: Machine::current(),
            command: "tandem bench".into(),
            runs: vec![run()],
        };
        let path = std::env::temp_dir().join(format!("tandem-bench-{}.json", std::process::id()));
        file.save(&path).unwrap();
        let back = BenchFile::load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(back, file);
    }
}
