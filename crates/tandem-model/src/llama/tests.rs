//! The CPU forward pass against a tiny random model: chunking, batching, tensor-parallel ranks and
//! pipeline stages all give the whole model's logits bit for bit; bad batches and splits are refused.

use super::*;
use crate::collective::ThreadCollective;
use crate::config::DenseShape;
use crate::expert_map::{ExpertMapError, ExpertPlacement};
use crate::spec::LayerRope;
use crate::spec::{Activation, AttentionSpan, MlpKind, MoeSpec};
use crate::weights::{GatedMlp, LayerWeights, MlpWeights, MoeWeights, SharedExpert};
use tandem_kernels::RopeScaling;

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
        tie_word_embeddings: true,
        attention_bias: bias,
        ..ModelConfig::dense(DenseShape {
            hidden: 32,
            ffn: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            vocab: 50,
            max_positions: 64,
            rope: LayerRope {
                theta: 10000.0,
                scaling: RopeScaling::None,
            },
        })
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
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            ffn_norm: (0..h).map(|_| 1.0 + g.next()).collect(),
            mlp: MlpWeights::Dense(GatedMlp {
                gate: g.matrix(f, h),
                up: g.matrix(f, h),
                down: g.matrix(h, f),
            }),
            post_ffn_norm: None,
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
/// The tiny model with every structural feature of the description on: per-head norms, sandwich
/// norms, GELU, a scaled embedding, soft-capped logits, a windowed layer with its own rope, and a
/// mixture-of-experts layer with a shared expert (Gemma 3's and Qwen-MoE's pieces in one model).
fn featured() -> (ModelConfig, LlamaWeights) {
    let (mut c, mut w) = tiny(true);
    let mut g = Lcg(11);
    let (h, hd) = (c.hidden_size, c.head_dim);
    c.qk_norm = true;
    c.sandwich_norms = true;
    c.activation = Activation::GeluTanh;
    c.embedding_scale = Some(2.0);
    c.final_logit_softcap = Some(3.0);
    c.attn_scale = 0.2;
    c.layers[0].attention = AttentionSpan::Window(3);
    c.layers[0].rope.theta = 500.0;
    c.layers[1].mlp = MlpKind::Moe;
    let (experts, ef, sf) = (4, 16, 24);
    c.moe = Some(MoeSpec {
        num_experts: experts,
        top_k: 2,
        norm_top_k: true,
        expert_ffn: ef,
        shared_ffn: Some(sf),
    });
    c.validate().unwrap();
    let mut norm = |n: usize| -> Vec<f32> { (0..n).map(|_| 1.0 + g.next()).collect() };
    let norms: Vec<[Vec<f32>; 4]> = (0..c.num_layers)
        .map(|_| [norm(hd), norm(hd), norm(h), norm(h)])
        .collect();
    for (lw, [qn, kn, pa, pf]) in w.layers.iter_mut().zip(norms) {
        lw.q_norm = Some(qn);
        lw.k_norm = Some(kn);
        lw.post_attn_norm = Some(pa);
        lw.post_ffn_norm = Some(pf);
    }
    let mut mlp = |f: usize| GatedMlp {
        gate: g.matrix(f, h),
        up: g.matrix(f, h),
        down: g.matrix(h, f),
    };
    let moe = MoeWeights {
        router: Lcg(5).matrix(experts, h),
        experts: (0..experts).map(|_| mlp(ef)).collect(),
        expert_ids: (0..experts).collect(),
        shared: Some(SharedExpert {
            mlp: mlp(sf),
            gate: (0..h).map(|i| (i as f32 - 16.0) / 32.0).collect(),
        }),
    };
    w.layers[1].mlp = MlpWeights::Moe(moe);
    (c, w)
}

