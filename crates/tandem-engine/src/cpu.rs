//! The CPU backend: `crate::kvtypes::CpuLlama` plus the paged `KvCache` it reads and writes.

use crate::backend::{Backend, BackendError};
use crate::kvtypes::{CpuLlama, ForwardBatch, KvCache, KvDtype, KvLayout};

/// The Llama-family model on CPU with a KV cache sized from a byte budget.
pub struct CpuBackend {
    model: CpuLlama,
    kv: KvCache,
    eos: Vec<u32>,
}

impl CpuBackend {
    /// Sizes the KV cache to as many `block_size`-token blocks as `kv_cache_bytes` holds across all layers.
    pub fn new(model: CpuLlama, block_size: usize, kv_cache_bytes: usize) -> CpuBackend {
        let c = model.config();
        let num_blocks =
            KvLayout::blocks_for_budget(kv_cache_bytes, c.num_layers, c.num_kv_heads, c.head_dim, block_size, KvDtype::F32);
        let eos = c.eos_token_ids.clone();
        let kv = KvCache::new(model.kv_layout(block_size, num_blocks));
        tracing::info!(num_blocks, block_size, "CPU KV cache allocated");
        CpuBackend { model, kv, eos }
    }
}

impl Backend for CpuBackend {
    fn kv_layout(&self) -> KvLayout {
        *self.kv.layout()
    }

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn max_model_len(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.model.forward(batch, &mut self.kv, logits).map_err(|e| BackendError::new(e.to_string()))
    }

    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) {
        self.kv.export_block(layer, block, out);
    }

    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) {
        self.kv.import_block(layer, block, data);
    }

    fn copy_block(&mut self, src: u32, dst: u32) {
        self.kv.copy_block(src, dst);
    }
}
