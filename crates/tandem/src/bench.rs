//! `tandem bench`: the serving benchmark (library: `tandem-bench`) against any OpenAI-compatible server,
//! and `tandem bench plot` to chart and tabulate result files from several invocations together.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use tandem_bench::arrival::parse_rate;
use tandem_bench::multiturn::{self, MultiTurnSpec};
use tandem_bench::workload::LengthSpec;
use tandem_bench::{
    plot, report, BenchFile, BenchPlan, BurstySpec, Endpoint, PromptBuilder, PromptFormat, Slo,
    SweepPoint, WorkloadSpec,
};

use crate::process::resolve_model;

/// Options of `tandem bench`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: Option<BenchCommand>,
    #[command(flatten)]
    run: RunArgs,
}

/// `tandem bench` subcommands (none: run a benchmark).
#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Chart and tabulate result files (`--output` of earlier runs) together.
    Plot(PlotArgs),
}

/// Which workload to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum WorkloadKind {
    /// Random prompts of --input-len tokens, --output-len tokens out.
    Random,
    /// Prompts that share one of --num-prefixes system prompts of --prefix-len tokens, then --input-len
    /// tokens of their own.
    SharedPrefix,
    /// Steady short requests at --request-rate plus bursts of --burst-size long prompts every
    /// --burst-interval seconds.
    Bursty,
    /// Prompts from --dataset (JSONL: {"prompt": "...", "max_tokens": N} per line).
    Jsonl,
    /// --conversations conversations of --turns turns at once, each turn's prompt the whole history
    /// (a shared --doc-len document, the user turns of --user-len tokens, the answers the server
    /// returned, --answer-len tokens each), --think-time seconds between turns; or the conversations
    /// of a ShareGPT-style JSONL --conversations-file. Reports TTFT per turn index.
    MultiTurn,
}

/// The workload flags, shared by `tandem bench` and `tandem sim`.
#[derive(Args, Debug, Clone)]
pub(crate) struct WorkloadArgs {
    /// Workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Random)]
    pub(crate) workload: WorkloadKind,
    /// Requests per run (for bursty: steady requests; bursts come on top).
    #[arg(long, default_value_t = 100)]
    pub(crate) num_prompts: usize,
    /// Prompt tokens (for shared-prefix: after the prefix; for bursty: of the steady requests).
    #[arg(long, default_value_t = 256)]
    pub(crate) input_len: usize,
    /// Output tokens (for bursty: of the steady requests).
    #[arg(long, default_value_t = 128)]
    pub(crate) output_len: usize,
    /// Draw input and output lengths uniformly within ±this fraction of --input-len/--output-len.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) range_ratio: f64,
    /// Shared-prefix: tokens of each shared prefix.
    #[arg(long, default_value_t = 512)]
    pub(crate) prefix_len: usize,
    /// Shared-prefix: distinct prefixes.
    #[arg(long, default_value_t = 1)]
    pub(crate) num_prefixes: usize,
    /// Bursty: prompt tokens of each burst request.
    #[arg(long, default_value_t = 1024)]
    pub(crate) burst_input_len: usize,
    /// Bursty: output tokens of each burst request.
    #[arg(long, default_value_t = 16)]
    pub(crate) burst_output_len: usize,
    /// Bursty: requests per burst.
    #[arg(long, default_value_t = 4)]
    pub(crate) burst_size: usize,
    /// Bursty: seconds between bursts.
    #[arg(long, default_value_t = 5.0)]
    pub(crate) burst_interval: f64,
    /// JSONL prompt file for --workload jsonl.
    #[arg(long)]
    pub(crate) dataset: Option<PathBuf>,
}

/// The multi-turn workload's flags, shared by `tandem bench` and `tandem sim`.
#[derive(Args, Debug, Clone)]
pub(crate) struct MultiTurnArgs {
    /// Multi-turn: conversations running at once.
    #[arg(long, default_value_t = 16)]
    pub(crate) conversations: usize,
    /// Multi-turn: turns per conversation.
    #[arg(long, default_value_t = 8)]
    pub(crate) turns: usize,
    /// Multi-turn: tokens of the document every conversation starts with.
    #[arg(long, default_value_t = 1500)]
    pub(crate) doc_len: usize,
    /// Multi-turn: tokens of each user turn.
    #[arg(long, default_value_t = 100)]
    pub(crate) user_len: usize,
    /// Multi-turn: tokens of each answer (with --conversations-file: the most an answer gets).
    #[arg(long, default_value_t = 64)]
    pub(crate) answer_len: usize,
    /// Multi-turn: seconds between an answer and the conversation's next turn.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) think_time: f64,
    /// Multi-turn: ShareGPT-style JSONL ({"conversations": [{"from": "human", "value": ...}, ...]} per
    /// line) instead of synthetic conversations.
    #[arg(long)]
    pub(crate) conversations_file: Option<PathBuf>,
}

