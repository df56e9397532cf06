//! AVX-512 VNNI matmul kernels for the 32-element GGML formats (Q4_0, Q4_1, Q8_0).
//!
//! One 512-bit register holds two weight blocks, and `vpdpbusd` multiplies 64 unsigned weight bytes by 64
//! signed activation bytes and sums each group of four into an int32 lane in one instruction (AVX2 needs
//! `maddubs` + `madd` for half as many). Every lane group of 8 int32s then belongs to one block, so the
//! per-block scales are applied as a vector multiply of `[d_b ×8 | d_b+1 ×8]`.
//!
//! Signed weights are made unsigned and the error is taken back exactly in integers: Q4_0 stores `q + 8`
//! and Q8_0 is flipped to `q + 128`, so `dot(q, x) = dot(q + c, x) − c·Σx`; the `c·Σx` per lane comes
//! from one more `vpdpbusd` per activation block, shared by every weight row of the tile, and seeds the
//! accumulator. Q4_1's offset `m` is a float, so it is added as `m · d_x·Σx` in f32 (`sx` of the acts).

use std::arch::x86_64::*;
use std::ops::Range;

use super::{q32_block_bytes, Q4_0, Q4_1, Q8_0};
use crate::matmul::{Job, RangeKernel};
use crate::quant::DType;

/// The AVX-512 kernel for `dt`, if one exists (other formats use the AVX2 kernels).
pub(crate) fn kernel(dt: DType) -> Option<RangeKernel> {
    Some(match dt {
        DType::Q4_0 => run::<Q4_0>,
        DType::Q4_1 => run::<Q4_1>,
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
    let w = job.w;
    let (cols, total) = (w.cols(), w.rows());
    let rb = w.row_bytes();
    let nb = cols / 32;
    let a = &job.acts;
    let wp = w.bytes().as_ptr();
    let t = |i: usize, j: usize| Tile {
        w: wp.add(i * rb),
        rb,
        nb,
        qx: a.qx.as_ptr().add(j * cols),
        dx: a.dx.as_ptr().add(j * nb),
        sx: a.sx.as_ptr().add(j * nb),
        cols,
        out: job.out.0.add(j * total + i),
        out_stride: total,
    };
    let mut j = ms.start;
    while j + 8 <= ms.end {
        let mut i = rows.start;
        while i + 2 <= rows.end {
            tile::<2, 8, FMT>(&t(i, j));
            i += 2;
        }
        while i < rows.end {
            tile::<1, 8, FMT>(&t(i, j));
            i += 1;
        }
        j += 8;
    }
    while j + 4 <= ms.end {
        let mut i = rows.start;
        while i + 3 <= rows.end {
            tile::<3, 4, FMT>(&t(i, j));
            i += 3;
        }
        while i < rows.end {
            tile::<1, 4, FMT>(&t(i, j));
            i += 1;
        }
        j += 4;
    }
    while j < ms.end {
        let mut i = rows.start;
        while i + 4 <= rows.end {
            tile::<4, 1, FMT>(&t(i, j));
            i += 4;
        }
        while i < rows.end {
            tile::<1, 1, FMT>(&t(i, j));
            i += 1;
        }
        j += 1;
    }
}

/// Where one tile reads and writes: `RW` weight rows from `w` (stride `rb`) × `MT` activation rows from `qx`.
struct Tile {
    w: *const u8,
    rb: usize,
    nb: usize,
    qx: *const i8,
    dx: *const f32,
    sx: *const f32,
    cols: usize,
    out: *mut f32,
    out_stride: usize,
}

/// Two weight blocks `b` and `b + 1` (only `b` when `two` is false; the upper half is then zero): the 64
/// quants as unsigned bytes in element order, the scales `[d_b ×8 | d_b+1 ×8]` and, for Q4_1, the offsets
/// `[m_b ×8 | m_b+1 ×8]`.
#[inline(always)]
unsafe fn load_pair<const FMT: u8>(p: *const u8, two: bool) -> (__m512i, __m512, __m512) {
    let bb = q32_block_bytes(FMT);
    let hdr = |q: *const u8| -> i32 {
        if FMT == Q4_1 {
            q.cast::<i32>().read_unaligned()
        } else {
            q.cast::<u16>().read_unaligned() as i32
        }
    };
    let (h0, h1) = (hdr(p), if two { hdr(p.add(bb)) } else { 0 });
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
        let lo = _mm256_loadu_si256(p.add(2).cast());
        let hi = if two {
            _mm256_loadu_si256(p.add(bb + 2).cast())
        } else {
            _mm256_setzero_si256()
        };
        // A missing second block's flipped zeros meet zeroed activations, so its lanes stay zero.
        let flip = _mm512_set1_epi8(-128);
        _mm512_xor_si512(
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
            flip,
        )
    } else {
        let qoff = if FMT == Q4_1 { 4 } else { 2 };
        let r0 = _mm_loadu_si128(p.add(qoff).cast());
        let r1 = if two {
            _mm_loadu_si128(p.add(bb + qoff).cast())
        } else {
            _mm_setzero_si128()
        };
        let r = _mm256_set_m128i(r1, r0);
        let m4 = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(r, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), m4);
        // [lo0 lo1 hi0 hi1] → [lo0 hi0 lo1 hi1]: element order of two consecutive blocks.
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z)
    };
    (q, d, m)
}

