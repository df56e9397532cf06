//! The `tandem` command: `serve` runs the OpenAI-compatible server, `chat` talks to one.

mod autoscale;
mod bench;
mod bench_engine;
mod chat;
mod config;
mod cuda_settings;
#[cfg(feature = "cuda")]
mod cuda_tools;
mod device;
mod launch;
mod logging;
mod plan;
mod probe;
mod process;
mod profile;
mod serve;
mod sim;
mod stage;
mod tls;
mod token;
mod worker;

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::config::{LogFormat, ServeArgs};
use crate::logging::ProcessTag;

/// tandem: LLM serving on CPU with an OpenAI-compatible API.
#[derive(Parser, Debug)]
#[command(name = "tandem", version, about)]
struct Cli {
    /// Log format: readable text or one JSON object per line (overrides the config file's `log_format`;
    /// a P/D head passes its format to the workers it starts through this variable).
    #[arg(long, global = true, value_enum, env = LOG_FORMAT_ENV)]
    log_format: Option<LogFormat>,
    /// Cap the CPU kernels' instruction set: portable, avx2 or avx512 [default: the best the CPU has]
    /// (A/B comparisons, benchmarks against builds of one level; the processes this one starts inherit it).
    #[arg(long, global = true, env = KERNELS_ENV, value_parser = parse_isa)]
    kernels: Option<tandem_kernels::Isa>,
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(Box<ServeArgs>),
    /// Chat interactively with a running server, or with a model loaded in process (--local).
    Chat(chat::ChatArgs),
    /// Run one prefill or decode worker of a disaggregated deployment.
    Worker(Box<worker::WorkerArgs>),
    /// Measure the engine's decode and prefill speed on one model, in process.
    BenchEngine(bench_engine::BenchEngineArgs),
    /// Benchmark an OpenAI-compatible server (or several) with vLLM-compatible serving metrics.
    Bench(bench::BenchArgs),
    /// Measure one worker's step times, KV size and transfer rates on this machine into a profile for `tandem sim`.
    Profile(profile::ProfileArgs),
    /// Simulate a deployment (colocated or N prefill / M decode) on a workload, from a profile.
    Sim(Box<sim::SimArgs>),
    /// The deployment (colocated or prefill:decode split) with the most goodput per GPU for a profile, a workload and SLOs.
    Plan(Box<plan::PlanArgs>),
    /// Drive a compose deployment's prefill and decode replica counts from the head's metrics, with the planner's model.
    Autoscale(Box<autoscale::AutoscaleArgs>),
    /// GET a URL (default: this host's /health) and exit 0 on a 2xx answer, 1 otherwise: the images' health check.
    Probe(probe::ProbeArgs),
    /// Host one later pipeline stage (a worker with pipeline_parallel_size > 1 starts its own; run it on another host for `pipeline_stages`).
    Stage(stage::StageArgs),
    /// Write the CUDA (or CPU) backend's logits for given prompts as JSON (device checks).
    #[cfg(feature = "cuda")]
    #[command(hide = true)]
    CudaCheck(cuda_tools::CudaCheckArgs),
    /// Measure the CUDA backend on an 8B-shaped model with random weights made on the GPU.
    #[cfg(feature = "cuda")]
    #[command(hide = true)]
    CudaBench(cuda_tools::CudaBenchArgs),
    /// Check the on-device sampler against the host sampler's distribution.
    #[cfg(feature = "cuda")]
    #[command(hide = true)]
    CudaSampleCheck(cuda_tools::CudaSampleCheckArgs),
}

/// The environment variable behind `--log-format`.
const LOG_FORMAT_ENV: &str = "TANDEM_LOG_FORMAT";

/// The environment variable behind `--kernels`.
const KERNELS_ENV: &str = "TANDEM_KERNELS";

/// A `--kernels` value.
fn parse_isa(s: &str) -> Result<tandem_kernels::Isa, String> {
    s.parse()
}

/// Caps the CPU kernels at `cap` for this process and the ones it starts (one thread here still: the
/// environment is process-wide).
fn cap_kernels(cap: tandem_kernels::Isa) {
    tandem_kernels::set_isa_cap(cap);
    std::env::set_var(KERNELS_ENV, cap.name());
}

