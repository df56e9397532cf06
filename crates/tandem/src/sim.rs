//! `tandem sim`: a deployment simulated on a virtual clock (`tandem-sim`) with `tandem bench`'s
//! workloads and reports, calibrated by a profile from `tandem profile`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_bench::arrival::parse_rate;
use tandem_bench::report::{self, BenchFile, Machine};
use tandem_bench::{PromptBuilder, Slo};
use tandem_model::LoadOptions;
use tandem_sim::{Profile, SimConfig, SimRun, Topology};

use crate::bench::{workload, MultiTurnArgs, WorkloadArgs, WorkloadKind};
use crate::process::resolve_model;

/// The profile and the model `tandem sim` and `tandem plan` read.
#[derive(Args, Debug)]
pub struct ProfiledModel {
    /// The profile (`tandem profile`'s output, or one written from datasheet figures).
    #[arg(long)]
    pub profile: PathBuf,
    /// The model (GGUF file or HF folder) whose tokenizer builds the prompts and whose identity the
    /// profile must match; absent means the default model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The datasheet profile describes a model that is not here (OPT-66B on A100s): skip the model
    /// check, and let the model given (or the default) only tokenize the workload, whose lengths are
    /// what the simulation uses. Refused for measured profiles.
    #[arg(long)]
    pub foreign_model: bool,
}

impl ProfiledModel {
    /// The profile, checked against the model, the model's prompt builder and its path.
    pub fn load(&self) -> Result<(Profile, PromptBuilder, PathBuf)> {
        let profile = Profile::load(&self.profile)?;
        let path = resolve_model(self.model.as_deref())?;
        let loaded = tandem_model::load(&path, &LoadOptions { progress: false })
            .with_context(|| format!("loading {}", path.display()))?;
        if self.foreign_model {
            if profile.source != tandem_sim::ProfileSource::Datasheet {
                bail!(
                    "--foreign-model: profile {} is measured (source: measured), so it must match the model it was measured with",
                    self.profile.display()
                );
            }
        } else {
            profile
                .check_model(&loaded.name, &loaded.identity.0)
                .with_context(|| format!("profile {}", self.profile.display()))?;
        }
        let builder = PromptBuilder::new(loaded.tokenizer)
            .with_context(|| format!("the tokenizer of {}", path.display()))?;
        Ok((profile, builder, path))
    }
}

