//! What the CUDA backend's test files share: the small model they load with random weights, and the
//! comparison of a GPU run's logits with a float32 CPU reference. Each test file uses part of it.
#![allow(dead_code)]

use tandem_kernels::RopeScaling;
use tandem_model::{DenseShape, ForwardBatch, LayerRope, LogitsWanted, ModelConfig};

/// Tokens per KV block of the reference comparisons.
pub const BLOCK: usize = 16;
/// KV blocks of the one sequence of a reference comparison.
pub const BLOCKS: usize = 8;

/// Logits rows of one prompt's prefill (every row) then single-token decode steps.
pub type Rows = Vec<Vec<f32>>;

/// Runs `prompt` through `step` (`chunk` tokens a step: every row's logits), then one decode step per
/// token of `steps`; returns every logits row.
pub fn run(
    mut step: impl FnMut(&ForwardBatch, &mut Vec<f32>),
    vocab: usize,
    prompt: &[u32],
    chunk: usize,
    steps: &[u32],
) -> Rows {
    let table: Vec<u32> = (0..BLOCKS as u32).collect();
    let mut batch = ForwardBatch::default();
    let mut logits = Vec::new();
    let mut rows: Rows = Vec::new();
    for (i, part) in prompt.chunks(chunk.max(1)).enumerate() {
        batch.clear();
        batch.push(part, i * chunk, table.clone(), LogitsWanted::All);
        step(&batch, &mut logits);
        rows.extend(logits.chunks_exact(vocab).map(<[f32]>::to_vec));
    }
    for (i, &t) in steps.iter().enumerate() {
        batch.clear();
        batch.push(&[t], prompt.len() + i, table.clone(), LogitsWanted::Last);
        step(&batch, &mut logits);
        rows.push(logits[..vocab].to_vec());
    }
    rows
}

/// ‖a − b‖ / ‖b‖ over rows `range`, and how many of those rows' argmaxes agree.
pub fn compare(a: &Rows, b: &Rows, range: std::ops::Range<usize>) -> (f64, usize) {
    let (mut num, mut den, mut same) = (0f64, 0f64, 0);
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |m, (i, &v)| if v > m.1 { (i, v) } else { m },
            )
            .0
    };
    for i in range {
        for (x, y) in a[i].iter().zip(&b[i]) {
            num += f64::from(x - y).powi(2);
            den += f64::from(*y).powi(2);
        }
        same += usize::from(argmax(&a[i]) == argmax(&b[i]));
    }
    ((num / den).sqrt(), same)
}

/// SmolLM2-135M's shape, cut to four layers (random weights made on the device, so the tests need no
/// model file there).
pub fn small_llama() -> ModelConfig {
    ModelConfig {
        tie_word_embeddings: true,
        eos_token_ids: vec![2],
        ..ModelConfig::dense(DenseShape {
            hidden: 576,
            ffn: 1536,
            layers: 4,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            max_positions: 2048,
            rope: LayerRope {
                theta: 100000.0,
                scaling: RopeScaling::None,
            },
        })
    }
}
