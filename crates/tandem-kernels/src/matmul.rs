//! `out = x · Wᵀ` for every weight dtype, split over the thread pool by blocks of output features.
//!
//! Quantized weights: activations are first quantized per block the way llama.cpp does for the format
//! (Q8_0/Q8_1-style int8 blocks of 32 with an f16 scale and a `scale * sum(q)` term for Q4_0/Q4_1/Q5_0/Q8_0;
//! Q8_K-style blocks of 256 with per-16 sums for the K-quants), then dotted in integer arithmetic and
//! accumulated in f32 per block.

use std::ops::Range;

use half::f16;

use crate::dispatch::{isa, Isa};
use crate::quant::{f16_at, q5_0_value, q6k_value, scale_min_k4, DType, Matrix};
use crate::threads::ThreadPool;

/// Reusable scratch (quantized activations, per-thread buffers), grow-only.
#[derive(Default, Debug)]
pub struct MatmulScratch {
    qx: Vec<i8>,
    dx: Vec<f32>,
    sx: Vec<f32>,
    bsums: Vec<i16>,
    dxt: Vec<f32>,
    sxt: Vec<f32>,
}

/// Quantized activations of `m` rows, borrowed from the scratch; the row stride is implied by `cols`.
#[derive(Clone, Copy)]
pub(crate) struct QuantActs<'a> {
    /// int8 quants, `m * cols`.
    pub qx: &'a [i8],
    /// Per-block scale: `m * cols / 32` (Q8_0 style) or `m * cols / 256` (Q8_K style).
    pub dx: &'a [f32],
    /// Q8_0 style only: `scale * sum(q)` per block, for formats with an offset.
    pub sx: &'a [f32],
    /// Q8_K style only: sum of quants per 16 elements, `m * cols / 16`.
    pub bsums: &'a [i16],
    /// AVX2 kernels of the 32-element formats only (`uses_block_major_scales`; empty otherwise): `dx`
    /// block-major (`[b * m + t]`) so the scales of consecutive activation rows of a block are one load;
    /// 4 zeros of padding at the end.
    pub dxt: &'a [f32],
    /// Filled with `dxt`: `sx` block-major like it (read by the Q4_1 kernel).
    pub sxt: &'a [f32],
}

/// Shared pointer to the output so tasks can write disjoint parts of it.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub *mut f32);
// SAFETY: tasks write disjoint elements; the pool joins before the borrow ends.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The raw pointer (a method, so closures capture the whole `Sync` wrapper rather than the field).
    #[inline(always)]
    pub fn ptr(&self) -> *mut f32 {
        self.0
    }
}

/// Everything a row-range kernel needs: weight rows, activations, where to write.
pub(crate) struct Job<'a> {
    pub w: &'a Matrix,
    pub x: &'a [f32],
    pub acts: QuantActs<'a>,
    /// The weight's repacked bytes where the kernel reads those (`Matrix::q4_1_pairs`), else empty.
    pub pairs: &'a [u8],
    /// llama.cpp's batch-dependent K-quant kernels are on (`dispatch::llamacpp_batch_orders`).
    pub batch_orders: bool,
    pub out: OutPtr,
}

/// Computes `out[i][r]` for rows `rows` of the weight and activation rows `ms`.
pub(crate) type RangeKernel = fn(&Job, Range<usize>, Range<usize>);

/// Quantizes rows of 32-element blocks like llama.cpp's `quantize_row_q8_0` / `quantize_row_q8_1`:
/// d = amax/127 stored as f16 (as the block formats do), q = round-half-even(x · 127/amax); the sum term
/// is `s = f16(d·Σq)` with the unrounded d for Q8_1 (`q8_1`, the activations of Q4_1 weights), else the
/// exact `d_f16·Σq` (Q4_0's offset, which llama.cpp takes in integers).
pub(crate) fn quantize_q8_0_acts(
    x: &[f32],
    qx: &mut [i8],
    dx: &mut [f32],
    sx: &mut [f32],
    q8_1: bool,
) {
    for ((xb, qb), (d, s)) in x
        .chunks_exact(32)
        .zip(qx.chunks_exact_mut(32))
        .zip(dx.iter_mut().zip(sx.iter_mut()))
    {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let dd = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
            sum += *q as i32;
        }
        *d = f16::from_f32(dd).to_f32();
        *s = if q8_1 {
            f16::from_f32(dd * sum as f32).to_f32()
        } else {
            *d * sum as f32
        };
    }
}

