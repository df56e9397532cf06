//! CUDA graphs of decode-only steps: planning pads a step to a captured size, and the captured graph
//! replays the body and head.

use std::collections::HashMap;

use cudarc::driver::sys as drv;
use cudarc::driver::CudaGraph;
use tandem_model::ForwardBatch;

use super::CudaLlama;
use crate::error::CudaError;
use crate::options::AttnMode;

/// Captured decode graphs by padded batch size.
#[derive(Default)]
pub(super) struct Graphs(pub(super) HashMap<usize, CudaGraph>);

// SAFETY: a graph exec handle is plain driver state usable from any thread with the context bound
// (forward binds it first); the model owns its graphs and is moved to, never shared with, the
// engine thread.
unsafe impl Send for Graphs {}

/// Decode batch sizes graphs are captured for (a step is padded up to the next one).
pub(super) const GRAPH_SIZES: [usize; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

impl CudaLlama {
    /// Plans the batch; pads a decode-only step to a graph size when graphs apply. Returns the graph
    /// size (0 = run eagerly).
    pub(super) fn prepare(&mut self, batch: &ForwardBatch) -> Result<usize, CudaError> {
        let lim = self.limits();
        self.plan.build(batch, &lim)?;
        let p = &self.plan;
        let n = p.num_tokens();
        let decode_only = n > 0
            && p.tile_seq.is_empty()
            && p.dec_row.len() == n
            && p.logit_rows.len() == n
            && p.logit_rows
                .iter()
                .enumerate()
                .all(|(i, &r)| r as usize == i);
        let mut graph_size = 0;
        if self.opts.graphs && self.opts.attn == AttnMode::Fast && decode_only {
            if let Some(&g) = GRAPH_SIZES.iter().find(|&&g| {
                g >= n
                    && g <= self.opts.max_seqs
                    && g <= self.opts.max_tokens
                    && g <= self.opts.logits_chunk_rows
            }) {
                graph_size = g;
                // Padding rows: token 0 at position 0 writing to the scratch block past the pool.
                let scratch = self.layout.num_blocks as i32;
                let p = &mut self.plan;
                let bt = p.block_tables.len() as i32;
                p.block_tables.push(scratch);
                for i in n..g {
                    p.tokens.push(0);
                    p.positions.push(0);
                    p.slots.push(scratch * self.layout.block_size as i32);
                    p.dec_row.push(i as i32);
                    p.dec_ctx.push(1);
                    p.dec_bt.push(bt);
                    p.logit_rows.push(i as i32);
                }
            }
        }
        self.meta_layout.check(&self.plan)?;
        self.upload_plan()?;
        Ok(graph_size)
    }

    /// Queues the body and head of a decode step of `g` (padded) rows, through a graph captured on
    /// first use.
    pub(super) fn run_graph(&mut self, g: usize) -> Result<(), CudaError> {
        if !self.graphs.0.contains_key(&g) {
            // Run once eagerly (cuBLAS picks and loads its kernels outside capture), then capture.
            self.enqueue_body(g, true)?;
            self.enqueue_graph_head(g)?;
            self.stream.synchronize()?;
            self.stream
                .begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
            let body = self
                .enqueue_body(g, true)
                .and_then(|_| self.enqueue_graph_head(g));
            let graph = self.stream.end_capture(drv::CUgraphInstantiate_flags(0))?;
            body?;
            let graph = graph
                .ok_or_else(|| CudaError::Unsupported("stream capture produced no graph".into()))?;
            tracing::debug!(batch = g, "captured decode graph");
            self.graphs.0.insert(g, graph);
            return Ok(());
        }
        self.graphs.0[&g].launch()?;
        Ok(())
    }

    /// The output head of a graph's `g` rows: only on the stage holding the last layer (an earlier
    /// stage's graph ends with the residual stream, which goes to the next stage).
    fn enqueue_graph_head(&self, g: usize) -> Result<(), CudaError> {
        if self.is_last() {
            self.enqueue_head(0, g)
        } else {
            Ok(())
        }
    }
}
