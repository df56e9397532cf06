//! FP8 weights on the GPU against a float32 reference on the same dequantized weights. It needs an
//! NVIDIA GPU, so it skips with a message where the driver is absent; on the GPU machine
//! `scripts/gpu/run.sh fp8` runs it (built here with
//! `cargo test --release -p tandem-cuda --test fp8 --no-run`).
//!
//! The reference quantizes the tiny Llama fixture's projections exactly as the GPU does at load
//! (`tandem_model::weights::fp8::quantize_fp8_rows`, the host twin of `quant_fp8`, over the same
//! fused [q; k; v] and [gate; up] matrices), dequantizes them to float32 and runs the CPU model on
//! them: what is left between the two is the GPU's bf16 activations. The same comparison with bf16
//! weights gives that floor; the FP8 run must stay near it, in its prefill step (FP8 matrices
//! dequantized for cuBLAS) and in its decode steps (the FP8 GEMV kernels).

use std::path::Path;

use tandem_cuda::{CudaLlama, CudaOptions, WeightSource};
use tandem_kernels::Matrix;
use tandem_model::weights::fp8::{e4m3_to_f32, quantize_fp8_rows};
use tandem_model::{LlamaWeights, LoadOptions, MlpWeights, ModelConfig};

mod common;

use common::{assert_near_floor, compare, cpu_rows, run};

/// The bf16 value nearest `x` (round to nearest even), as the upload rounds host weights.
fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Matrices (same columns) row-concatenated, rounded to bf16, quantized to FP8 (one scale per row
/// and 128 columns) and dequantized: returned split back into the inputs' row counts.
fn fp8_roundtrip(ms: &[&Matrix]) -> Vec<Matrix> {
    let cols = ms[0].cols();
    let rows: usize = ms.iter().map(|m| m.rows()).sum();
    let mut values = Vec::with_capacity(rows * cols);
    let mut row = vec![0f32; cols];
    for m in ms {
        for r in 0..m.rows() {
            m.dequantize_row(r, &mut row);
            values.extend(row.iter().map(|&x| bf16_round(x)));
        }
    }
    let (codes, scales) = quantize_fp8_rows(&values, rows, cols);
    let kb = cols.div_ceil(128);
    let deq: Vec<f32> = codes
        .iter()
        .enumerate()
        .map(|(i, &c)| e4m3_to_f32(c) * scales[(i / cols) * kb + (i % cols) / 128])
        .collect();
    let mut out = Vec::new();
    let mut at = 0;
    for m in ms {
        let n = m.rows() * cols;
        out.push(Matrix::from_f32(m.rows(), cols, deq[at..at + n].to_vec()));
        at += n;
    }
    out
}

/// `w` with every layer's projections replaced by what the GPU holds: bf16-rounded values, or
/// with `fp8` their FP8 round trip.
fn gpu_weights(w: &LlamaWeights, fp8: bool) -> LlamaWeights {
    let mut w = w.clone();
    let round = |ms: &[&Matrix]| -> Vec<Matrix> {
        if fp8 {
            return fp8_roundtrip(ms);
        }
        ms.iter()
            .map(|m| {
                let mut row = vec![0f32; m.cols()];
                let mut v = Vec::with_capacity(m.rows() * m.cols());
                for r in 0..m.rows() {
                    m.dequantize_row(r, &mut row);
                    v.extend(row.iter().map(|&x| bf16_round(x)));
                }
                Matrix::from_f32(m.rows(), m.cols(), v)
            })
            .collect()
    };
    for l in &mut w.layers {
        let mut qkv = round(&[&l.wq, &l.wk, &l.wv]).into_iter();
        (l.wq, l.wk, l.wv) = (
            qkv.next().unwrap(),
            qkv.next().unwrap(),
            qkv.next().unwrap(),
        );
        l.wo = round(&[&l.wo]).remove(0);
        if let MlpWeights::Dense(mlp) = &mut l.mlp {
            let mut gu = round(&[&mlp.gate, &mlp.up]).into_iter();
            (mlp.gate, mlp.up) = (gu.next().unwrap(), gu.next().unwrap());
            mlp.down = round(&[&mlp.down]).remove(0);
        }
    }
    w
}

/// The errors against the float32 reference (prefill rows, decode rows) with bf16 weights and with
/// FP8 weights (`gemm`: large steps on the FP8 tensor-core GEMMs).
fn errors(c: &ModelConfig, weights: &LlamaWeights, gemm: bool) -> [(f64, f64); 2] {
    let vocab = c.vocab_size;
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % vocab as u32).collect();
    let steps: Vec<u32> = (0..6).map(|i| (i * 53 + 5) % vocab as u32).collect();
    let n_prefill = prompt.len();
    let mut errors = Vec::new();
    for fp8 in [false, true] {
        let reference = cpu_rows(c, gpu_weights(weights, fp8), &prompt, prompt.len(), &steps);
        let opts = CudaOptions {
            fp8_weights: fp8,
            fp8_gemm: gemm,
            ..common::reference_options()
        };
        let mut gpu = CudaLlama::new(c.clone(), WeightSource::Host(weights), opts)
            .expect("the CUDA model loads");
        if fp8 && gemm {
            eprintln!(
                "FP8 tensor-core GEMMs: {}",
                if gpu.fp8_tensor_cores() {
                    "on"
                } else {
                    "off (the load-time check failed; large steps ran on bf16 tiles)"
                }
            );
        }
        let got = run(
            |b, l| gpu.forward(b, l).expect("CUDA step"),
            vocab,
            &prompt,
            prompt.len(),
            &steps,
        );
        let prefill = compare(&got, &reference, 0..n_prefill);
        let decode = compare(&got, &reference, n_prefill..got.len());
        eprintln!("fp8 {fp8}: prefill rel L2 {:.4} ({} of {n_prefill} top-1), decode rel L2 {:.4} ({} of {} top-1)",
            prefill.0, prefill.1, decode.0, decode.1, steps.len());
        errors.push((prefill.0, decode.0));
    }
    [errors[0], errors[1]]
}

#[test]
fn fp8_weights_match_a_float32_reference_on_the_dequantized_weights() {
    if !common::gpu_or_skip() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/tiny-llama");
    let loaded = tandem_model::load(&dir, &LoadOptions::default()).expect("the fixture loads");
    let [floor, fp8] = errors(&loaded.config, &loaded.weights, false);
    // What separates the GPU from its float32 reference is the bf16 activations, with FP8 weights as
    // with bf16 ones: a wrong code, scale or block index would put the FP8 run far past the floor.
    assert_near_floor("FP8", fp8, floor, 2.0);
}

/// Prompt steps on FP8 tensor-core GEMMs (cuBLASLt, activations quantized per token and 128-value
/// group): their error is the activations' E4M3 rounding on top of the bf16 floor, a few times
/// that floor, never the O(1) of a wrong scale order (which the load-time check must have refused).
#[test]
fn fp8_tensor_core_gemms_stay_near_the_reference() {
    if !common::gpu_or_skip() {
        return;
    }
    let (c, w) = common::random_format_model(0x2545_f491_4f6c_dd1d);
    let [floor, fp8] = errors(&c, &w, true);
    assert!(
        fp8.0 <= 6.0 * floor.0 + 0.04,
        "prefill: FP8 GEMMs {:.4} vs bf16 floor {:.4}",
        fp8.0,
        floor.0
    );
    assert!(
        fp8.1 <= 2.0 * floor.1 + 0.01,
        "decode: FP8 {:.4} vs bf16 floor {:.4}",
        fp8.1,
        floor.1
    );
}
