//! Driving runs: a sweep of points (request rates or concurrency limits) against one or more endpoints.
//! Each point gets fresh prompts from its own seed, the same for every endpoint, so servers are compared
//! on identical requests and no point is served from a prefix cache that an earlier point filled.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::arrival::send_times;
use crate::client::{Client, Endpoint};
use crate::error::BenchError;
use crate::metrics::{summarize, RequestRecord, Slo};
use crate::report::{load_average, BenchFile, Machine, RunConfig, RunResult};
use crate::workload::{BenchRequest, PromptBuilder, PromptFormat, WorkloadSpec};

/// One point of a sweep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SweepPoint {
    /// Poisson request rate (infinite: all at once). For the bursty workload, the steady stream's rate.
    pub request_rate: f64,
    /// Requests in flight at most.
    pub max_concurrency: Option<usize>,
}

/// Everything one `tandem bench` invocation does.
#[derive(Clone, Debug)]
pub struct BenchPlan {
    /// The servers, benchmarked one after another.
    pub endpoints: Vec<Endpoint>,
    /// Model name to send; each endpoint's first listed model when `None`.
    pub model: Option<String>,
    /// Bearer token.
    pub api_key: Option<String>,
    /// CA certificates an https endpoint's certificate may chain to (`--ca-cert`; a private CA).
    pub ca_certs: Vec<reqwest::Certificate>,
    /// What to send.
    pub workload: WorkloadSpec,
    /// Requests per point.
    pub num_prompts: usize,
    /// The sweep (one point for a plain run).
    pub points: Vec<SweepPoint>,
    /// Requests sent and discarded before each endpoint's first point.
    pub warmup: usize,
    /// Base seed; point `i` uses `seed + i`.
    pub seed: u64,
    /// How prompts are sent.
    pub prompt_format: PromptFormat,
    /// Goodput objectives.
    pub slo: Slo,
    /// Per-request limit.
    pub request_timeout: Duration,
    /// Show a progress bar.
    pub progress: bool,
    /// The command line, stored in the result file.
    pub command: String,
    /// Sent as every request's `response_format` (guided decoding); None sends none.
    pub response_format: Option<serde_json::Value>,
}

/// Seed offset of warm-up prompts, so they never prime the prefix cache for the measured ones.
const WARMUP_SEED: u64 = 0x5741_524d;

/// Runs every point against every endpoint; `on_run` sees each run as it finishes.
pub async fn run_plan(
    plan: &BenchPlan,
    builder: &PromptBuilder,
    mut on_run: impl FnMut(&RunResult),
) -> Result<BenchFile, BenchError> {
    if plan.points.is_empty() || plan.endpoints.is_empty() || plan.num_prompts == 0 {
        return Err(BenchError::Config(
            "need at least one endpoint, one sweep point and one prompt".into(),
        ));
    }
    let mut runs = Vec::new();
    for endpoint in &plan.endpoints {
        let client = Client::connect(
            endpoint.clone(),
            plan.model.clone(),
            plan.api_key.clone(),
            plan.request_timeout,
            &plan.ca_certs,
        )
        .await?
        .with_response_format(plan.response_format.clone());
        if plan.warmup > 0 {
            let warm = plan.workload.generate(
                builder,
                plan.warmup,
                plan.prompt_format,
                plan.seed ^ WARMUP_SEED,
            )?;
            let mut requests = warm.requests;
            requests.truncate(plan.warmup);
            let n = requests.len();
            tracing::info!(endpoint = %endpoint.name, requests = n, "warm-up");
            let records = run_requests(
                &client,
                requests,
                vec![0.0; n],
                plan.points[0].max_concurrency,
                progress_bar(
                    plan.progress,
                    n as u64,
                    format!("{} warm-up", endpoint.name),
                ),
            )
            .await;
            let failed = records.iter().filter(|r| !r.success).count();
            if failed > 0 {
                tracing::warn!(endpoint = %endpoint.name, failed, first_error = ?records.iter().find_map(|r| r.error.clone()), "warm-up requests failed");
            }
        }
        for (i, point) in plan.points.iter().enumerate() {
            let run = run_point(plan, builder, &client, i, *point).await?;
            on_run(&run);
            runs.push(run);
        }
    }
    Ok(BenchFile {
        tool: format!("tandem bench {}", env!("CARGO_PKG_VERSION")),
        machine: Machine::current(),
        command: plan.command.clone(),
        runs,
    })
}

