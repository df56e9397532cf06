//! The seam between a pipeline and the device computing one of its stages: [`StageModel`] is one stage's
//! layers and its share of the KV pool, on whichever device holds them. It lives beside [`crate::Backend`]
//! so a device crate (CPU in `tandem-pipeline`, CUDA in `tandem-cuda`) implements it without depending on
//! the pipeline that runs it; [`SizedPool`] and the trait's batched block operations are what every
//! stage implementation would otherwise restate.

use serde::{Deserialize, Serialize};
use tandem_model::{
    ForwardBatch, KvDtype, KvLayout, LayerExpertTokens, ModelConfig, ModelError, Partition,
};

use crate::{DeviceSampling, LayerBlocks};

/// Element type of the hidden states a stage takes and gives: what the stages' models keep their
/// residual stream in, so nothing is converted between stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// 32-bit floats (the CPU model).
    F32,
    /// bfloat16 (the CUDA model).
    Bf16,
}

impl Activations {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            Activations::F32 => 4,
            Activations::Bf16 => 2,
        }
    }
}

impl std::fmt::Display for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Activations::F32 => "f32",
            Activations::Bf16 => "bf16",
        })
    }
}

/// Why a stage's model failed an operation, or a stage server refused one request of its link (its
/// message then reaches the worker in the link's `Error` frame).
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// A block or forward request reached the stage before any worker sized its pool.
    #[error("the stage's KV pool is not sized")]
    Unsized,
    /// The worker asked for a pool with no blocks or blocks of no tokens.
    #[error("a KV pool of {num_blocks} blocks of {block_size} tokens")]
    EmptyPool {
        /// Tokens per block asked for.
        block_size: usize,
        /// Blocks asked for.
        num_blocks: usize,
    },
    /// The worker asked for a bigger pool than the stage's KV budget allows; a client's hello must not
    /// size the stage's memory past what its operator configured.
    #[error(
        "a KV pool of {num_blocks} blocks of {block_size} tokens needs {needs} bytes of the whole model's KV, \
         more than this stage's budget of {budget} (raise `tandem stage --kv-cache-memory` to the worker's \
         engine.kv_cache_memory)"
    )]
    PoolTooLarge {
        /// Tokens per block asked for.
        block_size: usize,
        /// Blocks asked for.
        num_blocks: usize,
        /// Bytes such a pool takes across all layers (what the worker's budget must have held; u128::MAX
        /// when even that overflows).
        needs: u128,
        /// The stage's budget of the whole model's KV, in bytes.
        budget: usize,
    },
    /// The layer belongs to another stage.
    #[error("layer {layer} is not on stage {stage} (layers {layers:?})")]
    ForeignLayer {
        /// The global layer asked for.
        layer: usize,
        /// This stage's index.
        stage: usize,
        /// This stage's global layers.
        layers: std::ops::Range<usize>,
    },
    /// The block id is beyond the pool.
    #[error("block {block} beyond the pool of {num_blocks}")]
    BlockOutOfRange {
        /// The block asked for.
        block: u32,
        /// Blocks in the pool.
        num_blocks: usize,
    },
    /// The stage's layers failed on the batch.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The stage's device failed (a GPU's driver, kernels or memory).
    #[error("stage device: {0}")]
    Device(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Token draws were asked of a stage that returns logits (not the last, or not on a GPU).
    #[error("this stage does not draw tokens on its device")]
    NoDeviceSampling,
}

/// What a stage holds once its KV pool is sized (its KV cache, or its model on the GPU): empty until
/// [`StageModel::size_pool`], so every block or forward operation before it fails with
/// [`StageError::Unsized`].
pub struct SizedPool<T>(Option<T>);

impl<T> SizedPool<T> {
    /// Nothing yet: the pool is sized later.
    pub fn empty() -> Self {
        SizedPool(None)
    }

    /// Keeps what sizing the pool built.
    pub fn set(&mut self, value: T) {
        self.0 = Some(value);
    }

    /// What the sized pool holds, if it is sized.
    pub fn as_ref(&self) -> Option<&T> {
        self.0.as_ref()
    }

    /// What the sized pool holds, or [`StageError::Unsized`].
    pub fn get(&self) -> Result<&T, StageError> {
        self.0.as_ref().ok_or(StageError::Unsized)
    }