/// Quantizes rows of 256-element blocks like llama.cpp's `quantize_row_q8_K`: `max` is the value of
/// largest magnitude (the first such), `iscale = −127/max`, `q = round-half-even(iscale·x)` (at most
/// 127), `d = 1/iscale`, and the per-16 sums of the quants. With `positive_wins`, a block holding both
/// `+amax` and `−amax` takes the positive one, as `ggml_quantize_mat_q8_K_4x8` does for the groups of 4
/// activation rows that llama.cpp's repacked Q4_K kernels read.
pub(crate) fn quantize_q8_k_acts(
    x: &[f32],
    qx: &mut [i8],
    dx: &mut [f32],
    bsums: &mut [i16],
    positive_wins: bool,
) {
    for (((xb, qb), d), bs) in x
        .chunks_exact(256)
        .zip(qx.chunks_exact_mut(256))
        .zip(dx.iter_mut())
        .zip(bsums.chunks_exact_mut(16))
    {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax || (positive_wins && v == amax && amax > 0.0) {
                (amax, max) = (v.abs(), v);
            }
        }
        if amax == 0.0 {
            qb.fill(0);
            bs.fill(0);
            *d = 0.0;
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        *d = 1.0 / iscale;
        for (s, g) in bs.iter_mut().zip(qb.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
    }
}

/// out[m][n] = sum_k x[m][k] * W[n][k]   (x: m × cols row-major, out: m × rows row-major)
pub fn matmul(
    pool: &ThreadPool,
    w: &Matrix,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_fused(pool, [w], x, m, [out], scratch);
}

/// Several matmuls of the same input in one dispatch (Q/K/V, gate/up): the activations are quantized once
/// and one pool run covers the rows of every weight, so each step pays one synchronisation instead of
/// `N`. Results are identical to `N` calls of [`matmul`]. Weights whose activation formats differ (a
/// 32-element format beside a K-quant) fall back to separate calls.
pub fn matmul_fused<const N: usize>(
    pool: &ThreadPool,
    ws: [&Matrix; N],
    x: &[f32],
    m: usize,
    outs: [&mut [f32]; N],
    scratch: &mut MatmulScratch,
) {
    if !ws
        .iter()
        .all(|w| act_group(w.dtype()) == act_group(ws[0].dtype()))
    {
        for (w, out) in ws.into_iter().zip(outs) {
            matmul(pool, w, x, m, out, scratch);
        }
        return;
    }
    let level = isa();
    let simd = level >= Isa::Avx2;
    let cols = ws[0].cols();
    assert_eq!(x.len(), m * cols, "matmul: x must be m x cols");
    for (w, out) in ws.iter().zip(&outs) {
        assert_eq!(w.cols(), cols, "matmul: fused weights must share cols");
        assert_eq!(out.len(), m * w.rows(), "matmul: out must be m x rows");
    }
    if m == 0 {
        return;
    }
    let batch_orders = crate::dispatch::llamacpp_batch_orders();
    prepare_acts(pool, ws[0].dtype(), x, m, cols, scratch, simd, batch_orders);
    let pairs = uses_q4_1_pairs(ws[0].dtype(), level);
    if uses_block_major_scales(ws[0].dtype(), level) {
        transpose_scales(scratch, m, cols / 32);
    } else {
        scratch.dxt.clear();
        scratch.sxt.clear();
    }
    let acts = QuantActs {
        qx: &scratch.qx,
        dx: &scratch.dx,
        sx: &scratch.sx,
        bsums: &scratch.bsums,
        dxt: &scratch.dxt,
        sxt: &scratch.sxt,
    };
    let mut outs = outs;
    let jobs: [Job; N] = std::array::from_fn(|p| Job {
        w: ws[p],
        x,
        acts,
        pairs: if pairs { ws[p].q4_1_pairs() } else { &[] },
        batch_orders,
        out: OutPtr(outs[p].as_mut_ptr()),
    });
    let kernels: [RangeKernel; N] = std::array::from_fn(|p| select_kernel(ws[p].dtype(), level));

    // Output features per task: a multiple of 8 (disjoint cache lines per thread), about 4 tasks per thread
    // for load balance on m = 1, fewer and larger for big m where each task re-reads its weights per m tile.
    let target_tasks = (pool.n_threads() * 4).max(1);
    let m_chunk = if m <= 64 { m } else { 64 };
    let n_m_tasks = m.div_ceil(m_chunk);
    let chunks: [usize; N] = std::array::from_fn(|p| {
        let chunk = ws[p]
            .rows()
            .div_ceil(target_tasks)
            .next_multiple_of(8)
            .max(8);
        if m >= 64 {
            chunk.min(64)
        } else {
            chunk
        }
    });
    let row_tasks: [usize; N] = std::array::from_fn(|p| ws[p].rows().div_ceil(chunks[p]));
    let total: usize = row_tasks.iter().map(|r| r * n_m_tasks).sum();
    let run_task = |t: usize| {
        let (mut p, mut t) = (0, t);
        while t >= row_tasks[p] * n_m_tasks {
            t -= row_tasks[p] * n_m_tasks;
            p += 1;
        }
        let rows = ws[p].rows();
        let (rt, mt) = (t % row_tasks[p], t / row_tasks[p]);
        let r = rt * chunks[p]..((rt + 1) * chunks[p]).min(rows);
        let ms = mt * m_chunk..((mt + 1) * m_chunk).min(m);
        kernels[p](&jobs[p], r, ms);
    };
    pool.run(total, &run_task);
}

/// Elements per activation quantization block a weight format needs (0: float weights, none).
fn act_group(dt: DType) -> usize {
    match dt {
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q8_0 => 32,
        DType::Q4K | DType::Q6K => 256,
        DType::F32 | DType::F16 | DType::BF16 => 0,
    }
}

/// Whether `dt` at `level` runs the AVX2 kernel of repacked Q4_1 weights ([`crate::quant::pack_q4_1_pairs`]).
pub(crate) fn uses_q4_1_pairs(dt: DType, level: Isa) -> bool {
    cfg!(target_arch = "x86_64") && dt == DType::Q4_1 && level == Isa::Avx2
}

/// Whether the AVX2 kernel for `dt` reads the activation scales block-major (`dxt`, `sxt`): the repacked
/// Q4_1 kernel, and the Q4_0/Q5_0/Q8_0 kernel's tiles of 4 activation rows (8 scale products in one multiply).
pub(crate) fn uses_block_major_scales(dt: DType, level: Isa) -> bool {
    uses_q4_1_pairs(dt, level)
        || (cfg!(target_arch = "x86_64")
            && matches!(dt, DType::Q4_0 | DType::Q5_0 | DType::Q8_0)
            && level == Isa::Avx2)
}

/// Fills `dxt`/`sxt`, the block-major copies of the activation scales of `m` rows of `nb` blocks.
fn transpose_scales(s: &mut MatmulScratch, m: usize, nb: usize) {
    let n = m * nb;
    for v in [&mut s.dxt, &mut s.sxt] {
        v.resize(n + 4, 0.0);
        v[n..].fill(0.0);
    }
    // Block-outer: the writes run sequentially; the strided reads stay within a few cached lines per row.
    for b in 0..nb {
        let (dxt, sxt) = (&mut s.dxt[b * m..][..m], &mut s.sxt[b * m..][..m]);
        for t in 0..m {
            dxt[t] = s.dx[t * nb + b];
            sxt[t] = s.sx[t * nb + b];
        }
    }
}

/// Which of llama.cpp's AVX2 kernels computes activation row `i` of an `m`-row K-quant product, as their
/// sums differ (see `dot_qk_portable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KPath {
    /// One row at a time: Q4_K's `gemv_q4_K_8x8_q8_K`, Q6_K's `ggml_vec_dot_q6_K_q8_K`.
    Single,
    /// Q4_K's `gemm_q4_K_8x8_q8_K`: all but the last `m % 4` rows, in groups of 4.
    Grouped,
    /// Q6_K's tiled kernel (`ggml_compute_forward_mul_mat_tiled`), for products of 8 rows or more.
    Tiled,
}

