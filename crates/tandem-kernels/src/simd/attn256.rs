//! AVX2 paged attention over 16-token blocks for chunks of consecutive queries of one head (prefill) and
//! for single queries (decode): the 256-bit form of `attn512`.
//!
//! It computes exactly what `attention::attend_one` (llama.cpp's CPU attention order) computes for each
//! query, bit for bit, only faster: a chunk's queries share each K block, transposed once into
//! `[head_dim][16]`, so a query's 16 scores are broadcast FMAs into two registers whose lanes are the
//! block's keys; every score still goes through the 32 partial sums and the reduction tree of llama.cpp's
//! `ggml_vec_dot_f32`. A single query dots 8 keys at a time from the cache's own layout instead, their
//! last reductions in one register (`scores8_rows`). The value sums keep
//! `attend_one`'s 8 accumulators (position mod 8) per dimension in registers over the whole context. A
//! chunk transposes the V blocks too, into `[head_dim][position]`, so that one register holds 8
//! consecutive positions of one dimension — exactly the 8 accumulators' lanes: a query's weights of 8
//! positions are one load shared by 8 dimensions, and 8 dimensions' values over the whole context (16
//! KiB at 512 positions) stay in L1 while every query of the chunk sums them. A single query sums from
//! the cache's own layout, 8 dimensions at a time over tiles of 64 positions (`values_tiled`).

use std::arch::x86_64::*;

use super::chunk::{Half, QueryChunk, Span, BLOCK, MAX_HEAD_DIM, MAX_QUERIES};
use crate::attention::AttnParams;

/// Causal (optionally windowed) attention of the chunk's queries over its kv head; `scores` is grow-only
/// scratch.
///
/// # Safety
/// The CPU must have AVX2+FMA; `chunk::supports(p, c.n)` must hold; `c`'s pointers must cover `c.n`
/// rows; `c.blocks` must cover positions up to the last query's and lie inside `c.kv`.
// Indexes run over the chunk's queries in several arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn attend_chunk(p: &AttnParams, c: &QueryChunk, scores: &mut Vec<f32>) {
    let span = Span::new(p, c);
    let (hd, base, row_len) = (span.hd, span.base, span.row_len);
    // For a chunk, V transposed goes first: dimension d's values of positions base.. are row d of `vt`.
    // Every entry of it is written before it is read, so only the scores are reset.
    let vt_len = if c.n > 1 { hd * row_len } else { 0 };
    let need = vt_len + c.n * row_len;
    if scores.len() < need {
        scores.resize(need, 0.0);
    }
    let (vt, scores) = scores[..need].split_at_mut(vt_len);
    scores.fill(f32::NEG_INFINITY);
    // Per-query running maxima, lane-wise (max is exact, so reducing once at the end changes nothing).
    let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); MAX_QUERIES];
    let mut kt = [0f32; MAX_HEAD_DIM * BLOCK];
    let scale = _mm256_set1_ps(p.scale);
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let lane_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let lane_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    for (bpos, b) in span.blocks(c.blocks) {
        let kb = span.at(c, b, Half::K, 0);
        // A chunk transposes every slot once for all its queries, also those past the last query (stale
        // or zero): their scores are replaced by -inf below, whatever they hold.
        if c.n > 1 {
            let vb = span.at(c, b, Half::V, 0);
            for d0 in (0..hd).step_by(8) {
                for j0 in [0, 8] {
                    transpose8(
                        kb.add(j0 * hd + d0),
                        hd,
                        kt.as_mut_ptr().add(d0 * BLOCK + j0),
                        BLOCK,
                    );
                    transpose8(
                        vb.add(j0 * hd + d0),
                        hd,
                        vt.as_mut_ptr().add(d0 * row_len + bpos - base + j0),
                        row_len,
                    );
                }
            }
        }
        for i in 0..c.n {
            let Some((pos, lo)) = span.sees(i, bpos) else {
                continue;
            };
            let (j0, j1) = (lo.saturating_sub(bpos), (pos + 1 - bpos).min(BLOCK));
            let qi = c.q.add(i * c.stride);
            let (s_lo, s_hi) = if c.n > 1 {
                // The usual heads get loops of constant length, fully unrolled.
                match hd {
                    64 => scores16(qi, &kt, 64),
                    128 => scores16(qi, &kt, 128),
                    _ => scores16(qi, &kt, hd),
                }
            } else {
                // Keys of a half with no position of the query's are not dotted (their lanes are masked).
                let half = |h: usize| j0 < 8 * h + 8 && j1 > 8 * h;
                let lo_keys = if half(0) {
                    scores8_rows(qi, kb, hd)
                } else {
                    neg_inf
                };
                let hi_keys = if half(1) {
                    scores8_rows(qi, kb.add(8 * hd), hd)
                } else {
                    neg_inf
                };
                (lo_keys, hi_keys)
            };
            // Lanes j0..j1 are the query's positions in this block; the rest are masked to -inf.
            let (v0, v1) = (
                _mm256_set1_epi32(j0 as i32 - 1),
                _mm256_set1_epi32(j1 as i32),
            );
            let keep = |lanes: __m256i| {
                _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_cmpgt_epi32(lanes, v0),
                    _mm256_cmpgt_epi32(v1, lanes),
                ))
            };
            let s_lo = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(s_lo, scale), keep(lane_lo));
            let s_hi = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(s_hi, scale), keep(lane_hi));
            let dst = scores.as_mut_ptr().add(i * row_len + bpos - base);
            _mm256_storeu_ps(dst, s_lo);
            _mm256_storeu_ps(dst.add(8), s_hi);
            m[i] = _mm256_max_ps(m[i], _mm256_max_ps(s_lo, s_hi));
        }
    }
    for i in 0..c.n {
        let mi = super::hmax(m[i]);
        let pos = c.first_pos + i;
        let row = &mut scores[i * row_len..(i + 1) * row_len];
        // Whole chunks of 8 from `base` (a multiple of 8) through the query's own position; the chunks
        // before the window are all -inf and add exactly 0 to the sum.
        let used = (pos + 1).next_multiple_of(8) - base;
        let inv = (1.0 / super::softmax_numerators(&mut row[..used], mi)) as f32;
        // The value weights `numerator · inv`, the same f32 product `attend_one` forms per position.
        let vi = _mm256_set1_ps(inv);
        for k in (0..used).step_by(8) {
            let w = row.as_mut_ptr().add(k);
            _mm256_storeu_ps(w, _mm256_mul_ps(_mm256_loadu_ps(w), vi));
        }
        if c.n == 1 {
            values_tiled(
                row,
                span.window_start(pos),
                pos,
                &span,
                c,
                c.out.add(i * c.stride),
            );
        }
    }
    if c.n > 1 {
        // Dimensions outer, queries inner: 8 rows of `vt` serve every query of the chunk from L1.
        for d0 in (0..hd).step_by(8) {
            for i in 0..c.n {
                let pos = c.first_pos + i;
                values8_t(
                    &scores[i * row_len..(i + 1) * row_len],
                    base,
                    span.window_start(pos),
                    pos,
                    vt.as_ptr().add(d0 * row_len),
                    row_len,
                    c.out.add(i * c.stride + d0),
                );
            }
        }
    }
}