impl MultiTurnArgs {
    /// The synthetic conversations' spec, with the think time checked.
    pub(crate) fn spec(&self) -> Result<MultiTurnSpec> {
        if !self.think_time.is_finite() || self.think_time < 0.0 {
            bail!("--think-time must be a non-negative number of seconds");
        }
        Ok(MultiTurnSpec {
            conversations: self.conversations,
            turns: self.turns,
            shared_len: self.doc_len,
            user_len: self.user_len,
            answer_len: self.answer_len,
            think_s: self.think_time,
        })
    }
}

/// Options of a benchmark run.
#[derive(Args, Debug)]
struct RunArgs {
    /// Server base URL (without /v1).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    base_url: String,
    /// Benchmark several servers one after another: NAME=URL, repeated (replaces --base-url).
    #[arg(long = "endpoint", value_name = "NAME=URL")]
    endpoints: Vec<String>,
    /// Model name to send (default: the first of each server's /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Bearer token for the server.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// PEM CA certificate(s) to trust for https servers (whose certificates a private CA signed).
    #[arg(long, value_name = "FILE")]
    ca_cert: Option<PathBuf>,
    /// Tokenizer of the served model: GGUF file or HF folder (default: the default model).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Poisson arrival rate in requests/s, or inf to send all at once (bursty: the steady rate; inf
    /// there means 2/s).
    #[arg(long, default_value = "inf", value_parser = parse_rate)]
    request_rate: f64,
    /// Sweep over request rates, e.g. 1,2,4,inf.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate, conflicts_with = "concurrencies")]
    request_rates: Vec<f64>,
    /// Requests in flight at most.
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Sweep over concurrency limits, e.g. 1,4,16.
    #[arg(long, value_delimiter = ',')]
    concurrencies: Vec<usize>,
    /// Requests sent and discarded before measuring.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Seed of prompts and arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Send prompts as round-trip-checked text or as token ids.
    #[arg(long, value_enum, default_value_t = FormatArg::Text)]
    prompt_format: FormatArg,
    /// Goodput objectives in ms, e.g. --goodput ttft:500 tpot:50 (keys: ttft, tpot, e2el).
    #[arg(long, num_args = 1.., value_name = "KEY:MS")]
    goodput: Vec<String>,
    /// Seconds before one request counts as failed.
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// A `response_format` (JSON) sent with every request, to measure guided decoding, e.g.
    /// '{"type":"json_schema","json_schema":{"name":"s","schema":{...}}}'.
    #[arg(long, value_name = "JSON")]
    response_format: Option<String>,
    /// Write every run (summary and per-request timings) to this JSON file.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Write PNG charts (latency–throughput; ITL over time for bursty runs) into this folder.
    #[arg(long)]
    plot_dir: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    #[command(flatten)]
    multi_turn: MultiTurnArgs,
}

/// How prompts travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum FormatArg {
    /// Text that re-encodes to the exact token count.
    Text,
    /// Token id lists.
    Tokens,
}

/// Options of `tandem bench plot`.
#[derive(Args, Debug)]
struct PlotArgs {
    /// Result files written by `tandem bench --output`.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Folder for the charts and results.md.
    #[arg(long, default_value = "out/bench")]
    out_dir: PathBuf,
}

/// Runs `tandem bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    match args.command {
        Some(BenchCommand::Plot(p)) => plot_files(&p),
        None => run_bench(args.run),
    }
}

/// The sweep points the flags describe.
/// The roots of `--ca-cert` (none without it).
fn ca_certs(a: &RunArgs) -> Result<Vec<reqwest::Certificate>> {
    match &a.ca_cert {
        Some(path) => crate::tls::ca_certs(path),
        None => Ok(Vec::new()),
    }
}

fn points(a: &RunArgs) -> Vec<SweepPoint> {
    if !a.request_rates.is_empty() {
        a.request_rates
            .iter()
            .map(|&request_rate| SweepPoint {
                request_rate,
                max_concurrency: a.max_concurrency,
            })
            .collect()
    } else if !a.concurrencies.is_empty() {
        a.concurrencies
            .iter()
            .map(|&c| SweepPoint {
                request_rate: a.request_rate,
                max_concurrency: Some(c),
            })
            .collect()
    } else {
        vec![SweepPoint {
            request_rate: a.request_rate,
            max_concurrency: a.max_concurrency,
        }]
    }
}

