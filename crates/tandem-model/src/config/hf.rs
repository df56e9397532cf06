//! `ModelConfig` from a Hugging Face `config.json`: each served architecture is a row of
//! [`HF_FAMILIES`]; the per-layer structure comes from `layer_types`, the sliding-window keys, the
//! rope keys (one set, or one per layer type) and the expert keys.

use std::path::Path;

use serde_json::Value;
use tandem_kernels::{RopeScaling, RopeStyle};

use super::ModelConfig;
use crate::error::ModelError;
use crate::spec::{Activation, AttentionSpan, LayerRope, LayerSpec, MlpKind, MoeSpec};

/// An HF `architectures` entry tandem serves and the GGUF name of its family.
const HF_FAMILIES: [(&str, &str); 7] = [
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("Qwen3MoeForCausalLM", "qwen3moe"),
    ("Qwen2MoeForCausalLM", "qwen2moe"),
    ("Gemma3ForCausalLM", "gemma3"),
];

/// The served HF architectures, for error messages.
pub fn served_hf_architectures() -> Vec<&'static str> {
    HF_FAMILIES.iter().map(|f| f.0).collect()
}

impl ModelConfig {
    /// Reads `config.json` (and `generation_config.json` for extra eos ids) of a Hugging Face folder.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
        let gen_path = dir.join("generation_config.json");
        let generation = match std::fs::read_to_string(&gen_path) {
            Ok(t) => Some(
                serde_json::from_str::<Value>(&t)
                    .map_err(|e| ModelError::Config(format!("{}: {e}", gen_path.display())))?,
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(ModelError::io(gen_path, e)),
        };
        ModelConfig::from_hf_json(&json, generation.as_ref())
    }

    /// Builds the configuration from parsed `config.json` and optional `generation_config.json`.
    pub fn from_hf_json(
        json: &Value,
        generation: Option<&Value>,
    ) -> Result<ModelConfig, ModelError> {
        let arch_name = json
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .ok_or_else(|| ModelError::Config("config.json lacks architectures".into()))?;
        let architecture = HF_FAMILIES
            .iter()
            .find(|f| f.0 == arch_name)
            .map(|f| f.1)
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "unsupported architecture {arch_name:?}; served: {}",
                    served_hf_architectures().join(", ")
                ))
            })?;
        let req = |k: &str| -> Result<usize, ModelError> {
            json.get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::Config(format!("config.json lacks integer {k}")))
        };
        let opt = |k: &str| json.get(k).and_then(|v| v.as_u64()).map(|v| v as usize);
        let opt_f = |k: &str| json.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
        let gemma = architecture == "gemma3";

        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        if num_heads == 0 {
            return Err(ModelError::Config("num_attention_heads is zero".into()));
        }
        let head_dim = opt("head_dim").unwrap_or(hidden_size / num_heads);
        let num_layers = req("num_hidden_layers")?;
        let spans = attention_spans(json, architecture, num_layers)?;
        let (global_rope, local_rope) = hf_ropes(json, gemma)?;
        let moe = hf_moe(json)?;
        let dense_layers: Vec<usize> = json
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|v| v as usize)
                    .collect()
            })
            .unwrap_or_default();
        let sparse_step = opt("decoder_sparse_step").unwrap_or(1).max(1);
        let layers = spans
            .into_iter()
            .enumerate()
            .map(|(l, attention)| LayerSpec {
                attention,
                rope: match attention {
                    AttentionSpan::Window(_) if gemma => local_rope.clone(),
                    _ => global_rope.clone(),
                },
                mlp: if moe.is_some() && !dense_layers.contains(&l) && (l + 1) % sparse_step == 0 {
                    MlpKind::Moe
                } else {
                    MlpKind::Dense
                },
            })
            .collect::<Vec<_>>();
        let intermediate_size = match (opt("intermediate_size"), &moe) {
            (Some(f), _) => f,
            (None, Some(m)) if layers.iter().all(|l| l.mlp == MlpKind::Moe) => m.expert_ffn,
            (None, _) => req("intermediate_size")?,
        };
        if json
            .get("attn_logit_softcapping")
            .is_some_and(|v| !v.is_null())
        {
            return Err(ModelError::Config(
                "attn_logit_softcapping (attention logit soft-capping) is not served".into(),
            ));
        }
        let activation = match json
            .get("hidden_activation")
            .or_else(|| json.get("hidden_act"))
            .and_then(Value::as_str)
            .unwrap_or("silu")
        {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_tanh" => Activation::GeluTanh,
            other => {
                return Err(ModelError::Config(format!(
                    "unsupported MLP activation {other:?}; served: silu, gelu_pytorch_tanh"
                )))
            }
        };
        let (bos_token_id, eos_token_ids) = special_ids(json, generation);
        let config = ModelConfig {
            architecture: architecture.to_string(),
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads: opt("num_key_value_heads").unwrap_or(num_heads),
            head_dim,
            vocab_size: req("vocab_size")?,
            max_position_embeddings: opt("max_position_embeddings").unwrap_or(4096),
            rms_norm_eps: opt_f("rms_norm_eps").unwrap_or(1e-6),
            rope_style: RopeStyle::Neox,
            tie_word_embeddings: json
                .get("tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(gemma),
            attention_bias: matches!(architecture, "qwen2" | "qwen2moe")
                || json
                    .get("attention_bias")
                    .and_then(|v| v.as_bool())
                    .unwrap_or(false),
            bos_token_id,
            eos_token_ids,
            layers,
            moe,
            qk_norm: matches!(architecture, "qwen3" | "qwen3moe" | "gemma3"),
            sandwich_norms: gemma,
            activation,
            embedding_scale: gemma.then(|| (hidden_size as f32).sqrt()),
            attn_scale: match opt_f("query_pre_attn_scalar") {
                Some(s) if gemma => 1.0 / s.sqrt(),
                _ => ModelConfig::default_attn_scale(head_dim),
            },
            final_logit_softcap: opt_f("final_logit_softcapping").filter(|&c| c > 0.0),
        };
        config.validate()?;
        Ok(config)
    }
}

