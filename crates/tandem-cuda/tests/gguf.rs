//! GGUF block-quantized weights on the GPU, packed (`tandem_cuda::packed`), against a float32
//! reference on the same dequantized values. It needs an NVIDIA GPU, so it skips with a message where
//! the driver is absent; on the GPU machine `scripts/gpu/run.sh gguf` runs it (built here with
//! `cargo test --release -p tandem-cuda --test gguf --no-run`).
//!
//! The model's projections use every GGUF format tandem reads, alone and mixed inside a fused
//! projection (as Q4_K_M files mix them), and an untied quantized head. The reference runs the CPU
//! model on float32 matrices holding exactly the values the formats decode to, so what separates a
//! packed GPU run from it is the GPU's bf16 activations only; the same model dequantized to bf16 at
//! upload (`gguf_packed: false`) adds its weights' bf16 rounding. A wrong nibble order, scale index or
//! sign would put the packed run far past that floor, in prompt steps (dequantized tiles for cuBLAS),
//! in the single-row GEMVs of decode and in the multi-row GEMVs of small chunks.

mod common;

use common::{
    assert_near_floor, compare, cpu_rows, cuda_rows, format_test_config, format_test_layer, uniform,
};
use tandem_cuda::CudaOptions;
use tandem_kernels::{quantize_row, DType, Matrix, WeightBytes};
use tandem_model::{LlamaWeights, MlpWeights, ModelConfig};

/// A random `rows` × `cols` matrix quantized to `dtype`.
fn quantized(dtype: DType, rows: usize, cols: usize, seed: &mut u64) -> Matrix {
    let scale = 1.7 / (cols as f32).sqrt();
    let mut bytes = Vec::new();
    for _ in 0..rows {
        let x: Vec<f32> = (0..cols).map(|_| uniform(seed) * scale).collect();
        quantize_row(dtype, &x, &mut bytes);
    }
    Matrix::new(
        dtype,
        rows,
        cols,
        WeightBytes::Owned(std::sync::Arc::new(bytes)),
    )
    .expect("whole blocks")
}

/// `m` as float32 holding the values its format decodes to.
fn decoded(m: &Matrix) -> Matrix {
    let mut v = vec![0f32; m.rows() * m.cols()];
    for (r, row) in v.chunks_exact_mut(m.cols()).enumerate() {
        m.dequantize_row(r, row);
    }
    Matrix::from_f32(m.rows(), m.cols(), v)
}

/// A 2-layer model (widths whole 256-value K-quant blocks) whose projections cover every format:
/// layer 0 packs to 4-bit codes (Q4_0 / Q4_1 / Q4_K, mixed in [q; k; v]), layer 1 to 8-bit codes
/// (Q8_0, Q5_0, Q6_K, and [gate; up] mixing Q4_K with Q6_K), the head is Q8_0.
fn model() -> (ModelConfig, LlamaWeights) {
    let c = format_test_config();
    let (h, f, q, kv) = (256, 512, 256, 128);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut m = |d: DType, rows: usize, cols: usize| quantized(d, rows, cols, &mut seed);
    use DType::*;
    let formats = [
        [Q4K, Q4_0, Q4_1, Q4_1, Q4K, Q4K, Q4_0],
        [Q8_0, Q8_0, Q5_0, Q5_0, Q4K, Q6K, Q6K],
    ];
    let layers = formats
        .iter()
        .map(|d| {
            format_test_layer([
                m(d[0], q, h),
                m(d[1], kv, h),
                m(d[2], kv, h),
                m(d[3], h, q),
                m(d[4], f, h),
                m(d[5], f, h),
                m(d[6], h, f),
            ])
        })
        .collect();
    let w = LlamaWeights {
        embed: m(Q8_0, 512, h),
        layers,
        norm: vec![1.0; h],
        lm_head: Some(m(Q8_0, 512, h)),
    };
    (c, w)
}

/// `w` with every matrix replaced by its float32 decoded values.
fn reference_weights(w: &LlamaWeights) -> LlamaWeights {
    let mut w = w.clone();
    w.embed = decoded(&w.embed);
    w.lm_head = w.lm_head.as_ref().map(decoded);
    for l in &mut w.layers {
        for m in [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo] {
            *m = decoded(m);
        }
        if let MlpWeights::Dense(mlp) = &mut l.mlp {
            for m in [&mut mlp.gate, &mut mlp.up, &mut mlp.down] {
                *m = decoded(m);
            }
        }
    }
    w
}

#[test]
fn packed_gguf_weights_match_a_float32_reference() {
    if !common::gpu_or_skip() {
        return;
    }
    let (c, w) = model();
    let vocab = c.vocab_size;
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % vocab as u32).collect();
    let steps: Vec<u32> = (0..6).map(|i| (i * 53 + 5) % vocab as u32).collect();
    let n = prompt.len();
    // Whole prompt in one step (cuBLAS on dequantized tiles), then 4-token chunks on the 4-row GEMVs,
    // then 7-token chunks (three steps on the 7-row GEMVs, the last on the 3-row ones).
    for chunk in [n, 4, 7] {
        let reference = cpu_rows(&c, reference_weights(&w), &prompt, chunk, &steps);
        let mut errors = Vec::new();
        for packed in [false, true] {
            let opts = CudaOptions {
                gemv_max_rows: 8,
                gguf_packed: packed,
                ..common::reference_options()
            };
            let got = cuda_rows(&c, &w, opts, &prompt, chunk, &steps);
            let prefill = compare(&got, &reference, 0..n);
            let decode = compare(&got, &reference, n..got.len());
            eprintln!(
                "chunk {chunk}, packed {packed}: prefill rel L2 {:.4} ({} of {n} top-1), decode rel L2 {:.4} ({} of {} top-1)",
                prefill.0,
                prefill.1,
                decode.0,
                decode.1,
                steps.len()
            );
            errors.push((prefill.0, decode.0));
        }
        let (floor, packed) = (errors[0], errors[1]);
        // Packed weights are exact where the bf16 upload rounds them: the packed run must stay at or
        // under the bf16 run's error (with slack for the activations' rounding paths).
        assert_near_floor(&format!("chunk {chunk}, packed"), packed, floor, 1.5);
    }
}
