//! Launch shapes of the small-batch GEMV kernels: split-K, block groups, persistent grids, and which
//! steps run them.

use super::launch::Funcs;
use super::{CudaLlama, WFormat};
use crate::error::CudaError;
use crate::kernels;
use crate::memory::BF16;

impl Funcs {
    /// Blocks of each GEMV kernel one GPU runs at once (multiprocessors × blocks per
    /// multiprocessor at the kernel's registers and shared memory): `[format][family][rows - 1]`.
    pub(super) fn gemv_caps(&self, sms: u32, hidden: usize) -> Result<GemvCaps, CudaError> {
        let mut caps = [[[1u32; kernels::GEMV_MAX_ROWS]; 4]; 4];
        for (format, families) in self.gemv.iter().enumerate() {
            for (fam, funcs) in families.iter().enumerate() {
                for (i, f) in funcs.iter().enumerate() {
                    let smem = if fam >= 2 {
                        fused_smem_bytes(i + 1, hidden)
                    } else {
                        0
                    };
                    let per_sm = if smem <= FUSED_SMEM_MAX {
                        f.occupancy_max_active_blocks_per_multiprocessor(
                            32 * GEMV_WARPS as u32,
                            smem,
                            None,
                        )?
                    } else {
                        1
                    };
                    caps[format][fam][i] = (sms * per_sm).max(1);
                }
            }
        }
        Ok(caps)
    }
}

/// Blocks each GEMV kernel runs at once on the device, `[format][family][rows - 1]`.
pub(super) type GemvCaps = [[[u32; kernels::GEMV_MAX_ROWS]; 4]; 4];

/// Dynamic shared memory of a fused-norm GEMV over `m` rows of `hidden` bf16 values (each row
/// followed by `kernels::GEMV_SMEM_PAD` values of padding).
pub(super) fn fused_smem_bytes(m: usize, hidden: usize) -> usize {
    m * (hidden + kernels::GEMV_SMEM_PAD) * BF16
}

/// Most dynamic shared memory a fused-norm GEMV block asks for (Hopper allows 227 KiB per block;
/// beyond this a step falls back to the unfused kernels).
pub(super) const FUSED_SMEM_MAX: usize = 160 << 10;

/// Warps per block of the GEMV kernels (`GV_WARPS` in llama.cu); each warp owns two weight rows
/// ([`gemv_pairs_per_warp`] pairs in the packed formats' tensor-core path).
pub(super) const GEMV_WARPS: usize = 8;

/// Row pairs a GEMV warp's work item covers: 8 in the packed formats' tensor-core path (`gv_octet`:
/// 16 weight rows, the MMA's), else 1.
pub(super) fn gemv_pairs_per_warp(format: WFormat, tuning: &kernels::GemvTuning) -> usize {
    if format.packed().is_some() && tuning.packed_mma {
        8
    } else {
        1
    }
}

/// The GEMV kernel families (the order of `kernels::GEMV_FAMILIES`).
#[derive(Clone, Copy)]
pub(super) enum GemvFamily {
    Plain,
    Add,
    Silu,
    Qkv,
}

/// Block-groups of a GEMV launch with one warp per work item.
pub(super) fn gemv_blocks(warps: usize) -> u32 {
    warps.div_ceil(GEMV_WARPS) as u32
}

/// K slices per row pair of a GEMV (split-K, a power of two dividing `GEMV_WARPS`): the fewest
/// that reach `target` warps (`CudaOptions::gemv_target_warps`), keeping slices at least 256 values
/// long.
pub(super) fn gemv_split(pairs: usize, k: usize, target: usize) -> usize {
    let mut ks = 1;
    while ks < GEMV_WARPS && pairs * ks < target && k / (2 * ks) >= 256 {
        ks *= 2;
    }
    ks
}

impl CudaLlama {
    /// Whether projections of `t` rows run on our GEMV kernels (else cuBLAS).
    pub(super) fn gemv_rows(&self, t: usize) -> bool {
        self.opts.gemv && t >= 1 && t <= self.opts.gemv_max_rows.min(kernels::GEMV_MAX_ROWS)
    }

    /// The launch shape of a GEMV over `t` rows with `pairs` row pairs of `k` values: (grid, K
    /// slices, block-groups). A work item is [`gemv_pairs_per_warp`] pairs; one block per group, or
    /// with persistent launches no more blocks than the GPU holds at once.
    pub(super) fn gemv_shape(
        &self,
        family: GemvFamily,
        format: WFormat,
        t: usize,
        pairs: usize,
        k: usize,
    ) -> (u32, i32, i32) {
        let items = pairs.div_ceil(gemv_pairs_per_warp(format, &self.opts.gemv_tuning));
        let ks = gemv_split(items, k, self.opts.gemv_target_warps);
        let groups = gemv_blocks(items * ks);
        let grid = if self.opts.gemv_persistent {
            groups.min(self.gemv_caps[format as usize][family as usize][t - 1])
        } else {
            groups
        };
        (grid, ks as i32, groups as i32)
    }

    /// Whether a step of `t` tokens runs the fused GEMV kernels (norm, RoPE, K/V write, SiLU and
    /// residual adds inside the projections): our GEMV on, few rows, shapes the kernels take, and a
    /// structure they compute (SiLU, no norm between a projection and its residual add).
    pub(super) fn fused_step(&self, t: usize) -> bool {
        let c = &self.config;
        !c.sandwich_norms
            && c.activation == tandem_model::Activation::Silu
            && self.gemv_rows(t)
            && c.hidden_size.is_multiple_of(8)
            && c.intermediate_size.is_multiple_of(8)
            && fused_smem_bytes(t, c.hidden_size) <= FUSED_SMEM_MAX
    }
}
