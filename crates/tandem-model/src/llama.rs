//! The Llama-family forward pass on CPU over a flat paged batch.

use tandem_kernels::{
    add_inplace, apply_rope, matmul, matmul_fused, paged_attention, rms_norm, silu_mul, write_kv,
    AttnParams, AttnSeq, MatmulScratch, Matrix, RopeTable, ThreadPool,
};

use crate::batch::{ForwardBatch, KvDtype, KvLayout, LogitsWanted};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv::KvCache;
use crate::weights::LlamaWeights;

/// Activation buffers of one step, grown to the largest step seen and then reused.
#[derive(Default)]
struct Scratch {
    /// Residual stream, tokens × hidden.
    x: Vec<f32>,
    /// Normalized residual, tokens × hidden.
    xn: Vec<f32>,
    /// Queries, tokens × q_dim.
    q: Vec<f32>,
    /// Keys, tokens × kv_dim.
    k: Vec<f32>,
    /// Values, tokens × kv_dim.
    v: Vec<f32>,
    /// Attention output, tokens × q_dim.
    attn: Vec<f32>,
    /// Projection output before the residual add, tokens × hidden.
    proj: Vec<f32>,
    /// MLP gate (then silu(gate)·up), tokens × ffn.
    gate: Vec<f32>,
    /// MLP up, tokens × ffn.
    up: Vec<f32>,
    /// Final-normed hidden states of the rows that want logits, rows × hidden.
    head_in: Vec<f32>,
}

/// Returns `buf[..n]`, growing `buf` first if needed (never shrinks, so steady state allocates nothing).
fn grown(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    &mut buf[..n]
}

/// Reuses a vector's allocation for a different lifetime: it is emptied first, so no value outlives
/// its borrow, and the in-place `collect` keeps the capacity.
fn recycle<'a, 'b>(mut v: Vec<AttnSeq<'a>>) -> Vec<AttnSeq<'b>> {
    v.clear();
    v.into_iter()
        .map(|_| unreachable!("the vector is empty"))
        .collect()
}

/// The Llama-family forward pass on CPU over a flat paged batch.
pub struct CpuLlama {
    config: ModelConfig,
    weights: LlamaWeights,
    pool: ThreadPool,
    rope: RopeTable,
    mm: MatmulScratch,
    scratch: Scratch,
    seqs: Vec<AttnSeq<'static>>,
}

impl std::fmt::Debug for CpuLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuLlama")
            .field("config", &self.config)
            .field("threads", &self.pool.n_threads())
            .finish()
    }
}

