//! What two workers exchange when they first meet, and the compatibility check on it.

use serde::{Deserialize, Serialize};

use crate::KvError;

/// `Ok` when a handshake field agrees, else a mismatch naming it with both values; public so other
/// handshakes over this crate's frames (the pipeline stage link) refuse a peer the same way.
pub fn check_field<T: PartialEq + std::fmt::Debug>(
    field: &'static str,
    l: &T,
    r: &T,
) -> Result<(), KvError> {
    if l == r {
        Ok(())
    } else {
        Err(KvError::Mismatch {
            field,
            local: format!("{l:?}"),
            remote: format!("{r:?}"),
        })
    }
}

/// Element type of the KV cache as it travels on the wire; mirrors `tandem_model::batch::KvDtype` so this
/// crate stays independent of the model crate's build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WireDtype {
    /// 32-bit float (the CPU backend's cache).
    F32,
    /// bfloat16 (GPU backends).
    Bf16,
    /// FP8 E4M3 codes (GPU backends with `kv_cache_dtype: fp8`).
    Fp8E4m3,
}

impl WireDtype {
    /// Bytes per element, needed to size blocks.
    pub fn size(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::Bf16 => 2,
            WireDtype::Fp8E4m3 => 1,
        }
    }
}

/// The KV cache shape both ends must share for block bytes to be interchangeable.
///
/// Same meaning as `tandem_model::batch::KvLayout` minus `num_blocks` (pool sizes legitimately differ
/// between workers) plus the query head count, which decides how the decode side reads the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WireLayout {
    /// Transformer layers, each with its own K and V.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA groups).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Element type of the cache.
    pub dtype: WireDtype,
}

impl WireLayout {
    /// Refuses a layout whose blocks would not be interchangeable, naming the first differing field.
    pub fn check_compatible(&self, remote: &WireLayout) -> Result<(), KvError> {
        let (l, r) = (self, remote);
        check_field("dtype", &l.dtype, &r.dtype)?;
        check_field("block_size", &l.block_size, &r.block_size)?;
        check_field("n_layers", &l.n_layers, &r.n_layers)?;
        check_field("n_heads", &l.n_heads, &r.n_heads)?;
        check_field("n_kv_heads", &l.n_kv_heads, &r.n_kv_heads)?;
        check_field("head_dim", &l.head_dim, &r.head_dim)
    }

    /// Bytes of one (layer, block) pair: `[K|V][kv_head][slot][head_dim]`, the unit of transfer.
    pub fn block_bytes(&self) -> usize {
        2 * self.n_kv_heads * self.block_size * self.head_dim * self.dtype.size()
    }
}

/// Handshake payload: who the worker serves and how its KV cache is laid out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// Hash identifying model weights and config (e.g. the model crate's identity hash); KV from another
    /// model is garbage even when shapes agree.
    pub model_id: String,
    /// The cache shape.
    pub layout: WireLayout,
}

impl PeerInfo {
    /// Refuses a peer whose KV bytes would not mean the same thing here, naming the first differing field.
    pub fn check_compatible(&self, remote: &PeerInfo) -> Result<(), KvError> {
        check_field("model_id", &self.model_id, &remote.model_id)?;
        self.layout.check_compatible(&remote.layout)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The default model's shape: 30 layers, 9 heads, 3 KV heads of 64, blocks of 16 f32 tokens.
    pub(crate) fn smollm_info() -> PeerInfo {
        PeerInfo {
            model_id: "smollm2-135m-q4_1".into(),
            layout: WireLayout {
                n_layers: 30,
                n_heads: 9,
                n_kv_heads: 3,
                head_dim: 64,
                block_size: 16,
                dtype: WireDtype::F32,
            },
        }
    }

    /// Mutates a `PeerInfo` so that one field no longer matches.
    pub(crate) type Breaker = fn(&mut PeerInfo);

    /// One way to break each handshake field, paired with the field name the refusal must carry.
    pub(crate) fn mismatch_cases() -> Vec<(&'static str, Breaker)> {
        vec![
            ("model_id", |p| p.model_id = "llama-3-8b".into()),
            ("dtype", |p| p.layout.dtype = WireDtype::Bf16),
            ("block_size", |p| p.layout.block_size = 32),
            ("n_layers", |p| p.layout.n_layers = 32),
            ("n_heads", |p| p.layout.n_heads = 32),
            ("n_kv_heads", |p| p.layout.n_kv_heads = 8),
            ("head_dim", |p| p.layout.head_dim = 128),
        ]
    }

    /// A GPU worker with an FP8 KV cache and one with bf16 refuse each other by the field and both
    /// dtypes' names (a transfer would otherwise reinterpret half-size blocks); FP8 blocks are half.
    #[test]
    fn an_fp8_and_a_bf16_kv_cache_are_refused_by_name() {
        let mut bf16 = smollm_info();
        bf16.layout.dtype = WireDtype::Bf16;
        let mut fp8 = bf16.clone();
        fp8.layout.dtype = WireDtype::Fp8E4m3;
        assert_eq!(2 * fp8.layout.block_bytes(), bf16.layout.block_bytes());
        let err = fp8.check_compatible(&bf16).unwrap_err().to_string();
        assert!(
            err.contains("dtype") && err.contains("Fp8E4m3") && err.contains("Bf16"),
            "{err}"
        );
    }

    #[test]
    fn block_bytes_matches_default_model() {
        assert_eq!(smollm_info().layout.block_bytes(), 24_576);
    }

    #[test]
    fn each_field_mismatch_is_named() {
        let base = smollm_info();
        let cases = mismatch_cases();
        assert!(base.check_compatible(&base).is_ok());
        for (field, mutate) in cases {
            let mut other = base.clone();
            mutate(&mut other);
            match base.check_compatible(&other) {
                Err(KvError::Mismatch {
                    field: f,
                    local,
                    remote,
                }) => {
                    assert_eq!(f, field);
                    assert_ne!(local, remote);
                }
                r => panic!("{field}: expected mismatch, got {r:?}"),
            }
        }
    }
}
