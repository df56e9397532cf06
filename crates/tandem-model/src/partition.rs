//! How one model is cut across workers: a pipeline stage owns a contiguous run of layers, and a
//! tensor-parallel rank owns a share of every layer's heads, MLP features, hidden features and vocabulary.
//!
//! Every weight is cut by output rows only, which shares the bytes (no copy) and never cuts a quantization
//! block: Q/K/V by heads, gate/up by MLP features, the attention output and MLP down projections by hidden
//! features, the head by vocabulary. Instead of Megatron's partial sums (all-reduce after the attention
//! output and MLP down projections), ranks all-gather the activations those projections read and then
//! all-gather their outputs: every output element is one full-length dot product computed by the same
//! kernel, so tensor-parallel logits equal the single-rank ones bit for bit (the kernels' rows do not
//! depend on the row slice or thread count: tested in tandem-kernels). Uneven splits are allowed
//! (SmolLM2-135M's 3 KV heads over 2 ranks give 2 + 1): a rank's query heads follow its KV heads, so GQA
//! groups are never cut.
//!
//! A mixture of experts is split by experts, not features (expert parallelism): a rank holds the whole
//! matrices of the experts its [`ExpertMap`] places there and a replica of the (small) router; the
//! shared expert, if any, is split like a dense MLP. `llama/moe.rs` says how the outputs are combined.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::expert_map::ExpertMap;
use crate::weights::{GatedMlp, LayerWeights, LlamaWeights, MlpWeights, MoeWeights, SharedExpert};

/// Which share of the model one `CpuLlama` computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Layers of this pipeline stage (all of them without pipeline parallelism).
    pub layers: Range<usize>,
    /// This rank's index in its tensor-parallel group.
    pub tp_rank: usize,
    /// Ranks that split every layer's heads and MLP columns (1: no tensor parallelism).
    pub tp_size: usize,
}

impl Partition {
    /// The whole model on one rank.
    pub fn whole(config: &ModelConfig) -> Partition {
        Partition {
            layers: 0..config.num_layers,
            tp_rank: 0,
            tp_size: 1,
        }
    }

    /// Stage `stage` of `stages` pipeline stages: layers split as evenly as possible, earlier stages
    /// taking the remainder.
    pub fn stage(
        config: &ModelConfig,
        stage: usize,
        stages: usize,
    ) -> Result<Partition, ModelError> {
        if stages == 0 || stage >= stages {
            return Err(ModelError::Partition(format!(
                "stage {stage} of pipeline_parallel_size {stages}"
            )));
        }
        if stages > config.num_layers {
            return Err(ModelError::Partition(format!(
                "pipeline_parallel_size {stages} exceeds the model's {} layers",
                config.num_layers
            )));
        }
        Ok(Partition {
            layers: even_range(config.num_layers, stages, stage),
            tp_rank: 0,
            tp_size: 1,
        })
    }

    /// This partition as rank `rank` of a tensor-parallel group of `size`.
    pub fn with_rank(self, rank: usize, size: usize) -> Partition {
        Partition {
            tp_rank: rank,
            tp_size: size,
            ..self
        }
    }

    /// Whether this stage embeds the tokens (it owns layer 0).
    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    /// Whether this stage produces logits (it owns the last layer).
    pub fn is_last(&self, config: &ModelConfig) -> bool {
        self.layers.end == config.num_layers
    }
}

/// Part `i` of `n` items cut into `parts` contiguous runs whose sizes differ by at most one.
pub fn even_range(n: usize, parts: usize, i: usize) -> Range<usize> {
    let (base, extra) = (n / parts, n % parts);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// The dimensions a tensor-parallel rank owns, in units of the full model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankShare {
    /// KV heads of this rank.
    pub kv_heads: Range<usize>,
    /// Query heads of this rank (the groups of its KV heads).
    pub q_heads: Range<usize>,
    /// MLP intermediate features of this rank.
    pub ffn: Range<usize>,
    /// Hidden features this rank's attention-output and MLP-down rows produce.
    pub hidden: Range<usize>,
    /// Output-head rows (vocabulary ids) whose logits this rank computes.
    pub vocab: Range<usize>,
    /// Shared-expert features of this rank (empty for a model without a shared expert).
    pub shared_ffn: Range<usize>,
    /// Which rank of the group holds each routed expert (this rank holds those placed on its index).
    pub experts: ExpertMap,
}

impl RankShare {
    /// The share of rank `rank` of `size` ranks for `config`, experts placed contiguously: checks that
    /// the split fits.
    pub fn new(config: &ModelConfig, rank: usize, size: usize) -> Result<RankShare, ModelError> {
        let experts = ExpertMap::contiguous(config, size.max(1))?;
        RankShare::with_experts(config, rank, size, experts)
    }

