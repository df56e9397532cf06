//! AVX2 matmul kernels: integer dot products for the 32-element GGML formats (`maddubs` + `madd`, f32
//! accumulation per block) and an FMA kernel for float weights.
//!
//! The 32-element formats follow llama.cpp's x86 dot products operation for operation (8 lane sums per
//! block, `acc = fma(d_w·d_x, lanes, acc)` block after block, `hsum_float_8`, Q4_1's `Σ m·s` as a fused
//! chain added last), so that tandem's logits reproduce llama.cpp's bit for bit on the same weights.
//!
//! Each kernel computes a tile of `RW` weight rows × `MT` activation rows so one weight-block load serves
//! `MT` activation rows (batched decode and prefill), and several weight rows give independent
//! accumulators (latency hiding on m = 1).

use std::arch::x86_64::*;
use std::ops::Range;

use super::{q32_block_bytes, Q32Tile, Q4_0, Q4_1, Q5_0, Q8_0};
use crate::matmul::{k_path, Job, KPath, RangeKernel};
use crate::quant::{f16_at, scale_min_k4, DType, Q4_1_PAIR_BYTES};

/// K-quant format tags.
const Q4K: u8 = 3;
const Q6K: u8 = 4;

/// Float format tags.
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

/// The AVX2 kernel for `dt`, if one exists.
pub(crate) fn kernel(dt: DType) -> Option<RangeKernel> {
    Some(match dt {
        DType::Q4_0 => run_q32::<Q4_0>,
        DType::Q4_1 => run_q32::<Q4_1>,
        DType::Q5_0 => run_q32::<Q5_0>,
        DType::Q8_0 => run_q32::<Q8_0>,
        DType::F32 => run_float::<F32>,
        DType::F16 => run_float::<F16>,
        DType::BF16 => run_float::<BF16>,
        DType::Q4K => run_qk::<Q4K>,
        DType::Q6K => run_qk::<Q6K>,
    })
}

fn run_q32<const FMT: u8>(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    // SAFETY: this kernel is only selected when the CPU has AVX2+FMA+F16C; shapes were checked by matmul.
    unsafe { run_q32_impl::<FMT>(job, rows, ms) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_q32_impl<const FMT: u8>(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    let args = |i: usize, j: usize| Q32Tile::at(job, i, j);
    let mut j = ms.start;
    while j + 4 <= ms.end {
        let mut i = rows.start;
        while i + 2 <= rows.end {
            tile_q32::<2, 4, FMT>(&args(i, j));
            i += 2;
        }
        if i < rows.end {
            tile_q32::<1, 4, FMT>(&args(i, j));
        }
        j += 4;
    }
    while j < ms.end {
        let mut i = rows.start;
        while i + 4 <= rows.end {
            tile_q32::<4, 1, FMT>(&args(i, j));
            i += 4;
        }
        while i < rows.end {
            tile_q32::<1, 1, FMT>(&args(i, j));
            i += 1;
        }
        j += 1;
    }
}

/// Byte `j` of the result is all ones where bit `j` of `bits` is set, else zero (ggml's `bytes_from_bits_32`).
#[inline(always)]
pub(super) unsafe fn bytes_from_bits_32(bits: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1))
}

/// Unpacked weight block: 32 quants as bytes (unsigned for Q4_1, signed for Q8_0 and for Q4_0 and Q5_0,
/// whose `q − 8` and `q − 16` are taken in integers as llama.cpp does), its f32 scale in all lanes, and
/// Q4_1's offset m (0 for the others).
#[inline(always)]
unsafe fn load_block<const FMT: u8>(p: *const u8) -> (__m256i, __m256, f32) {
    match FMT {
        Q5_0 => {
            let d = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32));
            let raw = _mm_loadu_si128(p.add(6).cast());
            let m4 = _mm_set1_epi8(0x0F);
            let nib = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16(raw, 4), m4),
                _mm_and_si128(raw, m4),
            );
            // q − 16 as a signed byte: the nibble with 0xF0 above it where the fifth bit is clear.
            let high = bytes_from_bits_32(p.add(2).cast::<u32>().read_unaligned());
            let q = _mm256_or_si256(nib, _mm256_andnot_si256(high, _mm256_set1_epi8(-16)));
            (q, _mm256_broadcastss_ps(d), 0.0)
        }
        Q8_0 => {
            let d = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32));
            (
                _mm256_loadu_si256(p.add(2).cast()),
                _mm256_broadcastss_ps(d),
                0.0,
            )
        }
        _ => {
            let hdr = if FMT == Q4_1 {
                p.cast::<u32>().read_unaligned()
            } else {
                p.cast::<u16>().read_unaligned() as u32
            };
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(hdr as i32));
            let qoff = if FMT == Q4_1 { 4 } else { 2 };
            let raw = _mm_loadu_si128(p.add(qoff).cast());
            let m4 = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(raw, m4);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
            let q = _mm256_set_m128i(hi, lo);
            if FMT == Q4_1 {
                let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
                (q, _mm256_broadcastss_ps(dm), m)
            } else {
                (
                    _mm256_sub_epi8(q, _mm256_set1_epi8(8)),
                    _mm256_broadcastss_ps(dm),
                    0.0,
                )
            }
        }
    }
}

