//! What the CUDA backend's test files share: the small model they load with random weights, and the
//! comparison of a GPU run's logits with a float32 CPU reference. Each test file uses part of it.
#![allow(dead_code)]

use tandem_cuda::{CudaLlama, CudaOptions, WeightSource};
use tandem_kernels::{Matrix, RopeScaling};
use tandem_model::{
    CpuLlama, DenseShape, ForwardBatch, GatedMlp, KvCache, LayerRope, LayerWeights, LlamaWeights,
    LogitsWanted, MlpWeights, ModelConfig,
};

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

/// Whether this machine has an NVIDIA driver, saying that the test is skipped where it has none (the
/// GPU tests build everywhere and run on the GPU machine).
pub fn gpu_or_skip() -> bool {
    let there = tandem_cuda::driver_available();
    if !there {
        eprintln!("skipping: no NVIDIA driver (libcuda.so.1) on this machine");
    }
    there
}

/// The CUDA options of a reference comparison: one sequence in [`BLOCKS`] blocks, eager launches;
/// each test sets what it compares on top.
pub fn reference_options() -> CudaOptions {
    CudaOptions {
        block_size: BLOCK,
        num_blocks: Some(BLOCKS),
        max_tokens: 64,
        max_seqs: 1,
        max_model_len: Some(BLOCK * BLOCKS),
        graphs: false,
        ..CudaOptions::default()
    }
}

/// [`run`] on the float32 CPU forward: the reference the GPU runs are measured against.
pub fn cpu_rows(
    c: &ModelConfig,
    w: LlamaWeights,
    prompt: &[u32],
    chunk: usize,
    steps: &[u32],
) -> Rows {
    let mut model = CpuLlama::new(c.clone(), w, 1);
    let mut kv = KvCache::new(model.kv_layout(BLOCK, BLOCKS));
    run(
        |b, l| model.forward(b, &mut kv, l).expect("CPU step"),
        c.vocab_size,
        prompt,
        chunk,
        steps,
    )
}

/// [`run`] on a CUDA model of `w` loaded with `opts`.
pub fn cuda_rows(
    c: &ModelConfig,
    w: &LlamaWeights,
    opts: CudaOptions,
    prompt: &[u32],
    chunk: usize,
    steps: &[u32],
) -> Rows {
    let mut gpu =
        CudaLlama::new(c.clone(), WeightSource::Host(w), opts).expect("the CUDA model loads");
    run(
        |b, l| gpu.forward(b, l).expect("CUDA step"),
        c.vocab_size,
        prompt,
        chunk,
        steps,
    )
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

/// The 2-layer Llama of the weight-format tests (FP8, packed GGUF): hidden 256 and ffn 512 are whole
/// 128-value FP8 blocks and 256-value K-quant blocks; one KV head of 128 dims under two query heads.
pub fn format_test_config() -> ModelConfig {
    ModelConfig::dense(DenseShape {
        hidden: 256,
        ffn: 512,
        layers: 2,
        heads: 2,
        kv_heads: 1,
        head_dim: 128,
        vocab: 512,
        max_positions: 256,
        rope: LayerRope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        },
    })
}

/// A layer of [`format_test_config`] with projections `[q, k, v, o, gate, up, down]` and unit norms.
pub fn format_test_layer(m: [Matrix; 7]) -> LayerWeights {
    let [wq, wk, wv, wo, gate, up, down] = m;
    LayerWeights {
        attn_norm: vec![1.0; wq.cols()],
        wq,
        wk,
        wv,
        ffn_norm: vec![1.0; wo.rows()],
        wo,
        bq: None,
        bk: None,
        bv: None,
        q_norm: None,
        k_norm: None,
        post_attn_norm: None,
        mlp: MlpWeights::Dense(GatedMlp { gate, up, down }),
        post_ffn_norm: None,
    }
}

/// [`format_test_config`] with random float32 weights from `seed` (an untied head): its widths are whole
/// 128-value FP8 blocks, and its one KV head of 128 dims takes the tensor-core attention kernels.
pub fn random_format_model(mut seed: u64) -> (ModelConfig, LlamaWeights) {
    let c = format_test_config();
    let mut matrix = |rows: usize, cols: usize| {
        let scale = 1.7 / (cols as f32).sqrt();
        let v = (0..rows * cols)
            .map(|_| uniform(&mut seed) * scale)
            .collect();
        Matrix::from_f32(rows, cols, v)
    };
    let (h, f, q, kv) = (256, 512, 256, 128);
    let layers = (0..c.num_layers)
        .map(|_| {
            format_test_layer([
                matrix(q, h),
                matrix(kv, h),
                matrix(kv, h),
                matrix(h, q),
                matrix(f, h),
                matrix(f, h),
                matrix(h, f),
            ])
        })
        .collect();
    let w = LlamaWeights {
        embed: matrix(512, h),
        layers,
        norm: vec![1.0; h],
        lm_head: Some(matrix(512, h)),
    };
    (c, w)
}

/// The next value in [-1, 1) of the xorshift generator at `seed` (the tests' random weights).
pub fn uniform(seed: &mut u64) -> f32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

/// Asserts that a run's (prefill, decode) errors against the float32 reference stay within
/// `factor` × the bf16 floor's + 0.01: a wrong code, scale or block index in a weight format lands
/// far past that, while the activations' rounding paths stay near it.
pub fn assert_near_floor(what: &str, got: (f64, f64), floor: (f64, f64), factor: f64) {
    for (part, g, f) in [("prefill", got.0, floor.0), ("decode", got.1, floor.1)] {
        assert!(
            g <= factor * f + 0.01,
            "{what} {part}: {g:.4} against the bf16 floor {f:.4}"
        );
    }
}
