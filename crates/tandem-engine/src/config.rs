//! The engine's settings.

/// Knobs of one engine; defaults suit the default model on a laptop.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Bytes of KV cache across all layers (the backend is sized from it): the setting
    /// `engine.kv_cache_memory`, whose default is this type's, the one default every backend takes.
    pub kv_cache_memory: usize,
    /// Running sequences per step.
    pub max_num_seqs: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps so decodes keep flowing.
    pub enable_chunked_prefill: bool,
    /// Reuse KV of shared prompt prefixes.
    pub enable_prefix_caching: bool,
    /// None = the model's context length.
    pub max_model_len: Option<usize>,
    /// Beyond this many queued requests `submit` returns QueueFull (the API answers 503).
    pub max_waiting: usize,
    /// Compute threads for the backend; 0 = all cores.
    pub threads: usize,
    /// Tensor-parallel ranks the backend splits every layer over (1 = none).
    pub tensor_parallel_size: usize,
    /// How the routed experts of a mixture of experts are placed over the tensor-parallel ranks
    /// (each rank holds whole experts): contiguous runs of ids, or round robin.
    pub expert_placement: tandem_model::ExpertPlacement,
    /// CPU kernels sum in llama.cpp's batch-dependent orders (`tandem_kernels::set_llamacpp_batch_orders`):
    /// logits bit-identical to llama.cpp's, at the price of a token's bits depending on its step's size.
    pub llamacpp_orders: bool,
    /// Pipeline stages the backend splits the layers over (1 = none); stage 0 runs in this process.
    pub pipeline_parallel_size: usize,
    /// Micro-batches per step of a pipelined backend (0 = one per stage).
    pub pipeline_micro_batches: usize,
    /// Addresses of stage servers 1.. of a pipeline; empty = the launcher starts them on this host.
    pub pipeline_stages: Vec<String>,
    /// Tiers that blocks evicted from the KV pool are copied down to (`engine.kv_offload`); off by
    /// default.
    pub kv_offload: KvOffloadConfig,
}

/// KV cache tiers under the pool (see `kv_tiers`): host memory and a directory on disk, each LRU
/// under its own byte budget.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvOffloadConfig {
    /// Bytes of host memory for evicted blocks; None: no host tier.
    pub host: Option<usize>,
    /// The disk tier; None: none.
    pub disk: Option<DiskOffloadConfig>,
    /// The served model's identity, written into and checked against every block file (the binary
    /// sets it from the loaded model; a disk tier refuses to start without it).
    #[serde(skip)]
    pub model_identity: String,
}

impl KvOffloadConfig {
    /// Whether any tier is configured.
    pub fn enabled(&self) -> bool {
        self.host.is_some() || self.disk.is_some()
    }
}

/// The disk tier: a directory of block files and the bytes it may hold.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskOffloadConfig {
    /// The directory (created if missing; kept across restarts).
    pub path: std::path::PathBuf,
    /// Bytes of block files the directory may hold.
    pub size: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_memory: 1 << 30,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            max_model_len: None,
            max_waiting: 1024,
            threads: 0,
            tensor_parallel_size: 1,
            expert_placement: tandem_model::ExpertPlacement::Contiguous,
            llamacpp_orders: false,
            pipeline_parallel_size: 1,
            pipeline_micro_batches: 0,
            pipeline_stages: Vec::new(),
            kv_offload: KvOffloadConfig::default(),
        }
    }
}
