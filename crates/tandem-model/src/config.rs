//! Model hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tandem_kernels::{RopeScaling, RopeStyle};

use crate::error::ModelError;
use crate::gguf::{GgufFile, GgufValue};

/// Hyper-parameters of one Llama-family model, read from GGUF metadata or config.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// "llama", "qwen2" or "mistral".
    pub architecture: String,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate/up projections.
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA).
    pub num_kv_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Rows of the embedding and of the output head.
    pub vocab_size: usize,
    /// Longest context the model was trained for; also the size of the RoPE table.
    pub max_position_embeddings: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// RoPE frequency scaling for long-context variants.
    pub rope_scaling: RopeScaling,
    /// Which element pairs RoPE rotates: GGUF llama weights are permuted for adjacent pairs, HF weights are not.
    pub rope_style: RopeStyle,
    /// Whether the output head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry biases (Qwen2).
    pub attention_bias: bool,
    /// Beginning-of-sequence token, if the model uses one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Sliding-window attention span (Mistral v0.1): each token attends to this many latest positions.
    #[serde(default)]
    pub sliding_window: Option<usize>,
}

impl ModelConfig {
    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the invariants the forward pass relies on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(ModelError::Config(format!("{name} must be positive")));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(ModelError::Config(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim
            )));
        }
        if !(self.rms_norm_eps > 0.0 && self.rope_theta > 0.0) {
            return Err(ModelError::Config(
                "rms_norm_eps and rope_theta must be positive".into(),
            ));
        }
        Ok(())
    }

    /// Reads the configuration from GGUF metadata (`{arch}.*` keys and `tokenizer.ggml.*` ids).
    pub fn from_gguf(gguf: &GgufFile) -> Result<ModelConfig, ModelError> {
        let arch = gguf
            .get("general.architecture")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| ModelError::Config("GGUF lacks general.architecture".into()))?
            .to_string();
        let rope_style = match arch.as_str() {
            // llama.cpp's converter permutes Q/K of llama-arch models for adjacent-pair RoPE; Qwen2
            // is converted unpermuted and uses llama.cpp's NEOX RoPE.
            "llama" | "mistral" => RopeStyle::Interleaved,
            "qwen2" => RopeStyle::Neox,
            other => {
                return Err(ModelError::Config(format!(
                    "unsupported GGUF architecture {other:?}"
                )))
            }
        };
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
        let rope_scaling = match gguf
            .get(&key("rope.scaling.type"))
            .and_then(GgufValue::as_str)
        {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear {
                factor: opt_f("rope.scaling.factor").ok_or_else(|| {
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
        let rope_scaling = match gguf.tensor("rope_freqs.weight") {
            None => rope_scaling,
            Some(_) if rope_scaling != RopeScaling::None => {
                return Err(ModelError::Config(
                    "GGUF has both rope_freqs.weight and a rope scaling type".into(),
                ))
            }
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
                RopeScaling::FreqFactors { factors }
            }
        };
        let tok_u32 = |k: &str| gguf.get(k).and_then(GgufValue::as_u64).map(|v| v as u32);
        let config = ModelConfig {
            architecture: arch.clone(),
            hidden_size,
            intermediate_size: req_u("feed_forward_length")?,
            num_layers: req_u("block_count")?,
            num_heads,
            num_kv_heads: opt_u("attention.head_count_kv").unwrap_or(num_heads),
            head_dim,
            vocab_size,
            max_position_embeddings: req_u("context_length")?,
            rms_norm_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: opt_f("rope.freq_base").unwrap_or(10_000.0),
            rope_scaling,
            rope_style,
            tie_word_embeddings: gguf.tensor("output.weight").is_none(),
            attention_bias: gguf.tensor("blk.0.attn_q.bias").is_some(),
            bos_token_id: tok_u32("tokenizer.ggml.bos_token_id"),
            eos_token_ids: tok_u32("tokenizer.ggml.eos_token_id").into_iter().collect(),
            sliding_window: None,
        };
        config.validate()?;
        Ok(config)
    }

    /// Reads `config.json` (and `generation_config.json` for extra eos ids) of a Hugging Face folder.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
        let gen_path = dir.join("generation_config.json");
        let generation = match std::fs::read_to_string(&gen_path) {
            Ok(t) => Some(
                serde_json::from_str::<serde_json::Value>(&t)
                    .map_err(|e| ModelError::Config(format!("{}: {e}", gen_path.display())))?,
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(ModelError::io(gen_path, e)),
        };
        ModelConfig::from_hf_json(&json, generation.as_ref())
    }

    /// Builds the configuration from parsed `config.json` and optional `generation_config.json`.
    pub fn from_hf_json(
        json: &serde_json::Value,
        generation: Option<&serde_json::Value>,
    ) -> Result<ModelConfig, ModelError> {
        let arch_name = json
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .ok_or_else(|| ModelError::Config("config.json lacks architectures".into()))?;
        let architecture = match arch_name {
            "LlamaForCausalLM" => "llama",
            "Qwen2ForCausalLM" => "qwen2",
            "MistralForCausalLM" => "mistral",
            other => {
                return Err(ModelError::Config(format!(
                    "unsupported architecture {other:?}"
                )))
            }
        };
        let req = |k: &str| -> Result<usize, ModelError> {
            json.get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::Config(format!("config.json lacks integer {k}")))
        };
        let opt = |k: &str| json.get(k).and_then(|v| v.as_u64()).map(|v| v as usize);
        let opt_f = |k: &str| json.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);

        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        if num_heads == 0 {
            return Err(ModelError::Config("num_attention_heads is zero".into()));
        }
        // Mistral applies its window unless told otherwise; Qwen2 declares one but enables it explicitly.
        let sliding_window = opt("sliding_window").filter(|_| {
            json.get("use_sliding_window")
                .and_then(|v| v.as_bool())
                .unwrap_or(architecture == "mistral")
        });
        // transformers v5 moved rope_theta and the scaling into `rope_parameters`.
        let rope_params = json.get("rope_parameters").filter(|v| v.is_object());
        let rope_scaling = parse_hf_rope_scaling(
            json.get("rope_scaling")
                .filter(|v| !v.is_null())
                .or(rope_params),
        )?;
        let rope_theta = opt_f("rope_theta")
            .or_else(|| {
                rope_params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(|v| v.as_f64())
                    .map(|v| v as f32)
            })
            .unwrap_or(10_000.0);
        let eos_from = |v: Option<&serde_json::Value>| -> Vec<u32> {
            match v {
                Some(serde_json::Value::Number(n)) => {
                    n.as_u64().map(|n| vec![n as u32]).unwrap_or_default()
                }
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .filter_map(|x| x.as_u64())
                    .map(|n| n as u32)
                    .collect(),
                _ => Vec::new(),
            }
        };
        let mut eos_token_ids = eos_from(json.get("eos_token_id"));
        for id in eos_from(generation.and_then(|g| g.get("eos_token_id"))) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let bos_token_id = json
            .get("bos_token_id")
            .and_then(|v| v.as_u64())
            .or_else(|| {
                generation
                    .and_then(|g| g.get("bos_token_id"))
                    .and_then(|v| v.as_u64())
            })
            .map(|v| v as u32);
        let config = ModelConfig {
            architecture: architecture.to_string(),
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_layers: req("num_hidden_layers")?,
            num_heads,
            num_kv_heads: opt("num_key_value_heads").unwrap_or(num_heads),
            head_dim: opt("head_dim").unwrap_or(hidden_size / num_heads),
            vocab_size: req("vocab_size")?,
            max_position_embeddings: opt("max_position_embeddings").unwrap_or(4096),
            rms_norm_eps: opt_f("rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            rope_style: RopeStyle::Neox,
            tie_word_embeddings: json
                .get("tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            attention_bias: architecture == "qwen2"
                || json
                    .get("attention_bias")
                    .and_then(|v| v.as_bool())
                    .unwrap_or(false),
            bos_token_id,
            eos_token_ids,
            sliding_window,
        };
        config.validate()?;
        Ok(config)
    }
}

/// Maps HF `rope_scaling` (keyed `rope_type`, or legacy `type`) onto the kernels' scaling.
fn parse_hf_rope_scaling(v: Option<&serde_json::Value>) -> Result<RopeScaling, ModelError> {
    let Some(obj) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|t| t.as_str())
        .ok_or_else(|| ModelError::Config("rope_scaling lacks rope_type".into()))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama_json() -> serde_json::Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": true, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008],
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        })
    }

    #[test]
    fn parses_llama3_config_with_defaults_and_eos_list() {
        let gen = json!({"eos_token_id": [128001, 128009]});
        let c = ModelConfig::from_hf_json(&llama_json(), Some(&gen)).unwrap();
        assert_eq!(c.architecture, "llama");
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.num_kv_heads, 8);
        assert_eq!(c.rope_style, RopeStyle::Neox);
        assert!(c.tie_word_embeddings && !c.attention_bias);
        assert_eq!(c.bos_token_id, Some(128000));
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192
            }
        );
    }

    #[test]
    fn qwen2_implies_attention_bias_and_int_eos() {
        let mut j = llama_json();
        j["architectures"] = json!(["Qwen2ForCausalLM"]);
        j["eos_token_id"] = json!(151645);
        j["head_dim"] = json!(128);
        j["rope_scaling"] = json!(null);
        let c = ModelConfig::from_hf_json(&j, None).unwrap();
        assert!(c.attention_bias);
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.eos_token_ids, vec![151645]);
        assert_eq!(c.rope_scaling, RopeScaling::None);
    }

    #[test]
    fn rejects_unknown_architecture_and_bad_heads() {
        let mut j = llama_json();
        j["architectures"] = json!(["GPT2LMHeadModel"]);
        assert!(matches!(
            ModelConfig::from_hf_json(&j, None),
            Err(ModelError::Config(_))
        ));
        let mut j = llama_json();
        j["num_key_value_heads"] = json!(5);
        assert!(matches!(
            ModelConfig::from_hf_json(&j, None),
            Err(ModelError::Config(_))
        ));
        let mut j = llama_json();
        j["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(matches!(
            ModelConfig::from_hf_json(&j, None),
            Err(ModelError::Config(_))
        ));
    }

    #[test]
    fn reads_transformers_v5_rope_parameters() {
        let mut j = llama_json();
        j.as_object_mut().unwrap().remove("rope_theta");
        j["rope_scaling"] = json!(null);
        j["rope_parameters"] = json!({"rope_theta": 50000.0, "rope_type": "default"});
        let c = ModelConfig::from_hf_json(&j, None).unwrap();
        assert_eq!(c.rope_theta, 50000.0);
        assert_eq!(c.rope_scaling, RopeScaling::None);
    }

    #[test]
    fn config_round_trips_through_json() {
        let c = ModelConfig::from_hf_json(&llama_json(), None).unwrap();
        let s = serde_json::to_string(&c).unwrap();
        let back: ModelConfig = serde_json::from_str(&s).unwrap();
        assert_eq!(c, back);
    }

    #[test]
    fn reads_gguf_metadata() {
        use crate::gguf::tests::GgufWriter;
        let mut w = GgufWriter::default();
        w.kv_str("general.architecture", "llama")
            .kv_u32("llama.embedding_length", 64)
            .kv_u32("llama.feed_forward_length", 128)
            .kv_u32("llama.block_count", 2)
            .kv_u32("llama.attention.head_count", 4)
            .kv_u32("llama.attention.head_count_kv", 2)
            .kv_u32("llama.context_length", 256)
            .kv_u32("llama.vocab_size", 100)
            .kv_f32("llama.rope.freq_base", 100000.0)
            .kv_u32("tokenizer.ggml.bos_token_id", 1)
            .kv_u32("tokenizer.ggml.eos_token_id", 2);
        let f = GgufFile::parse(std::sync::Arc::new(w.finish())).unwrap();
        let c = ModelConfig::from_gguf(&f).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.num_kv_heads, 2);
        assert_eq!(c.rope_style, RopeStyle::Interleaved);
        assert_eq!(c.rope_theta, 100000.0);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![2]);
    }
}