    /// What the sized pool holds, mutably, or [`StageError::Unsized`].
    pub fn get_mut(&mut self) -> Result<&mut T, StageError> {
        self.0.as_mut().ok_or(StageError::Unsized)
    }
}

impl<T> Default for SizedPool<T> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for SizedPool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// One batch as a stage takes it.
#[derive(Clone, Copy)]
pub struct StageInput<'a> {
    /// The batch's sequences.
    pub batch: &'a ForwardBatch,
    /// The previous stage's hidden states (little-endian [`StageModel::activations`]); `None` on the
    /// first stage, which starts from the tokens.
    pub hidden: Option<&'a [u8]>,
}

/// What a stage gives for one batch.
pub enum StageOutput<'a> {
    /// The next stage's hidden states, or on the last stage the batch's logits rows (little-endian
    /// f32).
    Hidden(&'a mut Vec<u8>),
    /// On a last stage that samples on its device: one token per logits row, drawn under `rows`.
    Tokens {
        /// One draw per logits row.
        rows: &'a [DeviceSampling],
        /// The drawn tokens.
        out: &'a mut Vec<u32>,
    },
}

/// One pipeline stage's layers and KV pool on one device. Layers passed to the block operations are
/// stage-local (0 = the stage's first layer); callers check them and the block ids first.
pub trait StageModel: Send + 'static {
    /// The whole model's hyper-parameters.
    fn config(&self) -> &ModelConfig;
    /// The layers this stage computes.
    fn partition(&self) -> &Partition;
    /// Element type of this device's KV cache (it sets how many blocks a byte budget holds).
    fn kv_dtype(&self) -> KvDtype;
    /// Element type of the hidden states this stage takes and gives (its residual stream's).
    fn activations(&self) -> Activations;
    /// The stage's KV layout (its layers only), once the pool is sized.
    fn pool(&self) -> Option<KvLayout>;
    /// The longest context the stage serves (a GPU's buffers may cap it below the model's).
    fn max_len(&self) -> usize {
        self.config().max_position_embeddings
    }
    /// Copies into `out` the token rows routed to each expert of this stage's mixture-of-experts layers
    /// since load (left empty for dense layers or a device that does not count them).
    fn moe_expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) {
        out.clear();
    }
    /// Allocates the KV pool: `num_blocks` blocks of `block_size` tokens for the stage's layers.
    fn size_pool(&mut self, block_size: usize, num_blocks: usize) -> Result<(), StageError>;
    /// Runs the stage's layers on one batch into `output`: the next stage's hidden states (or on the
    /// last stage the batch's logits rows), or on a last stage that samples on its device the drawn
    /// tokens; a stage that cannot draw tokens answers [`StageOutput::Tokens`] with
    /// [`StageError::NoDeviceSampling`].
    fn forward(&mut self, input: StageInput, output: StageOutput) -> Result<(), StageError>;
    /// Whether [`StageModel::forward`] takes [`StageOutput::Tokens`]: a last stage that draws tokens
    /// where its logits are (a GPU), so only token ids cross the links.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Copies one block of one stage-local layer of KV into `out` (exactly one block's bytes).
    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), StageError>;
    /// Overwrites one block of one stage-local layer of KV from `data` (exactly one block's bytes).
    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), StageError>;
    /// Copies the blocks of one stage-local layer of KV out (`out`: their bytes back to back), one
    /// block at a time.
    fn export_blocks(&self, at: LayerBlocks, out: &mut [u8]) -> Result<(), StageError> {
        let n = self.pool().ok_or(StageError::Unsized)?.block_bytes();
        for (b, o) in at.zip_mut(out, n) {
            self.export_block(at.layer, b, o)?;
        }
        Ok(())
    }
    /// Overwrites the blocks of one stage-local layer of KV from `data` (their bytes back to back),
    /// one block at a time unless the device has a bulk path.
    fn import_blocks(&mut self, at: LayerBlocks, data: &[u8]) -> Result<(), StageError> {
        let n = self.pool().ok_or(StageError::Unsized)?.block_bytes();
        for (b, d) in at.zip(data, n) {
            self.import_block(at.layer, b, d)?;
        }
        Ok(())
    }
    /// Copies block `src` to `dst` in every layer of the stage.
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), StageError>;
}
