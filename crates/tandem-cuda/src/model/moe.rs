//! Mixture-of-experts layers on the GPU: the router on our GEMV or cuBLAS, then `moe_route`; for a
//! decode step of a few tokens the expert GEMVs (`moe_gemv_silu`, `moe_gemv_down`: each (token,
//! expert) slot streams its expert's rows), otherwise `moe_align` and one grouped GEMM per projection
//! over every expert the step uses (`moe_gemm_16` / `moe_gemm_64` in `kernels/moe.cu`); then
//! `moe_combine` into the residual stream. The shared expert
//! (Qwen2-MoE) is a dense gated MLP on the normalised rows, scaled by its own sigmoid gate, which is
//! one more row of the router matrix.

use std::sync::Arc;

use cudarc::driver::{result as drv_result, CudaContext, LaunchConfig, PushKernelArg};
use tandem_model::{LayerExpertTokens, MlpKind, ModelConfig, MoeSpec};

use super::gemv::{GemvFamily, GEMV_WARPS};
use super::{CudaLlama, FfnBufs, WFormat};
use crate::error::CudaError;
use crate::memory::{DeviceBuf, BF16};
use crate::plan::Region;

/// Most routed experts a layer may have (`moe_align` counts them in one block of 1024 threads;
/// `moe_route` holds 32 per lane).
pub(super) const MAX_EXPERTS: usize = 1024;

/// Largest y dimension of a CUDA grid.
const MAX_GRID_Y: usize = 65_535;

/// Most experts a token may be sent to (`moe_route` gives each chosen expert a lane).
pub(super) const MAX_TOP_K: usize = 32;

/// Refuses, naming the limit, a mixture of experts the kernels do not take.
pub(super) fn check(c: &ModelConfig) -> Result<(), CudaError> {
    let Some(m) = c.moe.as_ref().filter(|_| c.has_moe()) else {
        return Ok(());
    };
    let refused = if m.num_experts > MAX_EXPERTS {
        Some(format!("{} experts (at most {MAX_EXPERTS})", m.num_experts))
    } else if m.top_k == 0 || m.top_k > MAX_TOP_K.min(m.num_experts) {
        Some(format!(
            "top-{} of {} experts (at most {MAX_TOP_K})",
            m.top_k, m.num_experts
        ))
    } else if !m.expert_ffn.is_multiple_of(8) || !m.shared_ffn.unwrap_or(8).is_multiple_of(8) {
        Some(format!(
            "expert features {} / shared {:?} (the kernels need multiples of 8)",
            m.expert_ffn, m.shared_ffn
        ))
    } else {
        None
    };
    match refused {
        Some(what) => Err(CudaError::Unsupported(format!(
            "mixture of experts on CUDA: {what}"
        ))),
        None => Ok(()),
    }
}

/// One mixture-of-experts layer's device weights.
pub(super) struct MoeBufs {
    /// The router (experts × hidden), then the shared expert's gate row when there is one.
    pub(super) router: DeviceBuf,
    /// Every expert's [gate; up] rows, expert after expert (experts × 2·ffn × hidden).
    pub(super) gate_up: DeviceBuf,
    /// Every expert's down projection (experts × hidden × ffn).
    pub(super) down: DeviceBuf,
    /// The shared expert's [gate; up] and down (Qwen2-MoE).
    pub(super) shared: Option<(DeviceBuf, DeviceBuf)>,
}

/// Row blocks of a grouped GEMM over `slots` (token, expert) pairs of `experts` experts in blocks of
/// `bm` rows: each used expert pads its rows up to a whole block.
fn max_blocks(slots: usize, experts: usize, bm: usize) -> usize {
    slots.div_ceil(bm) + experts.min(slots)
}

/// The row-block height of a step's grouped GEMMs: 64 rows once experts average 32 rows or more
/// (prefill: a weight tile feeds four times the rows), else 16 (decode: little padding).
fn block_rows(slots: usize, experts: usize) -> usize {
    if slots >= 32 * experts {
        64
    } else {
        16
    }
}