/// out[j][i] for RW weight rows × MT activation rows.
#[inline(always)]
unsafe fn tile_q32<const RW: usize, const MT: usize, const FMT: u8>(t: &Q32Tile) {
    let (w, rb, nb, qx, cols) = (t.w, t.rb, t.nb, t.qx, t.cols);
    let bb = q32_block_bytes(FMT);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); MT]; RW];
    let mut acc_off = [[0f32; MT]; RW];
    // Signed formats, 4 activation rows: the tile's scale products d_w·d_x are formed 8 at a time.
    let vector_scales = FMT != Q4_1 && MT == 4 && RW <= 2;
    debug_assert!(!vector_scales || t.m > 0, "block-major scales not filled");
    let mut ahead = super::Prefetch::new(w, RW * rb, nb);
    for b in 0..nb {
        let mut wq = [_mm256_setzero_si256(); RW];
        let mut wd = [_mm256_setzero_ps(); RW];
        let mut wo = [0f32; RW];
        ahead.block();
        for r in 0..RW {
            let (q, d, o) = load_block::<FMT>(w.add(r * rb + b * bb));
            wq[r] = q;
            wd[r] = d;
            wo[r] = o;
        }
        // |w| once per weight block (llama.cpp's `sign(x, x)`), for every activation row.
        let mut aw = [_mm256_setzero_si256(); RW];
        if FMT != Q4_1 {
            for r in 0..RW {
                aw[r] = _mm256_sign_epi8(wq[r], wq[r]);
            }
        }
        // Lane 4·r + i: d_w(row r)·d_x(activation row i), the same f32 product llama.cpp forms per block.
        let mut prod = [0f32; 8];
        if vector_scales {
            let dx = _mm256_broadcast_ps(&_mm_loadu_ps(t.dxt.add(b * t.m)));
            let dw = _mm256_insertf128_ps::<1>(wd[0], _mm256_castps256_ps128(wd[RW - 1]));
            _mm256_storeu_ps(prod.as_mut_ptr(), _mm256_mul_ps(dw, dx));
        }
        for i in 0..MT {
            let xv = _mm256_loadu_si256(qx.add(i * cols + 32 * b).cast());
            let xd = _mm256_broadcast_ss(&*t.dx.add(i * nb + b));
            let xs = if FMT == Q4_1 {
                *t.sx.add(i * nb + b)
            } else {
                0.0
            };
            for r in 0..RW {
                let prod_q = if FMT != Q4_1 {
                    _mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv, wq[r]))
                } else {
                    _mm256_maddubs_epi16(wq[r], xv)
                };
                let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod_q, ones));
                let d = if vector_scales {
                    _mm256_broadcast_ss(&prod[4 * r + i])
                } else {
                    _mm256_mul_ps(wd[r], xd)
                };
                acc[r][i] = _mm256_fmadd_ps(dot, d, acc[r][i]);
                if FMT == Q4_1 {
                    // llama.cpp's `summs += m·s`, which its compiler contracts to a fused multiply-add.
                    acc_off[r][i] = wo[r].mul_add(xs, acc_off[r][i]);
                }
            }
        }
    }
    for r in 0..RW {
        for i in 0..MT {
            *t.out.add(i * t.out_stride + r) = super::hsum(acc[r][i]) + acc_off[r][i];
        }
    }
}