#[test]
fn the_featured_model_chunks_batches_and_bounds_its_logits() {
    let (c, w) = featured();
    let mut m = CpuLlama::new(c, w, 2);
    let prompt: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 50).collect();
    let blocks = [9, 2, 14, 5];
    let one = run_chunks(&mut m, &prompt, &[], &blocks);
    let each: Vec<usize> = (1..13).collect();
    let single = run_chunks(&mut m, &prompt, &each, &blocks);
    for (a, b) in one.iter().zip(&single) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    assert!(one.iter().all(|x| x.abs() < 3.0), "soft-capped at 3");
    // Every routed row went to exactly top-k experts of the one MoE layer.
    let counts: Vec<_> = m.expert_tokens().collect();
    assert_eq!(counts.len(), 1, "{counts:?}");
    assert_eq!((counts[0].layer, counts[0].tokens.len()), (1, 4));
    let routed: u64 = counts[0].tokens.iter().sum();
    assert_eq!(
        routed,
        2 * 2 * 13,
        "two runs of 13 tokens, two experts each"
    );
}

#[test]
fn the_window_hides_tokens_beyond_it() {
    // Two layers of window 3 reach back 2·(3-1) = 4 positions: the first token, 5 back from the last,
    // cannot change the last row's logits, while it does change its own.
    let (mut c, w) = tiny(false);
    for l in &mut c.layers {
        l.attention = AttentionSpan::Window(3);
    }
    let mut m = CpuLlama::new(c, w, 1);
    let a = run_chunks(&mut m, &[1, 2, 3, 4, 5, 6], &[], &[0, 1]);
    let b = run_chunks(&mut m, &[9, 2, 3, 4, 5, 6], &[], &[0, 1]);
    assert_eq!(a[5 * 50..], b[5 * 50..]);
    assert_ne!(a[..50], b[..50]);
}