/// Routing and grouped-expert activations, sized for the largest step.
pub(super) struct MoeActs {
    spec: MoeSpec,
    /// Router logits, tokens × (experts + shared gate), fp32.
    logits: DeviceBuf,
    ids: DeviceBuf,
    weights: DeviceBuf,
    shared_w: DeviceBuf,
    sorted: DeviceBuf,
    slot_row: DeviceBuf,
    block_expert: DeviceBuf,
    /// Grouped gate/up outputs, activations and expert outputs, one row per sorted row.
    gu: DeviceBuf,
    act: DeviceBuf,
    y: DeviceBuf,
    /// The shared expert's gate/up, activation and output per token.
    shared: Option<(DeviceBuf, DeviceBuf, DeviceBuf)>,
    /// Real token rows routed to each expert, per layer of this instance (u64, layers × experts).
    counts: DeviceBuf,
}

impl MoeActs {
    /// The buffers of a model with MoE layers (`None` for a dense one), for `layers` layers on this
    /// instance and steps of at most `max_tokens` tokens.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        c: &ModelConfig,
        layers: usize,
        max_tokens: usize,
    ) -> Result<Option<MoeActs>, CudaError> {
        let Some(m) = c.moe.clone().filter(|_| c.has_moe()) else {
            return Ok(None);
        };
        let h = c.hidden_size;
        let slots = max_tokens * m.top_k;
        let rows = [16, 64]
            .iter()
            .map(|&bm| max_blocks(slots, m.num_experts, bm) * bm)
            .max()
            .unwrap_or(0);
        let blocks = max_blocks(slots, m.num_experts, 16);
        let buf = |elems: usize, size: usize| DeviceBuf::new(ctx, elems.max(1) * size);
        let width = m.num_experts + usize::from(m.shared_ffn.is_some());
        let shared = match m.shared_ffn {
            Some(fs) => Some((
                buf(max_tokens * 2 * fs, BF16)?,
                buf(max_tokens * fs, BF16)?,
                buf(max_tokens * h, BF16)?,
            )),
            None => None,
        };
        let counts = buf(layers * m.num_experts, 8)?;
        let zero = ctx.default_stream();
        // SAFETY: a live allocation of exactly this many bytes on this context.
        unsafe { drv_result::memset_d8_async(counts.ptr, 0, counts.bytes, zero.cu_stream()) }?;
        zero.synchronize()?;
        Ok(Some(MoeActs {
            logits: buf(max_tokens * width, 4)?,
            ids: buf(slots, 4)?,
            weights: buf(slots, 4)?,
            shared_w: buf(max_tokens, 4)?,
            sorted: buf(rows, 4)?,
            slot_row: buf(slots, 4)?,
            block_expert: buf(blocks, 4)?,
            gu: buf(rows * 2 * m.expert_ffn, BF16)?,
            act: buf(rows * m.expert_ffn, BF16)?,
            y: buf(rows * h, BF16)?,
            shared,
            counts,
            spec: m,
        }))
    }
}

