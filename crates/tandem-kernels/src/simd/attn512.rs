//! AVX-512 paged attention over 16-token blocks, for chunks of consecutive queries of one head (prefill) and
//! for single queries (decode).
//!
//! A chunk's queries share each K block: it is transposed once into `[head_dim][16]`, and a query's 16 scores
//! are broadcast FMAs into registers whose lanes are the block's keys, with no horizontal sum per key. A
//! single query skips the transpose and dots each key along `head_dim`, then sums the 16 lanes by a fixed
//! tree. Both paths perform the same floating-point operations in the same order for every score (lane `l`
//! of the per-key dot is the chunk path's accumulator `l`, and both combine the 16 partial sums by the same
//! tree), and share the softmax and P·V code, so a prompt recomputed in one prefill step gives bit-identical
//! results to the same tokens decoded one at a time: preemption, P/D import and decode failover rely on it.

use std::arch::x86_64::*;

use crate::attention::AttnParams;

/// Queries of one chunk and where their outputs go: query `i` is at absolute position `first_pos + i`,
/// its `head_dim` values start at `q + i * stride`, its output at `out + i * stride`.
pub(crate) struct QueryChunk {
    pub q: *const f32,
    pub out: *mut f32,
    pub stride: usize,
    pub n: usize,
    pub first_pos: usize,
}

/// Largest chunk and head this kernel's stack buffers hold.
pub(crate) const MAX_QUERIES: usize = 16;
const MAX_HEAD_DIM: usize = 256;
const BLOCK: usize = 16;

/// Whether the kernel applies: 16-token blocks, a head of whole 512-bit vectors, a chunk it can hold.
pub(crate) fn supports(p: &AttnParams, n_queries: usize) -> bool {
    p.block_size == BLOCK
        && p.head_dim.is_multiple_of(16)
        && p.head_dim <= MAX_HEAD_DIM
        && n_queries <= MAX_QUERIES
}

/// Causal (optionally windowed) attention of the chunk's queries over kv head `kvh` of the sequence with
/// block table `blocks`.
///
/// # Safety
/// The CPU must have AVX-512F (and AVX2+FMA); `supports(p, c.n)` must hold; `c`'s pointers must cover
/// `c.n` rows; `blocks` must cover positions up to the last query's and lie inside `kv`.
pub(crate) unsafe fn attend_chunk(
    p: &AttnParams,
    c: &QueryChunk,
    kv: &[f32],
    blocks: &[u32],
    kvh: usize,
) {
    // The head width as a constant keeps each query's accumulator in registers.
    match p.head_dim / 16 {
        4 => attend_chunk_nv::<4>(p, c, kv, blocks, kvh),
        8 => attend_chunk_nv::<8>(p, c, kv, blocks, kvh),
        2 => attend_chunk_nv::<2>(p, c, kv, blocks, kvh),
        6 => attend_chunk_nv::<6>(p, c, kv, blocks, kvh),
        nv => {
            assert!(
                nv <= MAX_HEAD_DIM / 16,
                "head too wide for the AVX-512 attention"
            );
            attend_chunk_nv::<16>(p, c, kv, blocks, kvh)
        }
    }
}

