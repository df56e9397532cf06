//! The `Backend` contract (tandem_testkit::conformance) on the CUDA backend. It needs an NVIDIA GPU and
//! CUDA's run-time libraries, so it skips with a message where the driver is absent; on the GPU
//! machine `scripts/gpu/run.sh conformance` runs it (built here with
//! `cargo test --release -p tandem-cuda --test conformance --no-run`).
//!
//! The model is a small Llama of SmolLM2-135M's width with random bf16 weights made on the device, so
//! the test needs no model file there.

mod common;

use tandem_cuda::{CudaBackend, CudaLlama, CudaOptions, WeightSource};
use tandem_model::KvDtype;
use tandem_testkit::conformance::{self, MIN_BLOCKS};

/// Largest logit difference between differently shaped steps over the same tokens: bf16 activations
/// round differently when cuBLAS picks another kernel for another number of rows.
const TOLERANCE: f32 = 0.05;

/// The contract with bf16 or FP8 weights (`fp8`) and a KV cache of `kv_dtype`, within `tolerance`.
fn conforms(fp8: bool, kv_dtype: KvDtype, tolerance: f32) {
    if !common::gpu_or_skip() {
        return;
    }
    let opts = CudaOptions {
        block_size: 16,
        num_blocks: Some(MIN_BLOCKS),
        max_tokens: 256,
        max_seqs: 8,
        max_model_len: Some(512),
        fp8_weights: fp8,
        kv_dtype,
        ..CudaOptions::default()
    };
    conformance::run(
        || {
            let model = CudaLlama::new(
                common::small_llama(),
                WeightSource::Random { seed: 7 },
                opts.clone(),
            )
            .expect("the CUDA model loads");
            CudaBackend::new(model)
        },
        tolerance,
    );
}

#[test]
fn the_cuda_backend_conforms() {
    conforms(false, KvDtype::Bf16, TOLERANCE);
}

/// With FP8 weights, steps of one row read the codes through the FP8 GEMVs while larger steps run
/// cuBLAS on bf16 copies of the dequantized blocks (each weight rounded to bf16 once more): twice the
/// bf16 tolerance covers that rounding.
#[test]
fn the_cuda_backend_conforms_with_fp8_weights() {
    conforms(true, KvDtype::Bf16, 2.0 * TOLERANCE);
}

/// With an FP8 KV cache, a key or value whose bf16 activation rounds differently in another step shape
/// may land on the neighbouring E4M3 code (16 bf16 steps apart): three times the bf16 tolerance covers
/// that, while exports, imports, copies and the prefix cache must move the codes exactly.
#[test]
fn the_cuda_backend_conforms_with_an_fp8_kv_cache() {
    conforms(false, KvDtype::Fp8E4m3, 3.0 * TOLERANCE);
}