/// The Q4_1 kernel over the repacked layout of `Matrix::q4_1_pairs` (`job.pairs`): the same per-block
/// operations and order as [`tile_q32`] (hence llama.cpp's bits), with the block unpack down to one mask
/// (or shift and mask) per row and block, and the scale products `d_w·d_x` and offset chains `Σ m·s` of a
/// tile computed 8 (weight row, activation row) pairs per instruction: the activation scales come
/// block-major (`acts.dxt`, `acts.sxt`) so 4 rows' are one broadcast load.
pub(crate) fn run_q4_1_pairs(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    // SAFETY: this kernel is only selected when the CPU has AVX2+FMA+F16C; shapes were checked by matmul,
    // `job.pairs` is the weight's repacked copy and `acts.dxt`/`acts.sxt` were filled for this input.
    unsafe { run_q4_1_pairs_impl(job, rows, ms) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_q4_1_pairs_impl(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    let w = job.w;
    let (cols, total) = (w.cols(), w.rows());
    let nb = cols / 32;
    let pair_bytes = nb.div_ceil(2) * Q4_1_PAIR_BYTES;
    let a = &job.acts;
    // Activation rows of the input: `dxt` holds `m * nb` scales and 4 of padding.
    let m = (a.dxt.len() - 4) / nb;
    debug_assert!(
        rows.start.is_multiple_of(2),
        "row tasks start on a row pair"
    );
    debug_assert_eq!(job.pairs.len(), total.div_ceil(2) * pair_bytes);
    let wp = job.pairs.as_ptr();
    let args = |i: usize, j: usize| PairTile {
        w: wp.add(i / 2 * pair_bytes),
        pair_bytes,
        nb,
        m,
        qx: a.qx.as_ptr().add(j * cols),
        dxt: a.dxt.as_ptr().add(j),
        sxt: a.sxt.as_ptr().add(j),
        cols,
        out: job.out.0.add(j * total + i),
        out_stride: total,
        valid: rows.end - i,
    };
    let mut j = ms.start;
    while j + 4 <= ms.end {
        for i in rows.clone().step_by(2) {
            tile_q4_1_pairs::<1, 4>(&args(i, j));
        }
        j += 4;
    }
    while j < ms.end {
        let mut i = rows.start;
        while i + 4 <= rows.end {
            tile_q4_1_pairs::<2, 1>(&args(i, j));
            i += 4;
        }
        while i < rows.end {
            tile_q4_1_pairs::<1, 1>(&args(i, j));
            i += 2;
        }
        j += 1;
    }
}

/// Where a [`tile_q4_1_pairs`] reads and writes.
struct PairTile {
    /// First row pair of the tile in the repacked weight.
    w: *const u8,
    /// Bytes of one row pair.
    pair_bytes: usize,
    /// Blocks per row.
    nb: usize,
    /// Activation rows of the input (the block stride of `dxt`, `sxt`).
    m: usize,
    /// First activation row's quants.
    qx: *const i8,
    /// First activation row's block-0 scale in the block-major scales (`sxt` likewise).
    dxt: *const f32,
    sxt: *const f32,
    /// Elements per row (the stride of `qx`).
    cols: usize,
    /// out[first activation row][first weight row].
    out: *mut f32,
    out_stride: usize,
    /// Weight rows from the tile's first to the end of the task (an odd total leaves a padding row).
    valid: usize,
}

/// out[t][r] for `P` row pairs × `MT` activation rows of the repacked Q4_1 layout.
#[inline(always)]
unsafe fn tile_q4_1_pairs<const P: usize, const MT: usize>(t: &PairTile) {
    let mut acc = [[[_mm256_setzero_ps(); MT]; 2]; P];
    let mut off = [_mm256_setzero_ps(); P];
    let mut ahead = super::Prefetch::new(t.w, P * t.pair_bytes, t.nb.div_ceil(2));
    for q in 0..t.nb.div_ceil(2) {
        ahead.block();
        block_q4_1_pairs::<P, MT, 0>(t, q, &mut acc, &mut off);
        if 2 * q + 1 < t.nb {
            block_q4_1_pairs::<P, MT, 1>(t, q, &mut acc, &mut off);
        }
    }
    for p in 0..P {
        let mut offs = [0f32; 8];
        _mm256_storeu_ps(offs.as_mut_ptr(), off[p]);
        for r in 0..2 {
            if 2 * p + r >= t.valid {
                continue;
            }
            for (i, a) in acc[p][r].iter().enumerate() {
                *t.out.add(i * t.out_stride + 2 * p + r) = super::hsum(*a) + offs[4 * r + i];
            }
        }
    }
}

/// Block `2q + H` of a [`tile_q4_1_pairs`].
#[inline(always)]
unsafe fn block_q4_1_pairs<const P: usize, const MT: usize, const H: usize>(
    t: &PairTile,
    q: usize,
    acc: &mut [[[__m256; MT]; 2]; P],
    off: &mut [__m256; P],
) {
    let b = 2 * q + H;
    let ones = _mm256_set1_epi16(1);
    let m4 = _mm256_set1_epi8(0x0F);
    // [d_x or s_x of activation rows 0..4] in both 128-bit lanes.
    let dx = _mm256_broadcast_ps(&_mm_loadu_ps(t.dxt.add(b * t.m)));
    let sx = _mm256_broadcast_ps(&_mm_loadu_ps(t.sxt.add(b * t.m)));
    let mut wq = [[_mm256_setzero_si256(); 2]; P];
    // Lane 4·r + i: d_w(row r)·d_x(activation row i), llama.cpp's per-block scale product.
    let mut prod = [[0f32; 8]; P];
    for p in 0..P {
        let base = t.w.add(p * t.pair_bytes + q * Q4_1_PAIR_BYTES);
        // [d0A d0B m0A m0B | d1A d1B m1A m1B]: row 0's scales in the low lane, row 1's in the high.
        let sc = _mm256_cvtph_ps(_mm_loadu_si128(base.add(64).cast()));
        let (dw, mw) = if H == 0 {
            (_mm256_permute_ps::<0x00>(sc), _mm256_permute_ps::<0xAA>(sc))
        } else {
            (_mm256_permute_ps::<0x55>(sc), _mm256_permute_ps::<0xFF>(sc))
        };
        _mm256_storeu_ps(prod[p].as_mut_ptr(), _mm256_mul_ps(dw, dx));
        // llama.cpp's `summs += m·s` (a fused multiply-add) for the 8 (row, activation row) pairs at once.
        off[p] = _mm256_fmadd_ps(mw, sx, off[p]);
        for (r, v) in wq[p].iter_mut().enumerate() {
            let raw = _mm256_loadu_si256(base.add(32 * r).cast());
            *v = if H == 0 {
                _mm256_and_si256(raw, m4)
            } else {
                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4)
            };
        }
    }
    for i in 0..MT {
        let xv = _mm256_loadu_si256(t.qx.add(i * t.cols + 32 * b).cast());
        for p in 0..P {
            for r in 0..2 {
                let dot =
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wq[p][r], xv), ones));
                let d = _mm256_broadcast_ss(&prod[p][4 * r + i]);
                acc[p][r][i] = _mm256_fmadd_ps(dot, d, acc[p][r][i]);
            }
        }
    }
}

