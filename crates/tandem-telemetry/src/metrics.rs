//! Prometheus metrics with vLLM-like names (`tandem:` prefix) so existing dashboards map over.
//!
//! Latency histograms are observed by the request handlers; engine gauges and counters are copied from
//! an [`EngineStats`] snapshot at scrape time.

use parking_lot::Mutex;
use prometheus::core::{Collector, Desc, Metric};
use prometheus::proto::{self, MetricFamily, MetricType};
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tandem_engine::{EngineStats, RestoreHistogram};

/// Buckets for time to first token, in seconds (a CPU model: milliseconds to tens of seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
/// Buckets for the gap between consecutive tokens, in seconds.
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5,
];
/// Buckets for whole-request latency, in seconds.
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
];

/// The finish reasons `request_success_total` is labelled with.
pub const FINISH_REASONS: &[&str] = &["stop", "length", "abort"];

/// Errors while building or encoding metrics; only possible through programming mistakes (bad names).
pub type MetricsError = prometheus::Error;

/// All metrics of one server: the engine's gauges and counters, and the latencies its requests saw.
pub struct Metrics {
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    kv_usage: Gauge,
    kv_used: IntGauge,
    kv_total: IntGauge,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    preemptions: IntCounter,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    success: IntCounterVec,
    /// Token rows routed per (layer, expert) of a mixture-of-experts model; no series for a dense one.
    moe_expert_tokens: IntCounterVec,
    /// Blocks and bytes each KV tier holds (`tier` = host, disk); no series with tiers off.
    kv_tier_blocks: IntGaugeVec,
    kv_tier_bytes: IntGaugeVec,
    /// Block lookups each KV tier answered or missed, bytes copied down into and up from it, and
    /// block files dropped as corrupt.
    kv_tier_hits: IntCounterVec,
    kv_tier_misses: IntCounterVec,
    kv_tier_bytes_down: IntCounterVec,
    kv_tier_bytes_up: IntCounterVec,
    kv_tier_corrupt: IntCounterVec,
    /// Disk hits served from blocks read ahead of admission.
    kv_tier_read_ahead: IntCounterVec,
    /// The engine's histogram of prefix restore times, as of the last render.
    kv_restore: Arc<Mutex<RestoreHistogram>>,
    /// The engine counters as of the last scrape; Prometheus counters only move by increments.
    last: Mutex<EngineStats>,
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str| -> Result<IntGauge, MetricsError> {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let counter = |name: &str, help: &str| -> Result<IntCounter, MetricsError> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let histogram =
            |name: &str, help: &str, buckets: &[f64]| -> Result<Histogram, MetricsError> {
                let h =
                    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))?;
                registry.register(Box::new(h.clone()))?;
                Ok(h)
            };
        let kv_usage = Gauge::new(
            "tandem:kv_cache_usage_perc",
            "Fraction of KV blocks in use (0..1).",
        )?;
        registry.register(Box::new(kv_usage.clone()))?;
        let success = IntCounterVec::new(
            Opts::new(
                "tandem:request_success_total",
                "Finished requests by finish reason.",
            ),
            &["finished_reason"],
        )?;
        registry.register(Box::new(success.clone()))?;
        for reason in FINISH_REASONS {
            success.with_label_values(&[reason]);
        }
        let moe_expert_tokens = IntCounterVec::new(
            Opts::new(
                "tandem:moe_expert_tokens_total",
                "Token rows routed to each expert of each mixture-of-experts layer.",
            ),
            &["layer", "expert"],
        )?;
        registry.register(Box::new(moe_expert_tokens.clone()))?;
        let tier_gauge = |name: &str, help: &str| -> Result<IntGaugeVec, MetricsError> {
            let g = IntGaugeVec::new(Opts::new(name, help), &["tier"])?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let tier_counter = |name: &str, help: &str| -> Result<IntCounterVec, MetricsError> {
            let c = IntCounterVec::new(Opts::new(name, help), &["tier"])?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let kv_restore = Arc::new(Mutex::new(RestoreHistogram::default()));
        registry.register(Box::new(SnapshotHistogram::new(
            "tandem:kv_tier_restore_seconds",
            "Time to restore one request's cached prefix from the KV tiers.",
            kv_restore.clone(),
        )?))?;
        Ok(Self {
            kv_tier_blocks: tier_gauge("tandem:kv_tier_blocks", "KV blocks held by each tier.")?,
            kv_tier_bytes: tier_gauge("tandem:kv_tier_bytes", "Bytes of KV held by each tier.")?,
            kv_tier_hits: tier_counter(
                "tandem:kv_tier_hits_total",
                "KV block lookups that missed the pool and were answered by this tier.",
            )?,
            kv_tier_misses: tier_counter(
                "tandem:kv_tier_misses_total",
                "KV block lookups that consulted this tier and missed.",
            )?,
            kv_tier_bytes_down: tier_counter(
                "tandem:kv_tier_bytes_down_total",
                "Bytes of evicted KV copied down into this tier.",
            )?,
            kv_tier_bytes_up: tier_counter(
                "tandem:kv_tier_bytes_up_total",
                "Bytes of KV copied back up from this tier.",
            )?,
            kv_tier_corrupt: tier_counter(
                "tandem:kv_tier_corrupt_total",
                "Block files dropped because they failed their checks when read.",
            )?,
            kv_tier_read_ahead: tier_counter(
                "tandem:kv_tier_read_ahead_hits_total",
                "Block hits of this tier served from blocks read ahead of their request's admission.",
            )?,
            kv_restore,
            running: gauge(
                "tandem:num_requests_running",
                "Requests in the running batch.",
            )?,
            waiting: gauge(
                "tandem:num_requests_waiting",
                "Requests waiting to be scheduled.",
            )?,
            kv_used: gauge(
                "tandem:kv_blocks_used",
                "KV blocks referenced by live sequences.",
            )?,
            kv_total: gauge("tandem:kv_blocks_total", "KV blocks in the pool.")?,
            prompt_tokens: counter("tandem:prompt_tokens_total", "Prompt tokens received.")?,
            generation_tokens: counter("tandem:generation_tokens_total", "Tokens generated.")?,
            prefix_queries: counter(
                "tandem:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
            )?,
            prefix_hits: counter(
                "tandem:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache.",
            )?,
            preemptions: counter(
                "tandem:num_preemptions_total",
                "Sequences preempted for lack of KV blocks.",
            )?,
            ttft: histogram(
                "tandem:time_to_first_token_seconds",
                "Time from request arrival to its first token.",
                TTFT_BUCKETS,
            )?,
            itl: histogram(
                "tandem:inter_token_latency_seconds",
                "Time between consecutive tokens of a request.",
                ITL_BUCKETS,
            )?,
            e2e: histogram(
                "tandem:e2e_request_latency_seconds",
                "Time from request arrival to its last token.",
                E2E_BUCKETS,
            )?,
            kv_usage,
            success,
            moe_expert_tokens,
            registry,
            last: Mutex::new(EngineStats::default()),
        })
    }

    /// Records a request's first token.
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.observe(secs);
    }

    /// Records the gap before a non-first token.
    pub fn observe_itl(&self, secs: f64) {
        self.itl.observe(secs);
    }

    /// Records a finished request (one engine request per choice).
    pub fn observe_finished(&self, finish_reason: &str, e2e_secs: f64) {
        self.e2e.observe(e2e_secs);
        self.success.with_label_values(&[finish_reason]).inc();
    }

    /// The latency histograms as they stand, for the API's `GET /v1/cluster`.
    pub fn latency(&self) -> LatencyView {
        LatencyView {
            ttft: histogram_view(&self.ttft),
            itl: histogram_view(&self.itl),
            e2e: histogram_view(&self.e2e),
        }
    }

    /// Copies an engine snapshot into the gauges and counters and renders the Prometheus text format.
    pub fn render(&self, stats: &EngineStats) -> Result<String, MetricsError> {
        self.running.set(stats.running as i64);
        self.waiting.set(stats.waiting as i64);
        self.kv_used.set(stats.kv_blocks_used as i64);
        self.kv_total.set(stats.kv_blocks_total as i64);
        let usage = if stats.kv_blocks_total == 0 {
            0.0
        } else {
            stats.kv_blocks_used as f64 / stats.kv_blocks_total as f64
        };
        self.kv_usage.set(usage);
        {
            let mut last = self.last.lock();
            let bump = |c: &IntCounter, now: u64, before: u64| c.inc_by(now.saturating_sub(before));
            bump(
                &self.prompt_tokens,
                stats.prompt_tokens_total,
                last.prompt_tokens_total,
            );
            bump(
                &self.generation_tokens,
                stats.generation_tokens_total,
                last.generation_tokens_total,
            );
            bump(
                &self.prefix_queries,
                stats.prefix_cache_queries,
                last.prefix_cache_queries,
            );
            bump(
                &self.prefix_hits,
                stats.prefix_cache_hits,
                last.prefix_cache_hits,
            );
            bump(
                &self.preemptions,
                stats.preemptions_total,
                last.preemptions_total,
            );
            for layer in &stats.moe_expert_tokens {
                let before = last
                    .moe_expert_tokens
                    .iter()
                    .find(|l| l.layer == layer.layer)
                    .map_or(&[][..], |l| &l.tokens[..]);
                for (expert, &now) in layer.tokens.iter().enumerate() {
                    let series = self
                        .moe_expert_tokens
                        .with_label_values(&[&layer.layer.to_string(), &expert.to_string()]);
                    bump(&series, now, before.get(expert).copied().unwrap_or(0));
                }
            }
            for t in &stats.kv_tiers {
                let l = [t.tier.as_str()];
                self.kv_tier_blocks
                    .with_label_values(&l)
                    .set(t.blocks as i64);
                self.kv_tier_bytes.with_label_values(&l).set(t.bytes as i64);
                let before = last.kv_tiers.iter().find(|b| b.tier == t.tier);
                let was = |f: fn(&tandem_engine::KvTierStats) -> u64| before.map_or(0, f);
                bump(
                    &self.kv_tier_hits.with_label_values(&l),
                    t.hits,
                    was(|b| b.hits),
                );
                bump(
                    &self.kv_tier_misses.with_label_values(&l),
                    t.misses,
                    was(|b| b.misses),
                );
                bump(
                    &self.kv_tier_bytes_down.with_label_values(&l),
                    t.bytes_down,
                    was(|b| b.bytes_down),
                );
                bump(
                    &self.kv_tier_bytes_up.with_label_values(&l),
                    t.bytes_up,
                    was(|b| b.bytes_up),
                );
                bump(
                    &self.kv_tier_corrupt.with_label_values(&l),
                    t.corrupt,
                    was(|b| b.corrupt),
                );
                bump(
                    &self.kv_tier_read_ahead.with_label_values(&l),
                    t.read_ahead,
                    was(|b| b.read_ahead),
                );
            }
            self.kv_restore.lock().clone_from(&stats.kv_restore_seconds);
            *last = stats.clone();
        }
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// Like [`Self::render`], only the engine's gauges and counters: for a P/D worker, whose requests'
    /// latencies are the head's to observe (its histograms would stay empty).
    pub fn render_engine(&self, stats: &EngineStats) -> Result<String, MetricsError> {
        self.render(stats)?;
        let latency = [
            self.ttft.desc(),
            self.itl.desc(),
            self.e2e.desc(),
            self.success.desc(),
        ];
        let families: Vec<_> = self
            .registry
            .gather()
            .into_iter()
            .filter(|f| !latency.iter().flatten().any(|d| d.fq_name == f.name()))
            .collect();
        let mut buf = Vec::new();
        TextEncoder::new().encode(&families, &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// A histogram whose counts the engine keeps (a [`RestoreHistogram`] copied at each render), exposed
/// as a Prometheus histogram: the engine thread cannot observe into a registry it does not know.
struct SnapshotHistogram {
    desc: Desc,
    snap: Arc<Mutex<RestoreHistogram>>,
}

impl SnapshotHistogram {
    fn new(
        name: &str,
        help: &str,
        snap: Arc<Mutex<RestoreHistogram>>,
    ) -> Result<Self, MetricsError> {
        let desc = Desc::new(name.into(), help.into(), Vec::new(), Default::default())?;
        Ok(Self { desc, snap })
    }
}

impl Collector for SnapshotHistogram {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let snap = self.snap.lock().clone();
        let mut h = proto::Histogram::default();
        h.set_sample_count(snap.count);
        h.set_sample_sum(snap.sum);
        h.set_bucket(
            snap.bounds
                .iter()
                .zip(&snap.counts)
                .map(|(&le, &n)| {
                    let mut b = proto::Bucket::default();
                    b.set_upper_bound(le);
                    b.set_cumulative_count(n);
                    b
                })
                .collect(),
        );
        let mut m = proto::Metric::default();
        m.set_histogram(h);
        let mut f = MetricFamily::default();
        f.set_name(self.desc.fq_name.clone());
        f.set_help(self.desc.help.clone());
        f.set_field_type(MetricType::HISTOGRAM);
        f.mut_metric().push(m);
        vec![f]
    }
}

/// The API's latency histograms as seen by clients of this server (the head, in a P/D deployment).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct LatencyView {
    /// Time from request arrival to its first token.
    pub ttft: HistogramView,
    /// Time between consecutive tokens of a request.
    pub itl: HistogramView,
    /// Time from request arrival to its last token; its count is the requests finished.
    pub e2e: HistogramView,
}

/// One cumulative histogram: the numbers behind Prometheus's `_count`, `_sum` and `_bucket` series.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct HistogramView {
    /// Observations since start.
    pub count: u64,
    /// Sum of the observations, in seconds.
    pub sum: f64,
    /// `[upper bound in seconds, observations at or below it]`, ascending; the `+Inf` bucket is `count`.
    pub buckets: Vec<(f64, u64)>,
}

