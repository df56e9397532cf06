//! `tandem plan`: for a profile, a workload and SLOs, the deployment with the most goodput per GPU at
//! each fleet size from 8 to 10,000 GPUs (`tandem_sim::plan`), and its deployment YAML.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use tandem_sim::plan::{calibrate, deployment_yaml, plan, PlanSlo};

use crate::bench::{workload, WorkloadArgs};
use crate::sim::ProfiledModel;

/// Options of `tandem plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub source: ProfiledModel,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// 90th percentile time to first token, ms.
    #[arg(long)]
    pub ttft_p90_ms: f64,
    /// 90th percentile inter-token latency, ms.
    #[arg(long)]
    pub itl_p90_ms: f64,
    /// Fleet sizes to plan, in GPUs (devices).
    #[arg(long, value_delimiter = ',', default_value = "8,64,512,10000")]
    pub gpus: Vec<usize>,
    /// Write the deployment YAML of the largest fleet's choice here.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Print the plans as JSON.
    #[arg(long)]
    pub json: bool,
    /// Seed of the calibration workload's prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs `tandem plan`.
pub fn run(a: PlanArgs) -> Result<()> {
    let started = Instant::now();
    let (profile, builder, path) = a.source.load()?;
    let spec = workload(&a.workload, f64::INFINITY)?;
    let (requests, _) = tandem_sim::build_requests(
        &builder,
        &spec,
        a.workload.num_prompts,
        f64::INFINITY,
        a.seed,
    )?;
    let slo = PlanSlo {
        ttft_p90_ms: a.ttft_p90_ms,
        itl_p90_ms: a.itl_p90_ms,
    };
    let capacity = calibrate(&profile, &requests, &slo)?;
    let mut plans = Vec::new();
    for &gpus in &a.gpus {
        plans.push((gpus, plan(&profile, capacity, &slo, gpus)?));
    }
    let secs = started.elapsed().as_secs_f64();
    if a.json {
        let json: Vec<_> = plans
            .iter()
            .map(|(gpus, p)| serde_json::json!({"gpus": gpus, "plan": p}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!(
            "workload {} ({} prompts), SLOs TTFT p90 ≤ {} ms, ITL p90 ≤ {} ms, profile {} ({:?})",
            spec.describe(),
            requests.len(),
            a.ttft_p90_ms,
            a.itl_p90_ms,
            profile.hardware.name,
            profile.source
        );
        println!("| GPUs | choice | req/s | req/s/GPU | runner-up | req/s | req/s/GPU |");
        println!("|---|---|---|---|---|---|---|");
        for (gpus, p) in &plans {
            let (ru, rg, rpg) = p.runner_up.as_ref().map_or(("–".into(), 0.0, 0.0), |r| {
                (r.topology.label(), r.goodput, r.goodput_per_gpu)
            });
            println!(
                "| {gpus} | {} | {:.2} | {:.4} | {ru} | {rg:.2} | {rpg:.4} |",
                p.choice.topology.label(),
                p.choice.goodput,
                p.choice.goodput_per_gpu
            );
        }
        if let Some((gpus, p)) = plans.last() {
            println!("\nat {gpus} GPUs: {}", p.why);
        }
        println!("planned in {secs:.2} s");
    }
    if let (Some(out), Some((_, p))) = (&a.output, plans.last()) {
        std::fs::write(out, deployment_yaml(&path.display().to_string(), p))
            .with_context(|| format!("writing {}", out.display()))?;
        eprintln!("deployment written to {}", out.display());
    }
    Ok(())
}