fn run_chunks(model: &mut CpuLlama, prompt: &[u32], cuts: &[usize], blocks: &[u32]) -> Vec<f32> {
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

/// One prefill chunk then two single-token steps, as the engine would run them; logits of each step.
fn steps(prompt: &[u32]) -> Vec<ForwardBatch> {
    let blocks = vec![3, 0, 5];
    let n = prompt.len();
    let mut out = Vec::new();
    for (range, pos) in [(0..n - 2, 0), (n - 2..n - 1, n - 2), (n - 1..n, n - 1)] {
        let mut b = ForwardBatch::default();
        b.push(&prompt[range], pos, blocks.clone(), LogitsWanted::All);
        out.push(b);
    }
    out
}

#[test]
fn tensor_parallel_ranks_match_the_whole_model_bit_for_bit() {
    for bias in [false, true] {
        let (c, w) = tiny(bias);
        let prompt: Vec<u32> = (0..11).map(|i| (i * 5 + 1) % 50).collect();
        let mut whole = CpuLlama::new(c.clone(), w.clone(), 1);
        let mut kv = KvCache::new(whole.kv_layout(4, 8));
        let mut want = Vec::new();
        for b in steps(&prompt) {
            let mut logits = Vec::new();
            whole.forward(&b, &mut kv, &mut logits).unwrap();
            want.push(logits);
        }
        let group = ThreadCollective::group(2);
        let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .enumerate()
                .map(|(r, col)| {
                    let (c, w, prompt) = (c.clone(), &w, &prompt);
                    s.spawn(move || {
                        let part = Partition::whole(&c).with_rank(r, 2);
                        let mut m =
                            CpuLlama::partitioned(c, w, 1, part, Some(Box::new(col))).unwrap();
                        assert_eq!(m.share().kv_heads, r..r + 1);
                        let mut kv = KvCache::new(m.kv_layout(4, 8));
                        steps(prompt)
                            .iter()
                            .map(|b| {
                                let mut logits = Vec::new();
                                m.forward(b, &mut kv, &mut logits).unwrap();
                                logits
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            got[1].iter().all(Vec::is_empty),
            "only rank 0 returns logits"
        );
        assert_eq!(
            got[0], want,
            "tensor-parallel logits must equal the whole model's bit for bit"
        );
    }
}

#[test]
fn pipeline_stages_chain_to_the_whole_model_bit_for_bit() {
    for (c, w) in [tiny(true), featured()] {
        stages_chain(c, w);
    }
}

fn stages_chain(c: ModelConfig, w: LlamaWeights) {
    let prompt: Vec<u32> = (0..11).map(|i| (i * 3 + 2) % 50).collect();
    let mut whole = CpuLlama::new(c.clone(), w.clone(), 1);
    let mut kv = KvCache::new(whole.kv_layout(4, 8));
    let stages: Vec<Partition> = (0..2)
        .map(|i| Partition::stage(&c, i, 2).unwrap())
        .collect();
    assert_eq!(stages[0].layers, 0..1);
    let mut models: Vec<CpuLlama> = stages
        .iter()
        .map(|p| CpuLlama::partitioned(c.clone(), &w, 1, p.clone(), None).unwrap())
        .collect();
    let mut caches: Vec<KvCache> = models
        .iter()
        .map(|m| KvCache::new(m.kv_layout(4, 8)))
        .collect();
    for b in steps(&prompt) {
        let mut want = Vec::new();
        whole.forward(&b, &mut kv, &mut want).unwrap();
        let mut hidden = Vec::new();
        models[0]
            .forward_stage(&b, &mut caches[0], None, &mut hidden)
            .unwrap();
        assert_eq!(hidden.len(), b.tokens.len() * c.hidden_size);
        let mut logits = Vec::new();
        models[1]
            .forward_stage(&b, &mut caches[1], Some(&hidden), &mut logits)
            .unwrap();
        assert_eq!(logits, want);
        assert!(matches!(
            models[1].forward_stage(&b, &mut caches[1], None, &mut logits),
            Err(ModelError::Batch(_))
        ));
    }
}

#[test]
fn splits_that_do_not_fit_are_refused_by_name() {
    let (c, w) = tiny(false);
    let err = |part: Partition, col| {
        CpuLlama::partitioned(c.clone(), &w, 1, part, col)
            .unwrap_err()
            .to_string()
    };
    let e = err(
        Partition::whole(&c).with_rank(0, 3),
        Some(Box::new(ThreadCollective::group(3).remove(0))),
    );
    assert!(
        e.contains("tensor_parallel_size 3 exceeds the model's 2 KV heads"),
        "{e}"
    );
    let e = err(Partition::whole(&c).with_rank(0, 2), None);
    assert!(e.contains("needs a collective"), "{e}");
    assert!(Partition::stage(&c, 0, 3)
        .unwrap_err()
        .to_string()
        .contains("pipeline_parallel_size 3"));
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

/// Runs `steps(prompt)` on `experts.ranks()` tensor-parallel ranks of (c, w) with the experts placed by
/// `experts`: rank 0's logits of each step, and each rank's (expert counts, expert ids held per MoE
/// layer, bytes of routed-expert weights held).
#[allow(clippy::type_complexity)]
fn expert_parallel(
    c: &ModelConfig,
    w: &LlamaWeights,
    prompt: &[u32],
    experts: &ExpertMap,
) -> (
    Vec<Vec<f32>>,
    Vec<(Vec<LayerExpertTokens>, Vec<Vec<usize>>, usize)>,
) {
    let size = experts.ranks();
    let group = ThreadCollective::group(size);
    let ranks: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(r, col)| {
                let (c, experts) = (c.clone(), experts.clone());
                s.spawn(move || {
                    let part = Partition::whole(&c).with_rank(r, size);
                    let mut m = CpuLlama::partitioned_with_experts(
                        c,
                        w,
                        1,
                        part,
                        Some(Box::new(col)),
                        experts,
                    )
                    .unwrap();
                    let mut kv = KvCache::new(m.kv_layout(4, 8));
                    let logits: Vec<Vec<f32>> = steps(prompt)
                        .iter()
                        .map(|b| {
                            let mut logits = Vec::new();
                            m.forward(b, &mut kv, &mut logits).unwrap();
                            logits
                        })
                        .collect();
                    let moe: Vec<&MoeWeights> = m
                        .weights()
                        .layers
                        .iter()
                        .filter_map(|l| match &l.mlp {
                            MlpWeights::Moe(moe) => Some(moe),
                            MlpWeights::Dense(_) => None,
                        })
                        .collect();
                    let held = moe.iter().map(|m| m.expert_ids.clone()).collect();
                    let bytes = moe
                        .iter()
                        .flat_map(|m| &m.experts)
                        .map(|e| e.gate.bytes().len() + e.up.bytes().len() + e.down.bytes().len())
                        .sum();
                    (logits, (m.expert_tokens().cloned().collect(), held, bytes))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut ranks = ranks.into_iter();
    let (logits, first) = ranks.next().unwrap();
    let mut info = vec![first];
    for (l, i) in ranks {
        assert!(l.iter().all(Vec::is_empty), "only rank 0 returns logits");
        info.push(i);
    }
    (logits, info)
}

#[test]
fn expert_parallel_ranks_match_the_whole_model_bit_for_bit() {
    let (c, w) = featured();
    let prompt: Vec<u32> = (0..11).map(|i| (i * 5 + 1) % 50).collect();
    let mut whole = CpuLlama::new(c.clone(), w.clone(), 1);
    let mut kv = KvCache::new(whole.kv_layout(4, 8));
    let want: Vec<Vec<f32>> = steps(&prompt)
        .iter()
        .map(|b| {
            let mut logits = Vec::new();
            whole.forward(b, &mut kv, &mut logits).unwrap();
            logits
        })
        .collect();
    let want_counts: Vec<LayerExpertTokens> = whole.expert_tokens().cloned().collect();
    let expert_bytes =
        |e: &GatedMlp| e.gate.bytes().len() + e.up.bytes().len() + e.down.bytes().len();
    let MlpWeights::Moe(all) = &w.layers[1].mlp else {
        panic!("layer 1 is the MoE layer")
    };
    let one = expert_bytes(&all.experts[0]);
    // 4 experts of layer 1: 2 + 2 contiguously, alternating round-robin, and an uneven 3 + 1.
    let maps = [
        (
            ExpertMap::contiguous(&c, 2).unwrap(),
            [vec![0, 1], vec![2, 3]],
        ),
        (
            ExpertMap::new(&c, 2, ExpertPlacement::RoundRobin).unwrap(),
            [vec![0, 2], vec![1, 3]],
        ),
        (
            ExpertMap::from_assignments(&c, 2, [(1, 0, 1), (1, 1, 1), (1, 2, 0), (1, 3, 1)])
                .unwrap(),
            [vec![2], vec![0, 1, 3]],
        ),
    ];
    for (map, held) in maps {
        let (got, info) = expert_parallel(&c, &w, &prompt, &map);
        assert_eq!(got, want, "{map:?}: logits must equal the whole model's");
        for (r, (_, ids, bytes)) in info.iter().enumerate() {
            assert_eq!(ids, &[held[r].clone()], "{map:?} rank {r}");
            assert_eq!(*bytes, held[r].len() * one, "only its experts' bytes");
        }
        // Each rank counts its own experts only; summed, the group counts what one rank does.
        let mut sum = info[0].0.clone();
        for (counts, _, _) in &info[1..] {
            for (s, l) in sum.iter_mut().zip(counts) {
                assert_eq!(s.layer, l.layer);
                s.tokens
                    .iter_mut()
                    .zip(&l.tokens)
                    .for_each(|(a, b)| *a += b);
            }
        }
        assert_eq!(sum, want_counts, "{map:?}");
        for (r, (counts, _, _)) in info.iter().enumerate() {
            for (x, &n) in counts[0].tokens.iter().enumerate() {
                if !held[r].contains(&x) {
                    assert_eq!(n, 0, "rank {r} counted expert {x} it does not hold");
                }
            }
        }
    }
}

#[test]
fn expert_maps_that_do_not_fit_the_group_are_refused() {
    let (c, w) = featured();
    let part = Partition::whole(&c).with_rank(0, 2);
    let err = |map: ExpertMap| {
        let col = ThreadCollective::group(2).remove(0);
        CpuLlama::partitioned_with_experts(c.clone(), &w, 1, part.clone(), Some(Box::new(col)), map)
            .unwrap_err()
    };
    let e = err(ExpertMap::contiguous(&c, 3).unwrap());
    assert!(
        matches!(
            e,
            ModelError::ExpertMap(ExpertMapError::WrongRanks { map: 3, ranks: 2 })
        ),
        "{e}"
    );
    let (dense, _) = tiny(false);
    let e = err(ExpertMap::contiguous(&dense, 2).unwrap());
    assert!(e.to_string().contains("does not match the model"), "{e}");
}
