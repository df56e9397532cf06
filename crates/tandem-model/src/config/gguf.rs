//! `ModelConfig` from GGUF metadata: each served architecture is a row of [`GGUF_FAMILIES`], the
//! per-layer structure comes from `{arch}.*` keys and from which tensors the file holds.

use tandem_kernels::{RopeScaling, RopeStyle};

use super::ModelConfig;
use crate::error::ModelError;
use crate::gguf::{GgufFile, GgufValue};
use crate::spec::{Activation, AttentionSpan, LayerRope, LayerSpec, MlpKind, MoeSpec};

/// What a GGUF architecture implies beyond its `{arch}.*` keys (llama.cpp fixes these per architecture).
struct GgufFamily {
    /// `general.architecture`.
    arch: &'static str,
    /// llama.cpp's converter permutes Q/K of llama-arch models for adjacent-pair RoPE; the others are
    /// converted unpermuted and use NEOX RoPE.
    rope_style: RopeStyle,
    qk_norm: bool,
    sandwich_norms: bool,
    activation: Activation,
    /// Embedding rows scaled by sqrt(hidden).
    scale_embedding: bool,
    /// Every `n`th layer is global and the others use the window of `{arch}.attention.sliding_window`.
    swa_pattern: Option<usize>,
    /// Rope base of the windowed layers when the file does not say (llama.cpp's fixed value).
    swa_rope_base: f32,
    /// Renormalise the top-k expert weights when the file does not say.
    norm_top_k: bool,
}

const fn family(arch: &'static str, rope_style: RopeStyle) -> GgufFamily {
    GgufFamily {
        arch,
        rope_style,
        qk_norm: false,
        sandwich_norms: false,
        activation: Activation::Silu,
        scale_embedding: false,
        swa_pattern: None,
        swa_rope_base: 10_000.0,
        norm_top_k: false,
    }
}

/// The GGUF architectures tandem serves.
const GGUF_FAMILIES: [GgufFamily; 7] = [
    family("llama", RopeStyle::Interleaved),
    family("mistral", RopeStyle::Interleaved),
    family("qwen2", RopeStyle::Neox),
    GgufFamily {
        qk_norm: true,
        ..family("qwen3", RopeStyle::Neox)
    },
    GgufFamily {
        qk_norm: true,
        norm_top_k: true,
        ..family("qwen3moe", RopeStyle::Neox)
    },
    family("qwen2moe", RopeStyle::Neox),
    GgufFamily {
        qk_norm: true,
        sandwich_norms: true,
        activation: Activation::GeluTanh,
        scale_embedding: true,
        swa_pattern: Some(6),
        ..family("gemma3", RopeStyle::Neox)
    },
];

/// The served GGUF architectures, for error messages.
pub fn served_gguf_architectures() -> Vec<&'static str> {
    GGUF_FAMILIES.iter().map(|f| f.arch).collect()
}

