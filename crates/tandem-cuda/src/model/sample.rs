//! Token choice on the device: argmax or seeded draws of each logits row, so that the logits never
//! leave the GPU.

use cudarc::driver::{result as drv_result, LaunchConfig, PushKernelArg};
use tandem_engine::{DeviceMasks, MaskSource};
use tandem_model::ForwardBatch;

use super::launch::KernelArg;
use super::CudaLlama;
use crate::error::CudaError;

/// One logits row's draw on the device (the `SampleParams` of `sample_rows` in llama.cu): the
/// host sampler's temperature, top-k, top-p and min-p, and the seed of this one draw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRow {
    /// 0 (or below 1e-5): greedy.
    pub temperature: f32,
    /// 1.0: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// 0: off.
    pub top_k: u32,
    /// The draw's random seed (the request's generator at this output index).
    pub seed: u64,
}

impl From<&tandem_engine::DeviceSampling> for SampleRow {
    fn from(r: &tandem_engine::DeviceSampling) -> SampleRow {
        SampleRow {
            temperature: r.temperature,
            top_p: r.top_p,
            min_p: r.min_p,
            top_k: r.top_k,
            seed: r.seed,
        }
    }
}

/// 32-bit words of one `SampleRow` on the device (24 bytes, the C struct's layout).
pub(super) const SAMPLE_ROW_WORDS: usize = 6;

impl SampleRow {
    /// The C struct's words: three floats, an int, a little-endian u64.
    pub(super) fn words(&self) -> [u32; SAMPLE_ROW_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.top_k.min(i32::MAX as u32),
            self.seed as u32,
            (self.seed >> 32) as u32,
        ]
    }
}

/// The masks of a guided step, once the engine has them (None for an unguided step).
fn wait_masks(masks: Option<&mut dyn MaskSource>) -> Result<Option<&DeviceMasks>, CudaError> {
    match masks {
        Some(m) => m
            .wait()
            .map(Some)
            .map_err(|e| CudaError::Batch(format!("token masks: {e}"))),
        None => Ok(None),
    }
}

impl CudaLlama {
    /// Queues the choice of the tokens of logits rows `start..start + n` (in `acts.logits` from
    /// row 0) into `acts.argmax`: argmax, or the draws of `sample[start..start + n]` among the
    /// tokens `masks` allows.
    pub(super) fn enqueue_pick(
        &mut self,
        start: usize,
        n: usize,
        sample: Option<&[SampleRow]>,
        masks: Option<&DeviceMasks>,
    ) -> Result<(), CudaError> {
        if let Some(masks) = masks {
            self.enqueue_mask(start, n, masks)?;
        }
        let Some(sample) = sample else {
            return self.enqueue_argmax(n);
        };
        let mut words = std::mem::take(&mut self.pick_words);
        words.clear();
        words.extend(sample[start..start + n].iter().flat_map(SampleRow::words));
        // SAFETY: sample_params holds logits_chunk_rows rows (n <= that); the pageable host slice
        // is staged before the call returns.
        let copied = unsafe {
            drv_result::memcpy_htod_async(
                self.acts.sample_params.ptr,
                &words[..],
                self.stream.cu_stream(),
            )
        };
        self.pick_words = words;
        copied?;
        let a = &self.acts;
        launch!(
            &self.stream,
            self.funcs.sample_rows,
            (n as u32, 1, 1),
            (1024, 1, 1),
            a.logits.ptr,
            self.config.vocab_size as i32,
            a.sample_params.ptr,
            a.argmax.ptr
        );
        Ok(())
    }

