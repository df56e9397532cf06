//! Expert parallelism on the tiny Qwen3-MoE and Qwen2-MoE fixtures (tests/fixtures/hf, safetensors and
//! GGUF): tensor-parallel ranks that each hold only the experts their `ExpertMap` places there give the
//! single rank's logits (within hf_reference's 1e-4; in fact bit for bit) and greedy tokens, the ranks'
//! routing counts add up to the single rank's, and a placement that does not place every expert once is
//! refused naming the layer and expert.

use std::path::Path;

use tandem_model::{
    load, CpuLlama, ExpertMap, ExpertMapError, ExpertPlacement, ForwardBatch, KvCache,
    LayerExpertTokens, LlamaWeights, LoadOptions, LogitsWanted, ModelConfig, ModelError, Partition,
    ThreadCollective,
};

/// hf_reference's bound on |tandem - transformers|; ranks must stay within it of one rank.
const TOL: f32 = 1e-4;
const FIXTURES: [&str; 4] = [
    "tiny-qwen3-moe",
    "tiny-qwen3-moe-gguf",
    "tiny-qwen2-moe",
    "tiny-qwen2-moe-gguf",
];
/// Tokens generated greedily after the prompt.
const NEW_TOKENS: usize = 8;

fn load_fixture(name: &str) -> (ModelConfig, LlamaWeights, Vec<u32>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name);
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let prompt = expected["prompts"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let gguf = dir.join("model.gguf");
    let path = if gguf.exists() { gguf } else { dir };
    let m = load(&path, &LoadOptions { progress: false }).unwrap();
    (m.config, m.weights, prompt)
}