fn run_qk<const FMT: u8>(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    // SAFETY: this kernel is only selected when the CPU has AVX2+FMA+F16C; shapes were checked by matmul.
    unsafe { run_qk_impl::<FMT>(job, rows, ms) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_qk_impl<const FMT: u8>(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    let w = job.w;
    let (cols, total) = (w.cols(), w.rows());
    let rb = w.row_bytes();
    let nb = cols / 256;
    let a = &job.acts;
    let wp = w.bytes().as_ptr();
    let m = job.x.len() / cols;
    let args = |i: usize, j: usize| {
        (
            wp.add(i * rb),
            a.qx.as_ptr().add(j * cols),
            a.dx.as_ptr().add(j * nb),
            a.bsums.as_ptr().add(j * cols / 16),
            job.out.0.add(j * total + i),
        )
    };
    let mut j = ms.start;
    // Prefill: one weight row's unpacked sub-blocks and header serve 8 activation rows (the integer sums
    // take 8 registers; the f32 accumulators, touched once a block, may live in memory).
    while j + 8 <= ms.end {
        for i in rows.clone() {
            let (w0, q, d, s, o) = args(i, j);
            tile_qk::<1, 8, FMT>(w0, rb, nb, q, d, s, cols, o, total, j, m, job.batch_orders);
        }
        j += 8;
    }
    while j + 4 <= ms.end {
        for i in rows.clone() {
            let (w0, q, d, s, o) = args(i, j);
            tile_qk::<1, 4, FMT>(w0, rb, nb, q, d, s, cols, o, total, j, m, job.batch_orders);
        }
        j += 4;
    }
    while j < ms.end {
        let mut i = rows.start;
        while i + 4 <= rows.end {
            let (w0, q, d, s, o) = args(i, j);
            tile_qk::<4, 1, FMT>(w0, rb, nb, q, d, s, cols, o, total, j, m, job.batch_orders);
            i += 4;
        }
        while i < rows.end {
            let (w0, q, d, s, o) = args(i, j);
            tile_qk::<1, 1, FMT>(w0, rb, nb, q, d, s, cols, o, total, j, m, job.batch_orders);
            i += 1;
        }
        j += 1;
    }
}

/// The 32 unsigned quants of sub-block `j` (0..8) of a K-quant block and their per-16 scales as i16 lanes
/// (Q4_K: one scale for all 32; Q6_K: one per 128-bit half).
#[inline(always)]
unsafe fn qk_sub<const FMT: u8>(blk: *const u8, j: usize, sc: &[i16; 16]) -> (__m256i, __m256i) {
    if FMT == Q4K {
        let raw = _mm256_loadu_si256(blk.add(16 + 32 * (j / 2)).cast());
        let m4 = _mm256_set1_epi8(0x0F);
        let q = if j.is_multiple_of(2) {
            _mm256_and_si256(raw, m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4)
        };
        (q, _mm256_set1_epi16(sc[j]))
    } else {
        let (half, quarter) = (j / 4, j % 4);
        let ql = _mm256_loadu_si256(blk.add(64 * half + 32 * (quarter & 1)).cast());
        let qh = _mm256_loadu_si256(blk.add(128 + 32 * half).cast());
        let m4 = _mm256_set1_epi8(0x0F);
        let lo = if quarter >= 2 {
            _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
        } else {
            _mm256_and_si256(ql, m4)
        };
        let hi = _mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * quarter as i32)),
            _mm256_set1_epi8(3),
        );
        let q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        (
            q,
            _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j])),
        )
    }
}