/// `values_tiled`'s sums from the transposed values: `vt` is row `d0` of `[head_dim][position]`, row k
/// (`k < 8`) at `vt + k·row_len`, position `p` at column `p - base`. Register k holds dimension d0 + k's
/// 8 accumulators, lane r the positions ≡ r (mod 8) — the same fused multiply-adds in the same order;
/// lanes outside `lo..=pos` keep their accumulator (a blend, as `values_tiled` skips them).
// Constant-count index loops keep the 8 accumulators in registers.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn values8_t(
    w: &[f32],
    base: usize,
    lo: usize,
    pos: usize,
    vt: *const f32,
    row_len: usize,
    out: *mut f32,
) {
    let mut acc = [_mm256_setzero_ps(); 8];
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mut g = lo / 8 * 8;
    while g <= pos {
        let off = g - base;
        let wv = _mm256_loadu_ps(w.as_ptr().add(off));
        let (r0, r1) = (lo.saturating_sub(g), (pos + 1 - g).min(8));
        if r0 == 0 && r1 == 8 {
            for k in 0..8 {
                let v = _mm256_loadu_ps(vt.add(k * row_len + off));
                acc[k] = _mm256_fmadd_ps(wv, v, acc[k]);
            }
        } else {
            let keep = _mm256_castsi256_ps(_mm256_and_si256(
                _mm256_cmpgt_epi32(lanes, _mm256_set1_epi32(r0 as i32 - 1)),
                _mm256_cmpgt_epi32(_mm256_set1_epi32(r1 as i32), lanes),
            ));
            for k in 0..8 {
                let v = _mm256_loadu_ps(vt.add(k * row_len + off));
                acc[k] = _mm256_blendv_ps(acc[k], _mm256_fmadd_ps(wv, v, acc[k]), keep);
            }
        }
        g += 8;
    }
    // Lane r of register k to register r, lane k: then `values_tiled`'s reduction, 8 dimensions at once.
    _mm256_storeu_ps(out, hsum_tree(&transpose8_regs(acc)));
}