/// The kernel llama.cpp's AVX2 build runs for row `i` of an `m`-row product of `dt` weights when its
/// batch-dependent orders are on (`batch_orders`), else the one-row kernel whatever `m`.
pub(crate) fn k_path(dt: DType, m: usize, i: usize, batch_orders: bool) -> KPath {
    match dt {
        _ if !batch_orders => KPath::Single,
        DType::Q4K if i < m - m % 4 => KPath::Grouped,
        DType::Q6K if m >= 8 => KPath::Tiled,
        _ => KPath::Single,
    }
}

#[allow(clippy::too_many_arguments)]
fn prepare_acts(
    pool: &ThreadPool,
    dt: DType,
    x: &[f32],
    m: usize,
    cols: usize,
    s: &mut MatmulScratch,
    simd: bool,
    batch_orders: bool,
) {
    let group = match dt {
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q8_0 => 32,
        DType::Q4K | DType::Q6K => 256,
        DType::F32 | DType::F16 | DType::BF16 => return,
    };
    let q8_1 = dt == DType::Q4_1;
    let n = m * cols;
    if s.qx.len() < n {
        s.qx.resize(n, 0);
    }
    if s.dx.len() < n / group {
        s.dx.resize(n / group, 0.0);
    }
    if group == 32 && s.sx.len() < n / 32 {
        s.sx.resize(n / 32, 0.0);
    }
    if group == 256 && s.bsums.len() < n / 16 {
        s.bsums.resize(n / 16, 0);
    }
    let (qx, dx, sx, bs) = (
        &mut s.qx[..n],
        &mut s.dx[..n / group],
        &mut s.sx[..],
        &mut s.bsums[..],
    );
    let quant_rows =
        |r0: usize, x: &[f32], qx: &mut [i8], dx: &mut [f32], sx: &mut [f32], bs: &mut [i16]| {
            if group == 32 {
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: `simd` is only true when the CPU has AVX2+FMA+F16C.
                    unsafe { crate::simd::quantize_q8_0_acts(x, qx, dx, sx, q8_1) };
                    return;
                }
                quantize_q8_0_acts(x, qx, dx, sx, q8_1);
            } else {
                let nb = cols / 256;
                for (i, (((xr, qr), dr), br)) in x
                    .chunks_exact(cols)
                    .zip(qx.chunks_exact_mut(cols))
                    .zip(dx.chunks_exact_mut(nb))
                    .zip(bs.chunks_exact_mut(cols / 16))
                    .enumerate()
                {
                    // The repacked Q4_K groups quantize with `ggml_quantize_mat_q8_K_4x8`.
                    let grouped = k_path(dt, m, r0 + i, batch_orders) == KPath::Grouped;
                    #[cfg(target_arch = "x86_64")]
                    if simd {
                        // SAFETY: `simd` is only true when the CPU has AVX2+FMA+F16C.
                        unsafe { crate::simd::quantize_q8_k_acts(xr, qr, dr, br, grouped) };
                        continue;
                    }
                    quantize_q8_k_acts(xr, qr, dr, br, grouped);
                }
            }
        };
    let _ = simd;
    if m < 32 {
        quant_rows(
            0,
            x,
            qx,
            dx,
            &mut sx[..if group == 32 { n / 32 } else { 0 }],
            &mut bs[..if group == 256 { n / 16 } else { 0 }],
        );
        return;
    }
    // Large batches: quantize rows in parallel, each task owning disjoint rows of every buffer.
    let rows_per = m.div_ceil(pool.n_threads() * 2);
    let ptrs = (
        OutPtrI8(qx.as_mut_ptr()),
        OutPtr(dx.as_mut_ptr()),
        OutPtr(sx.as_mut_ptr()),
        OutPtrI16(bs.as_mut_ptr()),
    );
    let n_tasks = m.div_ceil(rows_per);
    pool.run(n_tasks, &|t| {
        let r = t * rows_per..((t + 1) * rows_per).min(m);
        let nr = r.len();
        let p = &ptrs;
        // SAFETY: row ranges of the tasks are disjoint and inside the buffers sized above.
        unsafe {
            let qx = std::slice::from_raw_parts_mut(p.0 .0.add(r.start * cols), nr * cols);
            let dx = std::slice::from_raw_parts_mut(
                p.1 .0.add(r.start * cols / group),
                nr * cols / group,
            );
            let sx: &mut [f32] = if group == 32 {
                std::slice::from_raw_parts_mut(p.2 .0.add(r.start * cols / 32), nr * cols / 32)
            } else {
                &mut []
            };
            let bs: &mut [i16] = if group == 256 {
                std::slice::from_raw_parts_mut(p.3 .0.add(r.start * cols / 16), nr * cols / 16)
            } else {
                &mut []
            };
            quant_rows(r.start, &x[r.start * cols..r.end * cols], qx, dx, sx, bs);
        }
    });
}