    /// The share of rank `rank` of `size` ranks with the routed experts placed by `experts`: checks
    /// that the split fits and that the map places this model's experts over `size` ranks.
    pub fn with_experts(
        config: &ModelConfig,
        rank: usize,
        size: usize,
        experts: ExpertMap,
    ) -> Result<RankShare, ModelError> {
        let c = config;
        if size == 0 || rank >= size {
            return Err(ModelError::Partition(format!(
                "rank {rank} of tensor_parallel_size {size}"
            )));
        }
        if size > c.num_kv_heads {
            return Err(ModelError::Partition(format!(
                "tensor_parallel_size {size} exceeds the model's {} KV heads",
                c.num_kv_heads
            )));
        }
        experts.check(c, size)?;
        let shared = c.moe.as_ref().and_then(|m| m.shared_ffn).unwrap_or(0);
        if shared > 0 && size > shared {
            return Err(ModelError::Partition(format!(
                "tensor_parallel_size {size} exceeds the model's {shared} shared-expert features"
            )));
        }
        let group = c.num_heads / c.num_kv_heads;
        let kv_heads = even_range(c.num_kv_heads, size, rank);
        Ok(RankShare {
            q_heads: kv_heads.start * group..kv_heads.end * group,
            kv_heads,
            ffn: even_range(c.intermediate_size, size, rank),
            hidden: even_range(c.hidden_size, size, rank),
            vocab: even_range(c.vocab_size, size, rank),
            shared_ffn: even_range(shared, size, rank),
            experts,
        })
    }

    /// The whole model's dimensions: the share of a single rank.
    pub fn whole(config: &ModelConfig) -> RankShare {
        RankShare {
            kv_heads: 0..config.num_kv_heads,
            q_heads: 0..config.num_heads,
            ffn: 0..config.intermediate_size,
            hidden: 0..config.hidden_size,
            vocab: 0..config.vocab_size,
            shared_ffn: 0..config.moe.as_ref().and_then(|m| m.shared_ffn).unwrap_or(0),
            experts: ExpertMap::contiguous(config, 1).expect("one rank places every expert"),
        }
    }
}

/// The weights one partition needs: its layers cut to its rank's share, the embedding (first stage) and
/// its slice of the output head (last stage). Only rows are cut, so nothing is copied; of a mixture of
/// experts the rank keeps only the experts `share.experts` places on `part.tp_rank`, so the others'
/// bytes are never touched by this rank.
pub fn shard_weights(
    config: &ModelConfig,
    weights: &LlamaWeights,
    part: &Partition,
    share: &RankShare,
) -> LlamaWeights {
    let hd = config.head_dim;
    let q = share.q_heads.start * hd..share.q_heads.end * hd;
    let kv = share.kv_heads.start * hd..share.kv_heads.end * hd;
    let slice = |b: &Option<Vec<f32>>, r: &Range<usize>| b.as_ref().map(|b| b[r.clone()].to_vec());
    let layers = weights.layers[part.layers.clone()]
        .iter()
        .zip(part.layers.clone())
        .map(|(l, layer)| LayerWeights {
            attn_norm: l.attn_norm.clone(),
            wq: l.wq.slice_rows(q.clone()),
            wk: l.wk.slice_rows(kv.clone()),
            wv: l.wv.slice_rows(kv.clone()),
            wo: l.wo.slice_rows(share.hidden.clone()),
            bq: slice(&l.bq, &q),
            bk: slice(&l.bk, &kv),
            bv: slice(&l.bv, &kv),
            q_norm: l.q_norm.clone(),
            k_norm: l.k_norm.clone(),
            post_attn_norm: l.post_attn_norm.clone(),
            ffn_norm: l.ffn_norm.clone(),
            mlp: match &l.mlp {
                MlpWeights::Dense(m) => MlpWeights::Dense(slice_mlp(m, &share.ffn, &share.hidden)),
                MlpWeights::Moe(m) => MlpWeights::Moe(shard_moe(m, layer, part.tp_rank, share)),
            },
            post_ffn_norm: l.post_ffn_norm.clone(),
        })
        .collect();
    let whole_vocab = share.vocab == (0..config.vocab_size);
    LlamaWeights {
        embed: weights.embed.clone(),
        layers,
        norm: weights.norm.clone(),
        lm_head: if whole_vocab {
            weights.lm_head.clone()
        } else {
            Some(weights.output_head().slice_rows(share.vocab.clone()))
        },
    }
}

/// A gated MLP cut to features `ffn` (gate and up rows) and hidden features `hidden` (down rows).
fn slice_mlp(m: &GatedMlp, ffn: &Range<usize>, hidden: &Range<usize>) -> GatedMlp {
    GatedMlp {
        gate: m.gate.slice_rows(ffn.clone()),
        up: m.up.slice_rows(ffn.clone()),
        down: m.down.slice_rows(hidden.clone()),
    }
}

/// Rank `rank`'s share of whole-model layer `layer`'s experts: the router whole, the experts the map
/// places on the rank whole, the shared expert cut like a dense MLP. `m` holds every expert.
fn shard_moe(m: &MoeWeights, layer: usize, rank: usize, share: &RankShare) -> MoeWeights {
    let ids = share.experts.experts_on(layer, rank);
    MoeWeights {
        router: m.router.clone(),
        experts: ids.iter().map(|&x| m.experts[x].clone()).collect(),
        expert_ids: ids,
        shared: m.shared.as_ref().map(|s| SharedExpert {
            mlp: slice_mlp(&s.mlp, &share.shared_ffn, &share.hidden),
            gate: s.gate.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_ranges_cover_everything_once() {
        for n in 1..20 {
            for parts in 1..=n {
                let mut next = 0;
                for i in 0..parts {
                    let r = even_range(n, parts, i);
                    assert_eq!(r.start, next);
                    assert!(!r.is_empty());
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
        assert_eq!(even_range(3, 2, 0), 0..2);
        assert_eq!(even_range(3, 2, 1), 2..3);
    }
}
