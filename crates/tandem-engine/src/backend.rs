//! The seam between scheduling and model math: the engine drives any [`Backend`] (CPU, CUDA, CPU pipeline).

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

/// One logits row's draw for a backend that samples where the logits are (a GPU): the host
/// sampler's filters without penalties or logprobs, which need the whole row on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSampling {
    /// 0: greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0: off.
    pub top_k: u32,
    /// Keep the smallest set reaching this mass; 1.0: off.
    pub top_p: f32,
    /// Drop tokens below min_p times the top token's probability; 0: off.
    pub min_p: f32,
    /// Seed of this one draw (the request's generator at this output index, so a seeded request
    /// repeats on the same backend).
    pub seed: u64,
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
    /// Runs one step like `forward` and draws each logits row's token where the logits are, under
    /// `rows` (one per logits row): `Ok(true)` with the tokens in `out`. A backend without its own
    /// sampler returns `Ok(false)` before doing anything, and the engine calls `forward` instead.
    fn forward_sampled(
        &mut self,
        batch: &ForwardBatch,
        rows: &[DeviceSampling],
        out: &mut Vec<u32>,
    ) -> Result<bool, BackendError> {
        let _ = (batch, rows, out);
        Ok(false)
    }
}
