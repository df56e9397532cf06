//! What the CUDA backend's test files share: the small model they load with random weights.

use tandem_kernels::RopeScaling;
use tandem_model::{DenseShape, LayerRope, ModelConfig};

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