/// Decodes a K-quant block header: super scale, min factor, the per-16 scales (i16) and per-16 mins.
#[inline(always)]
unsafe fn qk_header<const FMT: u8>(blk: *const u8) -> (f32, f32, [i16; 16], [i16; 16]) {
    let mut sc = [0i16; 16];
    let mut mn = [0i16; 16];
    if FMT == Q4K {
        let b = std::slice::from_raw_parts(blk, 16);
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, &b[4..16]);
            sc[j] = s as i16;
            // Mins apply per 32; spread them over the two per-16 sums of the activation.
            mn[2 * j] = m as i16;
            mn[2 * j + 1] = m as i16;
        }
        (f16_at(b), f16_at(&b[2..]), sc, mn)
    } else {
        let b = std::slice::from_raw_parts(blk, 210);
        for g in 0..16 {
            sc[g] = b[192 + g] as i8 as i16;
            mn[g] = 32 * sc[g];
        }
        (f16_at(&b[208..]), f16_at(&b[208..]), sc, mn)
    }
}

/// out[t][r] for RW K-quant weight rows × MT Q8_K activation rows (rows `t0..t0 + MT` of an `m`-row
/// product, which with `batch_orders` picks llama.cpp's kernel per row: `KPath`), in llama.cpp's AVX2 order (see
/// `dot_qk_portable`): 8 int32 lanes of scale × dot per sub-block pair. Q4_K sums them (and
/// `Σ min·bsum`) to integers and fused-multiply-adds those into their own f32 chains; Q6_K takes the
/// `32·Σ scale·bsum` offset off each lane of the block in integers, then fused-multiply-adds the 8 lanes
/// (`Single`) or their integer sum (`Tiled`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile_qk<const RW: usize, const MT: usize, const FMT: u8>(
    w: *const u8,
    rb: usize,
    nb: usize,
    qx: *const i8,
    dx: *const f32,
    bsums: *const i16,
    cols: usize,
    out: *mut f32,
    out_stride: usize,
    t0: usize,
    m: usize,
    batch_orders: bool,
) {
    let bb = if FMT == Q4K { 144 } else { 210 };
    let dt = if FMT == Q4K { DType::Q4K } else { DType::Q6K };
    let paths: [KPath; MT] = std::array::from_fn(|t| k_path(dt, m, t0 + t, batch_orders));
    let mut acc = [[_mm256_setzero_ps(); MT]; RW];
    let mut acc_s = [[(0f32, 0f32); MT]; RW];
    let mut ahead = super::Prefetch::new(w, RW * rb, nb);
    for b in 0..nb {
        ahead.block();
        let mut hdr = [(0f32, 0f32, [0i16; 16], [0i16; 16]); RW];
        for (r, h) in hdr.iter_mut().enumerate() {
            *h = qk_header::<FMT>(w.add(r * rb + b * bb));
        }
        let mut isum = [[_mm256_setzero_si256(); MT]; RW];
        // Q4_K: the integer `Σ scale·dot` of each sub-block pair.
        let mut pair = [[[0i32; 4]; MT]; RW];
        for j in 0..8 {
            for r in 0..RW {
                let (q, scv) = qk_sub::<FMT>(w.add(r * rb + b * bb), j, &hdr[r].2);
                for (t, acc_t) in isum[r].iter_mut().enumerate() {
                    let xv = _mm256_loadu_si256(qx.add(t * cols + 256 * b + 32 * j).cast());
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scv);
                    *acc_t = _mm256_add_epi32(*acc_t, p);
                    if FMT == Q4K && j % 2 == 1 {
                        pair[r][t][j / 2] = hsum_epi32(*acc_t);
                        *acc_t = _mm256_setzero_si256();
                    }
                }
            }
        }
        // The weight mins (Q6_K: 32·scale) per 16, for the `Σ min·bsum` integer dot below.
        let mut mnv = [_mm256_setzero_si256(); RW];
        for (v, h) in mnv.iter_mut().zip(&hdr) {
            *v = _mm256_loadu_si256(h.3.as_ptr().cast());
        }
        for t in 0..MT {
            let d = *dx.add(t * nb + b);
            let bs = _mm256_loadu_si256(bsums.add(t * cols / 16 + 16 * b).cast());
            for r in 0..RW {
                let (wd, wmin, _, _) = &hdr[r];
                // Lane l: bsums of groups 2l and 2l+1 times their mins (exact integers; Q4_K: sub-block l).
                let mins = _mm256_madd_epi16(mnv[r], bs);
                let (a, am) = &mut acc_s[r][t];
                if FMT == Q4K {
                    let mut mn = [0i32; 8];
                    _mm256_storeu_si256(mn.as_mut_ptr().cast(), mins);
                    let (sd, md) = (wd * d, wmin * d);
                    if paths[t] == KPath::Grouped {
                        for (sb, &p) in pair[r][t].iter().enumerate() {
                            *a = (p as f32).mul_add(sd, *a);
                            *am = ((mn[2 * sb] + mn[2 * sb + 1]) as f32).mul_add(md, *am);
                        }
                    } else {
                        let p: i32 = pair[r][t].iter().sum();
                        *a = (p as f32).mul_add(sd, *a);
                        *am = (mn.iter().sum::<i32>() as f32).mul_add(md, *am);
                    }
                } else {
                    let lanes_i = _mm256_sub_epi32(isum[r][t], mins);
                    if paths[t] == KPath::Tiled {
                        *a = (wd * hsum_epi32(lanes_i) as f32).mul_add(d, *a);
                    } else {
                        let lanes = _mm256_cvtepi32_ps(lanes_i);
                        acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d * wd), lanes, acc[r][t]);
                    }
                }
            }
        }
    }
    for r in 0..RW {
        for t in 0..MT {
            *out.add(t * out_stride + r) = if FMT == Q4K {
                acc_s[r][t].0 - acc_s[r][t].1
            } else if paths[t] == KPath::Tiled {
                acc_s[r][t].0
            } else {
                super::hsum(acc[r][t])
            };
        }
    }
}

