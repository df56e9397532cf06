//! The seam between the pipeline and the device computing a stage: [`StageModel`] is one stage's layers
//! and its share of the KV pool, on whichever device holds them. The pipeline backend runs its first
//! stage through it and the stage server its later ones, so neither knows the device; [`CpuStage`] is
//! the CPU model behind it, and the CUDA model implements it in `tandem-cuda`.

use tandem_engine::DeviceSampling;
use tandem_model::{
    CpuLlama, ForwardBatch, KvCache, KvDtype, KvLayout, LlamaWeights, ModelConfig, ModelError,
    Partition,
};

use crate::link::Activations;
use crate::StageError;

/// Appends little-endian f32 `bytes` to `out` (a payload's bytes need not be 4-aligned).
pub(crate) fn extend_f32(out: &mut Vec<f32>, bytes: &[u8]) {
    out.extend(
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    );
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
    /// Allocates the KV pool: `num_blocks` blocks of `block_size` tokens for the stage's layers.
    fn size_pool(&mut self, block_size: usize, num_blocks: usize) -> Result<(), StageError>;
    /// Runs the stage's layers on one batch: from the tokens on the first stage (`hidden_in` None),
    /// else from the previous stage's hidden states (little-endian [`StageModel::activations`]); `out`
    /// gets the next stage's hidden states, or the batch's logits rows (little-endian f32) on the last
    /// stage.
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        hidden_in: Option<&[u8]>,
        out: &mut Vec<u8>,
    ) -> Result<(), StageError>;
    /// Whether [`StageModel::forward_sampled`] works: a last stage that draws tokens where its logits
    /// are (a GPU), so only token ids cross the links.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// [`StageModel::forward`] on the last stage, then one token per logits row drawn under `rows`.
    fn forward_sampled(
        &mut self,
        batch: &ForwardBatch,
        hidden_in: Option<&[u8]>,
        rows: &[DeviceSampling],
        out: &mut Vec<u32>,
    ) -> Result<(), StageError> {
        let _ = (batch, hidden_in, rows, out);
        Err(StageError::NoDeviceSampling)
    }
    /// Copies `blocks` of one stage-local layer of KV out (`out`: their bytes back to back).
    fn export_blocks(&self, layer: usize, blocks: &[u32], out: &mut [u8])
        -> Result<(), StageError>;
    /// Overwrites `blocks` of one stage-local layer of KV from `data` (their bytes back to back).
    fn import_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        data: &[u8],
    ) -> Result<(), StageError>;
    /// Copies block `src` to `dst` in every layer of the stage.
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), StageError>;
}

/// A stage on the CPU: a partitioned [`CpuLlama`] and its f32 KV cache.
pub struct CpuStage {
    model: CpuLlama,
    kv: Option<KvCache>,
    /// The step's hidden states in and out as f32 (reused).
    input: Vec<f32>,
    output: Vec<f32>,
}

impl CpuStage {
    /// Builds the layers of `part` with `threads` kernel threads (0 = all cores); the pool is sized later.
    pub fn new(
        config: &ModelConfig,
        weights: &LlamaWeights,
        threads: usize,
        part: Partition,
    ) -> Result<CpuStage, ModelError> {
        Ok(CpuStage {
            model: CpuLlama::partitioned(config.clone(), weights, threads, part, None)?,
            kv: None,
            input: Vec::new(),
            output: Vec::new(),
        })
    }

    fn kv(&self) -> Result<&KvCache, StageError> {
        self.kv.as_ref().ok_or(StageError::Unsized)
    }

    fn kv_mut(&mut self) -> Result<&mut KvCache, StageError> {
        self.kv.as_mut().ok_or(StageError::Unsized)
    }
}

impl StageModel for CpuStage {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn partition(&self) -> &Partition {
        self.model.partition()
    }

    fn kv_dtype(&self) -> KvDtype {
        KvDtype::F32
    }

    fn activations(&self) -> Activations {
        Activations::F32
    }

    fn pool(&self) -> Option<KvLayout> {
        self.kv.as_ref().map(|kv| *kv.layout())
    }

    fn size_pool(&mut self, block_size: usize, num_blocks: usize) -> Result<(), StageError> {
        self.kv = Some(KvCache::new(self.model.kv_layout(block_size, num_blocks)));
        Ok(())
    }

    fn forward(
        &mut self,
        batch: &ForwardBatch,
        hidden_in: Option<&[u8]>,
        out: &mut Vec<u8>,
    ) -> Result<(), StageError> {
        let kv = self.kv.as_mut().ok_or(StageError::Unsized)?;
        let input = hidden_in.map(|b| {
            self.input.clear();
            extend_f32(&mut self.input, b);
            &self.input[..]
        });
        self.model
            .forward_stage(batch, kv, input, &mut self.output)?;
        out.clear();
        out.extend_from_slice(bytemuck::cast_slice(&self.output));
        Ok(())
    }

    fn export_blocks(
        &self,
        layer: usize,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<(), StageError> {
        let kv = self.kv()?;
        let n = kv.layout().block_bytes();
        for (&b, o) in blocks.iter().zip(out.chunks_exact_mut(n)) {
            kv.export_block(layer, b, o);
        }
        Ok(())
    }

    fn import_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        data: &[u8],
    ) -> Result<(), StageError> {
        let kv = self.kv_mut()?;
        let n = kv.layout().block_bytes();
        for (&b, d) in blocks.iter().zip(data.chunks_exact(n)) {
            kv.import_block(layer, b, d);
        }
        Ok(())
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), StageError> {
        self.kv_mut()?.copy_block(src, dst);
        Ok(())
    }
}
