//! Pipeline parallelism: the model's layers cut into contiguous stages ([`Partition::stage`]), the
//! first stage inside the worker's engine thread and every later stage in a stage server process
//! ([`serve_stage`], `tandem stage`), possibly on another host. Each stage computes through the engine's
//! [`StageModel`] seam (`tandem_engine::stage`): the CPU model ([`CpuStage`]) or a GPU's (`tandem_cuda::CudaStage`, each stage on
//! the device ordinal it is given); stages on different devices do not mix, since the KV dtype sets
//! the pool.
//!
//! [`PipelineBackend`] implements the engine's `Backend`, so the engine, its block pool and the P/D
//! machinery do not know the model is split: `kv_layout()` is the whole model's (every stage holds the
//! same block ids for its own layers), and block export/import/copy are routed to the stage that owns
//! the layer, so KV leaves a pipelined worker in the canonical layout.
//!
//! Hidden states cross the links in the stages' own element type ([`tandem_engine::Activations`]: f32 on CPU, the
//! bf16 residual stream on GPUs), so nothing is converted or rounded on the way. When the last
//! stage draws tokens on its device ([`StageModel::samples_on_device`]), the backend's
//! `forward_sampled` sends the sampling rows along and only token ids come back, never logits rows.
//!
//! **Routing is a star through the first stage**, not a chain: the first stage sends micro-batch `i` to
//! stage 1, takes its hidden states back, sends them to stage 2, and so on; the last stage's logits come
//! back the same way. Why: the stage servers stay plain request/reply servers that only ever talk to their
//! worker (no stage-to-stage addresses, handshakes or failure paths), the worker sees every failure on its
//! own links and fails the step with the stage's name, and KV export/import already needs a link from the
//! worker to every stage. The cost is one extra hop of the hidden states per stage boundary beyond the
//! first (tokens × hidden × 4 bytes, 2.3 KiB per decode token for SmolLM2-135M), nothing for two stages.
//!
//! **Micro-batching:** a step's sequences are cut into `micro_batches` contiguous groups of about equal
//! token counts (fewer when the step is small: see [`PipelineConfig::min_micro_batch_tokens`]). The first
//! stage computes group `i + 1` while a link thread per later stage carries group `i` through its stage,
//! so stages overlap; logits rows are put back in batch order. Cutting between sequences is exact: every
//! row of the kernels is computed the same whatever the batch around it, and attention reads only its own
//! sequence's blocks, so pipelined logits equal the whole model's bit for bit.
//!
//! The KV budget (`kv_cache_memory`) is the whole model's, as without pipelining, so a pipelined worker has
//! the same number of blocks as an unsplit one; each stage allocates only its layers' share of it.
//!
//! Modules by job: `backend` (the first stage, [`PipelineBackend`]), `stage` (a later stage's model
//! answering its link, [`serve_stage`]) and [`link`] (the request/reply protocol between them, over the KV
//! transfer crate's frame header).

mod backend;
pub mod link;
mod model;
mod stage;

use tandem_engine::{StageError, StageModel};
use tandem_kv::KvError;
use tandem_model::{ModelError, ModelIdentity, Partition};

pub use backend::PipelineBackend;
pub use link::{StageServer, StageTimeouts};
pub use model::CpuStage;
pub use stage::{serve_stage, StageServing};

use link::StageHello;

/// Why a pipeline could not be built or a stage could not be served.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The model does not split as asked, or a stage failed to build.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A stage link failed to connect or handshake (a mismatch names the field).
    #[error("pipeline stage {stage} at {addr}: {source}")]
    Link {
        /// Index of the stage.
        stage: usize,
        /// Address the worker dialled.
        addr: String,
        /// The link's error.
        #[source]
        source: KvError,
    },
    /// The settings do not describe a pipeline.
    #[error("pipeline configuration: {0}")]
    Config(String),
    /// The first stage's model failed to size its KV pool.
    #[error("pipeline stage 0: {0}")]
    Stage(#[from] StageError),
}

/// Default of [`PipelineConfig::min_micro_batch_tokens`]: on the 2-core dev machine splitting 8 decode
/// tokens into 2 micro-batches lost 5% of decode speed while splitting 512 prefill tokens into 4 gained 75%
/// (`examples/pp_decode.rs`).
pub const DEFAULT_MIN_MICRO_BATCH_TOKENS: usize = 32;

/// How the first stage builds its pipeline.
#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// Micro-batches per step; 0 means one per stage.
    pub micro_batches: usize,
    /// Fewest tokens worth a micro-batch of their own: a step of fewer than `2 ×` this many is not split.
    /// On CPU a small step (decode) costs about one read of the weights whatever its row count, so cutting
    /// it only multiplies the weight reads; a prefill chunk is compute-bound and gains from the overlap.
    pub min_micro_batch_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV budget of the whole model, across all stages.
    pub kv_cache_memory: usize,
    /// Deadlines of every stage link.
    pub timeouts: StageTimeouts,
    /// The cluster secret to prove to every stage server (which must then ask for it).
    pub cluster_key: Option<tandem_kv::ClusterKey>,
    /// Mutual TLS on every stage link (`deployment.cluster_tls`); `None` speaks plain TCP.
    pub tls: Option<std::sync::Arc<tandem_kv::ClusterTls>>,
    /// Least time between two fetches of the later stages' mixture-of-experts counts while steps run
    /// (the engine asks after every step; each fetch is a round trip per stage on the engine thread).
    pub expert_counts_every: std::time::Duration,
}

/// Default of [`PipelineConfig::expert_counts_every`]: finer than any metrics scrape, rare enough that
/// its round trip is no part of the step time.
pub const DEFAULT_EXPERT_COUNTS_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The handshake both ends of the link to `stage` of `stages` agree on: `model` gives the model and
/// the activations, `part` the stage's layers, `pool` its (block size, block count).
pub(crate) fn hello(
    model: &dyn StageModel,
    identity: &ModelIdentity,
    part: &Partition,
    (stage, stages): (usize, usize),
    (block_size, num_blocks): (usize, usize),
) -> StageHello {
    StageHello {
        model_id: identity.0.clone(),
        stage,
        stages,
        layer_start: part.layers.start,
        layer_end: part.layers.end,
        hidden_size: model.config().hidden_size,
        vocab_size: model.config().vocab_size,
        activations: model.activations(),
        block_size,
        num_blocks,
        samples: false,
        version: link::STAGE_LINK_VERSION,
    }
}

#[cfg(test)]
mod tests;