#[derive(Clone, Copy)]
struct OutPtrI8(*mut i8);
unsafe impl Send for OutPtrI8 {}
unsafe impl Sync for OutPtrI8 {}
#[derive(Clone, Copy)]
struct OutPtrI16(*mut i16);
unsafe impl Send for OutPtrI16 {}
unsafe impl Sync for OutPtrI16 {}

fn select_kernel(dt: DType, level: Isa) -> RangeKernel {
    #[cfg(target_arch = "x86_64")]
    {
        if level >= Isa::Avx512 {
            if let Some(k) = crate::simd::matmul_kernel_avx512(dt) {
                return k;
            }
        }
        if uses_q4_1_pairs(dt, level) {
            return crate::simd::matmul_kernel_q4_1_pairs();
        }
        if level >= Isa::Avx2 {
            if let Some(k) = crate::simd::matmul_kernel(dt) {
                return k;
            }
        }
    }
    let _ = level;
    portable_kernel
}

/// Reference kernel: one (activation row, weight row) dot product at a time, plain scalar code.
fn portable_kernel(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    let w = job.w;
    let (cols, total_rows, rb) = (w.cols(), w.rows(), w.row_bytes());
    let dt = w.dtype();
    let a = &job.acts;
    let m = job.x.len() / cols;
    for i in ms {
        for r in rows.clone() {
            let wr = &w.bytes()[r * rb..(r + 1) * rb];
            let v = match dt {
                DType::F32 | DType::F16 | DType::BF16 => {
                    dot_float_portable(dt, wr, &job.x[i * cols..(i + 1) * cols])
                }
                DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q8_0 => {
                    let nb = cols / 32;
                    dot_q32_portable(
                        dt,
                        wr,
                        &a.qx[i * cols..(i + 1) * cols],
                        &a.dx[i * nb..(i + 1) * nb],
                        &a.sx[i * nb..(i + 1) * nb],
                    )
                }
                DType::Q4K | DType::Q6K => {
                    let nb = cols / 256;
                    dot_qk_portable(
                        dt,
                        wr,
                        &a.qx[i * cols..(i + 1) * cols],
                        &a.dx[i * nb..(i + 1) * nb],
                        &a.bsums[i * cols / 16..(i + 1) * cols / 16],
                        k_path(dt, m, i, job.batch_orders),
                    )
                }
            };
            // SAFETY: (i, r) is inside out (checked in matmul) and owned by this task.
            unsafe { *job.out.0.add(i * total_rows + r) = v };
        }
    }
}

