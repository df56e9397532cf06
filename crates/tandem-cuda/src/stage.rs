//! [`CudaStage`]: a pipeline stage's layers on one GPU behind the engine's [`StageModel`] seam, so the
//! pipeline backend and the stage server run it as they run the CPU model.

use tandem_engine::{
    Activations, LayerBlocks, SizedPool, StageError, StageInput, StageModel, StageOutput,
};
use tandem_model::{KvDtype, KvLayout, LlamaWeights, ModelConfig, Partition};

use crate::error::CudaError;
use crate::model::{CudaLlama, SampleRow, WeightSource};
use crate::options::CudaOptions;

/// One pipeline stage on GPU `opts.device`: its layers' weights and KV pool (bf16 or FP8). The weights go to the
/// GPU when the pool is sized (the worker's handshake gives the block count every stage shares).
pub struct CudaStage {
    config: ModelConfig,
    part: Partition,
    /// Host weights until the model is on the GPU.
    weights: Option<LlamaWeights>,
    opts: CudaOptions,
    model: SizedPool<CudaLlama>,
    rows: Vec<SampleRow>,
}

impl std::fmt::Debug for CudaStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStage")
            .field("layers", &self.part.layers)
            .field("device", &self.opts.device)
            .field("model", &self.model)
            .finish()
    }
}

/// A CUDA failure as the stage's error, boxed as the engine's classified error (the CUDA error its
/// source) so that the pipeline's backend reacts to its kind.
fn device(e: CudaError) -> StageError {
    StageError::Device(Box::new(tandem_engine::BackendError::from(e)))
}

impl CudaStage {
    /// The stage holding `part`'s layers of `weights`, to run on the GPU `opts` names (`opts.layers`
    /// and `opts.num_blocks` are set from `part` and the pool).
    pub fn new(
        config: ModelConfig,
        weights: LlamaWeights,
        part: Partition,
        opts: CudaOptions,
    ) -> Result<CudaStage, CudaError> {
        if part.tp_size != 1 {
            return Err(CudaError::Unsupported(
                "tensor-parallel ranks of a CUDA pipeline stage".into(),
            ));
        }
        Ok(CudaStage {
            config,
            part,
            weights: Some(weights),
            opts,
            model: SizedPool::empty(),
            rows: Vec::new(),
        })
    }
}

impl StageModel for CudaStage {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn partition(&self) -> &Partition {
        &self.part
    }

    fn kv_dtype(&self) -> KvDtype {
        self.opts.kv_dtype
    }

    fn activations(&self) -> Activations {
        Activations::Bf16
    }

    fn pool(&self) -> Option<KvLayout> {
        self.model.as_ref().map(|m| m.kv_layout())
    }

    fn max_len(&self) -> usize {
        self.model
            .as_ref()
            .map_or(self.config.max_position_embeddings, |m| m.max_model_len())
    }

    fn size_pool(&mut self, block_size: usize, num_blocks: usize) -> Result<(), StageError> {
        let weights = self.weights.as_ref().ok_or(StageError::Device(
            "the stage's weights are already on the GPU".into(),
        ))?;
        let opts = CudaOptions {
            block_size,
            num_blocks: Some(num_blocks),
            layers: Some(self.part.layers.clone()),
            ..self.opts.clone()
        };
        let model = CudaLlama::new(self.config.clone(), WeightSource::Host(weights), opts)
            .map_err(device)?;
        self.model.set(model);
        self.weights = None;
        Ok(())
    }

    fn forward(&mut self, input: StageInput, output: StageOutput) -> Result<(), StageError> {
        let model = self.model.get_mut()?;
        let (batch, hidden) = (input.batch, input.hidden);
        match output {
            StageOutput::Hidden(out) => model.forward_stage(batch, hidden, out),
            StageOutput::Tokens { rows, out } => {
                self.rows.clear();
                self.rows.extend(rows.iter().map(SampleRow::from));
                model.forward_stage_sampled(batch, hidden, &self.rows, out)
            }
        }
        .map_err(device)
    }

    fn samples_on_device(&self) -> bool {
        self.part.is_last(&self.config)
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), StageError> {
        self.model
            .get()?
            .export_block(layer, block, out)
            .map_err(device)
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), StageError> {
        self.model
            .get_mut()?
            .import_block(layer, block, data)
            .map_err(device)
    }

    /// One bulk scatter through a page-locked buffer (the P/D import path), ordered before the next
    /// step, rather than a synchronous copy per block.
    fn import_blocks(&mut self, at: LayerBlocks, data: &[u8]) -> Result<(), StageError> {
        let m = self.model.get_mut()?;
        let mut buf = m
            .host_pool()
            .take(data.len())
            .map_err(|e| StageError::Device(Box::new(e)))?;
        buf.as_mut_slice().copy_from_slice(data);
        m.import_kv(at.layer, at.blocks, buf).map_err(device)?;
        m.import_fence().map_err(device)
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), StageError> {
        self.model.get_mut()?.copy_block(src, dst).map_err(device)
    }
}
