//! The forward pass on CPU over a flat paged batch, for every model `ModelConfig` describes: each
//! layer's attention span, rope, norms and MLP kind come from the description, not the family.

use tandem_kernels::{
    add_inplace, apply_rope, gelu_tanh_mul, matmul, matmul_fused, paged_attention, resolve_threads,
    rms_norm, scale_inplace, silu_mul, softcap_inplace, write_kv, AttnParams, AttnSeq,
    MatmulScratch, Matrix, RopeTable, ThreadPool,
};

use crate::batch::{ForwardBatch, KvDtype, KvLayout, LogitsWanted};
use crate::collective::Collective;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::expert_map::ExpertMap;
use crate::kv::KvCache;
use crate::partition::{shard_weights, Partition, RankShare};
use crate::spec::{Activation, MlpKind};
use crate::weights::{GatedMlp, LlamaWeights, MlpWeights};

mod moe;

pub use moe::LayerExpertTokens;

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
    /// This rank's vocabulary slice of the logits before they are gathered, rows × local vocab.
    local_logits: Vec<f32>,
    /// Tensor parallelism: all ranks' shards of a projection's input, tokens × full width.
    gathered: Vec<f32>,
    /// Tensor parallelism: this rank's hidden features of a projection's output, tokens × local hidden.
    part: Vec<f32>,
    /// One row being normalised in place.
    row: Vec<f32>,
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

/// The Llama-family forward pass on CPU over a flat paged batch: the whole model, or one pipeline
/// stage's layers and/or one tensor-parallel rank's share of them ([`Partition`]).
pub struct CpuLlama {
    config: ModelConfig,
    /// The weights of this partition: its layers only, cut to its rank's share.
    weights: LlamaWeights,
    part: Partition,
    share: RankShare,
    /// Present when `part.tp_size > 1`: how the ranks all-gather projection inputs, outputs and logits.
    collective: Option<Box<dyn Collective>>,
    pool: ThreadPool,
    /// One table per distinct rope of the partition's layers (Gemma 3: local and global).
    ropes: Vec<RopeTable>,
    /// Index into `ropes` of each of this partition's layers.
    layer_rope: Vec<usize>,
    mm: MatmulScratch,
    scratch: Scratch,
    moe_scratch: moe::MoeScratch,
    /// Rows routed to each expert, one entry per layer of this partition (empty for a dense layer).
    expert_tokens: Vec<LayerExpertTokens>,
    seqs: Vec<AttnSeq<'static>>,
}

impl std::fmt::Debug for CpuLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuLlama")
            .field("config", &self.config)
            .field("threads", &self.pool.n_threads())
            .field("partition", &self.part)
            .finish()
    }
}

impl CpuLlama {
    /// Builds the whole model with its own kernel thread pool of `threads` threads (0 = all cores).
    pub fn new(config: ModelConfig, weights: LlamaWeights, threads: usize) -> CpuLlama {
        let part = Partition::whole(&config);
        let share = RankShare::whole(&config);
        CpuLlama::build(config, weights, threads, part, share, None)
    }

    /// Builds one partition of the model from the whole model's weights: a pipeline stage's layers,
    /// and with `collective` (one rank of a group of `part.tp_size`) that rank's share of them, the
    /// routed experts of a mixture of experts placed contiguously over the ranks.
    pub fn partitioned(
        config: ModelConfig,
        weights: &LlamaWeights,
        threads: usize,
        part: Partition,
        collective: Option<Box<dyn Collective>>,
    ) -> Result<CpuLlama, ModelError> {
        let experts = ExpertMap::contiguous(&config, part.tp_size.max(1))?;
        CpuLlama::partitioned_with_experts(config, weights, threads, part, collective, experts)
    }

