//! The CPU forward pass against a tiny random model: chunking, batching, tensor-parallel ranks and
//! pipeline stages all give the whole model's logits bit for bit; bad batches and splits are refused.

use super::*;
use crate::collective::ThreadCollective;
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
    let (c, w) = tiny(true);
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
