//! Paged causal attention over an f32 KV cache laid out in blocks (tandem_model's `KvLayout`).
//!
//! Per layer one buffer of `num_blocks` blocks; block b = [K|V][kv_head][slot][head_dim] contiguous:
//! K(b,h,s,d) at ((b*2 + 0)*n_kv + h)*bs*hd + s*hd + d and V(b,h,s,d) at ((b*2 + 1)*n_kv + h)*bs*hd + s*hd + d.
//! Work items are (sequence, query head, chunk of queries). The arithmetic is llama.cpp's CPU attention
//! without flash attention, operation for operation (see `attend_one`), so that tandem's logits match
//! llama.cpp's bit for bit on the same weights: each query's scores are materialized in a grow-only
//! per-thread row, normalized by an exact two-pass softmax, then weight the values.

use crate::dispatch::{isa, Isa};
use crate::matmul::OutPtr;
use crate::threads::ThreadPool;

/// Shape of the attention of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA: query head h reads kv head h / (n_heads / n_kv_heads)).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Score multiplier, usually 1/sqrt(head_dim).
    pub scale: f32,
    /// Sliding-window attention (Mistral): a query sees only the last `window` positions, itself
    /// included. `None` is full causal attention.
    pub window: Option<usize>,
}

/// One sequence of the flat batch: its queries are rows q_row..q_row+n_q of q; the sequence then holds
/// ctx_len tokens in the cache (including these n_q, already written); query i sits at position
/// ctx_len - n_q + i and attends causally to positions 0..=that.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    /// First row of this sequence's queries in `q` / `out`.
    pub q_row: usize,
    /// Number of query tokens.
    pub n_q: usize,
    /// Tokens in the cache, the new ones included.
    pub ctx_len: usize,
    /// Block table: cache block of every `block_size` positions.
    pub blocks: &'a [u32],
}

/// Largest head the kernels' stack buffers hold.
const MAX_HEAD_DIM: usize = 256;
/// Queries per work item in prefill: enough to amortize, small enough to balance threads.
const Q_CHUNK: usize = 16;

/// q: total_rows × (n_heads*head_dim); out same shape. GQA: head h reads kv head h / (n_heads/n_kv_heads).
pub fn paged_attention(
    pool: &ThreadPool,
    p: &AttnParams,
    q: &[f32],
    kv_layer: &[f32],
    seqs: &[AttnSeq],
    out: &mut [f32],
) {
    let level = isa();
    let simd = level >= Isa::Avx2;
    assert!(
        p.head_dim <= MAX_HEAD_DIM,
        "head_dim {} > {MAX_HEAD_DIM}",
        p.head_dim
    );
    assert!(
        p.n_kv_heads > 0 && p.n_heads.is_multiple_of(p.n_kv_heads),
        "n_heads must be a multiple of n_kv_heads"
    );
    let row = p.n_heads * p.head_dim;
    assert_eq!(
        q.len(),
        out.len(),
        "paged_attention: q and out differ in size"
    );
    let block_elems = 2 * p.n_kv_heads * p.block_size * p.head_dim;
    for s in seqs {
        assert!(s.n_q <= s.ctx_len, "more queries than context");
        assert!(
            (s.q_row + s.n_q) * row <= q.len(),
            "sequence rows outside q"
        );
        assert!(
            s.blocks.len() * p.block_size >= s.ctx_len,
            "block table too short for ctx_len"
        );
        assert!(
            s.blocks
                .iter()
                .all(|&b| (b as usize + 1) * block_elems <= kv_layer.len()),
            "block id outside the KV buffer"
        );
    }
    // Work items: (sequence, head, query chunk); a task finds its sequence by a linear walk (few sequences,
    // and no allocation per call).
    let items = |s: &AttnSeq| p.n_heads * s.n_q.div_ceil(Q_CHUNK);
    // A step of one token in all: llama.cpp multiplies by the values with `ggml_vec_dot_f32` (its
    // `llamafile_sgemm` only takes two tokens or more), which sums in another order (`attend_one`);
    // followed only with llama.cpp's batch-dependent orders on.
    let one_token = q.len() == row && crate::dispatch::llamacpp_batch_orders();
    let total: usize = seqs.iter().map(items).sum();
    let outp = OutPtr(out.as_mut_ptr());
    pool.run(total, &|t| {
        let (mut si, mut before) = (0, 0);
        while before + items(&seqs[si]) <= t {
            before += items(&seqs[si]);
            si += 1;
        }
        let s = &seqs[si];
        let local = t - before;
        let (head, qc) = (local % p.n_heads, local / p.n_heads);
        let q0 = qc * Q_CHUNK;
        let q1 = (q0 + Q_CHUNK).min(s.n_q);
        #[cfg(target_arch = "x86_64")]
        if level >= Isa::Avx2 && !one_token && crate::simd::chunk::supports(p, q1 - q0) {
            let r0 = s.q_row + q0;
            let chunk = crate::simd::chunk::QueryChunk {
                q: q[r0 * row + head * p.head_dim..].as_ptr(),
                // SAFETY (of the writes): rows r0..r0+n of this head belong to this work item alone.
                out: unsafe { outp.ptr().add(r0 * row + head * p.head_dim) },
                stride: row,
                n: q1 - q0,
                first_pos: s.ctx_len - s.n_q + q0,
                kv: kv_layer,
                blocks: s.blocks,
                kvh: head / (p.n_heads / p.n_kv_heads),
            };
            // SAFETY: each level is only chosen on CPUs that have it; `supports` checked the shape; the
            // asserts above checked the rows, the block table's length and its block ids.
            SCORES.with(|buf| unsafe {
                let buf = &mut buf.borrow_mut();
                if level >= Isa::Avx512 {
                    crate::simd::attn512::attend_chunk(p, &chunk, buf)
                } else {
                    crate::simd::attn256::attend_chunk(p, &chunk, buf)
                }
            });
            return;
        }
        SCORES.with(|buf| {
            let scores = &mut buf.borrow_mut();
            for i in q0..q1 {
                let r = s.q_row + i;
                let qv = &q[r * row + head * p.head_dim..r * row + (head + 1) * p.head_dim];
                // SAFETY: each (row, head) slice of out is written by exactly one work item.
                let ov = unsafe {
                    std::slice::from_raw_parts_mut(
                        outp.ptr().add(r * row + head * p.head_dim),
                        p.head_dim,
                    )
                };
                let last_pos = s.ctx_len - s.n_q + i;
                let kvh = head / (p.n_heads / p.n_kv_heads);
                attend_one(
                    p, qv, kv_layer, s.blocks, kvh, last_pos, ov, simd, one_token, scores,
                );
            }
        });
    });
}

