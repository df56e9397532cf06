//! [`CudaBackend`]: the engine's [`Backend`] over [`CudaLlama`].

use std::sync::Arc;

use tandem_engine::{
    Backend, BackendError, BackendInfo, HostBuf, HostPool, KvExport, KvStaging, LayerBlocks,
    SampledStep, StagedLayer, StagingSlice,
};
use tandem_model::ForwardBatch;

use crate::model::{CudaLlama, SampleRow};

/// The engine's view of the GPU model: steps, KV layout, and KV block export/import for P/D.
pub struct CudaBackend {
    model: CudaLlama,
    info: BackendInfo,
    rows: Vec<SampleRow>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("model", &self.model)
            .finish()
    }
}

impl CudaBackend {
    /// Wraps a loaded GPU model.
    pub fn new(model: CudaLlama) -> CudaBackend {
        let mut info = BackendInfo::new(model.config(), model.kv_layout());
        info.max_len = model.max_model_len();
        CudaBackend {
            model,
            info,
            rows: Vec::new(),
        }
    }

    /// The model, for callers that also want GPU-side greedy steps.
    pub fn model_mut(&mut self) -> &mut CudaLlama {
        &mut self.model
    }
}

impl Backend for CudaBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn moe_expert_tokens(&self, out: &mut Vec<tandem_model::LayerExpertTokens>) {
        if let Err(e) = self.model.moe_expert_tokens(out) {
            // A metric, not a result: a failed read leaves the series where they were.
            tracing::warn!(error = %e, "could not read the expert token counts");
            out.clear();
        }
    }

    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.model
            .forward(batch, logits)
            .map_err(BackendError::from)
    }

    fn forward_sampled(&mut self, step: SampledStep) -> Result<bool, BackendError> {
        self.rows.clear();
        self.rows.extend(step.rows.iter().map(SampleRow::from));
        self.model
            .forward_sampled(step.batch, &self.rows, step.masks, step.out)
            .map_err(BackendError::from)?;
        Ok(true)
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), BackendError> {
        self.model.export_block(layer, block, out).map_err(|e| {
            e.into_transfer(format_args!(
                "CUDA KV export of layer {layer} block {block}"
            ))
        })
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), BackendError> {
        self.model.import_block(layer, block, data).map_err(|e| {
            e.into_transfer(format_args!(
                "CUDA KV import of layer {layer} block {block}"
            ))
        })
    }

    fn host_pool(&self) -> Arc<dyn HostPool> {
        self.model.host_pool()
    }

    fn export_kv(&mut self, blocks: &[u32]) -> Result<Box<dyn KvExport>, BackendError> {
        self.model
            .export_kv(blocks)
            .map_err(|e| e.into_transfer(format_args!("CUDA KV export of {} blocks", blocks.len())))
    }

    fn import_kv(&mut self, at: LayerBlocks, data: HostBuf) -> Result<(), BackendError> {
        let (layer, blocks) = (at.layer, at.blocks);
        self.model.import_kv(layer, blocks, data).map_err(|e| {
            e.into_transfer(format_args!(
                "CUDA KV import of layer {layer} ({} blocks)",
                blocks.len()
            ))
        })
    }

    fn kv_staging(&mut self, bytes: usize) -> Result<Arc<KvStaging>, BackendError> {
        self.model
            .kv_staging(bytes)
            .map_err(|e| e.into_backend(format_args!("CUDA KV staging of {bytes} bytes")))
    }

    fn export_kv_staged(
        &mut self,
        blocks: &[u32],
        dest: StagingSlice,
    ) -> Result<Box<dyn KvExport>, BackendError> {
        self.model.export_kv_staged(blocks, dest).map_err(|e| {
            e.into_transfer(format_args!(
                "CUDA staged KV export of {} blocks",
                blocks.len()
            ))
        })
    }

    fn import_kv_staged(&mut self, at: LayerBlocks, src: StagedLayer) -> Result<(), BackendError> {
        let (layer, blocks) = (at.layer, at.blocks);
        self.model
            .import_kv_staged(layer, blocks, src)
            .map_err(|e| {
                e.into_transfer(format_args!(
                    "CUDA staged KV import of layer {layer} ({} blocks)",
                    blocks.len()
                ))
            })
    }

    fn import_fence(&mut self) -> Result<(), BackendError> {
        self.model
            .import_fence()
            .map_err(|e| e.into_transfer("CUDA KV import"))
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), BackendError> {
        self.model
            .copy_block(src, dst)
            .map_err(|e| e.into_backend(format_args!("CUDA KV copy of block {src} to {dst}")))
    }
}