/// The workload the flags describe; `request_rate` is the run's (bursty: the steady stream's, 2/s when
/// infinite).
pub(crate) fn workload(a: &WorkloadArgs, request_rate: f64) -> Result<WorkloadSpec> {
    let len = |len| LengthSpec {
        len,
        range_ratio: a.range_ratio,
    };
    Ok(match a.workload {
        WorkloadKind::Random => WorkloadSpec::Random {
            input: len(a.input_len),
            output: len(a.output_len),
        },
        WorkloadKind::SharedPrefix => WorkloadSpec::SharedPrefix {
            prefix_len: a.prefix_len,
            num_prefixes: a.num_prefixes,
            suffix: len(a.input_len),
            output: len(a.output_len),
        },
        WorkloadKind::Bursty => WorkloadSpec::Bursty(BurstySpec {
            steady_input: len(a.input_len),
            steady_output: len(a.output_len),
            steady_rate: if request_rate.is_finite() {
                request_rate
            } else {
                2.0
            },
            burst_input: a.burst_input_len,
            burst_output: a.burst_output_len,
            burst_size: a.burst_size,
            burst_interval_s: a.burst_interval,
        }),
        WorkloadKind::MultiTurn => bail!("the multi-turn workload has no request list"),
        WorkloadKind::Jsonl => WorkloadSpec::Jsonl {
            path: a
                .dataset
                .clone()
                .context("--workload jsonl needs --dataset FILE")?,
            output_len: a.output_len,
        },
    })
}

