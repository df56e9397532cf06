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
    /// Token rows each mixture-of-experts layer of this engine's backend routed to each expert since
    /// load (empty for a dense model); the backend's own count, copied as the other counters are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moe_expert_tokens: Vec<LayerExpertTokens>,
}
