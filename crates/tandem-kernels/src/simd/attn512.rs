//! AVX-512 paged attention over 16-token blocks for chunks of consecutive queries of one head (prefill)
//! and for single queries (decode).
//!
//! It computes exactly what `attention::attend_one` (llama.cpp's CPU attention order) computes for each
//! query, bit for bit, only faster: a chunk's queries share each K block, transposed once into
//! `[head_dim][16]`, so a query's 16 scores are broadcast FMAs into registers whose lanes are the block's
//! keys; every score still goes through the 32 partial sums and the reduction tree of llama.cpp's
//! `ggml_vec_dot_f32`. The scores are kept per query (a row from the first block on), then the softmax
//! numerators and the value sums run per query in the single-query order, with the value accumulators
//! (position mod 8) held in registers 32 dimensions at a time. A single query skips the transpose and
//! dots each key (`simd::dot_f32`'s operations). So a prompt recomputed in one prefill step gives
//! bit-identical results to the same tokens decoded one at a time (and to `attend_one`, tested):
//! preemption, P/D import and decode failover rely on it.

use std::arch::x86_64::*;

use super::chunk::{Half, QueryChunk, Span, BLOCK, MAX_HEAD_DIM, MAX_QUERIES};
use crate::attention::AttnParams;

/// Causal (optionally windowed) attention of the chunk's queries over its kv head; `scores` is grow-only
/// scratch.
///
/// # Safety
/// The CPU must have AVX-512F (and AVX2+FMA); `chunk::supports(p, c.n)` must hold; `c`'s pointers must
/// cover `c.n` rows; `c.blocks` must cover positions up to the last query's and lie inside `c.kv`.
// Indexes run over the chunk's queries in several arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn attend_chunk(p: &AttnParams, c: &QueryChunk, scores: &mut Vec<f32>) {
    let span = Span::new(p, c);
    let (hd, base, row_len) = (span.hd, span.base, span.row_len);
    scores.clear();
    scores.resize(c.n * row_len, f32::NEG_INFINITY);
    // Per-query running maxima, lane-wise (max is exact, so reducing once at the end changes nothing).
    let mut m = [_mm512_set1_ps(f32::NEG_INFINITY); MAX_QUERIES];
    let mut kt = [0f32; MAX_HEAD_DIM * BLOCK];
    let scale = _mm512_set1_ps(p.scale);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    for (bpos, b) in span.blocks(c.blocks) {
        let kb = span.at(c, b, Half::K, 0);
        // A chunk transposes every slot once for all its queries, also those past the last query (stale
        // or zero): their scores are replaced by -inf below, whatever they hold. A single query (decode)
        // dots each key instead, with the same operations (`simd::dot_f32`).
        if c.n > 1 {
            for d0 in (0..hd).step_by(16) {
                transpose16(kb.add(d0), hd, kt.as_mut_ptr().add(d0 * BLOCK));
            }
        }
        for i in 0..c.n {
            let Some((pos, lo)) = span.sees(i, bpos) else {
                continue;
            };
            let (j0, j1) = (lo.saturating_sub(bpos), (pos + 1 - bpos).min(BLOCK));
            let mask = (((1u32 << j1) - 1) & !((1u32 << j0) - 1)) as __mmask16;
            let qi = c.q.add(i * c.stride);
            let s = if c.n > 1 {
                scores16(qi, &kt, hd)
            } else {
                let mut one = [0f32; BLOCK];
                for (j, o) in one.iter_mut().enumerate().take(j1).skip(j0) {
                    *o = dot512(qi, kb.add(j * hd), hd);
                }
                _mm512_loadu_ps(one.as_ptr())
            };
            let s = _mm512_mask_mov_ps(neg_inf, mask, _mm512_mul_ps(s, scale));
            _mm512_storeu_ps(scores.as_mut_ptr().add(i * row_len + bpos - base), s);
            m[i] = _mm512_max_ps(m[i], s);
        }
    }
    let mut inv = [0f32; MAX_QUERIES];
    for (i, &mv) in m.iter().enumerate().take(c.n) {
        let mi = _mm512_reduce_max_ps(mv);
        let pos = c.first_pos + i;
        let row = &mut scores[i * row_len..(i + 1) * row_len];
        // Whole chunks of 8 from `base` (a multiple of 8) through the query's own position; the chunks
        // before the window are all -inf and add exactly 0 to the sum.
        inv[i] = (1.0
            / super::softmax_numerators(&mut row[..(pos + 1).next_multiple_of(8) - base], mi))
            as f32;
    }
    let halves = hd / 32;
    if c.n == 1 {
        let (pos, lo) = (c.first_pos, span.window_start(c.first_pos));
        for h in 0..halves {
            values32(scores, lo, pos, inv[0], &span, c, 32 * h, c.out.add(32 * h));
        }
        return;
    }
    // A chunk sums values block by block, so each V block stays in L1 for all the queries: a query's 8
    // accumulators (position mod 8) of 32 dimensions live in scratch between blocks and go through
    // registers for the block's positions, in the same order as `values32`.
    scores.resize(c.n * row_len + c.n * halves * 8 * 32, 0.0);
    let (rows, acc) = scores.split_at_mut(c.n * row_len);
    for (bpos, b) in span.blocks(c.blocks) {
        let vb = span.at(c, b, Half::V, 0);
        for i in 0..c.n {
            let Some((pos, lo)) = span.sees(i, bpos) else {
                continue;
            };
            let row = &rows[i * row_len..(i + 1) * row_len];
            for h in 0..halves {
                let ap = acc.as_mut_ptr().add((i * halves + h) * 8 * 32);
                values_block(row, base, bpos, lo, pos, inv[i], vb.add(32 * h), hd, ap);
            }
        }
    }
    for i in 0..c.n {
        for h in 0..halves {
            let ap = acc.as_ptr().add((i * halves + h) * 8 * 32);
            let out = c.out.add(i * c.stride + 32 * h);
            for k in 0..2 {
                let s = |r: usize| _mm512_loadu_ps(ap.add(32 * r + 16 * k));
                let y = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(s(4), s(0)), _mm512_add_ps(s(6), s(2))),
                    _mm512_add_ps(_mm512_add_ps(s(5), s(1)), _mm512_add_ps(s(7), s(3))),
                );
                _mm512_storeu_ps(out.add(16 * k), y);
            }
        }
    }
}

