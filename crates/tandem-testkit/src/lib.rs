//! Test support for tandem's crates (a dev-dependency only, never published): the default model with one
//! rule for when it is missing, the mock backend, greedy sampling, free ports, health polling and a
//! `tandem serve` child process killed on drop with HTTP helpers that assert on its answers.
//!
//! It depends only on `tandem-model` and `tandem-engine`, so every crate above them may use it in its unit
//! tests without a dependency cycle; the engine itself uses it from its integration tests only.

mod mock;
mod model;
mod server;

pub use mock::MockBackend;
pub use model::{default_model, model, model_path, root, DEFAULT_MODEL, DEFAULT_MODEL_NAME};
pub use server::{free_port, healthy, signal, text, Server};

use tandem_engine::SamplingParams;

/// Greedy sampling of exactly `max_tokens` tokens (EOS ignored), the deterministic request of most tests.
pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}