/// One point against one endpoint.
async fn run_point(
    plan: &BenchPlan,
    builder: &PromptBuilder,
    client: &Client,
    index: usize,
    point: SweepPoint,
) -> Result<RunResult, BenchError> {
    let seed = plan.seed + index as u64;
    let mut workload = plan.workload.clone();
    if let WorkloadSpec::Bursty(b) = &mut workload {
        if point.request_rate.is_finite() {
            b.steady_rate = point.request_rate;
        }
    }
    let generated = workload.generate(builder, plan.num_prompts, plan.prompt_format, seed)?;
    let n = generated.requests.len();
    let arrivals = send_times(&generated.requests, point.request_rate, seed);
    let config = RunConfig {
        endpoint: client.endpoint().name.clone(),
        base_url: client.endpoint().base_url.clone(),
        model: client.model().to_string(),
        workload,
        num_prompts: plan.num_prompts,
        request_rate: point.request_rate.is_finite().then_some(point.request_rate),
        max_concurrency: point.max_concurrency,
        warmup: plan.warmup,
        seed,
        prompt_format: plan.prompt_format,
    };
    let label = format!(
        "{} {} {}",
        config.endpoint,
        config.workload.kind(),
        config.point_label()
    );
    tracing::info!(run = %label, requests = n, "starting run");
    let started_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let load_avg_before = load_average();
    let start = Instant::now();
    let requests = run_requests(
        client,
        generated.requests,
        arrivals,
        point.max_concurrency,
        progress_bar(plan.progress, n as u64, label),
    )
    .await;
    let duration_s = start.elapsed().as_secs_f64();
    Ok(RunResult {
        summary: summarize(&requests, duration_s, &plan.slo),
        config,
        started_at,
        load_avg_before,
        load_avg_after: load_average(),
        burst_times_s: generated.burst_times_s,
        requests,
    })
}

/// A progress bar on stderr, or a hidden one.
fn progress_bar(visible: bool, len: u64, label: String) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg:<32} [{elapsed_precise}] {wide_bar} {pos}/{len} ({eta})",
        )
        .expect("the template is valid"),
    );
    pb.set_message(label);
    pb
}

/// Sends `requests` at their `arrivals` (seconds after the start), at most `max_concurrency` in flight;
/// returns their records in completion order.
pub async fn run_requests(
    client: &Client,
    requests: Vec<BenchRequest>,
    arrivals: Vec<f64>,
    max_concurrency: Option<usize>,
    pb: ProgressBar,
) -> Vec<RequestRecord> {
    let limit = max_concurrency.map(|c| Arc::new(Semaphore::new(c.max(1))));
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for (req, at) in requests.into_iter().zip(arrivals) {
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        let client = client.clone();
        let limit = limit.clone();
        let pb = pb.clone();
        tasks.spawn(async move {
            // The request's clock starts once it holds a slot, as in vLLM: queueing for the client's
            // own concurrency limit is not server latency.
            let _slot = match limit {
                Some(l) => Some(
                    l.acquire_owned()
                        .await
                        .expect("the semaphore is never closed"),
                ),
                None => None,
            };
            let rec = client.send(&req, start).await;
            pb.inc(1);
            rec
        });
    }
    let mut records = Vec::with_capacity(tasks.len());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(rec) => records.push(rec),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => tracing::warn!(error = %e, "a request task was cancelled"),
        }
    }
    pb.finish_and_clear();
    records
}
