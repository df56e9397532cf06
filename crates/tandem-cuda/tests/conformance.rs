//! The `Backend` contract (tandem_testkit::conformance) on the CUDA backend. It needs an NVIDIA GPU and
//! CUDA's run-time libraries, so it skips with a message where the driver is absent; on the GPU
//! machine `scripts/gpu/run.sh conformance` runs it (built here with
//! `cargo test --release -p tandem-cuda --test conformance --no-run`).
//!
//! The model is a small Llama of SmolLM2-135M's width with random bf16 weights made on the device, so
//! the test needs no model file there.

mod common;

use tandem_cuda::{CudaBackend, CudaLlama, CudaOptions, WeightSource};
use tandem_testkit::conformance::{self, MIN_BLOCKS};

/// Largest logit difference between differently shaped steps over the same tokens: bf16 activations
/// round differently when cuBLAS picks another kernel for another number of rows.
const TOLERANCE: f32 = 0.05;

/// The contract with bf16 or FP8 weights (`fp8`), within `tolerance`.
fn conforms(fp8: bool, tolerance: f32) {
    if !tandem_cuda::driver_available() {
        eprintln!("skipping: no NVIDIA driver (libcuda.so.1) on this machine");
        return;
    }
    let opts = CudaOptions {
        block_size: 16,
        num_blocks: Some(MIN_BLOCKS),
        max_tokens: 256,
        max_seqs: 8,
        max_model_len: Some(512),
        fp8_weights: fp8,
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
    conforms(false, TOLERANCE);
}

/// With FP8 weights, steps of one row read the codes through the FP8 GEMVs while larger steps run
/// cuBLAS on bf16 copies of the dequantized blocks (each weight rounded to bf16 once more): twice the
/// bf16 tolerance covers that rounding.
#[test]
fn the_cuda_backend_conforms_with_fp8_weights() {
    conforms(true, 2.0 * TOLERANCE);
}
