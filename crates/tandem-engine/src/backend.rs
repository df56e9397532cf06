//! The seam between scheduling and model math: the engine drives any [`Backend`] (CPU now, CUDA later).

use tandem_model::{ForwardBatch, KvLayout};

/// A model step failed; the engine fails the requests of that step and keeps serving.
#[derive(Debug, thiserror::Error)]
#[error("backend error: {message}")]
pub struct BackendError {
    /// What went wrong, for logs and the API's error body.
    pub message: String,
}

impl BackendError {
    /// An error with the given message.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// A model plus the paged KV storage it reads and writes, owned by the engine thread.
pub trait Backend: Send + 'static {
    /// Shape of the KV cache; `num_blocks` sizes the engine's block pool.
    fn kv_layout(&self) -> KvLayout;
    /// Width of one logits row.
    fn vocab_size(&self) -> usize;
    /// The model's context length.
    fn max_model_len(&self) -> usize;
    /// Tokens that end generation unless a request sets `ignore_eos`.
    fn eos_token_ids(&self) -> &[u32];
    /// Runs one step: writes the batch's K/V through its block tables and returns
    /// `batch.logits_rows()` rows of `vocab_size` logits (cleared, then filled).
    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Vec<f32>) -> Result<(), BackendError>;
    /// Copies one (layer, block) of KV out as bytes (`out.len() == kv_layout().block_bytes()`), in the
    /// canonical layout of [`KvLayout`] whatever way the backend splits it internally (tensor-parallel
    /// ranks, pipeline stages). Fails when the storage is unreachable (device lost, stage process gone).
    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), BackendError>;
    /// Overwrites one (layer, block) of KV with bytes produced by `export_block` of an equal layout.
    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), BackendError>;
    /// Copies a block across all layers (copy-on-write of a shared block).
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), BackendError>;
}