/// Positions `g..g + 8` (those in `lo..=pos`) added into a query's 8 accumulators of 32 value dimensions
/// (`[position mod 8][two halves]`), from values at `vg` (row stride `hd`), with weights
/// `row[p - base] · inv`. Constant trip counts keep the accumulators in registers; a whole group takes
/// the unconditional loop.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn value_group(
    a: &mut [[__m512; 2]; 8],
    row: &[f32],
    base: usize,
    g: usize,
    lo: usize,
    pos: usize,
    inv: f32,
    vg: *const f32,
    hd: usize,
) {
    let (r0, r1) = (lo.saturating_sub(g), (pos + 1 - g).min(8));
    if r0 == 0 && r1 == 8 {
        for r in 0..8 {
            let w = _mm512_set1_ps(*row.get_unchecked(g + r - base) * inv);
            let v = vg.add(r * hd);
            a[r][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a[r][0]);
            a[r][1] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v.add(16)), a[r][1]);
        }
    } else {
        for r in 0..8 {
            if r >= r0 && r < r1 {
                let w = _mm512_set1_ps(*row.get_unchecked(g + r - base) * inv);
                let v = vg.add(r * hd);
                a[r][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a[r][0]);
                a[r][1] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v.add(16)), a[r][1]);
            }
        }
    }
}

