//! The `Backend` contract (tandem_testkit::conformance) on the CPU backend over the default model, with
//! one rank and with tensor-parallel ranks: its logits are bit-exact however a step is shaped, so the
//! checks run at tolerance 0. Skips when the model is absent (scripts/fetch-model.sh fetches it).

use tandem_cpu::CpuBackend;
use tandem_model::{CpuLlama, ExpertPlacement, LoadedModel};
use tandem_testkit::conformance::{self, MIN_BLOCKS};

const BLOCK: usize = 4;

/// Bytes of exactly the blocks the checks need, across all layers.
fn budget(m: &LoadedModel) -> usize {
    let llama = CpuLlama::new(m.config.clone(), m.weights.clone(), 1);
    llama.kv_layout(BLOCK, 1).block_bytes() * m.config.num_layers * MIN_BLOCKS
}

#[test]
fn the_cpu_backend_conforms() {
    let Some(m) = tandem_testkit::model() else {
        return;
    };
    conformance::run(
        || {
            CpuBackend::new(
                CpuLlama::new(m.config.clone(), m.weights.clone(), 2),
                BLOCK,
                budget(m),
            )
        },
        0.0,
    );
}

#[test]
fn the_tensor_parallel_cpu_backend_conforms() {
    let Some(m) = tandem_testkit::model() else {
        return;
    };
    conformance::run(
        || {
            CpuBackend::tensor_parallel(
                &m.config,
                &m.weights,
                3,
                ExpertPlacement::Contiguous,
                3,
                BLOCK,
                budget(m),
            )
            .unwrap()
        },
        0.0,
    );
}