impl CpuLlama {
    /// Builds the model with its own kernel thread pool of `threads` threads (0 = all cores).
    pub fn new(config: ModelConfig, weights: LlamaWeights, threads: usize) -> CpuLlama {
        let threads = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        let rope = RopeTable::new(
            config.head_dim,
            config.rope_theta,
            &config.rope_scaling,
            config.max_position_embeddings,
            config.rope_style,
        );
        tracing::debug!(threads, layers = config.num_layers, "cpu llama ready");
        CpuLlama {
            config,
            weights,
            pool: ThreadPool::new(threads),
            rope,
            mm: MatmulScratch::default(),
            scratch: Scratch::default(),
            seqs: Vec::new(),
        }
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The model's weights.
    pub fn weights(&self) -> &LlamaWeights {
        &self.weights
    }

    /// The KV layout this model needs for a pool of `num_blocks` blocks of `block_size` tokens.
    pub fn kv_layout(&self, block_size: usize, num_blocks: usize) -> KvLayout {
        KvLayout {
            n_layers: self.config.num_layers,
            n_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            block_size,
            num_blocks,
            dtype: KvDtype::F32,
        }
    }

    /// Checks everything the kernels would otherwise assert on, and returns the number of logits rows.
    fn validate(&self, batch: &ForwardBatch, kv: &KvCache) -> Result<usize, ModelError> {
        let layout = kv.layout();
        let expected = self.kv_layout(layout.block_size, layout.num_blocks);
        if *layout != expected {
            return Err(ModelError::Batch(format!(
                "KV layout {layout:?} does not match the model's {expected:?}"
            )));
        }
        if layout.block_size == 0 {
            return Err(ModelError::Batch("KV block size is zero".into()));
        }
        let mut next = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.tokens.start != next
                || s.tokens.end < s.tokens.start
                || s.tokens.end > batch.tokens.len()
            {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: token range {:?} does not continue at {next} within {} tokens",
                    s.tokens,
                    batch.tokens.len()
                )));
            }
            next = s.tokens.end;
            let end = s.pos + s.tokens.len();
            if s.tokens.is_empty() && s.logits != LogitsWanted::None {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: logits wanted for an empty chunk"
                )));
            }
            if end > self.config.max_position_embeddings {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: position {end} beyond the model's {} positions",
                    self.config.max_position_embeddings
                )));
            }
            if s.blocks.len() * layout.block_size < end {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: {} blocks of {} cannot hold {end} tokens",
                    s.blocks.len(),
                    layout.block_size
                )));
            }
            if let Some(b) = s.blocks.iter().find(|&&b| b as usize >= layout.num_blocks) {
                return Err(ModelError::Batch(format!(
                    "sequence {i}: block {b} beyond the pool of {}",
                    layout.num_blocks
                )));
            }
        }
        if next != batch.tokens.len() {
            return Err(ModelError::Batch(format!(
                "{} tokens but sequences cover {next}",
                batch.tokens.len()
            )));
        }
        if let Some(t) = batch
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(ModelError::Batch(format!(
                "token {t} beyond the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        Ok(batch.logits_rows())
    }

    /// Runs one step; writes the new tokens' K/V into `kv` through each chunk's block table and
    /// returns batch.logits_rows() rows of vocab_size logits into `logits` (cleared, then filled).
    pub fn forward(
        &mut self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let n_rows = self.validate(batch, kv)?;
        logits.clear();
        let t = batch.tokens.len();
        if t == 0 {
            return Ok(());
        }
        let c = &self.config;
        let (h, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let (nh, nkv, eps) = (c.num_heads, c.num_kv_heads, c.rms_norm_eps);
        let params = AttnParams {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: c.head_dim,
            block_size: kv.layout().block_size,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            window: c.sliding_window,
        };
        let w = &self.weights;
        let pool = &self.pool;
        let mm = &mut self.mm;
        let s = &mut self.scratch;

        let mut seqs = recycle(std::mem::take(&mut self.seqs));
        seqs.extend(
            batch
                .seqs
                .iter()
                .filter(|sq| !sq.tokens.is_empty())
                .map(|sq| AttnSeq {
                    q_row: sq.tokens.start,
                    n_q: sq.tokens.len(),
                    ctx_len: sq.pos + sq.tokens.len(),
                    blocks: &sq.blocks,
                }),
        );

        let x = grown(&mut s.x, t * h);
        for (row, &tok) in x.chunks_exact_mut(h).zip(&batch.tokens) {
            w.embed.dequantize_row(tok as usize, row);
        }

        for (l, lw) in w.layers.iter().enumerate() {
            let xn = grown(&mut s.xn, t * h);
            norm_rows(x, &lw.attn_norm, eps, xn, h);
            let q = grown(&mut s.q, t * qd);
            let k = grown(&mut s.k, t * kvd);
            let v = grown(&mut s.v, t * kvd);
            matmul_fused(pool, [&lw.wq, &lw.wk, &lw.wv], xn, t, [q, k, v], mm);
            for (buf, bias, width) in [
                (&mut *q, &lw.bq, qd),
                (&mut *k, &lw.bk, kvd),
                (&mut *v, &lw.bv, kvd),
            ] {
                if let Some(b) = bias {
                    buf.chunks_exact_mut(width)
                        .for_each(|row| add_inplace(row, b));
                }
            }
            let kv_layer = kv.layer_mut(l);
            for sq in &batch.seqs {
                for (i, tok_row) in sq.tokens.clone().enumerate() {
                    let pos = sq.pos + i;
                    let qr = &mut q[tok_row * qd..(tok_row + 1) * qd];
                    let kr = &mut k[tok_row * kvd..(tok_row + 1) * kvd];
                    apply_rope(qr, nh, pos, &self.rope);
                    apply_rope(kr, nkv, pos, &self.rope);
                    write_kv(
                        &params,
                        kv_layer,
                        &sq.blocks,
                        pos,
                        kr,
                        &v[tok_row * kvd..(tok_row + 1) * kvd],
                    );
                }
            }
            let attn = grown(&mut s.attn, t * qd);
            paged_attention(pool, &params, q, kv.layer(l), &seqs, attn);
            let proj = grown(&mut s.proj, t * h);
            matmul(pool, &lw.wo, attn, t, proj, mm);
            add_inplace(x, proj);

            norm_rows(x, &lw.ffn_norm, eps, xn, h);
            let gate = grown(&mut s.gate, t * f);
            let up = grown(&mut s.up, t * f);
            matmul_fused(pool, [&lw.w_gate, &lw.w_up], xn, t, [gate, up], mm);
            silu_mul(gate, up);
            matmul(pool, &lw.w_down, gate, t, proj, mm);
            add_inplace(x, proj);
        }

        // Only the rows that want logits go through the final norm and the (large) output head.
        let head_in = grown(&mut s.head_in, n_rows * h);
        let mut r = 0;
        for sq in &batch.seqs {
            let rows = match sq.logits {
                LogitsWanted::None => continue,
                LogitsWanted::Last => sq.tokens.end - 1..sq.tokens.end,
                LogitsWanted::All => sq.tokens.clone(),
            };
            for row in rows {
                rms_norm(
                    &x[row * h..(row + 1) * h],
                    &w.norm,
                    eps,
                    &mut head_in[r * h..(r + 1) * h],
                );
                r += 1;
            }
        }
        if n_rows > 0 {
            let head: &Matrix = w.output_head();
            logits.resize(n_rows * c.vocab_size, 0.0);
            matmul(pool, head, head_in, n_rows, logits, mm);
        }
        self.seqs = recycle(seqs);
        Ok(())
    }
}

/// RMS-normalizes every `width`-wide row of `x` into `out`.
fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], width: usize) {
    for (xr, or) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        rms_norm(xr, weight, eps, or);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::LayerWeights;
    use tandem_kernels::{RopeScaling, RopeStyle};

    /// A deterministic pseudo-random generator so the tiny model's weights need no extra crate.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
        }
        fn matrix(&mut self, rows: usize, cols: usize) -> Matrix {
            Matrix::from_f32(rows, cols, (0..rows * cols).map(|_| self.next()).collect())
        }
    }

    fn tiny(bias: bool) -> (ModelConfig, LlamaWeights) {
        let c = ModelConfig {
            architecture: "llama".into(),
            hidden_size: 32,
            intermediate_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            vocab_size: 50,
            max_position_embeddings: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            rope_style: RopeStyle::Neox,
            tie_word_embeddings: true,
            attention_bias: bias,
            bos_token_id: None,
            eos_token_ids: vec![],
            sliding_window: None,
        };
        let mut g = Lcg(7);
        let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let layers = (0..c.num_layers)
            .map(|_| LayerWeights {
                attn_norm: (0..h).map(|_| 1.0 + g.next()).collect(),
                wq: g.matrix(q, h),
                wk: g.matrix(kv, h),
                wv: g.matrix(kv, h),
                wo: g.matrix(h, q),
                bq: bias.then(|| (0..q).map(|_| g.next()).collect()),
                bk: bias.then(|| (0..kv).map(|_| g.next()).collect()),
                bv: bias.then(|| (0..kv).map(|_| g.next()).collect()),
                ffn_norm: (0..h).map(|_| 1.0 + g.next()).collect(),
                w_gate: g.matrix(f, h),
                w_up: g.matrix(f, h),
                w_down: g.matrix(h, f),
            })
            .collect();
        let w = LlamaWeights {
            embed: g.matrix(c.vocab_size, h),
            layers,
            norm: vec![1.0; h],
            lm_head: None,
        };
        (c, w)
    }

    /// Runs `prompt` through the model split at `cuts`, returning the logits of every token.
    fn run_chunks(
        model: &mut CpuLlama,
        prompt: &[u32],
        cuts: &[usize],
        blocks: &[u32],
    ) -> Vec<f32> {
        let mut kv = KvCache::new(model.kv_layout(4, 16));
        let mut all = Vec::new();
        let mut logits = Vec::new();
        let mut batch = ForwardBatch::default();
        let mut start = 0;
        for &end in cuts.iter().chain(std::iter::once(&prompt.len())) {
            batch.clear();
            batch.push(
                &prompt[start..end],
                start,
                blocks.to_vec(),
                LogitsWanted::All,
            );
            model.forward(&batch, &mut kv, &mut logits).unwrap();
            all.extend_from_slice(&logits);
            start = end;
        }
        all
    }

    #[test]
    fn chunking_does_not_change_logits() {
        for bias in [false, true] {
            let (c, w) = tiny(bias);
            let mut m = CpuLlama::new(c, w, 2);
            let prompt: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 50).collect();
            let blocks = [9, 2, 14, 5];
            let one = run_chunks(&mut m, &prompt, &[], &blocks);
            let three = run_chunks(&mut m, &prompt, &[5, 6], &blocks);
            let each: Vec<usize> = (1..13).collect();
            let single = run_chunks(&mut m, &prompt, &each, &blocks);
            assert_eq!(one.len(), 13 * 50);
            for (a, b) in one.iter().zip(&three).chain(one.iter().zip(&single)) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn batched_sequences_match_running_alone() {
        let (c, w) = tiny(false);
        let mut m = CpuLlama::new(c, w, 2);
        let a: Vec<u32> = vec![1, 2, 3, 4, 5, 6];
        let b: Vec<u32> = vec![7, 8, 9];
        let alone_a = run_chunks(&mut m, &a, &[], &[0, 1]);
        let alone_b = run_chunks(&mut m, &b, &[], &[3]);
        let mut kv = KvCache::new(m.kv_layout(4, 16));
        let mut batch = ForwardBatch::default();
        batch.push(&a, 0, vec![0, 1], LogitsWanted::Last);
        batch.push(&b, 0, vec![3], LogitsWanted::All);
        let mut logits = Vec::new();
        m.forward(&batch, &mut kv, &mut logits).unwrap();
        assert_eq!(logits.len(), 4 * 50);
        let want: Vec<f32> = alone_a[5 * 50..].iter().chain(&alone_b).copied().collect();
        for (x, y) in logits.iter().zip(&want) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }

    #[test]
    fn rejects_inconsistent_batches() {
        let (c, w) = tiny(false);
        let mut m = CpuLlama::new(c, w, 1);
        let mut kv = KvCache::new(m.kv_layout(4, 4));
        let mut logits = Vec::new();
        let mut batch = ForwardBatch::default();
        batch.push(&[1, 2, 3, 4, 5], 0, vec![0], LogitsWanted::Last);
        assert!(matches!(
            m.forward(&batch, &mut kv, &mut logits),
            Err(ModelError::Batch(_))
        ));
        batch.clear();
        batch.push(&[1], 0, vec![4], LogitsWanted::Last);
        assert!(matches!(
            m.forward(&batch, &mut kv, &mut logits),
            Err(ModelError::Batch(_))
        ));
        batch.clear();
        batch.push(&[50], 0, vec![0], LogitsWanted::Last);
        assert!(matches!(
            m.forward(&batch, &mut kv, &mut logits),
            Err(ModelError::Batch(_))
        ));
        let mut other = KvCache::new(KvLayout {
            n_layers: 1,
            ..m.kv_layout(4, 4)
        });
        batch.clear();
        batch.push(&[1], 0, vec![0], LogitsWanted::Last);
        assert!(matches!(
            m.forward(&batch, &mut other, &mut logits),
            Err(ModelError::Batch(_))
        ));
    }
}
