//! AVX-512 VNNI matmul kernels for the 32-element GGML formats (Q4_0, Q4_1, Q5_0, Q8_0).
//!
//! One 512-bit register holds the same block of two weight rows (low and high 256 bits), and `vpdpbusd`
//! multiplies both by that block's activation bytes (broadcast to both halves), summing each group of
//! four products into an int32 lane (AVX2 needs `maddubs` + `madd` for half as many). Each half then
//! follows llama.cpp's x86 dot products for these formats (`ggml_vec_dot_q4_1_q8_1`,
//! `ggml_vec_dot_q5_0_q8_0`, `ggml_vec_dot_q8_0_q8_0`, llamafile's `tinyBLAS_Q0_AVX`) operation for operation: a block's 8 lane sums
//! are converted to f32 and fused-multiply-added into 8 accumulators with the scale `d_w·d_x`, block after
//! block, and the 8 lanes are summed at the end by ggml's `hsum_float_8`; Q4_1 adds its offsets `Σ m·s` as
//! a separate chain of fused multiply-adds. So the result is bit-identical to llama.cpp's and to this
//! crate's AVX2 kernel (tested).
//!
//! Signed weights are made unsigned and the error is taken back exactly in integers: Q4_0 stores `q + 8`,
//! Q5_0 `q + 16` and Q8_0 is flipped to `q + 128`, so `dot(q, x) = dot(q + c, x) − c·Σx`; the `c·Σx` per lane comes
//! from one more `vpdpbusd` per activation block, shared by every weight row of the tile, and seeds the
//! accumulator.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{q32_block_bytes, Q32Tile, Q4_0, Q4_1, Q5_0, Q8_0};
use crate::matmul::{Job, RangeKernel};
use crate::quant::DType;

/// The AVX-512 kernel for `dt`, if one exists (other formats use the AVX2 kernels).
pub(crate) fn kernel(dt: DType) -> Option<RangeKernel> {
    Some(match dt {
        DType::Q4_0 => run::<Q4_0>,
        DType::Q4_1 => run::<Q4_1>,
        DType::Q5_0 => run::<Q5_0>,
        DType::Q8_0 => run::<Q8_0>,
        _ => return None,
    })
}

fn run<const FMT: u8>(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    // SAFETY: this kernel is only selected when the CPU has AVX-512 F/BW/VL/VNNI and AVX2+FMA+F16C;
    // shapes were checked by matmul.
    unsafe { run_impl::<FMT>(job, rows, ms) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run_impl<const FMT: u8>(job: &Job, rows: Range<usize>, ms: Range<usize>) {
    let t = |i: usize, j: usize| Q32Tile::at(job, i, j);
    let mut j = ms.start;
    while j + 8 <= ms.end {
        let mut i = rows.start;
        while i < rows.end {
            let n = (rows.end - i).min(2);
            tile::<1, 8, FMT>(&t(i, j), n);
            i += n;
        }
        j += 8;
    }
    while j + 4 <= ms.end {
        let mut i = rows.start;
        while i + 4 <= rows.end {
            tile::<2, 4, FMT>(&t(i, j), 4);
            i += 4;
        }
        while i < rows.end {
            let n = (rows.end - i).min(2);
            tile::<1, 4, FMT>(&t(i, j), n);
            i += n;
        }
        j += 4;
    }
    while j < ms.end {
        let mut i = rows.start;
        while i + 8 <= rows.end {
            tile::<4, 1, FMT>(&t(i, j), 8);
            i += 8;
        }
        while i < rows.end {
            let n = (rows.end - i).min(2);
            tile::<1, 1, FMT>(&t(i, j), n);
            i += n;
        }
        j += 1;
    }
}

/// Block `b` of two weight rows at `p0` and `p1` (only `p0` when `two` is false; the upper half is then
/// zero): the 64 quants as unsigned bytes in element order, the scales `[d_r0 ×8 | d_r1 ×8]` and, for Q4_1,
/// the offsets `[m_r0 ×8 | m_r1 ×8]`.
#[inline(always)]
unsafe fn load_rows<const FMT: u8>(
    p0: *const u8,
    p1: *const u8,
    two: bool,
) -> (__m512i, __m512, __m512) {
    let hdr = |q: *const u8| -> i32 {
        if FMT == Q4_1 {
            q.cast::<i32>().read_unaligned()
        } else {
            q.cast::<u16>().read_unaligned() as i32
        }
    };
    let (h0, h1) = (hdr(p0), if two { hdr(p1) } else { 0 });
    // f16 [d0, m0, d1, m1] (Q4_1) or [d0, 0, d1, 0] → f32, then each spread over its 8 lanes.
    let f = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, h1, h0)));
    let d = _mm512_permutexvar_ps(
        _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
        f,
    );
    let m = if FMT == Q4_1 {
        _mm512_permutexvar_ps(
            _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
            f,
        )
    } else {
        _mm512_setzero_ps()
    };
    let q = if FMT == Q8_0 {
        let lo = _mm256_loadu_si256(p0.add(2).cast());
        let hi = if two {
            _mm256_loadu_si256(p1.add(2).cast())
        } else {
            _mm256_setzero_si256()
        };
        // A missing second row's flipped zeros cancel against the seed, so its lanes stay zero.
        let flip = _mm512_set1_epi8(-128);
        _mm512_xor_si512(
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
            flip,
        )
    } else {
        let qoff = match FMT {
            Q4_1 => 4,
            Q5_0 => 6,
            _ => 2,
        };
        let r0 = _mm_loadu_si128(p0.add(qoff).cast());
        let r1 = if two {
            _mm_loadu_si128(p1.add(qoff).cast())
        } else {
            _mm_setzero_si128()
        };
        let r = _mm256_set_m128i(r1, r0);
        let m4 = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(r, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), m4);
        // [lo0 lo1 hi0 hi1] → [lo0 hi0 lo1 hi1]: each row's block in element order.
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        let q = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
        if FMT == Q5_0 {
            // The fifth bits: bit j of a row's qh is element j's 16, row 1's in the upper 32 bytes.
            let qh = |q: *const u8| q.add(2).cast::<u32>().read_unaligned() as u64;
            let bits = qh(p0) | if two { qh(p1) << 32 } else { 0 };
            _mm512_or_si512(q, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)))
        } else {
            q
        }
    };
    (q, d, m)
}