    /// Like [`CpuLlama::partitioned`], with the routed experts placed by `experts` (a map over
    /// `part.tp_size` ranks; every rank of the group must be given the same map).
    pub fn partitioned_with_experts(
        config: ModelConfig,
        weights: &LlamaWeights,
        threads: usize,
        part: Partition,
        collective: Option<Box<dyn Collective>>,
        experts: ExpertMap,
    ) -> Result<CpuLlama, ModelError> {
        if part.layers.start >= part.layers.end || part.layers.end > config.num_layers {
            return Err(ModelError::Partition(format!(
                "layers {:?} of a {}-layer model",
                part.layers, config.num_layers
            )));
        }
        match &collective {
            Some(c) if c.size() == part.tp_size && c.rank() == part.tp_rank => {}
            None if part.tp_size == 1 => {}
            _ => {
                return Err(ModelError::Partition(format!(
                    "rank {} of tensor_parallel_size {} needs a collective of that rank and size",
                    part.tp_rank, part.tp_size
                )))
            }
        }
        let share = RankShare::with_experts(&config, part.tp_rank, part.tp_size, experts)?;
        let weights = shard_weights(&config, weights, &part, &share);
        Ok(CpuLlama::build(
            config, weights, threads, part, share, collective,
        ))
    }

    fn build(
        config: ModelConfig,
        weights: LlamaWeights,
        threads: usize,
        part: Partition,
        share: RankShare,
        collective: Option<Box<dyn Collective>>,
    ) -> CpuLlama {
        let threads = resolve_threads(threads);
        let (distinct, layer_rope) = config.distinct_ropes(part.layers.clone());
        let ropes = distinct
            .iter()
            .map(|r| {
                RopeTable::new(
                    config.head_dim,
                    r.theta,
                    &r.scaling,
                    config.max_position_embeddings,
                    config.rope_style,
                )
            })
            .collect();
        let experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
        let expert_tokens = part
            .layers
            .clone()
            .map(|layer| LayerExpertTokens {
                layer,
                tokens: match config.layer(layer).mlp {
                    MlpKind::Moe => vec![0; experts],
                    MlpKind::Dense => Vec::new(),
                },
            })
            .collect();
        tracing::debug!(threads, partition = ?part, "cpu llama ready");
        CpuLlama {
            config,
            weights,
            part,
            share,
            collective,
            pool: ThreadPool::new(threads),
            ropes,
            layer_rope,
            mm: MatmulScratch::default(),
            scratch: Scratch::default(),
            moe_scratch: moe::MoeScratch::default(),
            expert_tokens,
            seqs: Vec::new(),
        }
    }

    /// Which layers and which tensor-parallel share this instance computes.
    pub fn partition(&self) -> &Partition {
        &self.part
    }