impl ModelConfig {
    /// Reads the configuration from GGUF metadata (`{arch}.*` keys, `tokenizer.ggml.*` ids, and which
    /// per-layer tensors exist).
    pub fn from_gguf(gguf: &GgufFile) -> Result<ModelConfig, ModelError> {
        let arch = gguf
            .get("general.architecture")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| ModelError::Config("GGUF lacks general.architecture".into()))?
            .to_string();
        let fam = GGUF_FAMILIES
            .iter()
            .find(|f| f.arch == arch)
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "unsupported GGUF architecture {arch:?}; served: {}",
                    served_gguf_architectures().join(", ")
                ))
            })?;
        let key = |k: &str| format!("{arch}.{k}");
        let req_u = |k: &str| -> Result<usize, ModelError> {
            let full = key(k);
            gguf.get(&full)
                .and_then(GgufValue::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::Config(format!("GGUF lacks integer {full}")))
        };
        let opt_u = |k: &str| {
            gguf.get(&key(k))
                .and_then(GgufValue::as_u64)
                .map(|v| v as usize)
        };
        let opt_f = |k: &str| {
            gguf.get(&key(k))
                .and_then(GgufValue::as_f64)
                .map(|v| v as f32)
        };
        let opt_b = |k: &str| gguf.get(&key(k)).and_then(GgufValue::as_bool);

        let hidden_size = req_u("embedding_length")?;
        let num_heads = req_u("attention.head_count")?;
        if num_heads == 0 {
            return Err(ModelError::Config(format!(
                "{} is zero",
                key("attention.head_count")
            )));
        }
        let head_dim = opt_u("attention.key_length")
            .or_else(|| opt_u("rope.dimension_count"))
            .unwrap_or(hidden_size / num_heads);
        let vocab_size = match opt_u("vocab_size") {
            Some(v) => v,
            None => match gguf
                .get("tokenizer.ggml.tokens")
                .and_then(GgufValue::as_array)
            {
                Some(t) => t.len(),
                None => gguf
                    .tensor("token_embd.weight")
                    .and_then(|t| t.shape.get(1).copied())
                    .ok_or_else(|| ModelError::Config("cannot determine vocab size".into()))?
                    as usize,
            },
        };
        let global_rope = LayerRope {
            theta: opt_f("rope.freq_base").unwrap_or(10_000.0),
            scaling: gguf_rope_scaling(gguf, &key, head_dim)?,
        };
        let num_layers = req_u("block_count")?;
        let window = opt_u("attention.sliding_window");
        // llama.cpp reads the pattern as a period (every nth layer global) or as one flag per layer,
        // and falls back to the family's fixed period.
        let pattern = gguf.get(&key("attention.sliding_window_pattern"));
        let flags: Option<Vec<bool>> = pattern
            .and_then(GgufValue::as_array)
            .map(|a| a.iter().map(|v| v.as_bool().unwrap_or(false)).collect());
        if flags.as_ref().is_some_and(|f| f.len() != num_layers) {
            return Err(ModelError::Config(format!(
                "{} does not list one flag per layer of {num_layers}",
                key("attention.sliding_window_pattern")
            )));
        }
        let period = pattern
            .and_then(GgufValue::as_u64)
            .map(|n| n as usize)
            .or(fam.swa_pattern)
            .filter(|&n| n > 0);
        let layers = (0..num_layers)
            .map(|l| {
                let windowed = match (&flags, period, window) {
                    (_, _, None) => false,
                    (Some(f), _, _) => f[l],
                    (None, Some(n), _) => (l + 1) % n != 0,
                    (None, None, _) => false,
                };
                let (attention, rope) = match window {
                    Some(w) if windowed => (
                        AttentionSpan::Window(w),
                        LayerRope {
                            theta: opt_f("rope.freq_base_swa").unwrap_or(fam.swa_rope_base),
                            scaling: RopeScaling::None,
                        },
                    ),
                    _ => (AttentionSpan::Global, global_rope.clone()),
                };
                let moe = gguf
                    .tensor(&format!("blk.{l}.ffn_gate_inp.weight"))
                    .is_some();
                LayerSpec {
                    attention,
                    rope,
                    mlp: if moe { MlpKind::Moe } else { MlpKind::Dense },
                }
            })
            .collect::<Vec<_>>();
        let moe = match opt_u("expert_count").filter(|&n| n > 0) {
            None => None,
            Some(num_experts) => Some(MoeSpec {
                num_experts,
                top_k: req_u("expert_used_count")?,
                norm_top_k: opt_b("expert_weights_norm").unwrap_or(fam.norm_top_k),
                expert_ffn: req_u("expert_feed_forward_length")?,
                shared_ffn: opt_u("expert_shared_feed_forward_length").filter(|&n| n > 0),
            }),
        };
        let intermediate_size = match (opt_u("feed_forward_length"), &moe) {
            (Some(f), _) => f,
            // A model whose every layer is a mixture of experts need not state a dense width.
            (None, Some(m)) if layers.iter().all(|l| l.mlp == MlpKind::Moe) => m.expert_ffn,
            (None, _) => req_u("feed_forward_length")?,
        };
        if opt_f("attn_logit_softcapping").is_some_and(|c| c > 0.0) {
            return Err(ModelError::Config(format!(
                "{} (attention logit soft-capping) is not served",
                key("attn_logit_softcapping")
            )));
        }
        let tok_u32 = |k: &str| gguf.get(k).and_then(GgufValue::as_u64).map(|v| v as u32);
        let config = ModelConfig {
            architecture: arch.clone(),
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads: opt_u("attention.head_count_kv").unwrap_or(num_heads),
            head_dim,
            vocab_size,
            max_position_embeddings: req_u("context_length")?,
            rms_norm_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_style: fam.rope_style,
            tie_word_embeddings: gguf.tensor("output.weight").is_none(),
            attention_bias: gguf.tensor("blk.0.attn_q.bias").is_some(),
            bos_token_id: tok_u32("tokenizer.ggml.bos_token_id"),
            eos_token_ids: tok_u32("tokenizer.ggml.eos_token_id").into_iter().collect(),
            layers,
            moe,
            qk_norm: fam.qk_norm,
            sandwich_norms: fam.sandwich_norms,
            activation: fam.activation,
            embedding_scale: fam.scale_embedding.then(|| (hidden_size as f32).sqrt()),
            attn_scale: opt_f("attention.scale")
                .unwrap_or_else(|| ModelConfig::default_attn_scale(head_dim)),
            final_logit_softcap: opt_f("final_logit_softcapping").filter(|&c| c > 0.0),
        };
        config.validate()?;
        Ok(config)
    }
}

/// The global layers' rope scaling: `{arch}.rope.scaling.*`, or Llama 3.1's `rope_freqs.weight` tensor.
fn gguf_rope_scaling(
    gguf: &GgufFile,
    key: &dyn Fn(&str) -> String,
    head_dim: usize,
) -> Result<RopeScaling, ModelError> {
    let scaling = match gguf
        .get(&key("rope.scaling.type"))
        .and_then(GgufValue::as_str)
    {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: gguf
                .get(&key("rope.scaling.factor"))
                .and_then(GgufValue::as_f64)
                .map(|v| v as f32)
                .ok_or_else(|| {
                    ModelError::Config(format!("{} missing", key("rope.scaling.factor")))
                })?,
        },
        Some(other) => {
            return Err(ModelError::Config(format!(
                "unsupported rope scaling {other:?}"
            )))
        }
    };
    // Llama 3.1+ exports carry their frequency scaling as a tensor of per-pair divisors.
    match gguf.tensor("rope_freqs.weight") {
        None => Ok(scaling),
        Some(_) if scaling != RopeScaling::None => Err(ModelError::Config(
            "GGUF has both rope_freqs.weight and a rope scaling type".into(),
        )),
        Some(info) => {
            let pairs = head_dim / 2;
            if info.dtype != tandem_kernels::DType::F32 || info.elements() != pairs as u64 {
                return Err(ModelError::Config(format!(
                    "rope_freqs.weight must be {pairs} f32 values (one per rotated pair), got {:?} {:?}",
                    info.dtype, info.shape
                )));
            }
            let mut factors = vec![0f32; pairs];
            tandem_kernels::dequantize(
                info.dtype,
                gguf.tensor_bytes(info).as_slice(),
                &mut factors,
            );
            if factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
                return Err(ModelError::Config(
                    "rope_freqs.weight holds a non-positive or non-finite factor".into(),
                ));
            }
            Ok(RopeScaling::FreqFactors { factors })
        }
    }
}