/// One block's positions (`bpos..bpos + 16`, those in `lo..=pos`) added into a query's 8 accumulators of
/// 32 value dimensions at `acc` (`[position mod 8][32]`), from the block's values at `vb` (row stride
/// `hd`, already offset to the 32 dimensions), with weights `row[p - base] · inv`.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn values_block(
    row: &[f32],
    base: usize,
    bpos: usize,
    lo: usize,
    pos: usize,
    inv: f32,
    vb: *const f32,
    hd: usize,
    acc: *mut f32,
) {
    let mut a = [[_mm512_setzero_ps(); 2]; 8];
    for r in 0..8 {
        a[r][0] = _mm512_loadu_ps(acc.add(32 * r));
        a[r][1] = _mm512_loadu_ps(acc.add(32 * r + 16));
    }
    for g in [bpos, bpos + 8] {
        if g > pos {
            break;
        }
        value_group(
            &mut a,
            row,
            base,
            g,
            lo,
            pos,
            inv,
            vb.add((g - bpos) * hd),
            hd,
        );
    }
    for r in 0..8 {
        _mm512_storeu_ps(acc.add(32 * r), a[r][0]);
        _mm512_storeu_ps(acc.add(32 * r + 16), a[r][1]);
    }
}

/// `simd::dot_f32` (llama.cpp's `ggml_vec_dot_f32` order) for `hd` a multiple of 32, with its four 8-lane
/// accumulators packed two per 512-bit register: the same operations, half the instructions.
#[inline(always)]
unsafe fn dot512(a: *const f32, b: *const f32, hd: usize) -> f32 {
    // [acc0 | acc1] and [acc2 | acc3].
    let (mut s01, mut s23) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i < hd {
        s01 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), s01);
        s23 = _mm512_fmadd_ps(
            _mm512_loadu_ps(a.add(i + 16)),
            _mm512_loadu_ps(b.add(i + 16)),
            s23,
        );
        i += 32;
    }
    // [acc0 + acc2 | acc1 + acc3], then (acc0 + acc2) + (acc1 + acc3).
    let s = _mm512_add_ps(s01, s23);
    let x = _mm256_add_ps(
        _mm512_castps512_ps256(s),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s))),
    );
    let t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let t1 = _mm_hadd_ps(t0, t0);
    _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
}

/// `out[t][j] = src[j·stride + t]` for a 16 × 16 tile (t, j < 16): 16 rows of keys to 16 columns of one
/// dimension each, by in-register shuffles (a scalar loop compiles to gathers).
#[inline(always)]
unsafe fn transpose16(src: *const f32, stride: usize, out: *mut f32) {
    let r: [__m512; 16] = std::array::from_fn(|j| _mm512_loadu_ps(src.add(j * stride)));
    // Pairs of rows interleaved, then pairs of pairs, then 128-bit lanes across 4 and 8 rows.
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let g = 4 * (i / 4);
        let (a, b) = (t[g + (i % 2)], t[g + 2 + (i % 2)]);
        if (i / 2) % 2 == 0 {
            _mm512_shuffle_ps::<0x44>(a, b)
        } else {
            _mm512_shuffle_ps::<0xEE>(a, b)
        }
    });
    let v: [__m512; 16] = std::array::from_fn(|i| {
        let g = 8 * (i / 8);
        let (a, b) = (u[g + (i % 4)], u[g + 4 + (i % 4)]);
        if (i / 4) % 2 == 0 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xDD>(a, b)
        }
    });
    for i in 0..16 {
        let (a, b) = (v[i % 8], v[8 + (i % 8)]);
        let w = if i < 8 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xDD>(a, b)
        };
        _mm512_storeu_ps(out.add(TRANSPOSE_ORDER[i] * BLOCK), w);
    }
}

/// Which dimension (column of the input tile) each output of `transpose16`'s last stage holds.
const TRANSPOSE_ORDER: [usize; 16] = [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15];

