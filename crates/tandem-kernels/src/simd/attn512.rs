//! AVX-512 paged attention for a chunk of consecutive queries of one head (prefill), with 16-token blocks.
//!
//! The per-query path scores one key at a time: a dot product and a horizontal sum per key. Here the
//! chunk's queries share each K block: it is transposed once into `[head_dim][16]`, and then one query's
//! 16 scores are `head_dim` broadcast-FMAs into a single 512-bit register, with no horizontal sums;
//! masking, the online-softmax update and the P·V accumulation stay in registers per query.

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
        // Every slot is transposed, also those past the last query (stale or zero): their scores are
        // replaced by -inf below, whatever they hold.
        let kb = kv.as_ptr().add(kbase);
        for j in 0..BLOCK {
            for d in 0..hd {
                *kt.get_unchecked_mut(d * BLOCK + j) = *kb.add(j * hd + d);
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
            // Four independent sums so the FMAs pipeline instead of waiting on each other.
            let mut s4 = [_mm512_setzero_ps(); 4];
            for d in (0..hd).step_by(4) {
                for (k, sk) in s4.iter_mut().enumerate() {
                    *sk = _mm512_fmadd_ps(
                        _mm512_set1_ps(*qi.add(d + k)),
                        _mm512_loadu_ps(kt.as_ptr().add((d + k) * BLOCK)),
                        *sk,
                    );
                }
            }
            let s = _mm512_add_ps(_mm512_add_ps(s4[0], s4[1]), _mm512_add_ps(s4[2], s4[3]));
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
