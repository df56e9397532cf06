//! `tandem sim`: what a deployment of tandem would do with a workload, without running it.
//!
//! A discrete-event simulation on a virtual clock ([`sim`]) of the head and its prefill, decode or
//! colocated workers, running tandem's own scheduling code — the engine's `Scheduler` and `BlockPool`,
//! the head's routing policies from `tandem-cluster` — with step and transfer times from a hardware
//! [`profile`] that `tandem profile` measures (or a datasheet fills in). Workloads are `tandem bench`'s
//! own ([`tandem_bench::WorkloadSpec`]) and the results are its [`RunResult`]s, so the same tables, JSON
//! and charts report a simulated run and a measured one.

pub mod error;
pub mod layout;
pub mod plan;
pub mod profile;
pub mod scale;
pub mod sim;

pub use error::SimError;
pub use profile::{Profile, ProfileSource};
pub use sim::{simulate, SimConfig, SimOutcome, SimRequest, SimStats, Topology};

use tandem_bench::arrival::send_times;
use tandem_bench::metrics::summarize;
use tandem_bench::report::{RunConfig, RunResult};
use tandem_bench::workload::Prompt;
use tandem_bench::{PromptBuilder, PromptFormat, Slo, WorkloadSpec};

/// One simulated run: a workload at a rate (or concurrency) on a deployment.
#[derive(Clone, Debug)]
pub struct SimRun {
    /// The workload, as `tandem bench` defines it.
    pub workload: WorkloadSpec,
    /// Requests (for bursty: steady requests; bursts come on top).
    pub num_prompts: usize,
    /// Poisson rate in requests/s, infinite for all at once (bursty: the steady rate when finite).
    pub request_rate: f64,
    /// Requests in flight at most.
    pub max_concurrency: Option<usize>,
    /// Seed of prompts and arrivals, as `tandem bench --seed` (a sweep's first point).
    pub seed: u64,
    /// Goodput objectives.
    pub slo: Slo,
}

/// A simulated run and its counters.
#[derive(Clone, Debug)]
pub struct SimResult {
    /// The run in `tandem bench`'s form (its endpoint is `sim <topology>`).
    pub run: RunResult,
    /// The simulator's counters.
    pub stats: SimStats,
}

/// Builds the run's requests exactly as `tandem bench` would (same seed, same prompts, same send
/// times) and simulates them.
pub fn run(
    profile: &Profile,
    cfg: &SimConfig,
    builder: &PromptBuilder,
    spec: &SimRun,
) -> Result<SimResult, SimError> {
    let mut workload = spec.workload.clone();
    if let WorkloadSpec::Bursty(b) = &mut workload {
        if spec.request_rate.is_finite() {
            b.steady_rate = spec.request_rate;
        }
    }
    let (requests, burst_times_s) = build_requests(
        builder,
        &workload,
        spec.num_prompts,
        spec.request_rate,
        spec.seed,
    )?;
    let outcome = simulate(profile, cfg, requests, spec.max_concurrency)?;
    let config = RunConfig {
        endpoint: format!("sim {}", cfg.topology.label()),
        base_url: format!("sim://{}", profile.hardware.name),
        model: profile.model.name.clone(),
        workload,
        num_prompts: spec.num_prompts,
        request_rate: spec.request_rate.is_finite().then_some(spec.request_rate),
        max_concurrency: spec.max_concurrency,
        warmup: 0,
        seed: spec.seed,
        prompt_format: PromptFormat::Tokens,
    };
    Ok(SimResult {
        run: RunResult {
            summary: summarize(&outcome.records, outcome.duration_s, &spec.slo),
            config,
            started_at: String::new(),
            load_avg_before: None,
            load_avg_after: None,
            burst_times_s,
            requests: outcome.records,
        },
        stats: outcome.stats,
    })
}

/// The requests `tandem bench` would send for `workload` (token ids, send times) and its burst times.
pub fn build_requests(
    builder: &PromptBuilder,
    workload: &WorkloadSpec,
    num_prompts: usize,
    request_rate: f64,
    seed: u64,
) -> Result<(Vec<SimRequest>, Vec<f64>), SimError> {
    let generated = workload
        .generate(builder, num_prompts, PromptFormat::Tokens, seed)
        .map_err(|e| SimError::Config(format!("building the workload: {e}")))?;
    let times = send_times(&generated.requests, request_rate, seed);
    let requests = generated
        .requests
        .iter()
        .zip(times)
        .map(|(r, at_s)| SimRequest {
            prompt: match &r.prompt {
                Prompt::Tokens(ids) => ids.clone(),
                Prompt::Text(_) => unreachable!("built with PromptFormat::Tokens"),
            },
            max_tokens: r.max_tokens,
            class: r.class,
            at_s,
        })
        .collect();
    Ok((requests, generated.burst_times_s))
}