    /// Queues `mask_rows` over logits rows `start..start + n`: the guided rows' masks (contiguous
    /// in `masks.bits`, rows being in order) and the rows' indices into them go up first.
    fn enqueue_mask(
        &mut self,
        start: usize,
        n: usize,
        masks: &DeviceMasks,
    ) -> Result<(), CudaError> {
        let rows = masks.row_mask.get(start..start + n).ok_or_else(|| {
            CudaError::Batch(format!(
                "token masks for {} rows, the step has {}",
                masks.row_mask.len(),
                start + n
            ))
        })?;
        let mut guided = rows.iter().copied().filter(|&m| m >= 0);
        let Some(first) = guided.next() else {
            return Ok(());
        };
        let last = guided.max().unwrap_or(first);
        let words = masks.words;
        let v = self.config.vocab_size;
        let bits = masks
            .bits
            .get(first as usize * words..(last as usize + 1) * words);
        let Some(bits) = bits.filter(|_| words == v.div_ceil(32)) else {
            return Err(CudaError::Batch(format!(
                "token masks of {words} words per row for a vocabulary of {v}"
            )));
        };
        let mut idx = std::mem::take(&mut self.pick_mask_rows);
        idx.clear();
        idx.extend(rows.iter().map(|&m| if m < 0 { -1 } else { m - first }));
        // SAFETY: mask_rows holds a chunk's rows and mask_bits a chunk's masks (n rows at most,
        // hence at most n masks); the pageable host slices are staged before the calls return.
        let copied = unsafe {
            drv_result::memcpy_htod_async(
                self.acts.mask_rows.ptr,
                &idx[..],
                self.stream.cu_stream(),
            )
            .and_then(|()| {
                drv_result::memcpy_htod_async(
                    self.acts.mask_bits.ptr,
                    bits,
                    self.stream.cu_stream(),
                )
            })
        };
        self.pick_mask_rows = idx;
        copied?;
        let a = &self.acts;
        launch!(
            &self.stream,
            self.funcs.mask_rows,
            (n as u32, 1, 1),
            (256, 1, 1),
            a.logits.ptr,
            v as i32,
            a.mask_bits.ptr,
            words as i32,
            a.mask_rows.ptr
        );
        Ok(())
    }

    pub(super) fn enqueue_argmax(&self, n: usize) -> Result<(), CudaError> {
        let a = &self.acts;
        launch_pdl!(
            self,
            self.funcs.argmax_rows,
            (n as u32, 1, 1),
            (1024, 1, 1),
            0,
            a.logits.ptr,
            self.config.vocab_size as i32,
            a.argmax.ptr
        );
        Ok(())
    }

    /// Runs one step and returns the greedy (argmax) token of each logits row, sampled on the GPU.
    pub fn forward_greedy(
        &mut self,
        batch: &ForwardBatch,
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        self.forward_pick(batch, None, None, None, out)
    }

    /// Runs one step and draws each logits row's token on the GPU under `rows` (one per logits
    /// row, in order): the logits never leave the device. With `masks` (a step with guided rows),
    /// once the step's work is queued it hands over the allowed tokens of each guided row (computed
    /// on the host meanwhile), and each is drawn among them.
    pub fn forward_sampled(
        &mut self,
        batch: &ForwardBatch,
        rows: &[SampleRow],
        masks: Option<&mut dyn MaskSource>,
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        if rows.len() != batch.logits_rows() {
            return Err(CudaError::Batch(format!(
                "{} sampling rows for {} logits rows",
                rows.len(),
                batch.logits_rows()
            )));
        }
        self.forward_pick(batch, None, Some(rows), masks, out)
    }

    /// [`Self::forward_sampled`] on the last stage of a pipeline: `hidden` is the previous stage's
    /// output (tokens × hidden), `None` when this instance holds layer 0.
    pub fn forward_stage_sampled(
        &mut self,
        batch: &ForwardBatch,
        hidden: Option<&[u8]>,
        rows: &[SampleRow],
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        if !self.is_last() || rows.len() != batch.logits_rows() {
            return Err(CudaError::Batch(format!(
                "{} sampling rows for {} logits rows on layers {:?}",
                rows.len(),
                batch.logits_rows(),
                self.layers()
            )));
        }
        self.forward_pick(batch, hidden, Some(rows), None, out)
    }