/// The f32 values `v[b]` and `v[b + 1]` (0 when `two` is false) spread as `[v_b ×8 | v_b+1 ×8]`.
#[inline(always)]
unsafe fn pair_lanes(v: *const f32, two: bool) -> __m512 {
    let x = if two {
        _mm_castpd_ps(_mm_load_sd(v.cast()))
    } else {
        _mm_load_ss(v)
    };
    _mm512_permutexvar_ps(
        _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_castps128_ps512(x),
    )
}

/// out[t][r] for `RW` weight rows × `MT` activation rows, two blocks per step.
// Indexes run over weight rows and activation rows of several arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<const RW: usize, const MT: usize, const FMT: u8>(t: &Tile) {
    let bb = q32_block_bytes(FMT);
    let mut acc = [[_mm512_setzero_ps(); MT]; RW];
    let mut b = 0;
    while b < t.nb {
        let two = b + 1 < t.nb;
        if MT == 1 {
            // m = 1 (decode) streams every weight byte once: ask for the rows two tiles ahead now so their
            // lines arrive while this tile computes (past the end is harmless; `wrapping_add` keeps the
            // address arithmetic defined).
            for r in 0..RW {
                let ahead = t.w.wrapping_add((r + 2 * RW) * t.rb + b * bb);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>());
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(2 * bb - 1).cast::<i8>());
            }
        }
        let mut wq = [_mm512_setzero_si512(); RW];
        let mut wd = [_mm512_setzero_ps(); RW];
        let mut wm = [_mm512_setzero_ps(); RW];
        for r in 0..RW {
            (wq[r], wd[r], wm[r]) = load_pair::<FMT>(t.w.add(r * t.rb + b * bb), two);
        }
        for m in 0..MT {
            let xp = t.qx.add(m * t.cols + 32 * b);
            let x = if two {
                _mm512_loadu_si512(xp.cast())
            } else {
                _mm512_zextsi256_si512(_mm256_loadu_si256(xp.cast()))
            };
            let xd = pair_lanes(t.dx.add(m * t.nb + b), two);
            // Integer seed −c·Σx per lane for the formats stored with an unsigned shift c.
            let seed = match FMT {
                Q4_0 => _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(8), x),
                ),
                Q8_0 => _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), x),
                ),
                _ => _mm512_setzero_si512(),
            };
            // Q4_1: m·d_x·Σx per block, spread over the block's 8 lanes (the final sum adds them back).
            let xs = if FMT == Q4_1 {
                _mm512_mul_ps(
                    pair_lanes(t.sx.add(m * t.nb + b), two),
                    _mm512_set1_ps(0.125),
                )
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..RW {
                let dot = _mm512_dpbusd_epi32(seed, wq[r], x);
                let mut a =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wd[r], xd), acc[r][m]);
                if FMT == Q4_1 {
                    a = _mm512_fmadd_ps(wm[r], xs, a);
                }
                acc[r][m] = a;
            }
        }
        b += 2;
    }
    for (r, row) in acc.iter().enumerate() {
        for (m, a) in row.iter().enumerate() {
            *t.out.add(m * t.out_stride + r) = _mm512_reduce_add_ps(*a);
        }
    }
}