/// The sum of a vector's 8 int32 lanes.
#[inline(always)]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01)))
}

fn run_float<const FMT: u8>(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    // SAFETY: this kernel is only selected when the CPU has AVX2+FMA+F16C; shapes were checked by matmul.
    unsafe { run_float_impl::<FMT>(job, rows, ms) }
}

/// Loads 8 weights of any float format as f32.
#[inline(always)]
unsafe fn load8<const FMT: u8>(p: *const u8) -> __m256 {
    match FMT {
        F32 => _mm256_loadu_ps(p.cast()),
        F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        _ => _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())),
            16,
        )),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_float_impl<const FMT: u8>(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    let w = job.w;
    let (cols, total) = (w.cols(), w.rows());
    let rb = w.row_bytes();
    let es = if FMT == F32 { 4 } else { 2 };
    let x = job.x.as_ptr();
    let vec_cols = cols / 8 * 8;
    let mut j = ms.start;
    while j < ms.end {
        let mt = (ms.end - j).min(4);
        for i in rows.clone() {
            let wr = w.bytes().as_ptr().add(i * rb);
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut k = 0;
            while k < vec_cols {
                let wv = load8::<FMT>(wr.add(k * es));
                for (t, a) in acc.iter_mut().enumerate().take(mt) {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.add((j + t) * cols + k)), *a);
                }
                k += 8;
            }
            for (t, a) in acc.iter().enumerate().take(mt) {
                let mut s = super::hsum(*a);
                for kk in vec_cols..cols {
                    let wv = match FMT {
                        F32 => wr.add(kk * 4).cast::<f32>().read_unaligned(),
                        F16 => half::f16::from_bits(wr.add(kk * 2).cast::<u16>().read_unaligned())
                            .to_f32(),
                        _ => f32::from_bits(
                            (wr.add(kk * 2).cast::<u16>().read_unaligned() as u32) << 16,
                        ),
                    };
                    s += wv * *x.add((j + t) * cols + kk);
                }
                *job.out.0.add((j + t) * total + i) = s;
            }
        }
        j += mt;
    }
}