thread_local! {
    /// Grow-only per-thread rows of scores (the kernels materialize them, as llama.cpp does).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The llamafile `hsum` of lane accumulators `acc[0..8][i]`: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3)).
#[inline(always)]
pub(crate) fn hsum8_at(acc: &[[f32; MAX_HEAD_DIM]; 8], i: usize) -> f32 {
    let a = |r: usize| acc[r][i];
    ((a(4) + a(0)) + (a(6) + a(2))) + ((a(5) + a(1)) + (a(7) + a(3)))
}

/// One query head against positions 0..=last_pos (the last `window` of them when set), in the order of
/// llama.cpp's CPU attention without flash attention, so that the same q/K/V give the same bits: every
/// score `dot(q, k)·scale`, their max, the numerators `e^(s − max)` summed per 8 positions counted from
/// position 0 (masked ones are 0), the weights normalized by the f32 reciprocal of that f64 sum before the
/// value product, and each output element accumulated in 8 lanes (position mod 8) of fused multiply-adds
/// reduced like llamafile's `hsum` — or, for the only token of a step (`one_token`), as
/// `ggml_vec_dot_f32` sums over the positions: 4 × 8 lanes (position mod 32), reduced `(a0 + a2) +
/// (a1 + a3)` lane by lane, then halves and pairs. `scores` is grow-only scratch.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    p: &AttnParams,
    qv: &[f32],
    kv: &[f32],
    blocks: &[u32],
    kvh: usize,
    last_pos: usize,
    out: &mut [f32],
    simd: bool,
    one_token: bool,
    scores: &mut Vec<f32>,
) {
    let hd = p.head_dim;
    let bs = p.block_size;
    let n_pos = last_pos + 1;
    let first = p.window.map_or(0, |w| n_pos.saturating_sub(w));
    // Scores of positions base..n_pos rounded up to whole chunks of 8; the padding is masked (-inf).
    let base = first / 8 * 8;
    scores.clear();
    scores.resize(n_pos.next_multiple_of(8) - base, f32::NEG_INFINITY);
    let key = |pos: usize| {
        let b = blocks[pos / bs] as usize;
        let o = ((b * 2) * p.n_kv_heads + kvh) * bs * hd + (pos % bs) * hd;
        &kv[o..o + hd]
    };
    let value = |pos: usize| {
        let b = blocks[pos / bs] as usize;
        let o = ((b * 2 + 1) * p.n_kv_heads + kvh) * bs * hd + (pos % bs) * hd;
        &kv[o..o + hd]
    };
    let mut m = f32::NEG_INFINITY;
    for pos in first..n_pos {
        let sc = dot(qv, key(pos), simd) * p.scale;
        scores[pos - base] = sc;
        m = m.max(sc);
    }
    let inv = (1.0 / softmax_numerators(scores, m, simd)) as f32;
    if one_token {
        let mut acc = [[0f32; MAX_HEAD_DIM]; 32];
        for pos in first..n_pos {
            let w = scores[pos - base] * inv;
            axpy(&mut acc[pos % 32][..hd], w, value(pos), simd);
        }
        for (i, o) in out.iter_mut().enumerate() {
            let a = |r: usize| acc[r][i];
            let x: [f32; 8] = std::array::from_fn(|l| (a(l) + a(16 + l)) + (a(8 + l) + a(24 + l)));
            let t: [f32; 4] = std::array::from_fn(|l| x[l] + x[l + 4]);
            *o = (t[0] + t[1]) + (t[2] + t[3]);
        }
        return;
    }
    let mut acc = [[0f32; MAX_HEAD_DIM]; 8];
    for pos in first..n_pos {
        let w = scores[pos - base] * inv;
        axpy(&mut acc[pos % 8][..hd], w, value(pos), simd);
    }
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when the CPU has AVX2+FMA.
        return unsafe { crate::simd::reduce_lanes8(&acc, out) };
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = hsum8_at(&acc, i);
    }
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32], simd: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when the CPU has AVX2+FMA.
        return unsafe { crate::simd::dot_f32(a, b) };
    }
    let _ = simd;
    // The SIMD order (see `simd::dot_f32`) in scalar code.
    let n = a.len();
    let mut acc = [[0f32; 8]; 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, s) in lanes.iter_mut().enumerate() {
                *s = a[i + 8 * j + l].mul_add(b[i + 8 * j + l], *s);
            }
        }
        i += 32;
    }
    let x: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = std::array::from_fn(|l| x[l] + x[l + 4]);
    let mut s = (t[0] + t[1]) + (t[2] + t[3]);
    while i < n {
        s = a[i].mul_add(b[i], s);
        i += 1;
    }
    s
}

