//! A stable fingerprint of a model that two workers compare before sharing KV.

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::weights::TensorDesc;

/// A stable fingerprint that two workers compare before sharing KV.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelIdentity(pub String);

/// 64-bit FNV-1a: a fixed, spec-defined function, so the hex is identical across processes, builds
/// and machines (unlike `std`'s randomly seeded hashers).
struct Fnv1a(u64);

impl Fnv1a {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(Self::PRIME);
        }
    }

    /// Writes a length prefix first so that ("ab", "c") and ("a", "bc") differ.
    fn field(&mut self, bytes: &[u8]) {
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(bytes);
    }
}

impl ModelIdentity {
    /// Hashes the configuration (as canonical JSON) and every tensor's name, dtype, shape and leading bytes.
    pub fn compute(config: &ModelConfig, tensors: &[TensorDesc]) -> ModelIdentity {
        let mut h = Fnv1a(Fnv1a::OFFSET);
        h.field(b"tandem-model-identity-v1");
        // serde_json writes struct fields in declaration order with a fixed float format: canonical.
        let config_json = serde_json::to_vec(config).unwrap_or_default();
        h.field(&config_json);
        for t in tensors {
            h.field(t.name.as_bytes());
            h.field(t.dtype.as_bytes());
            h.write(&(t.shape.len() as u64).to_le_bytes());
            for &d in &t.shape {
                h.write(&(d as u64).to_le_bytes());
            }
            h.field(&t.head);
        }
        ModelIdentity(format!("{:016x}", h.0))
    }
}

impl std::fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ModelConfig {
        ModelConfig::from_hf_json(
            &serde_json::json!({
                "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100
            }),
            None,
        )
        .unwrap()
    }

    fn desc(name: &str, head: u8) -> TensorDesc {
        TensorDesc {
            name: name.into(),
            dtype: "F32".into(),
            shape: vec![4, 4],
            head: vec![head; 8],
        }
    }

    #[test]
    fn identity_is_a_fixed_function_of_its_inputs() {
        let id = ModelIdentity::compute(&config(), &[desc("a", 1), desc("b", 2)]);
        assert_eq!(id.0.len(), 16);
        assert_eq!(
            id,
            ModelIdentity::compute(&config(), &[desc("a", 1), desc("b", 2)])
        );
        assert_ne!(
            id,
            ModelIdentity::compute(&config(), &[desc("a", 1), desc("b", 3)])
        );
        assert_ne!(id, ModelIdentity::compute(&config(), &[desc("a", 1)]));
        let mut c = config();
        c.layers[0].rope.theta = 20000.0;
        assert_ne!(
            id,
            ModelIdentity::compute(&c, &[desc("a", 1), desc("b", 2)])
        );
    }

    #[test]
    fn fnv1a_matches_the_published_test_vector() {
        let mut h = Fnv1a(Fnv1a::OFFSET);
        h.write(b"a");
        assert_eq!(h.0, 0xaf63_dc4c_8601_ec8c);
    }
}