    /// The heads, MLP features and vocabulary slice of this instance's rank.
    pub fn share(&self) -> &RankShare {
        &self.share
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Rows routed to each expert of this partition's mixture-of-experts layers since it was built (none
    /// for a dense model). A tensor-parallel rank counts only the experts it holds (the others stay 0),
    /// so the sum over the group's ranks counts each routed row once.
    pub fn expert_tokens(&self) -> impl Iterator<Item = &LayerExpertTokens> {
        self.expert_tokens.iter().filter(|l| !l.tokens.is_empty())
    }

    /// The weights of this partition (its layers, cut to its rank's share).
    pub fn weights(&self) -> &LlamaWeights {
        &self.weights
    }

    /// The KV layout this partition stores for a pool of `num_blocks` blocks of `block_size` tokens:
    /// its own layers and KV heads only.
    pub fn kv_layout(&self, block_size: usize, num_blocks: usize) -> KvLayout {
        KvLayout {
            n_layers: self.part.layers.len(),
            n_kv_heads: self.share.kv_heads.len(),
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

    /// Runs one step of the whole model (or of a first-and-last partition); writes the new tokens' K/V
    /// into `kv` through each chunk's block table and returns batch.logits_rows() rows of vocab_size
    /// logits into `logits` (cleared, then filled).
    pub fn forward(
        &mut self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.forward_stage(batch, kv, None, logits)
    }

    /// Runs this partition's share of one step. The first stage embeds `batch.tokens`; a later stage
    /// takes the previous stage's hidden states (tokens × hidden) as `hidden_in`. The last stage fills
    /// `out` with the logits rows (on tensor-parallel rank 0; other ranks leave it empty); an earlier stage
    /// fills it with its hidden states for the next one.
    pub fn forward_stage(
        &mut self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        hidden_in: Option<&[f32]>,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let n_rows = self.validate(batch, kv)?;
        out.clear();
        let t = batch.tokens.len();
        let c = &self.config;
        let h = c.hidden_size;
        match (self.part.is_first(), hidden_in) {
            (true, None) => {}
            (false, Some(x)) if x.len() == t * h => {}
            (first, x) => {
                return Err(ModelError::Batch(format!(
                    "stage of layers {:?} (first: {first}) got {} hidden values for {t} tokens",
                    self.part.layers,
                    x.map_or(0, <[f32]>::len)
                )))
            }
        }
        if t == 0 {
            return Ok(());
        }
        let share = &self.share;
        let (nh, nkv, eps) = (share.q_heads.len(), share.kv_heads.len(), c.rms_norm_eps);
        let hd = c.head_dim;
        let (qd, kvd) = (nh * hd, nkv * hd);
        let mut params = AttnParams {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: c.head_dim,
            block_size: kv.layout().block_size,
            scale: c.attn_scale,
            window: None,
        };
        let w = &self.weights;
        let pool = &self.pool;
        let mm = &mut self.mm;
        let s = &mut self.scratch;
        let mut collective = self.collective.as_deref_mut();

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
        match hidden_in {
            Some(src) => x.copy_from_slice(src),
            None => {
                for (row, &tok) in x.chunks_exact_mut(h).zip(&batch.tokens) {
                    w.embed.dequantize_row(tok as usize, row);
                }
                if let Some(scale) = c.embedding_scale {
                    scale_inplace(x, scale);
                }
            }
        }

        for (l, lw) in w.layers.iter().enumerate() {
            let spec = c.layer(self.part.layers.start + l);
            let rope = &self.ropes[self.layer_rope[l]];
            params.window = spec.attention.window();
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
            // Per-head norms (Qwen3, Gemma 3) come before RoPE.
            for (buf, weight) in [(&mut *q, &lw.q_norm), (&mut *k, &lw.k_norm)] {
                if let Some(wn) = weight {
                    norm_rows_inplace(buf, wn, eps, hd, &mut s.row);
                }
            }
            let kv_layer = kv.layer_mut(l);
            for sq in &batch.seqs {
                for (i, tok_row) in sq.tokens.clone().enumerate() {
                    let pos = sq.pos + i;
                    let qr = &mut q[tok_row * qd..(tok_row + 1) * qd];
                    let kr = &mut k[tok_row * kvd..(tok_row + 1) * kvd];
                    apply_rope(qr, nh, pos, rope);
                    apply_rope(kr, nkv, pos, rope);
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
            match collective.as_deref_mut() {
                None => matmul(pool, &lw.wo, attn, t, proj, mm),
                Some(cl) => {
                    let io = (&mut s.gathered, &mut s.part);
                    let q_cols = share.q_heads.start * hd..share.q_heads.end * hd;
                    gathered_matmul(
                        pool,
                        cl,
                        &lw.wo,
                        attn,
                        q_cols,
                        t,
                        &share.hidden,
                        proj,
                        io,
                        mm,
                    );
                }
            }
            if let Some(wn) = &lw.post_attn_norm {
                norm_rows_inplace(proj, wn, eps, h, &mut s.row);
            }
            add_inplace(x, proj);

            norm_rows(x, &lw.ffn_norm, eps, xn, h);
            match &lw.mlp {
                MlpWeights::Dense(mlp) => {
                    let f = share.ffn.len();
                    let gate = grown(&mut s.gate, t * f);
                    let up = grown(&mut s.up, t * f);
                    dense_mlp_in(pool, mlp, c.activation, xn, t, gate, up, mm);
                    match collective.as_deref_mut() {
                        None => matmul(pool, &mlp.down, gate, t, proj, mm),
                        Some(cl) => {
                            let io = (&mut s.gathered, &mut s.part);
                            let f_cols = share.ffn.clone();
                            gathered_matmul(
                                pool,
                                cl,
                                &mlp.down,
                                gate,
                                f_cols,
                                t,
                                &share.hidden,
                                proj,
                                io,
                                mm,
                            );
                        }
                    }
                }
                MlpWeights::Moe(moe) => {
                    let spec = c.moe.as_ref().ok_or_else(|| {
                        ModelError::Config("a mixture-of-experts layer without experts".into())
                    })?;
                    let counts = &mut self.expert_tokens[l].tokens;
                    let layer = self.part.layers.start + l;
                    let ep = match collective.as_deref_mut() {
                        None => None,
                        Some(cl) => Some(moe::ExpertParallel {
                            cl,
                            owners: share.experts.owners(layer).ok_or_else(|| {
                                ModelError::Config(format!("layer {layer} has no expert placement"))
                            })?,
                            hidden: share.hidden.clone(),
                            shared_ffn: share.shared_ffn.clone(),
                        }),
                    };
                    self.moe_scratch.forward(
                        pool,
                        moe,
                        spec,
                        c.activation,
                        xn,
                        t,
                        h,
                        proj,
                        counts,
                        mm,
                        ep,
                    );
                }
            }
            if let Some(wn) = &lw.post_ffn_norm {
                norm_rows_inplace(proj, wn, eps, h, &mut s.row);
            }
            add_inplace(x, proj);
        }
        self.seqs = recycle(seqs);

        if !self.part.is_last(c) {
            out.extend_from_slice(x);
            return Ok(());
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
        if n_rows == 0 {
            return Ok(());
        }
        let head: &Matrix = w.output_head();
        match collective {
            None => {
                out.resize(n_rows * c.vocab_size, 0.0);
                matmul(pool, head, head_in, n_rows, out, mm);
                if let Some(cap) = c.final_logit_softcap {
                    softcap_inplace(out, cap);
                }
            }
            Some(cl) => {
                // Each rank computes its vocabulary slice; rank 0 assembles the full rows.
                let local = grown(&mut s.local_logits, n_rows * share.vocab.len());
                matmul(pool, head, head_in, n_rows, local, mm);
                let full = (cl.rank() == 0).then(|| {
                    out.resize(n_rows * c.vocab_size, 0.0);
                    &mut out[..]
                });
                if let Some(cap) = c.final_logit_softcap {
                    softcap_inplace(local, cap);
                }
                cl.gather_columns(local, share.vocab.clone(), c.vocab_size, full);
            }
        }
        Ok(())
    }
}

/// A projection under tensor parallelism: gathers the input's column shards (`in_cols` of the
/// `w.cols()`-wide input: rank shards cut only rows, so `w` keeps every input column) from every rank,
/// computes this rank's output features (`out_cols`, the rows of `w`) over the whole input, and gathers
/// every rank's features into `out` (tokens × hidden). Each output element is one
/// full dot product, as on a single rank, so the result is bit-identical to the unsplit projection.
#[allow(clippy::too_many_arguments)]
fn gathered_matmul(
    pool: &ThreadPool,
    cl: &mut dyn Collective,
    w: &Matrix,
    input: &[f32],
    in_cols: std::ops::Range<usize>,
    t: usize,
    out_cols: &std::ops::Range<usize>,
    out: &mut [f32],
    (gathered, part): (&mut Vec<f32>, &mut Vec<f32>),
    mm: &mut MatmulScratch,
) {
    let in_width = w.cols();
    let full = grown(gathered, t * in_width);
    cl.all_gather_columns(input, in_cols, in_width, full);
    let local = grown(part, t * out_cols.len());
    matmul(pool, w, full, t, local, mm);
    cl.all_gather_columns(local, out_cols.clone(), out.len() / t, out);
}

/// The MLP's input half: `gate = act(gate_proj·x) ⊙ up_proj·x`, rows × features (`up` is scratch).
#[allow(clippy::too_many_arguments)]
fn dense_mlp_in(
    pool: &ThreadPool,
    mlp: &GatedMlp,
    activation: Activation,
    xn: &[f32],
    t: usize,
    gate: &mut [f32],
    up: &mut [f32],
    mm: &mut MatmulScratch,
) {
    matmul_fused(
        pool,
        [&mlp.gate, &mlp.up],
        xn,
        t,
        [&mut *gate, &mut *up],
        mm,
    );
    match activation {
        Activation::Silu => silu_mul(gate, up),
        Activation::GeluTanh => gelu_tanh_mul(gate, up),
    }
}

/// RMS-normalizes every `width`-wide row of `x` in place (per-head and post-block norms).
fn norm_rows_inplace(x: &mut [f32], weight: &[f32], eps: f32, width: usize, row: &mut Vec<f32>) {
    let row = grown(row, width);
    for xr in x.chunks_exact_mut(width) {
        rms_norm(xr, weight, eps, row);
        xr.copy_from_slice(row);
    }
}

/// RMS-normalizes every `width`-wide row of `x` into `out`.
fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], width: usize) {
    for (xr, or) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        rms_norm(xr, weight, eps, or);
    }
}

#[cfg(test)]
mod tests;