impl CudaLlama {
    /// Queues the mixture-of-experts block of local layer `l` over the `t` normalised rows in `xn`,
    /// adding its output into the residual stream `x`.
    pub(super) fn enqueue_moe(&self, l: usize, w: &MoeBufs, t: usize) -> Result<(), CudaError> {
        let ma = self.acts.moe.as_ref().ok_or_else(|| {
            CudaError::Unsupported("a mixture-of-experts layer without its buffers".into())
        })?;
        let m = &ma.spec;
        let c = &self.config;
        let (h, e, k) = (c.hidden_size, m.num_experts, m.top_k);
        let s = &self.stream;
        let a = &self.acts;
        let has_shared = w.shared.is_some();
        let width = e + usize::from(has_shared);
        self.gemm(a.xn.ptr, w.router.ptr, ma.logits.ptr, t, width, h, true)?;
        let pool_slots = (self.layout.num_blocks * self.layout.block_size) as i32;
        // Four tokens (warps) a block.
        launch!(
            s,
            self.funcs.moe_route,
            (t.div_ceil(4) as u32, 1, 1),
            (128, 1, 1),
            ma.logits.ptr,
            width as i32,
            e as i32,
            k as i32,
            m.norm_top_k as i32,
            has_shared as i32,
            t as i32,
            self.meta(Region::Slots),
            pool_slots,
            ma.ids.ptr,
            ma.weights.ptr,
            ma.shared_w.ptr,
            ma.counts.at(l * e, 8)
        );
        let slots = t * k;
        let slot_row = if self.opts.gemv && slots <= self.opts.moe_gemv_max_slots {
            self.enqueue_expert_gemvs(ma, w, slots)?;
            0u64
        } else {
            self.enqueue_expert_gemms(ma, w, slots)?;
            ma.slot_row.ptr
        };
        let shared_out = match (&w.shared, &ma.shared, m.shared_ffn) {
            (Some((gu_w, down_w)), Some((gu, act, out)), Some(fs)) => {
                self.gemm(a.xn.ptr, gu_w.ptr, gu.ptr, t, 2 * fs, h, false)?;
                self.enqueue_silu_mul(gu.ptr, act.ptr, t, fs)?;
                self.gemm(act.ptr, down_w.ptr, out.ptr, t, h, fs, false)?;
                out.ptr
            }
            _ => 0u64,
        };
        let threads = (h / 8).div_ceil(32).clamp(1, 8) as u32 * 32;
        launch!(
            s,
            self.funcs.moe_combine,
            (t as u32, 1, 1),
            (threads, 1, 1),
            a.x.ptr,
            ma.y.ptr,
            slot_row,
            ma.weights.ptr,
            k as i32,
            shared_out,
            ma.shared_w.ptr,
            h as i32
        );
        Ok(())
    }

    /// Queues the routed experts of a few slots (decode) on the GEMV kernels: gate/up + SiLU·mul,
    /// then down, each slot's rows of `y` in slot order.
    fn enqueue_expert_gemvs(
        &self,
        ma: &MoeActs,
        w: &MoeBufs,
        slots: usize,
    ) -> Result<(), CudaError> {
        let m = &ma.spec;
        let (h, k, f) = (self.config.hidden_size, m.top_k, m.expert_ffn);
        let block = (32 * GEMV_WARPS as u32, 1, 1);
        let (grid, ks, groups) = self.gemv_shape(GemvFamily::Plain, WFormat::Bf16, 1, slots * f, h);
        launch!(
            self.stream,
            self.funcs.moe_gemv_silu,
            (grid, 1, 1),
            block,
            self.acts.xn.ptr,
            ma.ids.ptr,
            slots as i32,
            k as i32,
            w.gate_up.ptr,
            ma.act.ptr,
            f as i32,
            h as i32,
            ks,
            groups
        );
        let (grid, ks, groups) = self.gemv_shape(
            GemvFamily::Plain,
            WFormat::Bf16,
            1,
            slots * h.div_ceil(2),
            f,
        );
        launch!(
            self.stream,
            self.funcs.moe_gemv_down,
            (grid, 1, 1),
            block,
            ma.act.ptr,
            ma.ids.ptr,
            slots as i32,
            w.down.ptr,
            ma.y.ptr,
            h as i32,
            f as i32,
            ks,
            groups
        );
        Ok(())
    }