fn run_bench(a: RunArgs) -> Result<()> {
    if !(0.0..1.0).contains(&a.workload.range_ratio) {
        bail!("--range-ratio must be in [0, 1)");
    }
    if !a.request_timeout.is_finite() || a.request_timeout <= 0.0 {
        bail!("--request-timeout must be a positive number of seconds");
    }
    let slo = Slo::parse(&a.goodput).map_err(anyhow::Error::msg)?;
    let tokenizer = resolve_model(a.tokenizer.as_deref())?;
    let builder = PromptBuilder::load(&tokenizer)
        .with_context(|| format!("loading the tokenizer of {}", tokenizer.display()))?;
    let endpoints = if a.endpoints.is_empty() {
        vec![Endpoint::parse(&a.base_url)]
    } else {
        a.endpoints.iter().map(|e| Endpoint::parse(e)).collect()
    };
    if a.workload.workload == WorkloadKind::MultiTurn {
        return run_multi_turn(&a, &builder, endpoints);
    }
    let plan = BenchPlan {
        endpoints,
        model: a.model.clone(),
        api_key: a.api_key.clone(),
        ca_certs: ca_certs(&a)?,
        workload: workload(&a.workload, a.request_rate)?,
        num_prompts: a.workload.num_prompts,
        points: points(&a),
        warmup: a.warmup,
        seed: a.seed,
        prompt_format: match a.prompt_format {
            FormatArg::Text => PromptFormat::Text,
            FormatArg::Tokens => PromptFormat::Tokens,
        },
        slo,
        request_timeout: Duration::from_secs_f64(a.request_timeout),
        response_format: match &a.response_format {
            Some(s) => Some(serde_json::from_str(s).context("--response-format is not JSON")?),
            None => None,
        },
        progress: !a.no_progress,
        command: std::env::args().collect::<Vec<_>>().join(" "),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let file = runtime.block_on(tandem_bench::run_plan(&plan, &builder, |run| {
        println!("{}", report::render_run(run));
    }))?;
    if file.runs.len() > 1 {
        println!("\n{}", report::markdown_table(&file.runs));
    }
    if let Some(path) = &a.output {
        file.save(path)?;
        eprintln!("results written to {}", path.display());
    }
    if let Some(dir) = &a.plot_dir {
        write_charts(&file.runs, dir)?;
    }
    Ok(())
}

/// What a multi-turn run of one endpoint writes with `--output`.
#[derive(serde::Serialize)]
struct MultiTurnResult {
    endpoint: String,
    spec: MultiTurnSpec,
    conversations_file: Option<PathBuf>,
    ttft_by_turn: Vec<multiturn::TurnStats>,
    ttft_p50_turn2_on_s: f64,
    answers_digest: String,
    turns: Vec<multiturn::TurnRecord>,
}

/// `--workload multi-turn`: every endpoint in turn, the same conversations.
fn run_multi_turn(a: &RunArgs, builder: &PromptBuilder, endpoints: Vec<Endpoint>) -> Result<()> {
    let spec = a.multi_turn.spec()?;
    let (shared, convs) = match &a.multi_turn.conversations_file {
        Some(path) => (
            Vec::new(),
            multiturn::load_sharegpt(path, builder, a.multi_turn.answer_len)?,
        ),
        None => spec.generate(builder, a.seed),
    };
    let roots = ca_certs(a)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut results = Vec::new();
    for endpoint in endpoints {
        let name = endpoint.name.clone();
        let records = runtime.block_on(async {
            let client = tandem_bench::Client::connect(
                endpoint,
                a.model.clone(),
                a.api_key.clone(),
                Duration::from_secs_f64(a.request_timeout),
                &roots,
            )
            .await?;
            multiturn::run(
                &client,
                builder,
                &shared,
                &convs,
                Duration::from_secs_f64(a.multi_turn.think_time),
            )
            .await
        })?;
        let by_turn = multiturn::ttft_by_turn(&records);
        let failed = records.iter().filter(|r| !r.success).count();
        println!(
            "multi-turn {name}: {} conversations, {} turns sent, {failed} failed",
            convs.len(),
            records.len()
        );
        println!("| turn | ok | TTFT p50 (ms) | TTFT p99 (ms) |\n|---|---|---|---|");
        for t in &by_turn {
            println!(
                "| {} | {} | {:.1} | {:.1} |",
                t.turn,
                t.count,
                t.ttft_p50_s * 1e3,
                t.ttft_p99_s * 1e3
            );
        }
        let p50 = multiturn::ttft_p50_from(&records, 2);
        let digest = multiturn::answers_digest(&records);
        println!(
            "TTFT p50 of turns 2+: {:.1} ms; answers digest {digest}",
            p50 * 1e3
        );
        if let Some(r) = records.iter().find(|r| !r.success) {
            eprintln!("first failure: {:?}", r.error);
        }
        results.push(MultiTurnResult {
            endpoint: name,
            spec: spec.clone(),
            conversations_file: a.multi_turn.conversations_file.clone(),
            ttft_by_turn: by_turn,
            ttft_p50_turn2_on_s: p50,
            answers_digest: digest,
            turns: records,
        });
    }
    if let Some(path) = &a.output {
        let json = serde_json::to_string_pretty(&results)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("results written to {}", path.display());
    }
    Ok(())
}

/// Writes the charts that fit these runs into `dir`.
fn write_charts(runs: &[tandem_bench::RunResult], dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("latency_throughput.png");
    plot::latency_throughput(runs, &path)?;
    eprintln!("chart written to {}", path.display());
    if runs.iter().any(|r| r.config.workload.kind() == "bursty") {
        let path = dir.join("itl_over_time.png");
        plot::itl_over_time(runs, &path)?;
        eprintln!("chart written to {}", path.display());
    }
    Ok(())
}

fn plot_files(p: &PlotArgs) -> Result<()> {
    let mut runs = Vec::new();
    for path in &p.files {
        runs.extend(BenchFile::load(path)?.runs);
    }
    let table = report::markdown_table(&runs);
    std::fs::create_dir_all(&p.out_dir)
        .with_context(|| format!("creating {}", p.out_dir.display()))?;
    let md = p.out_dir.join("results.md");
    std::fs::write(&md, &table).with_context(|| format!("writing {}", md.display()))?;
    println!("{table}");
    write_charts(&runs, &p.out_dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn sweeps_and_workloads_parse() {
        let cli = Cli::try_parse_from([
            "bench",
            "--concurrencies",
            "1,4,16",
            "--workload",
            "bursty",
            "--request-rate",
            "3",
            "--goodput",
            "ttft:500",
            "tpot:50",
        ])
        .unwrap();
        let a = cli.bench.run;
        assert_eq!(
            points(&a)
                .iter()
                .map(|p| p.max_concurrency)
                .collect::<Vec<_>>(),
            [Some(1), Some(4), Some(16)]
        );
        assert_eq!(a.goodput, ["ttft:500", "tpot:50"]);
        let WorkloadSpec::Bursty(b) = workload(&a.workload, a.request_rate).unwrap() else {
            panic!("expected bursty")
        };
        assert_eq!(b.steady_rate, 3.0);

        let cli = Cli::try_parse_from(["bench", "--request-rates", "1,inf"]).unwrap();
        let rates: Vec<f64> = points(&cli.bench.run)
            .iter()
            .map(|p| p.request_rate)
            .collect();
        assert_eq!(rates, [1.0, f64::INFINITY]);
        assert!(
            Cli::try_parse_from(["bench", "--request-rates", "1", "--concurrencies", "2"]).is_err()
        );
        assert!(Cli::try_parse_from(["bench", "--request-rate", "-1"]).is_err());

        let cli = Cli::try_parse_from(["bench", "plot", "a.json", "b.json"]).unwrap();
        assert!(matches!(cli.bench.command, Some(BenchCommand::Plot(ref p)) if p.files.len() == 2));
        let cli = Cli::try_parse_from(["bench", "--workload", "jsonl"]).unwrap();
        let run = &cli.bench.run;
        assert!(workload(&run.workload, run.request_rate).is_err());
    }
}