/// out[t][r] for `n` (≤ 2·`RP`) weight rows, as `RP` row pairs, × `MT` activation rows, one block per step.
// Indexes run over weight row pairs and activation rows of several arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<const RP: usize, const MT: usize, const FMT: u8>(t: &Q32Tile, n: usize) {
    let bb = q32_block_bytes(FMT);
    let mut acc = [[_mm512_setzero_ps(); MT]; RP];
    // Q4_1's Σ m·s: every lane of a half holds the same chain.
    let mut offs = [[_mm512_setzero_ps(); MT]; RP];
    let mut ahead = super::Prefetch::new(t.w, n * t.rb, t.nb);
    for b in 0..t.nb {
        ahead.block();
        let mut wq = [_mm512_setzero_si512(); RP];
        let mut wd = [_mm512_setzero_ps(); RP];
        let mut wm = [_mm512_setzero_ps(); RP];
        for r in 0..RP {
            let p0 = t.w.add(2 * r * t.rb + b * bb);
            (wq[r], wd[r], wm[r]) = load_rows::<FMT>(p0, p0.wrapping_add(t.rb), 2 * r + 1 < n);
        }
        for m in 0..MT {
            let x =
                _mm512_broadcast_i64x4(_mm256_loadu_si256(t.qx.add(m * t.cols + 32 * b).cast()));
            let xd = _mm512_set1_ps(*t.dx.add(m * t.nb + b));
            // Integer seed −c·Σx per lane for the formats stored with an unsigned shift c.
            let seed = match FMT {
                Q4_0 => _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(8), x),
                ),
                Q5_0 => _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(16), x),
                ),
                Q8_0 => _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), x),
                ),
                _ => _mm512_setzero_si512(),
            };
            let xs = if FMT == Q4_1 {
                _mm512_set1_ps(*t.sx.add(m * t.nb + b))
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..RP {
                let dot = _mm512_dpbusd_epi32(seed, wq[r], x);
                acc[r][m] =
                    _mm512_fmadd_ps(_mm512_mul_ps(wd[r], xd), _mm512_cvtepi32_ps(dot), acc[r][m]);
                if FMT == Q4_1 {
                    offs[r][m] = _mm512_fmadd_ps(wm[r], xs, offs[r][m]);
                }
            }
        }
    }
    for r in 0..RP {
        for m in 0..MT {
            let (a, o) = (acc[r][m], offs[r][m]);
            let out = t.out.add(m * t.out_stride + 2 * r);
            let lo = super::hsum(_mm512_castps512_ps256(a));
            *out = if FMT == Q4_1 {
                lo + _mm_cvtss_f32(_mm512_castps512_ps128(o))
            } else {
                lo
            };
            if 2 * r + 1 < n {
                let hi = super::hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(a),
                )));
                *out.add(1) = if FMT == Q4_1 {
                    hi + _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_castpd_ps(
                        _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(o)),
                    )))
                } else {
                    hi
                };
            }
        }
    }
}