/// [`attend_chunk`] for a head of at most `NV` 512-bit vectors (`NV = 16` serves any supported width;
/// only `head_dim / 16` of them are used).
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_chunk_nv<const NV: usize>(
    p: &AttnParams,
    c: &QueryChunk,
    kv: &[f32],
    blocks: &[u32],
    kvh: usize,
) {
    let hd = p.head_dim;
    let nvec = (hd / 16).min(NV);
    let nkv = p.n_kv_heads;
    let window_start = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let last = c.first_pos + c.n - 1;
    let mut m = [f32::NEG_INFINITY; MAX_QUERIES];
    let mut l = [0f32; MAX_QUERIES];
    let mut acc = [0f32; MAX_QUERIES * MAX_HEAD_DIM];
    let mut kt = [0f32; MAX_HEAD_DIM * BLOCK];
    let mut e = [0f32; BLOCK];
    let scale = _mm512_set1_ps(p.scale);
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let first_block = window_start(c.first_pos) / BLOCK;
    for (bi, &b) in blocks
        .iter()
        .enumerate()
        .take(last / BLOCK + 1)
        .skip(first_block)
    {
        let bpos = bi * BLOCK;
        let b = b as usize;
        let kbase = ((b * 2) * nkv + kvh) * BLOCK * hd;
        let vbase = ((b * 2 + 1) * nkv + kvh) * BLOCK * hd;
        let kb = kv.as_ptr().add(kbase);
        // A chunk transposes the block once for all its queries. Every slot is transposed, also those past
        // the last query (stale or zero): their scores are replaced by -inf below, whatever they hold.
        if c.n > 1 {
            for j in 0..BLOCK {
                for d in 0..hd {
                    *kt.get_unchecked_mut(d * BLOCK + j) = *kb.add(j * hd + d);
                }
            }
        }
        for i in 0..c.n {
            let pos = c.first_pos + i;
            let lo = window_start(pos);
            if bpos > pos || bpos + BLOCK <= lo {
                continue;
            }
            let (j0, j1) = (lo.saturating_sub(bpos), (pos + 1 - bpos).min(BLOCK));
            let mask = (((1u32 << j1) - 1) & !((1u32 << j0) - 1)) as __mmask16;
            let qi = c.q.add(i * c.stride);
            let s = if c.n > 1 {
                scores_transposed(qi, &kt, nvec)
            } else {
                scores_direct(qi, kb, hd, nvec, j1)
            };
            let s = _mm512_mask_mov_ps(neg_inf, mask, _mm512_mul_ps(s, scale));
            let m_new = m[i].max(_mm512_reduce_max_ps(s));
            let shifted = _mm512_sub_ps(s, _mm512_set1_ps(m_new));
            // Masked lanes are -inf and come out of the exponential as exactly 0.
            let lo_half = super::exp256(_mm512_castps512_ps256(shifted));
            let hi_half = super::exp256(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(shifted),
            )));
            _mm256_storeu_ps(e.as_mut_ptr(), lo_half);
            _mm256_storeu_ps(e.as_mut_ptr().add(8), hi_half);
            let corr = (m[i] - m_new).exp();
            l[i] = l[i] * corr + super::hsum(_mm256_add_ps(lo_half, hi_half));
            m[i] = m_new;
            let ai = acc.as_mut_ptr().add(i * MAX_HEAD_DIM);
            let vcorr = _mm512_set1_ps(corr);
            let vb = kv.as_ptr().add(vbase);
            let mut a = [_mm512_setzero_ps(); NV];
            for (v, av) in a.iter_mut().enumerate().take(nvec) {
                *av = _mm512_mul_ps(_mm512_loadu_ps(ai.add(16 * v)), vcorr);
            }
            for j in j0..j1 {
                let w = _mm512_set1_ps(*e.get_unchecked(j));
                for (v, av) in a.iter_mut().enumerate().take(nvec) {
                    *av = _mm512_fmadd_ps(w, _mm512_loadu_ps(vb.add(j * hd + 16 * v)), *av);
                }
            }
            for (v, av) in a.iter().enumerate().take(nvec) {
                _mm512_storeu_ps(ai.add(16 * v), *av);
            }
        }
    }
    for (i, li) in l.iter().enumerate().take(c.n) {
        let inv = _mm512_set1_ps(1.0 / li);
        let (ai, oi) = (acc.as_ptr().add(i * MAX_HEAD_DIM), c.out.add(i * c.stride));
        for v in 0..nvec {
            _mm512_storeu_ps(
                oi.add(16 * v),
                _mm512_mul_ps(_mm512_loadu_ps(ai.add(16 * v)), inv),
            );
        }
    }
}

/// 16 keys' scores for one query from the transposed block `kt` (`[d][16]`): accumulator `l` sums
/// `q[16c + l] · k[16c + l]` over `c` in order, then the 16 accumulators are added by the tree
/// (l, l+8), (l, l+4), (l, l+2), (l, l+1), exactly as [`scores_direct`] sums one key's lanes.
#[inline(always)]
unsafe fn scores_transposed(q: *const f32, kt: &[f32], nvec: usize) -> __m512 {
    let mut u = [_mm512_setzero_ps(); 16];
    for c in 0..nvec {
        for (l, ul) in u.iter_mut().enumerate() {
            let d = 16 * c + l;
            *ul = _mm512_fmadd_ps(
                _mm512_set1_ps(*q.add(d)),
                _mm512_loadu_ps(kt.as_ptr().add(d * BLOCK)),
                *ul,
            );
        }
    }
    for half in [8, 4, 2, 1] {
        for l in 0..half {
            u[l] = _mm512_add_ps(u[l], u[l + half]);
        }
    }
    u[0]
}

/// 16 keys' scores for one query straight from the block (`[slot][head_dim]`), keys `0..n` (the rest 0):
/// lane `l` of a key's accumulator sums `q[16c + l] · k[16c + l]` over `c` in order, and the lanes are added
/// by the tree of [`scores_transposed`].
#[inline(always)]
unsafe fn scores_direct(q: *const f32, kb: *const f32, hd: usize, nvec: usize, n: usize) -> __m512 {
    let mut out = [0f32; BLOCK];
    for (j, o) in out.iter_mut().enumerate().take(n) {
        let k = kb.add(j * hd);
        let mut v = _mm512_setzero_ps();
        for c in 0..nvec {
            v = _mm512_fmadd_ps(
                _mm512_loadu_ps(q.add(16 * c)),
                _mm512_loadu_ps(k.add(16 * c)),
                v,
            );
        }
        // (l, l+8) → (l, l+4) → (l, l+2) → (l, l+1), the same pairs as the transposed path.
        let t8 = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        );
        let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
        let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        let t1 = _mm_add_ss(t2, _mm_shuffle_ps::<0b01>(t2, t2));
        *o = _mm_cvtss_f32(t1);
    }
    _mm512_loadu_ps(out.as_ptr())
}