fn dot_float_portable(dt: DType, wr: &[u8], x: &[f32]) -> f32 {
    match dt {
        DType::F32 => wr
            .chunks_exact(4)
            .zip(x)
            .map(|(c, &v)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * v)
            .sum(),
        DType::F16 => wr.chunks_exact(2).zip(x).map(|(c, &v)| f16_at(c) * v).sum(),
        _ => wr
            .chunks_exact(2)
            .zip(x)
            .map(|(c, &v)| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) * v)
            .sum(),
    }
}

/// Dot of one Q4_0/Q4_1/Q5_0/Q8_0 row with one Q8_0-style activation row, in the SIMD kernels' (llama.cpp's
/// x86) order: per block 8 integer lane sums of 4 products (Q4_0's `q − 8` and Q5_0's `q − 16` in
/// integers), fused-multiply-added
/// into 8 f32 lanes with `d_w·d_x`, the lanes summed like `hsum_float_8`, then Q4_1's `Σ m·s` chain.
pub(crate) fn dot_q32_portable(dt: DType, wr: &[u8], qx: &[i8], dx: &[f32], sx: &[f32]) -> f32 {
    let bb = dt.block_bytes();
    let mut acc = [0f32; 8];
    let mut offs = 0f32;
    for (b, blk) in wr.chunks_exact(bb).enumerate() {
        let q = &qx[32 * b..32 * b + 32];
        let d = f16_at(blk);
        let w = |j: usize| -> i32 {
            match dt {
                DType::Q8_0 => blk[2 + j] as i8 as i32,
                DType::Q5_0 => q5_0_value(blk, j) - 16,
                _ => {
                    let qs = &blk[bb - 16..];
                    let v = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 } as i32;
                    if dt == DType::Q4_0 {
                        v - 8
                    } else {
                        v
                    }
                }
            }
        };
        let scale = d * dx[b];
        for (l, a) in acc.iter_mut().enumerate() {
            let lane: i32 = (4 * l..4 * l + 4).map(|j| w(j) * q[j] as i32).sum();
            *a = scale.mul_add(lane as f32, *a);
        }
        if dt == DType::Q4_1 {
            offs = f16_at(&blk[2..]).mul_add(sx[b], offs);
        }
    }
    (((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1]) + (acc[7] + acc[3]))) + offs
}