/// Positions per tile of `values_tiled`: their values (16 KiB for 64-wide heads) stay in L1 while every
/// 8 dimensions are summed over them.
const TILE: usize = 64;

/// `out[0..hd]` of one query: every value dimension summed over positions `lo..=pos` with the weights
/// `w[p - base]`, per dimension in 8 accumulators by position mod 8 (fused multiply-adds in position
/// order), reduced like llamafile's `hsum` — `attend_one`'s order. The 8 accumulators of 8 dimensions are
/// one register each, so the context is walked in tiles and, per tile, once per 8 dimensions: each
/// position's values are read from memory once, not once per 8 dimensions.
// Constant-count index loops keep the 8 accumulators in registers.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn values_tiled(
    w: &[f32],
    lo: usize,
    pos: usize,
    span: &Span,
    c: &QueryChunk,
    out: *mut f32,
) {
    let (hd, base) = (span.hd, span.base);
    // Accumulator r of dimensions d0..d0 + 8 at acc[d0 + r].
    let mut acc = [_mm256_setzero_ps(); MAX_HEAD_DIM];
    let mut t0 = lo / 8 * 8;
    while t0 <= pos {
        let t1 = (t0 + TILE).min(pos + 1);
        for d0 in (0..hd).step_by(8) {
            let mut a = [_mm256_setzero_ps(); 8];
            a.copy_from_slice(&acc[d0..d0 + 8]);
            let mut g = t0;
            while g < t1 {
                let b = *c.blocks.get_unchecked(g / BLOCK) as usize;
                let vg = span.at(c, b, Half::V, g % BLOCK).add(d0);
                let wg = w.as_ptr().add(g - base);
                let (r0, r1) = (lo.saturating_sub(g), (pos + 1 - g).min(8));
                if r0 == 0 && r1 == 8 {
                    for r in 0..8 {
                        let wv = _mm256_broadcast_ss(&*wg.add(r));
                        a[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vg.add(r * hd)), a[r]);
                    }
                } else {
                    for r in 0..8 {
                        if r >= r0 && r < r1 {
                            let wv = _mm256_broadcast_ss(&*wg.add(r));
                            a[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vg.add(r * hd)), a[r]);
                        }
                    }
                }
                g += 8;
            }
            acc[d0..d0 + 8].copy_from_slice(&a);
        }
        t0 += TILE;
    }
    for d0 in (0..hd).step_by(8) {
        _mm256_storeu_ps(out.add(d0), hsum_tree(&acc[d0..d0 + 8]));
    }
}

/// llamafile's `hsum` of 8 accumulators, lane by lane: `((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))`.
#[inline(always)]
unsafe fn hsum_tree(a: &[__m256]) -> __m256 {
    _mm256_add_ps(
        _mm256_add_ps(_mm256_add_ps(a[4], a[0]), _mm256_add_ps(a[6], a[2])),
        _mm256_add_ps(_mm256_add_ps(a[5], a[1]), _mm256_add_ps(a[7], a[3])),
    )
}

/// Scores (unscaled) of one query against the 8 keys at `k`, `k + hd`, …: lane j is key j's
/// `ggml_vec_dot_f32` (`simd::dot_f32`, whose lanes `simd::dot_f32_lanes` gives), the last reductions of 8 keys done together — `t_l = x_l +
/// x_l+4` of keys j and j + 4 in one register, then two `hadd`s give `(t_0 + t_1) + (t_2 + t_3)` of each
/// key in key order.
#[inline(always)]
unsafe fn scores8_rows(q: *const f32, k: *const f32, hd: usize) -> __m256 {
    // The usual heads get loops of constant length, fully unrolled.
    match hd {
        64 => scores8_rows_n(q, k, 64),
        128 => scores8_rows_n(q, k, 128),
        _ => scores8_rows_n(q, k, hd),
    }
}

// Index loops (no iterators) keep every intrinsic in the inlined body of a target-feature function.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn scores8_rows_n(q: *const f32, k: *const f32, hd: usize) -> __m256 {
    let mut u = [_mm256_setzero_ps(); 4];
    for j in 0..4 {
        let (a, b) = (
            super::dot_f32_lanes(q, k.add(j * hd), hd),
            super::dot_f32_lanes(q, k.add((j + 4) * hd), hd),
        );
        u[j] = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        );
    }
    _mm256_hadd_ps(_mm256_hadd_ps(u[0], u[1]), _mm256_hadd_ps(u[2], u[3]))
}

