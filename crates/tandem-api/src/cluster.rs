//! `GET /v1/cluster`: one JSON snapshot of the deployment (its workers, their load, the head's routing
//! decisions and KV bytes moved) for the console, scripts and readiness checks.

use serde::{Deserialize, Serialize};
use tandem_engine::EngineStats;
use tandem_telemetry::LatencyView;

/// The deployment as `GET /v1/cluster` reports it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ClusterView {
    /// The served model's first name.
    pub model: String,
    /// Every worker the server knows (one for a colocated server).
    pub workers: Vec<WorkerView>,
    /// Where the head prefilled its requests (all `local` on a colocated server).
    pub routing: RoutingCounts,
    /// KV bytes pulled from prefill to decode workers since start: cumulative, so a poller takes rates.
    pub kv_bytes_moved: u64,
}

/// The whole `GET /v1/cluster` answer: the backend's [`ClusterView`] and what the API itself measured.
/// Kept apart from `ClusterView` because backends build that one and know nothing of the API's metrics.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ClusterSnapshot {
    /// Model, workers, routing and KV bytes, as the backend reports them.
    #[serde(flatten)]
    pub deployment: ClusterView,
    /// The server's own latency histograms, cumulative: a poller takes means and percentiles between
    /// two snapshots (the console's charts), as Prometheus does between two scrapes.
    pub latency: LatencyView,
}

/// One worker's role, address, health and load.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct WorkerView {
    /// Its unique name in the deployment.
    pub id: String,
    /// `prefill`, `decode` or `colocated`.
    pub role: String,
    /// Where it listens (its RPC URL; empty for a colocated server's own engine).
    pub address: String,
    /// Whether its last poll succeeded.
    pub healthy: bool,
    /// Whether it drains and gets no new work.
    pub draining: bool,
    /// Sequences running now.
    pub running: usize,
    /// Sequences waiting.
    pub waiting: usize,
    /// KV blocks held by live sequences or pins.
    pub kv_blocks_used: usize,
    /// KV blocks in its pool.
    pub kv_blocks_total: usize,
    /// Blocks pinned for transfers not yet acked.
    pub pinned_blocks: usize,
    /// Prompt tokens served from the prefix cache over prompt tokens looked up; absent before any lookup.
    pub prefix_cache_hit_rate: Option<f64>,
    /// Tokens generated since start (a poller takes throughput from it).
    pub generation_tokens_total: u64,
    /// Prompt tokens accepted since start.
    pub prompt_tokens_total: u64,
}

/// The head's prefill decisions since start.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RoutingCounts {
    /// Prefilled on a prefill worker.
    pub remote: u64,
    /// Prefilled on the decode worker (short prompt, or a colocated server).
    pub local: u64,
    /// Prefilled on the decode worker after the prefill workers or the pull failed.
    pub fallback: u64,
}

impl WorkerView {
    /// A worker's view from its engine's counters; pinning and identity are the caller's.
    pub fn from_stats(id: String, role: String, address: String, s: &EngineStats) -> Self {
        Self {
            id,
            role,
            address,
            healthy: true,
            draining: false,
            running: s.running,
            waiting: s.waiting,
            kv_blocks_used: s.kv_blocks_used,
            kv_blocks_total: s.kv_blocks_total,
            pinned_blocks: 0,
            prefix_cache_hit_rate: (s.prefix_cache_queries > 0)
                .then(|| s.prefix_cache_hits as f64 / s.prefix_cache_queries as f64),
            generation_tokens_total: s.generation_tokens_total,
            prompt_tokens_total: s.prompt_tokens_total,
        }
    }
}

impl ClusterView {
    /// A colocated server: its one engine as the only worker, every request prefilled locally.
    pub fn colocated(s: &EngineStats) -> Self {
        Self {
            model: String::new(),
            workers: vec![WorkerView::from_stats(
                "colocated-0".to_owned(),
                "colocated".to_owned(),
                String::new(),
                s,
            )],
            routing: RoutingCounts {
                local: s.requests_finished_total + (s.running + s.waiting) as u64,
                ..RoutingCounts::default()
            },
            kv_bytes_moved: 0,
        }
    }
}