/// Each layer's attention span: `layer_types` when the config lists them, else the family's rule.
fn attention_spans(
    json: &Value,
    architecture: &str,
    num_layers: usize,
) -> Result<Vec<AttentionSpan>, ModelError> {
    let window = json
        .get("sliding_window")
        .and_then(Value::as_u64)
        .map(|v| v as usize);
    if let Some(types) = json.get("layer_types").and_then(Value::as_array) {
        if types.len() != num_layers {
            return Err(ModelError::Config(format!(
                "layer_types lists {} layers of {num_layers}",
                types.len()
            )));
        }
        return types
            .iter()
            .enumerate()
            .map(|(l, t)| match (t.as_str(), window) {
                (Some("full_attention"), _) => Ok(AttentionSpan::Global),
                (Some("sliding_attention"), Some(w)) => Ok(AttentionSpan::Window(w)),
                (Some("sliding_attention"), None) => Err(ModelError::Config(format!(
                    "layer {l} is sliding_attention but the config has no sliding_window"
                ))),
                (other, _) => Err(ModelError::Config(format!(
                    "layer {l}: unsupported layer type {other:?}; served: full_attention, sliding_attention"
                ))),
            })
            .collect();
    }
    let all = |span| Ok(vec![span; num_layers]);
    match (architecture, window) {
        // Gemma 3 before `layer_types`: every `sliding_window_pattern`th layer is global.
        ("gemma3", Some(w)) => {
            let pattern = json
                .get("sliding_window_pattern")
                .and_then(Value::as_u64)
                .unwrap_or(6)
                .max(1) as usize;
            Ok((0..num_layers)
                .map(|l| {
                    if (l + 1) % pattern == 0 {
                        AttentionSpan::Global
                    } else {
                        AttentionSpan::Window(w)
                    }
                })
                .collect())
        }
        // Mistral applies its window unless told otherwise; Qwen declares one but enables it explicitly.
        (_, Some(w))
            if json
                .get("use_sliding_window")
                .and_then(Value::as_bool)
                .unwrap_or(architecture == "mistral") =>
        {
            all(AttentionSpan::Window(w))
        }
        _ => all(AttentionSpan::Global),
    }
}