/// 16 keys' scores (unscaled) for one query from the transposed block `kt` (`[d][16]`), each as llama.cpp's
/// AVX2 `ggml_vec_dot_f32` forms it: partial sum `k` (0..32) adds `q[32s + k] · key[32s + k]` over the
/// steps `s` by fused multiply-adds from 0, then `x_l = (P_l + P_16+l) + (P_8+l + P_24+l)`,
/// `t_l = x_l + x_l+4` and `(t_0 + t_1) + (t_2 + t_3)` (see `simd::dot_f32`).
#[inline(always)]
unsafe fn scores16(q: *const f32, kt: &[f32], hd: usize) -> __m512 {
    let mut x = [_mm512_setzero_ps(); 8];
    for (l, xl) in x.iter_mut().enumerate() {
        let mut pk = [_mm512_setzero_ps(); 4];
        for (j, a) in pk.iter_mut().enumerate() {
            let k = 8 * j + l;
            let mut s = 0;
            while s < hd {
                let d = s + k;
                *a = _mm512_fmadd_ps(
                    _mm512_set1_ps(*q.add(d)),
                    _mm512_loadu_ps(kt.as_ptr().add(d * BLOCK)),
                    *a,
                );
                s += 32;
            }
        }
        *xl = _mm512_add_ps(_mm512_add_ps(pk[0], pk[2]), _mm512_add_ps(pk[1], pk[3]));
    }
    let t0 = _mm512_add_ps(x[0], x[4]);
    let t1 = _mm512_add_ps(x[1], x[5]);
    let t2 = _mm512_add_ps(x[2], x[6]);
    let t3 = _mm512_add_ps(x[3], x[7]);
    _mm512_add_ps(_mm512_add_ps(t0, t1), _mm512_add_ps(t2, t3))
}

/// `out[0..32]` of one query: value dimensions `d0..d0 + 32` summed over positions `lo..=pos` with
/// weights `row[p - span.base] · inv`, in 8 accumulators by position mod 8 (fused multiply-adds in position
/// order), reduced like llamafile's `hsum` — `attend_one`'s order.
// Constant-count index loops keep the 16 accumulators in registers (iterator adaptors over `acc` made
// the compiler keep them in memory).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn values32(
    row: &[f32],
    lo: usize,
    pos: usize,
    inv: f32,
    span: &Span,
    c: &QueryChunk,
    d0: usize,
    out: *mut f32,
) {
    let (hd, base) = (span.hd, span.base);
    let mut acc = [[_mm512_setzero_ps(); 2]; 8];
    let mut g = lo / 8 * 8;
    while g <= pos {
        let b = *c.blocks.get_unchecked(g / BLOCK) as usize;
        let vb = span.at(c, b, Half::V, g % BLOCK).add(d0);
        value_group(&mut acc, row, base, g, lo, pos, inv, vb, hd);
        g += 8;
    }
    for h in 0..2 {
        let y = _mm512_add_ps(
            _mm512_add_ps(
                _mm512_add_ps(acc[4][h], acc[0][h]),
                _mm512_add_ps(acc[6][h], acc[2][h]),
            ),
            _mm512_add_ps(
                _mm512_add_ps(acc[5][h], acc[1][h]),
                _mm512_add_ps(acc[7][h], acc[3][h]),
            ),
        );
        _mm512_storeu_ps(out.add(16 * h), y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_transposes() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let stride = 40;
        let src: Vec<f32> = (0..16 * stride).map(|i| i as f32).collect();
        let mut out = vec![0f32; 256];
        unsafe { transpose16_test(src.as_ptr(), stride, out.as_mut_ptr()) };
        for t in 0..16 {
            for j in 0..16 {
                assert_eq!(out[t * 16 + j], src[j * stride + t], "t {t} j {j}");
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn transpose16_test(src: *const f32, stride: usize, out: *mut f32) {
        transpose16(src, stride, out)
    }
}