/// Dot of one Q4_K/Q6_K row with one Q8_K activation row in the order of the llama.cpp AVX2 kernel that
/// `path` names. Q4_K (its repacked kernels): the integer `Σ scale·dot` and `Σ min·bsum`
/// fused-multiply-added into their own f32 chains with `d·d_x` and `dmin·d_x`, the second chain
/// subtracted at the end — once per block of 256 (`Single`), once per pair of sub-blocks (`Grouped`).
/// Q6_K, `Single` (`ggml_vec_dot_q6_K_q8_K`): per block 8 integer lanes (lane `l` holds elements
/// `4l..4l+4` of every 32, minus `32·Σ scale·bsum` of the per-16 groups `2l, 2l+1`), fused-multiply-added
/// into 8 f32 lanes with `d_x·d`, the lanes summed like `hsum_float_8`; `Tiled`: per block the whole
/// integer sum `s`, then `acc = fma(d·s, d_x, acc)`.
pub(crate) fn dot_qk_portable(
    dt: DType,
    wr: &[u8],
    qx: &[i8],
    dx: &[f32],
    bsums: &[i16],
    path: KPath,
) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    let mut lanes = [0f32; 8];
    for (b, blk) in wr.chunks_exact(dt.block_bytes()).enumerate() {
        let q = &qx[256 * b..256 * b + 256];
        let bs = &bsums[16 * b..16 * b + 16];
        if dt == DType::Q4K {
            let (d, dmin) = (f16_at(blk), f16_at(&blk[2..]));
            let (scales, qs) = (&blk[4..16], &blk[16..144]);
            let (mut sumi, mut summ) = (0i32, 0i32);
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, scales);
                let (c, hi) = (j / 2, j % 2 == 1);
                let dot: i32 = (0..32)
                    .map(|l| {
                        let byte = qs[32 * c + l];
                        let w = if hi { byte >> 4 } else { byte & 0xF };
                        w as i32 * q[32 * j + l] as i32
                    })
                    .sum();
                sumi += sc as i32 * dot;
                summ += mn as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
                if (path == KPath::Grouped && j % 2 == 1) || j == 7 {
                    acc = (sumi as f32).mul_add(d * dx[b], acc);
                    acc_min = (summ as f32).mul_add(dmin * dx[b], acc_min);
                    (sumi, summ) = (0, 0);
                }
            }
        } else {
            let d = f16_at(&blk[208..]);
            let sc = |g: usize| blk[192 + g] as i8 as i32;
            let mut total = 0i32;
            for (l, lane) in lanes.iter_mut().enumerate() {
                let mut sumi: i32 = (0..8)
                    .flat_map(|c| 32 * c + 4 * l..32 * c + 4 * l + 4)
                    .map(|e| sc(e / 16) * q6k_value(blk, e) * q[e] as i32)
                    .sum();
                sumi -= 32 * (bs[2 * l] as i32 * sc(2 * l) + bs[2 * l + 1] as i32 * sc(2 * l + 1));
                *lane = (dx[b] * d).mul_add(sumi as f32, *lane);
                total += sumi;
            }
            acc = (d * total as f32).mul_add(dx[b], acc);
        }
    }
    match (dt, path) {
        (DType::Q4K, _) => acc - acc_min,
        (_, KPath::Tiled) => acc,
        _ => {
            ((lanes[4] + lanes[0]) + (lanes[6] + lanes[2]))
                + ((lanes[5] + lanes[1]) + (lanes[7] + lanes[3]))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dispatch::with_isa;
    use crate::quant::{dequantize, quantize_row, WeightBytes};
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    pub(crate) fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    pub(crate) fn quantized_matrix(dt: DType, rows: usize, cols: usize, seed: u64) -> Matrix {
        let w = rand_vec(rows * cols, seed);
        let mut bytes = Vec::new();
        for r in w.chunks_exact(cols) {
            quantize_row(dt, r, &mut bytes);
        }
        Matrix::new(dt, rows, cols, WeightBytes::Owned(Arc::new(bytes))).expect("sizes")
    }

    /// f32 reference: dequantize the weight, then plain dot products.
    pub(crate) fn reference(w: &Matrix, x: &[f32], m: usize) -> Vec<f32> {
        let (rows, cols) = (w.rows(), w.cols());
        let mut wf = vec![0f32; rows * cols];
        dequantize(w.dtype(), w.bytes(), &mut wf);
        let mut out = vec![0f32; m * rows];
        for i in 0..m {
            for r in 0..rows {
                out[i * rows + r] = (0..cols)
                    .map(|k| x[i * cols + k] as f64 * wf[r * cols + k] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// Tolerance from activation quantization: int8 steps of amax/127 on inputs in [-1, 1].
    pub(crate) fn tolerance(dt: DType, cols: usize) -> f32 {
        if dt.is_quantized() {
            0.02 * (cols as f32).sqrt()
        } else {
            1e-4 * cols as f32
        }
    }

    pub(crate) const ALL: [DType; 9] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q8_0,
        DType::Q4K,
        DType::Q6K,
    ];

    fn check(dt: DType, rows: usize, cols: usize, m: usize, threads: usize, level: Isa) {
        let w = quantized_matrix(dt, rows, cols, 11);
        let x = rand_vec(m * cols, 12);
        let pool = ThreadPool::new(threads);
        let mut out = vec![f32::NAN; m * rows];
        let mut scratch = MatmulScratch::default();
        with_isa(level, || matmul(&pool, &w, &x, m, &mut out, &mut scratch));
        let want = reference(&w, &x, m);
        let tol = tolerance(dt, cols);
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= tol,
                "{dt:?} {rows}x{cols} m={m} {level:?}: out[{i}] = {a}, want {b}"
            );
        }
    }

    /// The AVX-512 kernels of the 32-element formats reproduce the AVX2 ones (llama.cpp's order) bit for
    /// bit, for every tile shape: odd row counts, m = 1, 4 and 8 remainders.
    #[test]
    fn avx512_q32_kernels_equal_avx2_bitwise() {
        if crate::dispatch::cpu_isa() < Isa::Avx512 {
            return;
        }
        for dt in [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q8_0] {
            for &(rows, cols, m) in &[(13, 256, 1), (9, 128, 13), (20, 96, 8), (7, 64, 37)] {
                let w = quantized_matrix(dt, rows, cols, 21);
                let x = rand_vec(m * cols, 22);
                let pool = ThreadPool::new(2);
                let mut scratch = MatmulScratch::default();
                let mut a = vec![f32::NAN; m * rows];
                let mut b = vec![f32::NAN; m * rows];
                with_isa(Isa::Avx2, || matmul(&pool, &w, &x, m, &mut a, &mut scratch));
                with_isa(Isa::Avx512, || {
                    matmul(&pool, &w, &x, m, &mut b, &mut scratch)
                });
                assert_eq!(a, b, "{dt:?} {rows}x{cols} m={m}");
            }
        }
    }

    #[test]
    fn portable_matches_dequantized_reference() {
        for dt in ALL {
            for &(rows, cols, m) in &[(8, 256, 1), (40, 512, 3), (72, 256, 70)] {
                check(dt, rows, cols, m, 2, Isa::Portable);
            }
        }
    }

    /// A fused dispatch gives bit-identical results to one call per weight, with one activation format
    /// (one quantization) and with mixed formats (the fallback).
    #[test]
    fn fused_matmul_equals_separate_calls() {
        let pool = ThreadPool::new(2);
        for (da, db, dc) in [
            (DType::Q4_1, DType::Q4_1, DType::Q8_0),
            (DType::Q4K, DType::Q6K, DType::Q4K),
            (DType::Q4_0, DType::Q6K, DType::F16),
            (DType::Q5_0, DType::Q8_0, DType::Q5_0),
            (DType::Q5_0, DType::Q4K, DType::Q6K),
        ] {
            for m in [1, 5, 70] {
                let cols = 512;
                let (a, b, c) = (
                    quantized_matrix(da, 40, cols, 1),
                    quantized_matrix(db, 16, cols, 2),
                    quantized_matrix(dc, 24, cols, 3),
                );
                let x = rand_vec(m * cols, 4);
                let mut scratch = MatmulScratch::default();
                let (mut fa, mut fb, mut fc) =
                    (vec![0f32; m * 40], vec![0f32; m * 16], vec![0f32; m * 24]);
                matmul_fused(
                    &pool,
                    [&a, &b, &c],
                    &x,
                    m,
                    [&mut fa, &mut fb, &mut fc],
                    &mut scratch,
                );
                for (w, got) in [(&a, &fa), (&b, &fb), (&c, &fc)] {
                    let mut want = vec![0f32; m * w.rows()];
                    matmul(&pool, w, &x, m, &mut want, &mut scratch);
                    assert_eq!(got, &want, "{da:?}/{db:?}/{dc:?} m={m}: {:?}", w.dtype());
                }
            }
        }
    }

    #[test]
    fn activation_quantization_is_exact_for_representable_values() {
        // Multiples of 2^-7 with amax 127·2^-7: the scale 2^-7 is exact in f16, so is every quant.
        let step = 1.0 / 128.0;
        let x: Vec<f32> = (0..32)
            .map(|i| if i == 0 { 127.0 } else { (i * 7 - 100) as f32 } * step)
            .collect();
        let (mut q, mut d, mut s) = (vec![0i8; 32], vec![0f32; 1], vec![0f32; 1]);
        for q8_1 in [false, true] {
            quantize_q8_0_acts(&x, &mut q, &mut d, &mut s, q8_1);
            assert_eq!(d[0], step);
            for (qi, xi) in q.iter().zip(&x) {
                assert_eq!(*qi as f32 * d[0], *xi);
            }
            let sum: i32 = q.iter().map(|&v| v as i32).sum();
            assert_eq!(s[0], sum as f32 * d[0]);
        }
    }

    /// The scale is stored as f16 (rounded to nearest even) like llama.cpp's block_q8_0/q8_1, and Q8_1's
    /// sum term is f16(d·Σq) with the unrounded d.
    /// Q8_K activations as llama.cpp's `quantize_row_q8_K` makes them: `iscale = −127/max` of the first
    /// value of largest magnitude, `d = 1/iscale`, quants rounded half to even; with `positive_wins` a
    /// ±amax tie takes the positive value (its repacked Q4_K row groups).
    #[test]
    fn q8_k_activations_follow_llamacpp() {
        let mut x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        x[3] = -0.9;
        x[200] = 0.9;
        let (mut q, mut d, mut bs) = (vec![0i8; 256], vec![0f32; 1], vec![0i16; 16]);
        for positive_wins in [false, true] {
            quantize_q8_k_acts(&x, &mut q, &mut d, &mut bs, positive_wins);
            let max = if positive_wins { 0.9f32 } else { -0.9 };
            let iscale = -127.0f32 / max;
            assert_eq!(d[0].to_bits(), (1.0 / iscale).to_bits());
            for (i, (&qi, &xi)) in q.iter().zip(&x).enumerate() {
                let want = (iscale * xi).round_ties_even() as i8;
                assert_eq!(qi, want, "element {i}");
            }
            assert_eq!(q[3], if positive_wins { 127 } else { -127 });
            for (g, &s) in bs.iter().enumerate() {
                assert_eq!(
                    s as i32,
                    q[16 * g..16 * g + 16]
                        .iter()
                        .map(|&v| v as i32)
                        .sum::<i32>()
                );
            }
        }
        quantize_q8_k_acts(&[0.0; 256], &mut q, &mut d, &mut bs, false);
        assert!(d[0] == 0.0 && q.iter().all(|&v| v == 0) && bs.iter().all(|&v| v == 0));
    }

    #[test]
    fn activation_scales_are_f16_like_llamacpp() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin() * 1.3).collect();
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let (mut q, mut d, mut s) = (vec![0i8; 32], vec![0f32; 1], vec![0f32; 1]);
        quantize_q8_0_acts(&x, &mut q, &mut d, &mut s, true);
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        assert_eq!(d[0], f16::from_f32(amax / 127.0).to_f32());
        assert_ne!(d[0], amax / 127.0);
        assert_eq!(s[0], f16::from_f32(amax / 127.0 * sum as f32).to_f32());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn prop_quantized_matmul_close_to_reference(dt_idx in 0usize..9, rows in 1usize..40, blocks in 1usize..3, m in 1usize..6, seed in 0u64..1000) {
            let dt = ALL[dt_idx];
            let cols = blocks * 256;
            let w = quantized_matrix(dt, rows, cols, seed);
            let x = rand_vec(m * cols, seed + 1);
            let pool = ThreadPool::new(2);
            let mut out = vec![0f32; m * rows];
            matmul(&pool, &w, &x, m, &mut out, &mut MatmulScratch::default());
            let want = reference(&w, &x, m);
            for (a, b) in out.iter().zip(&want) {
                prop_assert!((a - b).abs() <= tolerance(dt, cols), "{:?}: {} vs {}", dt, a, b);
            }
        }
    }
}