#[cfg(test)]
mod tests {
    use crate::dispatch::{cpu_isa, with_batch_orders, with_isa, Isa};
    use crate::matmul::tests::{quantized_matrix, rand_vec, ALL};
    use crate::matmul::{matmul, MatmulScratch};
    use crate::quant::DType;
    use crate::threads::ThreadPool;

    /// The AVX2 kernels of the 32-element formats (Q4_1's on the repacked layout) give the portable dot
    /// product's bits (both follow llama.cpp's order) for every tile shape and tail: groups of 4
    /// activation rows and single rows, odd weight-row and block counts, one and many blocks.
    #[test]
    fn avx2_q32_kernels_equal_portable_bitwise() {
        if cpu_isa() < Isa::Avx2 {
            return;
        }
        let pool = ThreadPool::new(2);
        for dt in [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q8_0] {
            for &(rows, cols, m) in &[
                (13, 256, 1),
                (9, 128, 13),
                (20, 96, 8),
                (7, 64, 37),
                (64, 576, 70),
                (3, 32, 12),
                (33, 1536, 19),
            ] {
                let w = quantized_matrix(dt, rows, cols, 31);
                let x = rand_vec(m * cols, 32);
                let mut scratch = MatmulScratch::default();
                let (mut a, mut b) = (vec![f32::NAN; m * rows], vec![f32::NAN; m * rows]);
                with_isa(Isa::Avx2, || matmul(&pool, &w, &x, m, &mut a, &mut scratch));
                with_isa(Isa::Portable, || {
                    matmul(&pool, &w, &x, m, &mut b, &mut scratch)
                });
                let (a, b): (Vec<u32>, Vec<u32>) = (
                    a.iter().map(|v| v.to_bits()).collect(),
                    b.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(a, b, "{dt:?} {rows}x{cols} m={m}");
            }
        }
    }

    /// The AVX2 K-quant kernels give the portable dot product's bits (both follow llama.cpp's AVX2 order)
    /// for every tile shape: 8, 4 and single activation rows, groups of 4 weight rows and their tails, with
    /// llama.cpp's batch-dependent kernels off and on.
    #[test]
    fn avx2_kquant_kernels_equal_portable_bitwise() {
        if cpu_isa() < Isa::Avx2 {
            return;
        }
        let pool = ThreadPool::new(2);
        for dt in [DType::Q4K, DType::Q6K] {
            for &(rows, cols, m) in &[
                (13, 256, 1),
                (9, 512, 13),
                (20, 768, 8),
                (7, 256, 37),
                (11, 512, 5),
            ] {
                let w = quantized_matrix(dt, rows, cols, 41);
                let x = rand_vec(m * cols, 42);
                let mut scratch = MatmulScratch::default();
                for orders in [false, true] {
                    let (mut a, mut b) = (vec![f32::NAN; m * rows], vec![f32::NAN; m * rows]);
                    with_batch_orders(orders, || {
                        with_isa(Isa::Avx2, || matmul(&pool, &w, &x, m, &mut a, &mut scratch));
                        with_isa(Isa::Portable, || {
                            matmul(&pool, &w, &x, m, &mut b, &mut scratch)
                        });
                    });
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&a),
                        bits(&b),
                        "{dt:?} {rows}x{cols} m={m} orders {orders}"
                    );
                }
            }
        }
    }

    /// The AVX2 K-quant kernels give every activation row the same bits whatever tile it falls in (8, 4 or 1
    /// rows at a time) as long as the same kernel computes it (`KPath`): a batch of 13 rows against each row
    /// alone — every row with llama.cpp's batch-dependent kernels off; with them on, for Q4_K only the last
    /// row (llama.cpp's repacked path sums the first 12, in groups of 4, per 64), for Q6_K none (llama.cpp
    /// tiles products of 8 rows or more).
    #[test]
    fn avx2_kquant_tiles_agree_bitwise() {
        if cpu_isa() < Isa::Avx2 {
            return;
        }
        let pool = ThreadPool::new(2);
        for (dt, orders, alone) in [
            (DType::Q4K, false, 0),
            (DType::Q6K, false, 0),
            (DType::Q4K, true, 12),
        ] {
            let (rows, cols, m) = (21, 768, 13);
            let w = quantized_matrix(dt, rows, cols, 5);
            let x = rand_vec(m * cols, 6);
            let mut scratch = MatmulScratch::default();
            let mut all = vec![f32::NAN; m * rows];
            with_batch_orders(orders, || {
                with_isa(Isa::Avx2, || {
                    matmul(&pool, &w, &x, m, &mut all, &mut scratch)
                })
            });
            for t in alone..m {
                let mut one = vec![f32::NAN; rows];
                with_batch_orders(orders, || {
                    with_isa(Isa::Avx2, || {
                        matmul(
                            &pool,
                            &w,
                            &x[t * cols..(t + 1) * cols],
                            1,
                            &mut one,
                            &mut scratch,
                        )
                    })
                });
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&all[t * rows..(t + 1) * rows]),
                    bits(&one),
                    "{dt:?} row {t}"
                );
            }
        }
    }

    /// Every SIMD kernel the CPU supports against the portable one, over shapes that hit every tile and
    /// tail path (odd block counts, row and activation-row remainders).
    #[test]
    fn simd_matmul_matches_portable() {
        let levels: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&l| l <= cpu_isa())
            .collect();
        let pool = ThreadPool::new(2);
        for level in levels {
            for dt in ALL {
                for &(rows, cols, m) in &[
                    (1, 256, 1),
                    (13, 256, 1),
                    (37, 512, 5),
                    (64, 768, 16),
                    (9, 256, 67),
                    (11, 288, 3),
                    (19, 96, 9),
                ] {
                    if cols % dt.block_len() != 0 {
                        continue;
                    }
                    let w = quantized_matrix(dt, rows, cols, 3);
                    let x = rand_vec(m * cols, 4);
                    let (mut a, mut b) = (vec![0f32; m * rows], vec![0f32; m * rows]);
                    let mut scratch = MatmulScratch::default();
                    with_isa(level, || matmul(&pool, &w, &x, m, &mut a, &mut scratch));
                    with_isa(Isa::Portable, || {
                        matmul(&pool, &w, &x, m, &mut b, &mut scratch)
                    });
                    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                        // Same quantized activations: only f32 summation order differs.
                        assert!(
                            (p - q).abs() <= 1e-4 * (1.0 + q.abs()) * (cols as f32).sqrt(),
                            "{level:?} {dt:?} {rows}x{cols} m={m}: [{i}] simd {p} vs portable {q}"
                        );
                    }
                }
            }
        }
    }
}