/// Options of `tandem sim`.
#[derive(Args, Debug)]
pub struct SimArgs {
    #[command(flatten)]
    pub source: ProfiledModel,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub multi_turn: MultiTurnArgs,
    /// Poisson arrival rate in requests/s, or inf to send all at once (bursty: the steady rate).
    #[arg(long, default_value = "inf", value_parser = parse_rate)]
    pub request_rate: f64,
    /// Requests in flight at most.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Seed of prompts, arrivals and routing choices (the same as `tandem bench --seed` gives the same
    /// prompts).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Colocated workers (ignored with --prefill/--decode).
    #[arg(long, default_value_t = 1)]
    pub colocated: usize,
    /// Prefill workers of a disaggregated deployment.
    #[arg(long, requires = "decode")]
    pub prefill: Option<usize>,
    /// Decode workers of a disaggregated deployment.
    #[arg(long, requires = "prefill")]
    pub decode: Option<usize>,
    /// KV transport between prefill and decode workers (a rate the profile lists).
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    /// The workers share one device (a 1P1D deployment on one GPU): forwards that overlap share its
    /// time, instead of each worker having a device of its own.
    #[arg(long)]
    pub shared_device: bool,
    /// KV blocks per worker, instead of the profile's.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// Goodput objectives in ms, e.g. --goodput ttft:500 tpot:50 (keys: ttft, tpot, e2el).
    #[arg(long, num_args = 1.., value_name = "KEY:MS")]
    pub goodput: Vec<String>,
    /// Print the run (summary, every request, the simulator's counters) as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write the run as a `tandem bench --output` result file (for `tandem bench plot`).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

/// Runs `tandem sim`.
pub fn run(a: SimArgs) -> Result<()> {
    if !(0.0..1.0).contains(&a.workload.range_ratio) {
        bail!("--range-ratio must be in [0, 1)");
    }
    let (mut profile, builder, _) = a.source.load()?;
    if let Some(blocks) = a.kv_blocks {
        profile.kv_blocks = blocks;
    }
    let topology = match (a.prefill, a.decode) {
        (Some(prefill), Some(decode)) => Topology::Disaggregated { prefill, decode },
        _ => Topology::Colocated {
            replicas: a.colocated,
        },
    };
    let mut cfg = SimConfig::new(topology);
    cfg.transport = a.transport.clone();
    cfg.seed = a.seed;
    cfg.shared_device = a.shared_device;
    if a.workload.workload == WorkloadKind::MultiTurn {
        return run_multi_turn(&a, &profile, &builder, &cfg);
    }
    let spec = SimRun {
        workload: workload(&a.workload, a.request_rate)?,
        num_prompts: a.workload.num_prompts,
        request_rate: a.request_rate,
        max_concurrency: a.max_concurrency,
        seed: a.seed,
        slo: Slo::parse(&a.goodput).map_err(anyhow::Error::msg)?,
    };
    let result = tandem_sim::run(&profile, &cfg, &builder, &spec)?;
    if a.json {
        let mut json = serde_json::to_value(&result.run)?;
        json["sim"] = serde_json::to_value(&result.stats)?;
        json["profile"] = serde_json::json!({
            "path": a.source.profile,
            "source": profile.source,
            "hardware": profile.hardware.name,
        });
        println!("{json}");
    } else {
        println!("{}", report::render_run(&result.run));
        let s = &result.stats;
        println!(
            "simulated: {} steps, {} preemptions, {} remote / {} local prefills, {:.1} MiB of KV moved",
            s.steps,
            s.preemptions,
            s.remote_prefills,
            s.local_prefills,
            s.kv_bytes_moved / (1 << 20) as f64
        );
    }
    if let Some(out) = &a.output {
        BenchFile {
            tool: format!("tandem sim {}", env!("CARGO_PKG_VERSION")),
            machine: Machine::current(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            runs: vec![result.run],
        }
        .save(out)?;
        eprintln!("results written to {}", out.display());
    }
    Ok(())
}

/// `tandem sim --workload multi-turn`: `tandem bench`'s conversations on the simulated deployment, each
/// turn sent after the answer before it and the think time, reported as bench reports them (TTFT per
/// turn index).
fn run_multi_turn(
    a: &SimArgs,
    profile: &Profile,
    builder: &PromptBuilder,
    cfg: &SimConfig,
) -> Result<()> {
    let spec = a.multi_turn.spec()?;
    let turns = match &a.multi_turn.conversations_file {
        Some(path) => tandem_sim::multi_turn_requests(
            &[],
            &tandem_bench::multiturn::load_sharegpt(path, builder, spec.answer_len)?,
            spec.think_s,
        ),
        None => tandem_sim::multi_turn_spec_requests(&spec, builder, a.seed),
    };
    let out = tandem_sim::simulate_turns(
        profile,
        cfg,
        turns.requests,
        turns.follow_ups,
        a.max_concurrency,
    )?;
    let records: Vec<tandem_bench::multiturn::TurnRecord> = out
        .records
        .iter()
        .zip(&out.record_requests)
        .map(|(r, &i)| tandem_bench::multiturn::TurnRecord {
            conversation: turns.turns[i].0,
            turn: turns.turns[i].1,
            prompt_len: r.prompt_len,
            ttft_s: r.ttft_s,
            success: r.success,
            answer: String::new(),
            error: r.error.clone(),
        })
        .collect();
    let failed = records.iter().filter(|r| !r.success).count();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "spec": spec,
                "topology": cfg.topology,
                "turns": tandem_bench::multiturn::ttft_by_turn(&records),
                "failed": failed,
                "sim": out.stats,
            })
        );
        return Ok(());
    }
    println!(
        "multi-turn sim {}: {} turns simulated, {failed} failed",
        cfg.topology.label(),
        records.len()
    );
    println!("| turn | ok | TTFT p50 (ms) | TTFT p99 (ms) |\n|---|---|---|---|");
    for t in tandem_bench::multiturn::ttft_by_turn(&records) {
        println!(
            "| {} | {} | {:.1} | {:.1} |",
            t.turn,
            t.count,
            t.ttft_p50_s * 1e3,
            t.ttft_p99_s * 1e3
        );
    }
    println!(
        "TTFT p50 of turns 2+: {:.1} ms",
        tandem_bench::multiturn::ttft_p50_from(&records, 2) * 1e3
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(extra: &[&str]) -> SimArgs {
        let args = ["tandem", "sim", "--profile", "p.json"].iter().chain(extra);
        match crate::Cli::try_parse_from(args).expect("parses").command {
            crate::Command::Sim(args) => *args,
            other => panic!("expected sim, got {other:?}"),
        }
    }

    /// Workers have a device each unless `--shared-device` puts a 1P1D pair on one.
    #[test]
    fn shared_device_is_off_unless_asked_for() {
        assert!(!parse(&["--prefill", "1", "--decode", "1"]).shared_device);
        assert!(parse(&["--prefill", "1", "--decode", "1", "--shared-device"]).shared_device);
    }
}