    /// Queues the routed experts of many slots (prefill, large batches) as one grouped GEMM per
    /// projection: the slots grouped by expert into row blocks, gate/up, SiLU·mul, down; `y` in
    /// sorted-row order (`slot_row` maps a slot to its row).
    fn enqueue_expert_gemms(
        &self,
        ma: &MoeActs,
        w: &MoeBufs,
        slots: usize,
    ) -> Result<(), CudaError> {
        let m = &ma.spec;
        let (h, e, f) = (self.config.hidden_size, m.num_experts, m.expert_ffn);
        let s = &self.stream;
        let bm = block_rows(slots, e);
        let blocks = max_blocks(slots, e, bm);
        launch!(
            s,
            self.funcs.moe_align,
            (1, 1, 1),
            (1024, 1, 1),
            ma.ids.ptr,
            slots as i32,
            e as i32,
            bm as i32,
            blocks as i32,
            ma.sorted.ptr,
            ma.slot_row.ptr,
            ma.block_expert.ptr
        );
        let gemm = if bm == 16 {
            &self.funcs.moe_gemm_16
        } else {
            &self.funcs.moe_gemm_64
        };
        let tiles = |n: usize| n.div_ceil(64) as u32;
        launch!(
            s,
            gemm,
            (blocks as u32, tiles(2 * f), 1),
            (128, 1, 1),
            self.acts.xn.ptr,
            ma.sorted.ptr,
            m.top_k as i32,
            w.gate_up.ptr,
            ma.block_expert.ptr,
            ma.gu.ptr,
            (2 * f) as i32,
            h as i32
        );
        self.enqueue_silu_mul(ma.gu.ptr, ma.act.ptr, blocks * bm, f)?;
        launch!(
            s,
            gemm,
            (blocks as u32, tiles(h), 1),
            (128, 1, 1),
            ma.act.ptr,
            ma.sorted.ptr,
            0i32,
            w.down.ptr,
            ma.block_expert.ptr,
            ma.y.ptr,
            h as i32,
            f as i32
        );
        Ok(())
    }

    /// Queues `act = silu(gate) · up` over `rows` rows of [gate | up], each `ffn` wide.
    pub(super) fn enqueue_silu_mul(
        &self,
        gu: u64,
        act: u64,
        rows: usize,
        ffn: usize,
    ) -> Result<(), CudaError> {
        // Eight columns per thread: ffn / 2048 blocks cover a row in one pass; one grid row per row
        // up to the grid's y limit, past it the blocks stride over the rows.
        launch!(
            self.stream,
            self.funcs.silu_mul,
            (
                ffn.div_ceil(8 * 256) as u32,
                rows.clamp(1, MAX_GRID_Y) as u32,
                1
            ),
            (256, 1, 1),
            gu,
            act,
            ffn as i32,
            rows as i32,
            (self.config.activation == tandem_model::Activation::GeluTanh) as i32
        );
        Ok(())
    }

    /// Token rows routed to each expert of this instance's MoE layers since load (global layer
    /// indices); empty for a dense model.
    pub fn moe_expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) -> Result<(), CudaError> {
        out.clear();
        let Some(ma) = &self.acts.moe else {
            return Ok(());
        };
        let e = ma.spec.num_experts;
        let mut counts = vec![0u64; self.layers.len() * e];
        self.ctx.bind_to_thread()?;
        self.stream.synchronize()?;
        // SAFETY: `counts` is exactly the device buffer's live size (layers × experts u64).
        unsafe { drv_result::memcpy_dtoh_sync(&mut counts[..], ma.counts.ptr) }?;
        for (l, lw) in self.layers.iter().enumerate() {
            if matches!(lw.ffn, FfnBufs::Moe(_))
                && self.config.layer(self.first_layer + l).mlp == MlpKind::Moe
            {
                out.push(LayerExpertTokens {
                    layer: self.first_layer + l,
                    tokens: counts[l * e..(l + 1) * e].to_vec(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_cover_every_expert_padded_to_whole_blocks() {
        // One token, top-8 of 128: at most one block for the rows plus one per used expert.
        assert_eq!(max_blocks(8, 128, 16), 9);
        // Every expert used: the padded rows of the worst split fit.
        for (slots, e, bm) in [(512, 128, 16), (4096 * 8, 128, 64), (3, 4, 64)] {
            let worst: usize = (0..e)
                .map(|x| {
                    let rows = slots / e + usize::from(x < slots % e);
                    rows.div_ceil(bm)
                })
                .sum();
            assert!(worst <= max_blocks(slots, e, bm), "{slots} {e} {bm}");
        }
        assert_eq!(block_rows(8, 128), 16);
        assert_eq!(block_rows(4096 * 8, 128), 64);
    }
}
