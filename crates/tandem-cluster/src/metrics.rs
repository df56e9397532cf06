//! Ingress-side Prometheus metrics of the disaggregated path, in their own registry; the ingress
//! appends their text to the API's /metrics.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::protocol::{Role, WorkerLoad};

/// Buckets of KV pull durations, in seconds (loopback milliseconds to cross-host seconds).
const TRANSFER_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Buckets of the per-role wait, in seconds (a cached prompt's milliseconds to a long queue's minute).
const WAIT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
];

/// Errors only come from bad metric names, i.e. programming mistakes.
pub type MetricsError = prometheus::Error;

/// How a request's prompt was prefilled; a label of `tandem:pd_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillPath {
    /// On a prefill worker, KV pulled by the decode worker.
    Remote,
    /// On the decode worker because the uncached part was short (or no prefill worker was up).
    Local,
    /// On the decode worker after every prefill worker or the pull failed.
    Fallback,
}

impl PrefillPath {
    fn label(self) -> &'static str {
        match self {
            PrefillPath::Remote => "remote",
            PrefillPath::Local => "local",
            PrefillPath::Fallback => "fallback",
        }
    }
}

/// The cluster metrics of one ingress.
pub struct ClusterMetrics {
    registry: Registry,
    transfer_bytes: IntCounter,
    transfer_blocks: IntCounter,
    transfer_blocks_skipped: IntCounter,
    transfer_seconds: Histogram,
    transfer_failures: IntCounter,
    prefill_failures: IntCounter,
    decode_failures: IntCounter,
    decode_resumes: IntCounter,
    requests: IntCounterVec,
    pinned_blocks: IntGaugeVec,
    queue_depth: IntGaugeVec,
    running: IntGaugeVec,
    healthy: IntGaugeVec,
    admission_waiting: IntGauge,
    role_wait: HistogramVec,
    worker_prompt_tokens: IntCounterVec,
    worker_generation_tokens: IntCounterVec,
    worker_kv_used: IntGaugeVec,
    worker_kv_total: IntGaugeVec,
}

