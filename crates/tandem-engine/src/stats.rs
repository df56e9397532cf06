//! The engine's counters and gauges.

use tandem_model::LayerExpertTokens;

/// Counters and gauges the API exports as Prometheus metrics.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    /// Sequences in the running list.
    pub running: usize,
    /// Sequences waiting (new or preempted).
    pub waiting: usize,
    /// Blocks in the pool.
    pub kv_blocks_total: usize,
    /// Blocks referenced by a live sequence or pin (not merely cached).
    pub kv_blocks_used: usize,
    /// Free blocks still holding a reusable prefix.
    pub kv_blocks_cached: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_cache_hits: u64,
    /// Prompt tokens of accepted requests.
    pub prompt_tokens_total: u64,
    /// Tokens generated.
    pub generation_tokens_total: u64,
    /// Tokens run through prefill compute (a P/D decode worker proves 0 here).
    pub prefill_tokens_computed: u64,
    /// Blocks of imported prompts found in this engine's prefix cache: shared, so their KV is not transferred.
    #[serde(default)]
    pub import_blocks_cached: u64,
    /// Blocks of imported prompts whose KV the caller had to supply with `import_block`.
    #[serde(default)]
    pub import_blocks_needed: u64,
    /// Times a running sequence was preempted.
    pub preemptions_total: u64,
    /// Requests that ended (any reason).
    pub requests_finished_total: u64,
    /// Model steps run.
    pub steps_total: u64,
    /// Wall seconds of those steps, from scheduling to reaping (the forward pass, sampling, streaming
    /// the tokens out, the scheduler's bookkeeping): with `forward_seconds_total`, the host work a step
    /// costs beyond the model, which `tandem profile` measures for the simulator.
    #[serde(default)]
    pub step_seconds_total: f64,
    /// Seconds of those steps spent inside the backend's forward pass (what the profile's step curves time).
    #[serde(default)]
    pub forward_seconds_total: f64,
    /// Token rows each mixture-of-experts layer of this engine's backend routed to each expert since
    /// load (empty for a dense model); the backend's own count, copied as the other counters are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moe_expert_tokens: Vec<LayerExpertTokens>,
    /// The KV tiers under the pool (host, then disk; empty when `kv_offload` is off).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_tiers: Vec<KvTierStats>,
    /// Time to restore one request's prefix from the tiers.
    #[serde(default)]
    pub kv_restore_seconds: RestoreHistogram,
}

impl EngineStats {
    /// Mean seconds per step of the engine loop's own work outside the forward pass (scheduling,
    /// sampling, streaming, reaping) between `earlier` and these counters; `None` when no step ran.
    pub fn host_seconds_per_step(&self, earlier: &EngineStats) -> Option<f64> {
        let steps = self.steps_total.checked_sub(earlier.steps_total)?;
        if steps == 0 {
            return None;
        }
        let host = (self.step_seconds_total - earlier.step_seconds_total)
            - (self.forward_seconds_total - earlier.forward_seconds_total);
        Some(host.max(0.0) / steps as f64)
    }
}

/// One KV tier's occupancy and traffic since start.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KvTierStats {
    /// `host` or `disk`.
    pub tier: String,
    /// Whether the tier takes blocks (a disk tier turns off after a write error).
    pub enabled: bool,
    /// Blocks held.
    pub blocks: u64,
    /// Bytes held.
    pub bytes: u64,
    /// Block lookups this tier answered.
    pub hits: u64,
    /// Block lookups that consulted this tier and missed.
    pub misses: u64,
    /// Bytes copied down into this tier.
    pub bytes_down: u64,
    /// Bytes copied back up from this tier.
    pub bytes_up: u64,
    /// Block files dropped because they failed their checks when read.
    pub corrupt: u64,
    /// Hits served from blocks read ahead of their request's admission (disk), off the step loop.
    #[serde(default)]
    pub read_ahead: u64,
}

/// A fixed-bucket histogram of restore times, cumulative like Prometheus's.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RestoreHistogram {
    /// Upper bounds of the buckets, seconds.
    pub bounds: Vec<f64>,
    /// Observations at or below each bound.
    pub counts: Vec<u64>,
    /// Sum of all observations, seconds.
    pub sum: f64,
    /// Observations.
    pub count: u64,
}

impl Default for RestoreHistogram {
    fn default() -> Self {
        let bounds = vec![
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        ];
        Self {
            counts: vec![0; bounds.len()],
            bounds,
            sum: 0.0,
            count: 0,
        }
    }
}

impl RestoreHistogram {
    /// Records one restore of `seconds`.
    pub fn observe(&mut self, seconds: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if seconds <= *b {
                *c += 1;
            }
        }
        self.sum += seconds;
        self.count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host share of a step is its wall time less its forward pass, averaged over the steps between
    /// two snapshots; none without a step.
    #[test]
    fn host_seconds_per_step_is_the_wall_time_less_the_forward() {
        let before = EngineStats {
            steps_total: 10,
            step_seconds_total: 1.0,
            forward_seconds_total: 0.8,
            ..Default::default()
        };
        let after = EngineStats {
            steps_total: 14,
            step_seconds_total: 1.5,
            forward_seconds_total: 1.1,
            ..Default::default()
        };
        let host = after.host_seconds_per_step(&before).unwrap();
        assert!((host - 0.05).abs() < 1e-12, "{host}");
        assert_eq!(after.host_seconds_per_step(&after), None);
        assert_eq!(before.host_seconds_per_step(&after), None);
    }
}