/// Installs the global tracing subscriber (`logging::init`) at `info` unless RUST_LOG says otherwise,
/// and exports the format so every process this one starts (P/D workers, pipeline stages) logs alike.
fn init_logging(format: LogFormat, tag: Option<ProcessTag>) {
    init_logging_at(format, "info", tag);
}

/// `init_logging` with another default level.
fn init_logging_at(format: LogFormat, default_level: &str, tag: Option<ProcessTag>) {
    let value = match format {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    };
    // Still one thread here: the environment is process-wide (as `token::export` does).
    std::env::set_var(LOG_FORMAT_ENV, value);
    logging::set_format(format);
    logging::init(format, default_level, tag);
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // `{:#}` is the whole chain on one line; anyhow's own report (main returning `Err`) would
            // add a backtrace under RUST_BACKTRACE=1, which is noise for a busy port or a typo.
            let hint = hint(&err);
            if logging::format() == LogFormat::Json {
                // A JSON log stays JSON to its last line.
                tracing::error!(error = %format!("{err:#}"), hint, "tandem stopped");
            } else {
                eprintln!("error: {err:#}");
                if let Some(hint) = hint {
                    eprintln!("hint: {hint}");
                }
            }
            ExitCode::FAILURE
        }
    }
}

/// What to do about an ordinary user error, recognised by its cause.
fn hint(err: &anyhow::Error) -> Option<&'static str> {
    for cause in err.chain() {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::AddrInUse => {
                    return Some("that port is in use — another tandem? stop it, or pick another port with --port (server.port)")
                }
                std::io::ErrorKind::ConnectionRefused => return Some(SERVER_NOT_RUNNING),
                _ => {}
            }
        }
        if cause
            .downcast_ref::<reqwest::Error>()
            .is_some_and(reqwest::Error::is_connect)
        {
            return Some(SERVER_NOT_RUNNING);
        }
    }
    None
}

/// The hint for a client command that found nobody listening.
const SERVER_NOT_RUNNING: &str =
    "nothing answers there — is the server running? start it with `tandem serve`, or point the command at it (--url, --base-url)";

/// Says which config file the settings came from (or that none was given), once logging is up.
fn log_config(path: Option<&std::path::Path>) {
    match path {
        Some(path) => tracing::info!(config = %path.display(), "config file loaded"),
        None => tracing::info!("no config file: defaults and flags"),
    }
}

