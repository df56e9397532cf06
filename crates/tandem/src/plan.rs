//! `tandem plan`: for a profile, a workload and SLOs, the deployment with the most goodput per GPU at
//! each fleet size from 8 to 10,000 GPUs (`tandem_sim::plan`), a tensor/pipeline layout per role where
//! the profile has several, and its deployment YAML and Helm values.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use tandem_sim::plan::{calibrate_layouts, deployment_yaml, helm_values, plan, PlanSlo};

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
    /// Write Helm values (`deploy/helm/tandem`: pool sizes, GPUs per pod, parallelism flags) of the
    /// largest fleet's choice here (its best prefill/decode deployment when the choice is colocated).
    #[arg(long)]
    pub helm_values: Option<PathBuf>,
    /// Print the plans as JSON.
    #[arg(long)]
    pub json: bool,
    /// KV transport between prefill and decode workers (a rate the profile lists).
    #[arg(long, default_value = "tcp")]
    pub transport: String,
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
    let capacities = calibrate_layouts(&profile, &requests, &slo, &a.transport)?;
    let mut plans = Vec::new();
    for &gpus in &a.gpus {
        plans.push((gpus, plan(&capacities, &slo, gpus)?));
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
        println!(
            "| layout | GPUs/worker | source | colocated req/s | prefill req/s | decode req/s |"
        );
        println!("|---|---|---|---|---|---|");
        for l in &capacities {
            println!(
                "| {} | {} | {:?} | {:.3} | {:.3} | {:.3} |",
                l.parallelism.label(),
                l.devices,
                l.source,
                l.capacity.colocated,
                l.capacity.prefill,
                l.capacity.decode
            );
        }
        println!();
        println!(
            "| GPUs | choice | GPUs used | req/s | req/s/GPU | runner-up | req/s | req/s/GPU |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for (gpus, p) in &plans {
            let (ru, rg, rpg) = p.runner_up.as_ref().map_or(("–".into(), 0.0, 0.0), |r| {
                (r.label(), r.goodput, r.goodput_per_gpu)
            });
            println!(
                "| {gpus} | {} | {} | {:.2} | {:.4} | {ru} | {rg:.2} | {rpg:.4} |",
                p.choice.label(),
                p.choice.gpus,
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
    if let (Some(out), Some((_, p))) = (&a.helm_values, plans.last()) {
        let values = helm_values(p).with_context(|| {
            format!(
                "no Helm values for {}: the chart runs prefill/decode pools and no such deployment fits",
                p.choice.label()
            )
        })?;
        std::fs::write(out, values).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("Helm values written to {}", out.display());
    }
    Ok(())
}