/// Tensor parallelism relies on this: a row of the output does not depend on which other rows are
/// computed with it or on the thread count, so a rank's row slice of a weight reproduces the whole
/// matmul's rows bit for bit.
#[cfg(test)]
mod row_slices {
    use super::tests::{quantized_matrix, rand_vec};
    use super::*;

    #[test]
    fn row_slices_and_thread_counts_give_bit_identical_rows() {
        for dt in [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q8_0,
            DType::Q4K,
            DType::Q6K,
            DType::F32,
            DType::F16,
            DType::BF16,
        ] {
            let (rows, cols) = (72, 512);
            let w = quantized_matrix(dt, rows, cols, 3);
            for m in [1usize, 2, 3, 5, 8, 13, 17] {
                let x = rand_vec(m * cols, 9);
                let mut s = MatmulScratch::default();
                let mut full = vec![0.0; m * rows];
                matmul(&ThreadPool::new(2), &w, &x, m, &mut full, &mut s);
                for (a, b, threads) in [(0, 24, 1), (24, 72, 1), (5, 41, 2), (40, 72, 3)] {
                    let part = w.slice_rows(a..b);
                    let mut out = vec![0.0; m * (b - a)];
                    matmul(&ThreadPool::new(threads), &part, &x, m, &mut out, &mut s);
                    for t in 0..m {
                        assert_eq!(
                            &out[t * (b - a)..(t + 1) * (b - a)],
                            &full[t * rows + a..t * rows + b],
                            "{dt:?} m={m} rows {a}..{b} threads={threads}"
                        );
                    }
                }
            }
        }
    }
}