/// The global layers' rope and the windowed layers' rope (Gemma 3's `rope_local_base_freq`). Reads
/// transformers' legacy keys (`rope_theta`, `rope_scaling`) and v5's `rope_parameters`, which is one
/// set or one set per layer type.
fn hf_ropes(json: &Value, gemma: bool) -> Result<(LayerRope, LayerRope), ModelError> {
    let params = json.get("rope_parameters").filter(|v| v.is_object());
    let per_type = |t: &str| params.and_then(|p| p.get(t)).filter(|v| v.is_object());
    let theta_of = |v: Option<&Value>| {
        v.and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .map(|v| v as f32)
    };
    let global_params = per_type("full_attention").or(params);
    let global = LayerRope {
        theta: json
            .get("rope_theta")
            .and_then(Value::as_f64)
            .map(|v| v as f32)
            .or_else(|| theta_of(global_params))
            .unwrap_or(10_000.0),
        scaling: parse_hf_rope_scaling(
            json.get("rope_scaling")
                .filter(|v| !v.is_null())
                .or(global_params),
        )?,
    };
    let local = match per_type("sliding_attention") {
        Some(p) => LayerRope {
            theta: theta_of(Some(p)).unwrap_or(10_000.0),
            scaling: parse_hf_rope_scaling(Some(p))?,
        },
        None if gemma => LayerRope {
            theta: json
                .get("rope_local_base_freq")
                .and_then(Value::as_f64)
                .map(|v| v as f32)
                .unwrap_or(10_000.0),
            scaling: RopeScaling::None,
        },
        None => global.clone(),
    };
    Ok((global, local))
}

/// The experts of a Qwen-MoE style config (`num_experts` > 0, or `num_local_experts`, the name
/// transformers 5 saves), else `None`.
fn hf_moe(json: &Value) -> Result<Option<MoeSpec>, ModelError> {
    let get = |k: &str| json.get(k).and_then(Value::as_u64).map(|v| v as usize);
    let Some(num_experts) = get("num_experts")
        .or_else(|| get("num_local_experts"))
        .filter(|&n| n > 0)
    else {
        return Ok(None);
    };
    let need = |k: &str| {
        get(k).ok_or_else(|| ModelError::Config(format!("config.json lacks integer {k}")))
    };
    Ok(Some(MoeSpec {
        num_experts,
        top_k: need("num_experts_per_tok")?,
        norm_top_k: json
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        expert_ffn: need("moe_intermediate_size")?,
        shared_ffn: get("shared_expert_intermediate_size").filter(|&n| n > 0),
    }))
}

/// BOS and EOS ids from config.json, with generation_config.json's EOS ids added.
fn special_ids(json: &Value, generation: Option<&Value>) -> (Option<u32>, Vec<u32>) {
    let eos_from = |v: Option<&Value>| -> Vec<u32> {
        match v {
            Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|n| n as u32)
                .collect(),
            _ => Vec::new(),
        }
    };
    let mut eos = eos_from(json.get("eos_token_id"));
    for id in eos_from(generation.and_then(|g| g.get("eos_token_id"))) {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    let bos = json
        .get("bos_token_id")
        .and_then(|v| v.as_u64())
        .or_else(|| {
            generation
                .and_then(|g| g.get("bos_token_id"))
                .and_then(|v| v.as_u64())
        })
        .map(|v| v as u32);
    (bos, eos)
}

/// Maps HF `rope_scaling` (keyed `rope_type`, or legacy `type`) onto the kernels' scaling.
fn parse_hf_rope_scaling(v: Option<&Value>) -> Result<RopeScaling, ModelError> {
    let Some(obj) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let Some(kind) = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|t| t.as_str())
    else {
        // v5's rope_parameters may hold only a base frequency.
        return if obj.get("rope_theta").is_some() {
            Ok(RopeScaling::None)
        } else {
            Err(ModelError::Config("rope_scaling lacks rope_type".into()))
        };
    };
    let f = |k: &str| {
        obj.get(k)
            .and_then(|x| x.as_f64())
            .map(|x| x as f32)
            .ok_or_else(|| ModelError::Config(format!("rope_scaling lacks {k}")))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: f("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position: obj
                .get("original_max_position_embeddings")
                .and_then(|x| x.as_u64())
                .ok_or_else(|| {
                    ModelError::Config("rope_scaling lacks original_max_position_embeddings".into())
                })? as usize,
        }),
        other => Err(ModelError::Config(format!(
            "unsupported rope_scaling type {other:?}"
        ))),
    }
}