/// Softmax numerators of whole chunks of 8 and their sum (see `simd::softmax_numerators`).
#[inline(always)]
fn softmax_numerators(scores: &mut [f32], m: f32, simd: bool) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when the CPU has AVX2+FMA.
        return unsafe { crate::simd::softmax_numerators(scores, m) };
    }
    let _ = simd;
    let mut sum = 0f64;
    for c in scores.chunks_exact_mut(8) {
        for s in c.iter_mut() {
            *s = crate::ops::exp_ggml(*s - m);
        }
        let t: [f32; 4] = std::array::from_fn(|l| c[l + 4] + c[l]);
        sum += ((t[0] + t[2]) + (t[1] + t[3])) as f64;
    }
    sum
}

#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only true when the CPU has AVX2+FMA.
        return unsafe { crate::simd::axpy_f32(y, a, x) };
    }
    let _ = simd;
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = a.mul_add(xi, *yi);
    }
}

/// Stores one token's k and v (n_kv_heads*head_dim each) at position `pos` of a sequence with block table `blocks`.
pub fn write_kv(
    p: &AttnParams,
    kv_layer: &mut [f32],
    blocks: &[u32],
    pos: usize,
    k: &[f32],
    v: &[f32],
) {
    let (hd, bs, nkv) = (p.head_dim, p.block_size, p.n_kv_heads);
    assert_eq!(
        k.len(),
        nkv * hd,
        "write_kv: k must be n_kv_heads * head_dim"
    );
    assert_eq!(
        v.len(),
        nkv * hd,
        "write_kv: v must be n_kv_heads * head_dim"
    );
    let b = blocks[pos / bs] as usize;
    let slot = pos % bs;
    for h in 0..nkv {
        let ko = ((b * 2) * nkv + h) * bs * hd + slot * hd;
        let vo = ((b * 2 + 1) * nkv + h) * bs * hd + slot * hd;
        kv_layer[ko..ko + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
        kv_layer[vo..vo + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::{with_batch_orders, with_isa};
    use rand::{Rng, SeedableRng};

    /// Dense reference: softmax(q·Kᵀ·scale) · V over positions 0..=pos (the last `window` of them when
    /// set), from contiguous per-seq K/V.
    fn reference(
        p: &AttnParams,
        q: &[f32],
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        q_pos: usize,
        head: usize,
    ) -> Vec<f32> {
        let hd = p.head_dim;
        let kvh = head / (p.n_heads / p.n_kv_heads);
        let first = p.window.map_or(0, |w| (q_pos + 1).saturating_sub(w));
        let scores: Vec<f64> = (0..=q_pos)
            .map(|t| {
                if t < first {
                    return f64::NEG_INFINITY;
                }
                (0..hd)
                    .map(|d| q[d] as f64 * k[t][kvh * hd + d] as f64)
                    .sum::<f64>()
                    * p.scale as f64
            })
            .collect();
        let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
        let z: f64 = w.iter().sum();
        (0..hd)
            .map(|d| {
                ((0..=q_pos)
                    .map(|t| w[t] * v[t][kvh * hd + d] as f64)
                    .sum::<f64>()
                    / z) as f32
            })
            .collect()
    }

    fn run_case(level: Isa, window: Option<usize>) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let p = AttnParams {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 64,
            block_size: 16,
            scale: 0.125,
            window,
        };
        let num_blocks = 40;
        let mut kv = vec![0f32; num_blocks * 2 * p.n_kv_heads * p.block_size * p.head_dim];
        // Two sequences with scattered block tables: a prefill of 37 new tokens on top of 0, and a decode at 150.
        let lens = [37usize, 150];
        let n_new = [37usize, 1];
        let tables: Vec<Vec<u32>> =
            vec![vec![7, 3, 30], (10..20).rev().map(|b| b as u32).collect()];
        let width = p.n_kv_heads * p.head_dim;
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (si, &len) in lens.iter().enumerate() {
            let mut kk = Vec::new();
            let mut vv = Vec::new();
            for pos in 0..len {
                let k: Vec<f32> = (0..width).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let v: Vec<f32> = (0..width).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                write_kv(&p, &mut kv, &tables[si], pos, &k, &v);
                kk.push(k);
                vv.push(v);
            }
            ks.push(kk);
            vs.push(vv);
        }
        let row = p.n_heads * p.head_dim;
        let total_rows = n_new[0] + n_new[1];
        let q: Vec<f32> = (0..total_rows * row)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let seqs = [
            AttnSeq {
                q_row: 0,
                n_q: n_new[0],
                ctx_len: lens[0],
                blocks: &tables[0],
            },
            AttnSeq {
                q_row: n_new[0],
                n_q: 1,
                ctx_len: lens[1],
                blocks: &tables[1],
            },
        ];
        let mut out = vec![f32::NAN; q.len()];
        let pool = ThreadPool::new(2);
        with_isa(level, || {
            paged_attention(&pool, &p, &q, &kv, &seqs, &mut out)
        });
        for (si, s) in seqs.iter().enumerate() {
            for i in 0..s.n_q {
                let r = s.q_row + i;
                for h in 0..p.n_heads {
                    let qv = &q[r * row + h * p.head_dim..r * row + (h + 1) * p.head_dim];
                    let want = reference(&p, qv, &ks[si], &vs[si], s.ctx_len - s.n_q + i, h);
                    let got = &out[r * row + h * p.head_dim..r * row + (h + 1) * p.head_dim];
                    for (a, b) in got.iter().zip(&want) {
                        assert!((a - b).abs() < 1e-4, "seq {si} q {i} head {h}: {a} vs {b}");
                    }
                }
            }
        }
    }

    /// A prompt's attention computed in one prefill step equals, bit for bit, the same tokens attended one
    /// at a time in decode steps, alone or beside a second sequence: recompute after preemption, P/D import
    /// and decode failover rely on it. With llama.cpp's batch-dependent orders on, a step of one token in
    /// all sums the values in llama.cpp's other order (`ggml_vec_dot_f32`), so it is only close to those.
    /// The portable, AVX2 and AVX-512 kernels agree bit for bit in every case (all follow llama.cpp's order).
    #[test]
    fn prefill_and_token_by_token_attention_are_bitwise_equal() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for hd in [64usize, 128] {
            for window in [None, Some(19)] {
                let p = AttnParams {
                    n_heads: 6,
                    n_kv_heads: 2,
                    head_dim: hd,
                    block_size: 16,
                    scale: 0.125,
                    window,
                };
                let (n, row, width) = (45usize, 6 * hd, 2 * hd);
                let table: Vec<u32> = vec![5, 1, 7];
                let mut kv = vec![0f32; 8 * 2 * p.n_kv_heads * p.block_size * p.head_dim];
                for pos in 0..n {
                    let k: Vec<f32> = (0..width).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                    let v: Vec<f32> = (0..width).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                    write_kv(&p, &mut kv, &table, pos, &k, &v);
                }
                let q: Vec<f32> = (0..n * row)
                    .map(|_| rng.random_range(-2.0f32..2.0))
                    .collect();
                let pool = ThreadPool::new(2);
                let mut portable_whole: Option<Vec<f32>> = None;
                let mut portable_alone: Option<Vec<f32>> = None;
                for level in Isa::ALL {
                    if level > crate::dispatch::cpu_isa() {
                        continue;
                    }
                    let mut whole = vec![0f32; n * row];
                    let seq = AttnSeq {
                        q_row: 0,
                        n_q: n,
                        ctx_len: n,
                        blocks: &table,
                    };
                    with_isa(level, || {
                        paged_attention(&pool, &p, &q, &kv, &[seq], &mut whole)
                    });
                    let mut alone = vec![0f32; n * row];
                    for i in 0..n {
                        let seq = |q_row| AttnSeq {
                            q_row,
                            n_q: 1,
                            ctx_len: i + 1,
                            blocks: &table,
                        };
                        let qi = &q[i * row..(i + 1) * row];
                        let pair = [qi, qi].concat();
                        let mut two = vec![0f32; 2 * row];
                        with_isa(level, || {
                            paged_attention(&pool, &p, &pair, &kv, &[seq(0), seq(1)], &mut two)
                        });
                        for r in 0..2 {
                            assert_eq!(
                                two[r * row..(r + 1) * row],
                                whole[i * row..(i + 1) * row],
                                "{level:?} head_dim {hd} window {window:?}: token {i}"
                            );
                        }
                        let mut one = vec![0f32; row];
                        with_isa(level, || {
                            paged_attention(&pool, &p, qi, &kv, &[seq(0)], &mut one)
                        });
                        assert_eq!(
                            one,
                            whole[i * row..(i + 1) * row],
                            "{level:?} head_dim {hd} window {window:?}: token {i} alone"
                        );
                        let llama = &mut alone[i * row..(i + 1) * row];
                        with_batch_orders(true, || {
                            with_isa(level, || {
                                paged_attention(&pool, &p, qi, &kv, &[seq(0)], llama)
                            })
                        });
                        for (a, b) in llama.iter().zip(&whole[i * row..(i + 1) * row]) {
                            assert!((a - b).abs() <= 1e-5, "token {i} alone: {a} vs {b}");
                        }
                    }
                    match &portable_alone {
                        None => portable_alone = Some(alone),
                        Some(w) => assert_eq!(
                            w, &alone,
                            "{level:?} head_dim {hd} window {window:?}: llama.cpp's one-token steps differ from the portable kernel"
                        ),
                    }
                    match &portable_whole {
                        None => portable_whole = Some(whole),
                        Some(w) => assert_eq!(
                            w, &whole,
                            "{level:?} head_dim {hd} window {window:?} differs from the portable kernel"
                        ),
                    }
                }
            }
        }
    }

    #[test]
    fn portable_paged_attention_matches_dense_reference() {
        run_case(Isa::Portable, None);
    }

    /// A window shorter than both contexts and not aligned to blocks: the first keys are skipped.
    #[test]
    fn sliding_window_matches_dense_reference() {
        for level in Isa::ALL {
            if level <= crate::dispatch::cpu_isa() {
                run_case(level, Some(21));
            }
        }
    }

    #[test]
    fn simd_paged_attention_matches_dense_reference() {
        for level in [Isa::Avx2, Isa::Avx512] {
            if level <= crate::dispatch::cpu_isa() {
                run_case(level, None);
            }
        }
    }

    #[test]
    fn write_kv_layout() {
        let p = AttnParams {
            n_heads: 2,
            n_kv_heads: 2,
            head_dim: 2,
            block_size: 4,
            scale: 1.0,
            window: None,
        };
        let mut kv = vec![0f32; 3 * 2 * 2 * 4 * 2];
        write_kv(
            &p,
            &mut kv,
            &[2, 1],
            5,
            &[1.0, 2.0, 3.0, 4.0],
            &[5.0, 6.0, 7.0, 8.0],
        );
        // pos 5 -> block 1, slot 1. K head 1 at ((1*2+0)*2+1)*4*2 + 1*2.
        assert_eq!(&kv[(5 * 8 + 2)..(5 * 8 + 4)], &[3.0, 4.0]);
        assert_eq!(&kv[(6 * 8 + 2)..(6 * 8 + 4)], &[5.0, 6.0]);
    }
}