impl ClusterMetrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let transfer_bytes = IntCounter::new(
            "tandem:kv_transfer_bytes_total",
            "KV bytes pulled by decode workers.",
        )?;
        let transfer_blocks = IntCounter::new(
            "tandem:kv_transfer_blocks_total",
            "KV blocks (all layers of one logical block) pulled by decode workers.",
        )?;
        let transfer_blocks_skipped = IntCounter::new(
            "tandem:kv_transfer_blocks_skipped_total",
            "Prompt blocks a decode worker's prefix cache already held, so they were not pulled.",
        )?;
        let transfer_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "tandem:kv_transfer_duration_seconds",
                "Wall time of one KV pull.",
            )
            .buckets(TRANSFER_BUCKETS.to_vec()),
        )?;
        let transfer_failures = IntCounter::new(
            "tandem:kv_transfer_failures_total",
            "Decodes whose KV pull failed (prefilled again locally).",
        )?;
        let prefill_failures = IntCounter::new(
            "tandem:prefill_failures_total",
            "Prefill RPCs that failed and were retried elsewhere.",
        )?;
        let decode_failures = IntCounter::new(
            "tandem:decode_failures_total",
            "Decode streams that broke mid-request (worker died, connection lost, engine error).",
        )?;
        let decode_resumes = IntCounter::new(
            "tandem:decode_resumes_total",
            "Broken decode streams resumed on another decode worker after the tokens already sent.",
        )?;
        let requests = IntCounterVec::new(
            Opts::new(
                "tandem:pd_requests_total",
                "Requests by where their prompt was prefilled.",
            ),
            &["prefill"],
        )?;
        let pinned_blocks = IntGaugeVec::new(
            Opts::new(
                "tandem:kv_pinned_blocks",
                "KV blocks pinned for transfer and not yet acked, per worker.",
            ),
            &["worker"],
        )?;
        let queue_depth = IntGaugeVec::new(
            Opts::new("tandem:role_queue_depth", "Waiting requests per role."),
            &["role"],
        )?;
        let running = IntGaugeVec::new(
            Opts::new("tandem:role_requests_running", "Running requests per role."),
            &["role"],
        )?;
        let healthy = IntGaugeVec::new(
            Opts::new(
                "tandem:worker_healthy",
                "1 while the worker answers its load polls.",
            ),
            &["worker", "role"],
        )?;
        let admission_waiting = IntGauge::new(
            "tandem:admission_waiting",
            "Requests waiting at the head, before their prefill, for KV room on a decode worker.",
        )?;
        registry.register(Box::new(admission_waiting.clone()))?;
        // What an autoscaler charges a missed TTFT to: the role where requests spent longer.
        let role_wait = HistogramVec::new(
            HistogramOpts::new(
                "tandem:role_wait_seconds",
                "Seconds a request spent with each role before its result: prefill = the prefill RPC \
                 (its queue and the prompt's compute), decode = the rest until the decode worker's stream \
                 started (KV room at the head, the KV pull, the decode queue).",
            )
            .buckets(WAIT_BUCKETS.to_vec()),
            &["role"],
        )?;
        registry.register(Box::new(role_wait.clone()))?;
        // Per worker and role, so a dashboard can sum throughput and KV use by role: the head's
        // unlabelled engine series cover only the decode workers.
        let worker_prompt_tokens = IntCounterVec::new(
            Opts::new(
                "tandem:worker_prompt_tokens_total",
                "Prompt tokens a worker accepted, as of the head's last load poll.",
            ),
            &["worker", "role"],
        )?;
        let worker_generation_tokens = IntCounterVec::new(
            Opts::new(
                "tandem:worker_generation_tokens_total",
                "Tokens a worker generated, as of the head's last load poll.",
            ),
            &["worker", "role"],
        )?;
        let worker_kv_used = IntGaugeVec::new(
            Opts::new(
                "tandem:worker_kv_blocks_used",
                "KV blocks a worker's live sequences and pins hold.",
            ),
            &["worker", "role"],
        )?;
        let worker_kv_total = IntGaugeVec::new(
            Opts::new(
                "tandem:worker_kv_blocks_total",
                "KV blocks in a worker's pool.",
            ),
            &["worker", "role"],
        )?;
        registry.register(Box::new(worker_prompt_tokens.clone()))?;
        registry.register(Box::new(worker_generation_tokens.clone()))?;
        registry.register(Box::new(worker_kv_used.clone()))?;
        registry.register(Box::new(worker_kv_total.clone()))?;
        registry.register(Box::new(transfer_bytes.clone()))?;
        registry.register(Box::new(transfer_blocks.clone()))?;
        registry.register(Box::new(transfer_blocks_skipped.clone()))?;
        registry.register(Box::new(transfer_seconds.clone()))?;
        registry.register(Box::new(transfer_failures.clone()))?;
        registry.register(Box::new(prefill_failures.clone()))?;
        registry.register(Box::new(decode_failures.clone()))?;
        registry.register(Box::new(decode_resumes.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(pinned_blocks.clone()))?;
        registry.register(Box::new(queue_depth.clone()))?;
        registry.register(Box::new(running.clone()))?;
        registry.register(Box::new(healthy.clone()))?;
        for p in [
            PrefillPath::Remote,
            PrefillPath::Local,
            PrefillPath::Fallback,
        ] {
            requests.with_label_values(&[p.label()]);
        }
        Ok(ClusterMetrics {
            registry,
            transfer_bytes,
            transfer_blocks,
            transfer_blocks_skipped,
            transfer_seconds,
            transfer_failures,
            prefill_failures,
            decode_failures,
            decode_resumes,
            requests,
            pinned_blocks,
            queue_depth,
            running,
            healthy,
            admission_waiting,
            role_wait,
            worker_prompt_tokens,
            worker_generation_tokens,
            worker_kv_used,
            worker_kv_total,
        })
    }

    /// Records how many requests wait for decode KV room now (`crate::admission`).
    pub fn set_admission_waiting(&self, n: usize) {
        self.admission_waiting.set(n as i64);
    }

    /// Records the seconds a request spent with `role` before its result (`tandem:role_wait_seconds`).
    pub fn observe_wait(&self, role: Role, secs: f64) {
        self.role_wait
            .with_label_values(&[&role.to_string()])
            .observe(secs);
    }

    /// Records a finished KV pull: its bytes, wall time, blocks moved and prompt blocks found cached.
    pub fn observe_transfer(&self, bytes: u64, seconds: f64, blocks: usize, skipped: usize) {
        self.transfer_bytes.inc_by(bytes);
        self.transfer_blocks.inc_by(blocks as u64);
        self.transfer_blocks_skipped.inc_by(skipped as u64);
        self.transfer_seconds.observe(seconds);
    }

    /// Records a failed pull.
    pub fn transfer_failed(&self) {
        self.transfer_failures.inc();
    }

    /// Records a failed prefill RPC.
    pub fn prefill_failed(&self) {
        self.prefill_failures.inc();
    }

    /// Records a decode stream that broke mid-request.
    pub fn decode_failed(&self) {
        self.decode_failures.inc();
    }

    /// Records a broken decode stream resumed on another decode worker.
    pub fn decode_resumed(&self) {
        self.decode_resumes.inc();
    }

    /// Records where a request was prefilled.
    pub fn request(&self, path: PrefillPath) {
        self.requests.with_label_values(&[path.label()]).inc();
    }

    /// Requests per prefill path since start, for `GET /v1/cluster`.
    pub fn routing(&self) -> tandem_api::RoutingCounts {
        let count = |p: PrefillPath| self.requests.with_label_values(&[p.label()]).get();
        tandem_api::RoutingCounts {
            remote: count(PrefillPath::Remote),
            local: count(PrefillPath::Local),
            fallback: count(PrefillPath::Fallback),
        }
    }

    /// KV bytes pulled since start.
    pub fn transfer_bytes(&self) -> u64 {
        self.transfer_bytes.get()
    }

    /// Copies the workers' last polled loads into the gauges and renders the text format.
    pub fn render<'a>(
        &self,
        workers: impl Iterator<Item = (&'a str, Role, bool, &'a WorkerLoad)>,
    ) -> Result<String, MetricsError> {
        let mut depth = [0i64; 2];
        let mut running = [0i64; 2];
        for (id, role, healthy, load) in workers {
            let r = role as usize;
            depth[r] += load.engine.waiting as i64;
            running[r] += load.engine.running as i64;
            self.pinned_blocks
                .with_label_values(&[id])
                .set(load.pinned_blocks as i64);
            let labels = [id, &role.to_string()];
            self.healthy
                .with_label_values(&labels)
                .set(i64::from(healthy));
            follow(
                &self.worker_prompt_tokens.with_label_values(&labels),
                load.engine.prompt_tokens_total,
            );
            follow(
                &self.worker_generation_tokens.with_label_values(&labels),
                load.engine.generation_tokens_total,
            );
            self.worker_kv_used
                .with_label_values(&labels)
                .set(load.engine.kv_blocks_used as i64);
            self.worker_kv_total
                .with_label_values(&labels)
                .set(load.engine.kv_blocks_total as i64);
        }
        for role in [Role::Prefill, Role::Decode] {
            let label = role.to_string();
            self.queue_depth
                .with_label_values(&[&label])
                .set(depth[role as usize]);
            self.running
                .with_label_values(&[&label])
                .set(running[role as usize]);
        }
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// Moves a counter to a worker's own cumulative total. A total below the counter means the worker
/// restarted under the same id: the counter starts again from it, which Prometheus's `rate` reads as
/// the counter reset it is.
fn follow(counter: &IntCounter, total: u64) {
    let now = counter.get();
    if total < now {
        counter.reset();
        counter.inc_by(total);
    } else {
        counter.inc_by(total - now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_and_worker_gauges_render() {
        let m = ClusterMetrics::new().unwrap();
        m.observe_transfer(1000, 0.01, 2, 5);
        m.transfer_failed();
        m.request(PrefillPath::Remote);
        m.observe_wait(Role::Prefill, 0.3);
        let mut load = WorkerLoad {
            pinned_blocks: 3,
            ..WorkerLoad::default()
        };
        load.engine.waiting = 2;
        let text = m
            .render([("prefill-0", Role::Prefill, true, &load)].into_iter())
            .unwrap();
        assert!(
            text.contains("tandem:kv_transfer_bytes_total 1000"),
            "{text}"
        );
        assert!(text.contains("tandem:kv_transfer_blocks_total 2"), "{text}");
        assert!(
            text.contains("tandem:kv_transfer_blocks_skipped_total 5"),
            "{text}"
        );
        assert!(
            text.contains("tandem:kv_transfer_duration_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains("tandem:kv_transfer_failures_total 1"),
            "{text}"
        );
        assert!(
            text.contains("tandem:kv_pinned_blocks{worker=\"prefill-0\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("tandem:role_queue_depth{role=\"prefill\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("tandem:role_queue_depth{role=\"decode\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("tandem:pd_requests_total{prefill=\"remote\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tandem:role_wait_seconds_bucket{role=\"prefill\",le=\"0.5\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tandem:role_wait_seconds_bucket{role=\"prefill\",le=\"0.25\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn per_worker_counters_follow_the_polled_totals_and_restarts() {
        let m = ClusterMetrics::new().unwrap();
        let mut load = WorkerLoad::default();
        load.engine.generation_tokens_total = 40;
        load.engine.prompt_tokens_total = 7;
        load.engine.kv_blocks_used = 3;
        load.engine.kv_blocks_total = 64;
        let line = |text: &str, name: &str| {
            let key = format!("{name}{{role=\"decode\",worker=\"decode-0\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(key.as_str()).map(str::to_owned))
                .unwrap_or_else(|| panic!("{key} missing in\n{text}"))
        };
        let render = |load: &WorkerLoad| {
            m.render([("decode-0", Role::Decode, true, load)].into_iter())
                .unwrap()
        };
        let text = render(&load);
        assert_eq!(line(&text, "tandem:worker_generation_tokens_total"), "40");
        assert_eq!(line(&text, "tandem:worker_prompt_tokens_total"), "7");
        assert_eq!(line(&text, "tandem:worker_kv_blocks_used"), "3");
        assert_eq!(line(&text, "tandem:worker_kv_blocks_total"), "64");
        load.engine.generation_tokens_total = 55;
        assert_eq!(
            line(&render(&load), "tandem:worker_generation_tokens_total"),
            "55"
        );
        load.engine.generation_tokens_total = 5;
        assert_eq!(
            line(&render(&load), "tandem:worker_generation_tokens_total"),
            "5"
        );
    }
}