/// `out[t·out_stride + j] = src[j·stride + t]` for an 8 × 8 tile (t, j < 8): 8 rows' 8 columns to 8 rows
/// of one column each.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn transpose8(src: *const f32, stride: usize, out: *mut f32, out_stride: usize) {
    let mut r = [_mm256_setzero_ps(); 8];
    for j in 0..8 {
        r[j] = _mm256_loadu_ps(src.add(j * stride));
    }
    let t = transpose8_regs(r);
    for k in 0..8 {
        _mm256_storeu_ps(out.add(k * out_stride), t[k]);
    }
}

/// Lane t of register j to register t, lane j (an 8 × 8 transpose by in-register shuffles).
#[inline(always)]
unsafe fn transpose8_regs(r: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved: t[2p] = [a0 b0 a1 b1 | a4 b4 a5 b5], t[2p + 1] = [a2 b2 a3 b3 | a6 b6 a7 b7].
    let mut t = [_mm256_setzero_ps(); 8];
    for p in 0..4 {
        t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    // u[4g + k]: column k of rows 4g..4g + 4 in the lower half, column k + 4 in the upper.
    let mut u = [_mm256_setzero_ps(); 8];
    for g in 0..2 {
        let b = 4 * g;
        u[b] = _mm256_shuffle_ps::<0x44>(t[b], t[b + 2]);
        u[b + 1] = _mm256_shuffle_ps::<0xEE>(t[b], t[b + 2]);
        u[b + 2] = _mm256_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
        u[b + 3] = _mm256_shuffle_ps::<0xEE>(t[b + 1], t[b + 3]);
    }
    let mut o = [_mm256_setzero_ps(); 8];
    for k in 0..4 {
        let (a, b) = (u[k], u[4 + k]);
        o[k] = _mm256_permute2f128_ps::<0x20>(a, b);
        o[k + 4] = _mm256_permute2f128_ps::<0x31>(a, b);
    }
    o
}

/// 16 keys' scores (unscaled, keys 0..8 and 8..16) for one query from the transposed block `kt`
/// (`[d][16]`), each as llama.cpp's AVX2 `ggml_vec_dot_f32` forms it: partial sum `k` (0..32) adds
/// `q[32s + k] · key[32s + k]` over the steps `s` by fused multiply-adds from 0, then
/// `x_l = (P_l + P_16+l) + (P_8+l + P_24+l)`, `t_l = x_l + x_l+4` and `(t_0 + t_1) + (t_2 + t_3)` (see
/// `simd::dot_f32`).
// Plain index loops (no closures) so that every intrinsic sits in the inlined body of a target-feature
// function.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn scores16(q: *const f32, kt: &[f32], hd: usize) -> (__m256, __m256) {
    let mut res = [_mm256_setzero_ps(); 2];
    for h in 0..2 {
        let mut t = [_mm256_setzero_ps(); 4];
        for l in 0..8 {
            let mut pk = [_mm256_setzero_ps(); 4];
            for j in 0..4 {
                let k = 8 * j + l;
                let mut s = 0;
                while s < hd {
                    let d = s + k;
                    pk[j] = _mm256_fmadd_ps(
                        _mm256_broadcast_ss(&*q.add(d)),
                        _mm256_loadu_ps(kt.as_ptr().add(d * BLOCK + 8 * h)),
                        pk[j],
                    );
                    s += 32;
                }
            }
            let x = _mm256_add_ps(_mm256_add_ps(pk[0], pk[2]), _mm256_add_ps(pk[1], pk[3]));
            // t_l = x_l + x_l+4, in that operand order.
            t[l % 4] = if l < 4 { x } else { _mm256_add_ps(t[l % 4], x) };
        }
        res[h] = _mm256_add_ps(_mm256_add_ps(t[0], t[1]), _mm256_add_ps(t[2], t[3]));
    }
    (res[0], res[1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose8_transposes() {
        if !crate::dispatch::cpu_has_avx2() {
            return;
        }
        let stride = 40;
        let src: Vec<f32> = (0..8 * stride).map(|i| i as f32).collect();
        let mut out = vec![0f32; 8 * BLOCK];
        unsafe { transpose8_test(src.as_ptr(), stride, out.as_mut_ptr()) };
        for t in 0..8 {
            for j in 0..8 {
                assert_eq!(out[t * BLOCK + j], src[j * stride + t], "t {t} j {j}");
            }
        }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn transpose8_test(src: *const f32, stride: usize, out: *mut f32) {
        transpose8(src, stride, out, BLOCK)
    }
}
