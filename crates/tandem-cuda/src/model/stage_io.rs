//! A pipeline stage's step: the previous stage's residual stream in (instead of the embedding), this
//! stage's residual stream out (instead of logits), both through page-locked staging.
//!
//! The residual stream is bf16 on the device and crosses the link as the same bytes, so a pipeline
//! computes what the whole model does, bit for bit: a stage ends with the last layer's delta added
//! into the residual (`add_rmsnorm` rounds the sum to bf16, as the next layer's would), and the next
//! stage's first layer reads it as layer 0 reads the embedding.

use cudarc::driver::result as drv_result;
use tandem_model::ForwardBatch;

use super::CudaLlama;
use crate::error::CudaError;
use crate::memory::BF16;

impl CudaLlama {
    /// Runs this instance's layers on one step: from the tokens when it holds layer 0, else from
    /// `hidden` (the previous stage's residual stream, tokens × hidden bf16, little-endian); `out` gets
    /// f32 logits rows (little-endian) when it holds the last layer, else its residual stream.
    pub fn forward_stage(
        &mut self,
        batch: &ForwardBatch,
        hidden: Option<&[u8]>,
        out: &mut Vec<u8>,
    ) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        out.clear();
        let graph = self.prepare(batch)?;
        self.load_hidden(hidden, batch.tokens.len())?;
        if self.is_last() {
            let mut logits = std::mem::take(&mut self.stage_logits);
            logits.clear();
            let r = self.logits_of(graph, batch, &mut logits);
            out.reserve(logits.len() * 4);
            for v in &logits {
                out.extend_from_slice(&v.to_le_bytes());
            }
            self.stage_logits = logits;
            return r;
        }
        if graph > 0 {
            self.run_graph(graph)?;
        } else if self.plan.num_tokens() > 0 {
            self.enqueue_body(self.plan.num_tokens(), false)?;
        }
        self.copy_hidden(batch.tokens.len(), out)
    }

    /// Queues the copy of a previous stage's residual stream (`n` rows) into x, or checks that none is
    /// due on the stage that embeds tokens.
    pub(super) fn load_hidden(&mut self, hidden: Option<&[u8]>, n: usize) -> Result<(), CudaError> {
        let bytes = n * self.config.hidden_size * BF16;
        match (hidden, self.is_first()) {
            (None, true) => Ok(()),
            (Some(x), false) if x.len() == bytes && n <= self.opts.max_tokens => {
                let pinned = self
                    .hidden_pinned
                    .as_mut()
                    .ok_or_else(|| CudaError::Batch("no staging for hidden states".into()))?;
                pinned.bytes_mut(bytes).copy_from_slice(x);
                // SAFETY: x holds max_tokens rows, the staging as many; every step ends with the
                // stream synchronised, so the staging is not rewritten while this copy reads it.
                unsafe {
                    drv_result::memcpy_htod_async(
                        self.acts.x.ptr,
                        pinned.bytes(bytes),
                        self.stream.cu_stream(),
                    )
                }?;
                Ok(())
            }
            (Some(x), false) => Err(CudaError::Batch(format!(
                "{} bytes of hidden states for {n} tokens of width {} (at most {} tokens)",
                x.len(),
                self.config.hidden_size,
                self.opts.max_tokens
            ))),
            (None, false) => Err(CudaError::Batch(format!(
                "layers {:?} need the previous stage's hidden states",
                self.layers()
            ))),
            (Some(_), true) => Err(CudaError::Batch(
                "the stage holding layer 0 embeds tokens; it takes no hidden states".into(),
            )),
        }
    }

    /// Appends the first `n` rows of the residual stream (bf16 bytes) to `out`.
    fn copy_hidden(&mut self, n: usize, out: &mut Vec<u8>) -> Result<(), CudaError> {
        let bytes = n * self.config.hidden_size * BF16;
        let pinned = self
            .hidden_pinned
            .as_mut()
            .ok_or_else(|| CudaError::Batch("no staging for hidden states".into()))?;
        // SAFETY: x and the staging hold max_tokens rows (load_hidden or prepare checked n); the
        // stream is synchronised before the staging is read.
        unsafe {
            drv_result::memcpy_dtoh_async(
                pinned.bytes_mut(bytes),
                self.acts.x.ptr,
                self.stream.cu_stream(),
            )
        }?;
        self.stream.synchronize()?;
        out.extend_from_slice(pinned.bytes(bytes));
        Ok(())
    }
}