/// The prompt as one prefill step, then each later token of `seq` as a decode step: every step's last
/// logits row (from rank 0) and the routing counts summed over the ranks.
fn run(
    c: &ModelConfig,
    w: &LlamaWeights,
    map: &ExpertMap,
    seq: &[u32],
    prompt: usize,
) -> (Vec<Vec<f32>>, Vec<LayerExpertTokens>) {
    let ranks = map.ranks();
    let group = ThreadCollective::group(ranks);
    let per_rank: Vec<(Vec<Vec<f32>>, Vec<LayerExpertTokens>)> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(r, col)| {
                let (c, map) = (c.clone(), map.clone());
                s.spawn(move || {
                    let part = Partition::whole(&c).with_rank(r, ranks);
                    let col = (ranks > 1).then(|| Box::new(col) as _);
                    let mut m =
                        CpuLlama::partitioned_with_experts(c, w, 1, part, col, map).unwrap();
                    let mut kv = KvCache::new(m.kv_layout(4, 16));
                    let blocks: Vec<u32> = (0..16).rev().collect();
                    let mut rows = Vec::new();
                    let mut batch = ForwardBatch::default();
                    let mut logits = Vec::new();
                    let mut pos = 0;
                    for end in prompt..=seq.len() {
                        if end == pos {
                            continue;
                        }
                        batch.clear();
                        batch.push(&seq[pos..end], pos, blocks.clone(), LogitsWanted::Last);
                        m.forward(&batch, &mut kv, &mut logits).unwrap();
                        rows.push(logits.clone());
                        pos = end;
                    }
                    (rows, m.expert_tokens().cloned().collect())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut it = per_rank.into_iter();
    let (rows, mut counts) = it.next().unwrap();
    for (other, their) in it {
        assert!(
            other.iter().all(Vec::is_empty),
            "only rank 0 returns logits"
        );
        for (a, b) in counts.iter_mut().zip(&their) {
            assert_eq!(a.layer, b.layer);
            a.tokens
                .iter_mut()
                .zip(&b.tokens)
                .for_each(|(x, y)| *x += y);
        }
    }
    (rows, counts)
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

#[test]
fn expert_parallel_ranks_match_one_rank_on_the_moe_fixtures() {
    for name in FIXTURES {
        let (c, w, prompt) = load_fixture(name);
        // One rank generates greedily; that sequence is then replayed on the ranks step by step.
        let mut seq = prompt.clone();
        let one = ExpertMap::contiguous(&c, 1).unwrap();
        for _ in 0..NEW_TOKENS {
            let (rows, _) = run(&c, &w, &one, &seq, seq.len());
            seq.push(argmax(&rows[0]));
        }
        let (want, want_counts) = run(&c, &w, &one, &seq, prompt.len());
        assert_eq!(want.len(), NEW_TOKENS + 1);
        let routed: u64 = want_counts.iter().flat_map(|l| &l.tokens).sum();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            routed,
            (seq.len() * want_counts.len() * moe.top_k) as u64,
            "{name}: every row routed to top-k experts of every MoE layer"
        );
        let maps = [
            ExpertMap::contiguous(&c, 2).unwrap(),
            ExpertMap::new(&c, 2, ExpertPlacement::RoundRobin).unwrap(),
        ];
        for map in maps {
            let (got, counts) = run(&c, &w, &map, &seq, prompt.len());
            for (step, (g, r)) in got.iter().zip(&want).enumerate() {
                let d = g
                    .iter()
                    .zip(r)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(d <= TOL, "{name} {map:?} step {step}: max abs diff {d:e}");
                assert_eq!(argmax(g), argmax(r), "{name} step {step}: greedy token");
            }
            // The placement is exact (see llama/moe.rs), so the logits are identical, not just close.
            assert_eq!(got, want, "{name} {map:?}");
            assert_eq!(
                counts, want_counts,
                "{name} {map:?}: each expert counted once"
            );
        }
    }
}

#[test]
fn bad_expert_maps_and_unfit_splits_are_refused_by_name() {
    let (c, w, _) = load_fixture("tiny-qwen3-moe");
    // Layer 1 of tiny-qwen3-moe is dense (mlp_only_layers); 0 and 2 have 8 experts each.
    let placed: Vec<(usize, usize, usize)> = [0, 2]
        .iter()
        .flat_map(|&l| (0..8).map(move |x| (l, x, x % 2)))
        .collect();
    ExpertMap::from_assignments(&c, 2, placed.clone()).unwrap();
    let twice = placed.iter().copied().chain([(2, 5, 0)]);
    let e = ExpertMap::from_assignments(&c, 2, twice).unwrap_err();
    assert_eq!(
        e.to_string(),
        "layer 2 expert 5 placed twice (ranks 1 and 0)"
    );
    let missing = placed.iter().copied().filter(|&a| a != (0, 3, 1));
    let e = ExpertMap::from_assignments(&c, 2, missing).unwrap_err();
    assert_eq!(
        e,
        ExpertMapError::Missing {
            layer: 0,
            expert: 3
        }
    );
    let mut far = placed.clone();
    far[9].2 = 2;
    let e = ExpertMap::from_assignments(&c, 2, far).unwrap_err();
    assert_eq!(
        e.to_string(),
        "layer 2 expert 1 placed on rank 2, but there are 2 ranks"
    );
    let dense = placed.iter().copied().chain([(1, 0, 0)]);
    let e = ExpertMap::from_assignments(&c, 2, dense).unwrap_err();
    assert_eq!(e, ExpertMapError::NotMoeLayer { layer: 1 });
    // Three ranks would place 8 experts unevenly (3 + 3 + 2), but the model's 2 KV heads cannot be
    // split three ways: the refusal names the heads, no longer the experts.
    let col = ThreadCollective::group(3).remove(0);
    let part = Partition::whole(&c).with_rank(0, 3);
    let e = CpuLlama::partitioned(c.clone(), &w, 1, part, Some(Box::new(col))).unwrap_err();
    assert!(
        matches!(&e, ModelError::Partition(m) if m.contains("2 KV heads")),
        "{e}"
    );
}