    /// One step (from `hidden` on a later pipeline stage), then argmax (`sample` None) or the draws
    /// of `sample` over each logits row, among the tokens `masks` allows.
    pub(super) fn forward_pick(
        &mut self,
        batch: &ForwardBatch,
        hidden: Option<&[u8]>,
        sample: Option<&[SampleRow]>,
        masks: Option<&mut dyn MaskSource>,
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        let t0 = std::time::Instant::now();
        out.clear();
        let graph = self.prepare(batch)?;
        self.load_hidden(hidden, batch.tokens.len())?;
        let rows = batch.logits_rows();
        if graph == 0 && self.plan.num_tokens() == 0 {
            return Ok(());
        }
        let mut ids = std::mem::take(&mut self.pick_ids);
        ids.clear();
        ids.resize(rows, 0);
        let picked = self.pick_into(graph, rows, sample, masks, &mut ids, t0);
        out.extend(ids.iter().map(|&i| i as u32));
        self.pick_ids = ids;
        picked
    }

    /// The device work of `forward_pick` after planning: the body (through graph `graph` when
    /// non-zero), then the head and the choice of each logits row, chunk by chunk, into `ids`. The
    /// masks are waited for once the body is queued, so the host computes them while it runs.
    pub(super) fn pick_into(
        &mut self,
        graph: usize,
        rows: usize,
        sample: Option<&[SampleRow]>,
        masks: Option<&mut dyn MaskSource>,
        ids: &mut [i32],
        t0: std::time::Instant,
    ) -> Result<(), CudaError> {
        if graph > 0 {
            self.run_graph(graph)?;
            let masks = wait_masks(masks)?;
            self.enqueue_pick(0, rows, sample, masks)?;
            self.copy_i32(ids, 0)?;
        } else {
            self.enqueue_body(self.plan.num_tokens(), false)?;
            self.last_enqueue = t0.elapsed();
            let masks = wait_masks(masks)?;
            let chunk = self.opts.logits_chunk_rows.max(1);
            let mut start = 0;
            while start < rows {
                let n = chunk.min(rows - start);
                self.enqueue_head(start, n)?;
                self.enqueue_pick(start, n, sample, masks)?;
                self.copy_i32(&mut ids[start..start + n], 0)?;
                start += n;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Draws tokens on the GPU from given logits rows (`logits.len() == rows.len() * vocab`): the
    /// on-device sampler alone, for checks of its distribution against the host sampler's.
    pub fn sample_logits(
        &mut self,
        logits: &[f32],
        rows: &[SampleRow],
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        let v = self.config.vocab_size;
        let n = rows.len();
        if logits.len() != n * v || n > self.opts.logits_chunk_rows.max(1) {
            return Err(CudaError::Batch(format!(
                "{} logits for {n} rows of {v} (at most {} rows)",
                logits.len(),
                self.opts.logits_chunk_rows
            )));
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: acts.logits holds logits_chunk_rows rows of vocab fp32 (checked above); the
        // pageable host slice is staged before the call returns.
        unsafe {
            drv_result::memcpy_htod_async(self.acts.logits.ptr, logits, self.stream.cu_stream())
        }?;
        self.enqueue_pick(0, n, Some(rows), None)?;
        let mut ids = std::mem::take(&mut self.pick_ids);
        ids.clear();
        ids.resize(n, 0);
        let copied = self.copy_i32(&mut ids, 0);
        out.clear();
        out.extend(ids.iter().map(|&i| i as u32));
        self.pick_ids = ids;
        copied
    }

    pub(super) fn copy_i32(&self, dst: &mut [i32], offset: usize) -> Result<(), CudaError> {
        // SAFETY: acts.argmax holds logits_chunk_rows ints; dst is no longer.
        unsafe {
            drv_result::memcpy_dtoh_async(
                dst,
                self.acts.argmax.at(offset, 4),
                self.stream.cu_stream(),
            )
        }?;
        self.stream.synchronize()?;
        Ok(())
    }
}
