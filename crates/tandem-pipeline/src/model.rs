//! [`CpuStage`]: the CPU model behind the engine's [`StageModel`] seam (`tandem_engine::stage`), which
//! the pipeline backend runs its first stage through and the stage server its later ones, so neither
//! knows the device; the CUDA model implements the same trait in `tandem-cuda`.

use tandem_engine::{Activations, SizedPool, StageError, StageInput, StageModel, StageOutput};
use tandem_model::{
    CpuLlama, KvCache, KvDtype, KvLayout, LayerExpertTokens, LlamaWeights, ModelConfig, ModelError,
    Partition,
};

/// Appends little-endian f32 `bytes` to `out` (a payload's bytes need not be 4-aligned).
pub(crate) fn extend_f32(out: &mut Vec<f32>, bytes: &[u8]) {
    out.extend(
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    );
}

/// A stage on the CPU: a partitioned [`CpuLlama`] and its f32 KV cache.
pub struct CpuStage {
    model: CpuLlama,
    kv: SizedPool<KvCache>,
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
            kv: SizedPool::empty(),
            input: Vec::new(),
            output: Vec::new(),
        })
    }
}

impl StageModel for CpuStage {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn partition(&self) -> &Partition {
        self.model.partition()
    }

    fn moe_expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) {
        out.clear();
        out.extend(self.model.expert_tokens().cloned());
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
        self.kv
            .set(KvCache::new(self.model.kv_layout(block_size, num_blocks)));
        Ok(())
    }

    /// Hidden states or logits rows only: the CPU stage draws no tokens.
    fn forward(&mut self, input: StageInput, output: StageOutput) -> Result<(), StageError> {
        let StageOutput::Hidden(out) = output else {
            return Err(StageError::NoDeviceSampling);
        };
        let kv = self.kv.get_mut()?;
        let hidden = input.hidden.map(|b| {
            self.input.clear();
            extend_f32(&mut self.input, b);
            &self.input[..]
        });
        self.model
            .forward_stage(input.batch, kv, hidden, &mut self.output)?;
        out.clear();
        out.extend_from_slice(bytemuck::cast_slice(&self.output));
        Ok(())
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), StageError> {
        self.kv.get()?.export_block(layer, block, out);
        Ok(())
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), StageError> {
        self.kv.get_mut()?.import_block(layer, block, data);
        Ok(())
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), StageError> {
        self.kv.get_mut()?.copy_block(src, dst);
        Ok(())
    }
}