/// Runs the command line.
fn run(cli: Cli) -> Result<()> {
    let format = cli.log_format;
    if let Some(cap) = cli.kernels {
        cap_kernels(cap);
    }
    match cli.command {
        Command::Serve(args) => {
            if let Some(path) = &args.check_config {
                let file = config::Settings::load(path)?;
                let settings = config::resolved(&args.settings, file)
                    .with_context(|| format!("in config file {}", path.display()))?;
                print!("{}", serde_yaml::to_string(&settings)?);
                return Ok(());
            }
            let file = match &args.config {
                Some(path) => config::Settings::load(path)?,
                None => config::Settings::default(),
            };
            let pd = file
                .deployment
                .as_ref()
                .filter(|d| d.mode == config::DeploymentMode::Pd);
            if let Some(deployment) = pd {
                let (token, origin) = token::for_head(deployment)?;
                token::export(token.as_deref());
                tls::export(deployment.cluster_tls.as_ref());
                let head = ProcessTag {
                    name: "head".into(),
                    role: "head".into(),
                };
                init_logging(format.or(file.log_format).unwrap_or_default(), Some(head));
                log_config(args.config.as_deref());
                return launch::run(&args.settings, file, origin);
            }
            if let Some(deployment) = &file.deployment {
                token::export(deployment.cluster_token()?.as_deref());
                tls::export(deployment.cluster_tls.as_ref());
            }
            let settings = config::Settings::colocated(&args.settings, file)?;
            init_logging(format.or(settings.log_format).unwrap_or_default(), None);
            log_config(args.config.as_deref());
            serve::run(settings)
        }
        Command::Worker(args) => {
            init_logging(format.unwrap_or_default(), args.log_tag());
            worker::run(*args)
        }
        Command::Chat(args) => {
            // In-process serving would interleave its info logs with the conversation.
            let level = if args.local { "warn" } else { "info" };
            init_logging_at(format.unwrap_or_default(), level, None);
            chat::run(args)
        }
        Command::BenchEngine(args) => {
            init_logging(format.unwrap_or_default(), None);
            bench_engine::run(args)
        }
        #[cfg(feature = "cuda")]
        Command::CudaCheck(args) => {
            init_logging(format.unwrap_or_default(), None);
            cuda_tools::check(args)
        }
        #[cfg(feature = "cuda")]
        Command::CudaBench(args) => {
            init_logging(format.unwrap_or_default(), None);
            cuda_tools::bench(args)
        }
        #[cfg(feature = "cuda")]
        Command::CudaSampleCheck(args) => {
            init_logging(format.unwrap_or_default(), None);
            cuda_tools::sample_check(args)
        }
        Command::Stage(args) => {
            let settings = args.resolve();
            let stage = settings.as_ref().ok().and_then(|s| s.stage);
            init_logging(format.unwrap_or_default(), Some(args.log_tag(stage)));
            stage::run(args, settings?)
        }
        Command::Bench(args) => {
            init_logging_at(format.unwrap_or_default(), "warn", None);
            bench::run(args)
        }
        Command::Profile(args) => {
            init_logging_at(format.unwrap_or_default(), "warn", None);
            profile::run(args)
        }
        Command::Sim(args) => {
            init_logging_at(format.unwrap_or_default(), "warn", None);
            sim::run(*args)
        }
        Command::Plan(args) => {
            init_logging_at(format.unwrap_or_default(), "warn", None);
            plan::run(*args)
        }
        Command::Autoscale(args) => {
            init_logging(format.unwrap_or_default(), None);
            autoscale::run(*args)
        }
        Command::Probe(args) => probe::run(&args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent_and_parses_serve_flags() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "tandem",
            "serve",
            "m.gguf",
            "--port",
            "9000",
            "--kv-cache-memory",
            "1GiB",
            "--no-prefix-caching",
            "--log-format",
            "json",
        ])
        .unwrap();
        assert_eq!(cli.log_format, Some(LogFormat::Json));
        let Command::Serve(args) = cli.command else {
            panic!("expected serve")
        };
        assert_eq!(args.settings.server.port, Some(9000));
        let engine = &args.settings.engine;
        assert_eq!(engine.kv_cache_memory.map(|b| b.0), Some(1 << 30));
        assert_eq!(engine.enable_prefix_caching, Some(false));
        assert!(Cli::try_parse_from(["tandem", "serve", "--kv-cache-memory", "lots"]).is_err());
        assert!(
            Cli::try_parse_from(["tandem", "serve", "--check-config", "a", "--config", "b"])
                .is_err(),
            "--check-config takes the file itself"
        );
    }

    /// A worker or stage given its settings as one document refuses every visible settings flag beside
    /// it (the flag would otherwise be silently dropped) and takes the hidden tuning flags.
    #[test]
    fn a_settings_document_refuses_settings_flags_beside_it() {
        let parse = |cmd: &str, extra: &[&str]| {
            let args = ["tandem", cmd, "--settings-json", "{}"];
            Cli::try_parse_from(args.iter().chain(extra))
        };
        for cmd in ["worker", "stage"] {
            for flag in [
                &["--kv-cache-memory", "1GiB"][..],
                &["--kv-offload-host", "1GiB"],
                &["--kv-offload-disk", "/tmp/kv"],
                &["--cuda-device", "1"],
                &["--no-cuda-graphs"],
                &["--cuda-gemv-max-rows", "2"],
                &["--allow-unauthenticated"],
            ] {
                let e = parse(cmd, flag).expect_err(&format!("{cmd} {flag:?}"));
                assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
            }
            assert!(
                parse(cmd, &["--cuda-pdl"]).is_ok(),
                "{cmd}: tuning flags are its own"
            );
        }
    }

    /// `tandem serve --help` states the engine's defaults, and what it states is what the engine uses.
    #[test]
    fn serve_help_states_the_engine_defaults() {
        let d = tandem_engine::EngineConfig::default();
        let mut cmd = Cli::command();
        let help = cmd
            .find_subcommand_mut("serve")
            .expect("serve")
            .render_long_help()
            .to_string();
        for want in [
            format!("(default {})", d.block_size),
            format!("(default {}GiB)", d.kv_cache_memory >> 30),
            format!("(default {})", d.max_num_seqs),
            format!("(default {})", d.max_num_batched_tokens),
            format!("(default {})", d.max_waiting),
        ] {
            assert!(help.contains(&want), "`serve --help` lacks {want}:\n{help}");
        }
    }
}