/// One histogram's count, sum and cumulative buckets.
fn histogram_view(h: &Histogram) -> HistogramView {
    let proto = h.metric();
    let hist = proto.get_histogram();
    HistogramView {
        count: hist.get_sample_count(),
        sum: hist.get_sample_sum(),
        buckets: hist
            .get_bucket()
            .iter()
            .map(|b| (b.upper_bound(), b.cumulative_count()))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value_of(text: &str, name: &str) -> f64 {
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
    }

    #[test]
    fn kv_tier_series_follow_the_engine() {
        let m = Metrics::new().unwrap();
        let text = m.render(&EngineStats::default()).unwrap();
        assert!(
            !text.contains("tandem:kv_tier_hits_total{"),
            "no tier series with tiers off"
        );
        let mut s = EngineStats {
            kv_tiers: vec![tandem_engine::KvTierStats {
                tier: "disk".into(),
                enabled: true,
                blocks: 7,
                bytes: 700,
                hits: 3,
                misses: 1,
                bytes_down: 900,
                bytes_up: 300,
                corrupt: 0,
                read_ahead: 2,
            }],
            ..EngineStats::default()
        };
        s.kv_restore_seconds.observe(0.002);
        let text = m.render(&s).unwrap();
        assert_eq!(value_of(&text, "tandem:kv_tier_blocks{tier=\"disk\"}"), 7.0);
        assert_eq!(
            value_of(&text, "tandem:kv_tier_hits_total{tier=\"disk\"}"),
            3.0
        );
        assert_eq!(
            value_of(&text, "tandem:kv_tier_read_ahead_hits_total{tier=\"disk\"}"),
            2.0
        );
        assert_eq!(
            value_of(&text, "tandem:kv_tier_bytes_up_total{tier=\"disk\"}"),
            300.0
        );
        assert_eq!(value_of(&text, "tandem:kv_tier_restore_seconds_count"), 1.0);
        assert_eq!(
            value_of(
                &text,
                "tandem:kv_tier_restore_seconds_bucket{le=\"0.0025\"}"
            ),
            1.0
        );
        assert_eq!(
            value_of(&text, "tandem:kv_tier_restore_seconds_bucket{le=\"0.001\"}"),
            0.0
        );
        s.kv_tiers[0].hits = 5;
        let text = m.render(&s).unwrap();
        assert_eq!(
            value_of(&text, "tandem:kv_tier_hits_total{tier=\"disk\"}"),
            5.0
        );
    }

    #[test]
    fn render_copies_engine_stats_and_counts_increments() {
        let m = Metrics::new().unwrap();
        let mut s = EngineStats {
            running: 3,
            waiting: 2,
            kv_blocks_total: 100,
            kv_blocks_used: 25,
            prompt_tokens_total: 40,
            ..EngineStats::default()
        };
        let text = m.render(&s).unwrap();
        assert_eq!(value_of(&text, "tandem:num_requests_running"), 3.0);
        assert_eq!(value_of(&text, "tandem:num_requests_waiting"), 2.0);
        assert_eq!(value_of(&text, "tandem:kv_cache_usage_perc"), 0.25);
        assert_eq!(value_of(&text, "tandem:prompt_tokens_total"), 40.0);
        s.prompt_tokens_total = 55;
        let text = m.render(&s).unwrap();
        assert_eq!(value_of(&text, "tandem:prompt_tokens_total"), 55.0);
    }

    #[test]
    fn expert_tokens_are_a_series_per_layer_and_expert_only_for_moe() {
        let m = Metrics::new().unwrap();
        let mut s = EngineStats::default();
        assert!(!m
            .render(&s)
            .unwrap()
            .contains("tandem:moe_expert_tokens_total{"));
        s.moe_expert_tokens = vec![
            tandem_engine::LayerExpertTokens {
                layer: 3,
                tokens: vec![5, 0, 2],
            },
            tandem_engine::LayerExpertTokens {
                layer: 4,
                tokens: vec![1, 6, 0],
            },
        ];
        m.render(&s).unwrap();
        s.moe_expert_tokens[0].tokens[2] = 9;
        let text = m.render(&s).unwrap();
        let series = |layer: usize, expert: usize| {
            let name =
                format!("tandem:moe_expert_tokens_total{{expert=\"{expert}\",layer=\"{layer}\"}}");
            value_of(&text, &name)
        };
        assert_eq!(series(3, 0), 5.0);
        assert_eq!(series(3, 2), 9.0);
        assert_eq!(series(4, 1), 6.0);
        assert_eq!(series(4, 2), 0.0);
    }

    #[test]
    fn histograms_and_success_counter_are_exported() {
        let m = Metrics::new().unwrap();
        m.observe_ttft(0.05);
        m.observe_itl(0.01);
        m.observe_finished("length", 1.0);
        let text = m.render(&EngineStats::default()).unwrap();
        assert_eq!(
            value_of(&text, "tandem:time_to_first_token_seconds_count"),
            1.0
        );
        assert_eq!(
            value_of(&text, "tandem:inter_token_latency_seconds_count"),
            1.0
        );
        assert_eq!(
            value_of(&text, "tandem:e2e_request_latency_seconds_count"),
            1.0
        );
        assert!(text.contains("tandem:request_success_total{finished_reason=\"length\"} 1"));
        assert!(text.contains("tandem:request_success_total{finished_reason=\"stop\"} 0"));
    }

    #[test]
    fn latency_view_is_cumulative_with_buckets() {
        let m = Metrics::new().unwrap();
        m.observe_ttft(0.03);
        m.observe_ttft(3.0);
        m.observe_itl(0.004);
        let v = m.latency();
        assert_eq!(v.ttft.count, 2);
        assert!((v.ttft.sum - 3.03).abs() < 1e-9);
        assert_eq!(v.ttft.buckets.len(), TTFT_BUCKETS.len());
        let at = |le: f64| v.ttft.buckets.iter().find(|b| b.0 == le).unwrap().1;
        assert_eq!((at(0.02), at(0.04), at(2.5), at(5.0)), (0, 1, 1, 2));
        assert_eq!((v.itl.count, v.e2e.count), (1, 0));
    }
}
