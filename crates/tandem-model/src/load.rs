//! One entry point that loads everything a server needs from a GGUF file or an HF folder.

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::gguf::{GgufFile, GgufValue};
use crate::identity::ModelIdentity;
use crate::tokenizer::Tokenizer;
use crate::weights::fp8::fp8_scales_of;
use crate::weights::{
    gguf_tensor_descs, load_gguf_weights, load_safetensors_weights, LlamaWeights, SafetensorsSet,
    TensorDesc,
};

/// Everything loaded from a model path (GGUF file or HF folder).
pub struct LoadedModel {
    /// File stem or folder name; the default served-model-name.
    pub name: String,
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Weights, zero-copy where the format allows.
    pub weights: LlamaWeights,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// From GGUF `tokenizer.chat_template` or tokenizer_config.json.
    pub chat_template: Option<String>,
    /// Stable hash of config + tensor names/shapes/dtypes.
    pub identity: ModelIdentity,
    /// The checkpoint stores FP8 weights (dequantized here; the CUDA backend keeps them in FP8).
    pub fp8_checkpoint: bool,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("name", &self.name)
            .field("config", &self.config)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// How to load.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Show an indicatif bar while weights load.
    pub progress: bool,
}

/// Loads a `.gguf` file, or an HF folder with config.json, tokenizer.json and safetensors.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel, ModelError> {
    let name = path
        .file_stem()
        .or_else(|| path.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".to_string());
    let (parts, format) = if path.is_dir() {
        (load_hf_dir(path, opts)?, "safetensors")
    } else {
        (load_gguf(path, opts)?, "GGUF")
    };
    let identity = ModelIdentity::compute(&parts.config, &parts.tensors);
    tracing::info!(model = %name, arch = %parts.config.architecture, layers = parts.config.num_layers, identity = %identity, "loaded {format} model");
    Ok(LoadedModel {
        name,
        config: parts.config,
        weights: parts.weights,
        tokenizer: parts.tokenizer,
        chat_template: parts.chat_template,
        identity,
        fp8_checkpoint: parts.fp8_checkpoint,
    })
}

/// What either format's loader reads, before the identity is hashed from `tensors`.
struct Parts {
    config: ModelConfig,
    weights: LlamaWeights,
    tokenizer: Tokenizer,
    chat_template: Option<String>,
    tensors: Vec<TensorDesc>,
    fp8_checkpoint: bool,
}

fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<Parts, ModelError> {
    let gguf = GgufFile::open(path)?;
    let config = ModelConfig::from_gguf(&gguf)?;
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    check_vocab(&config, &tokenizer)?;
    let weights = load_gguf_weights(&gguf, &config, opts.progress)?;
    let chat_template = gguf
        .get("tokenizer.chat_template")
        .and_then(GgufValue::as_str)
        .map(str::to_string);
    Ok(Parts {
        config,
        weights,
        tokenizer,
        chat_template,
        tensors: gguf_tensor_descs(&gguf),
        fp8_checkpoint: false,
    })
}

fn load_hf_dir(dir: &Path, opts: &LoadOptions) -> Result<Parts, ModelError> {
    let config = ModelConfig::from_hf_dir(dir)?;
    let tc_path = dir.join("tokenizer_config.json");
    let tokenizer_config: Option<serde_json::Value> = match std::fs::read_to_string(&tc_path) {
        Ok(text) => Some(
            serde_json::from_str(&text)
                .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tc_path.display())))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(ModelError::io(tc_path, e)),
    };
    let special = |key: &str| -> Option<String> {
        let v = tokenizer_config.as_ref()?.get(key)?;
        // Either a plain string or an AddedToken object {"content": ...}.
        v.as_str()
            .or_else(|| v.get("content").and_then(|c| c.as_str()))
            .map(str::to_string)
    };
    let mut tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
    let id_token = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i));
    let bos = special("bos_token").or_else(|| id_token(config.bos_token_id));
    let eos = special("eos_token").or_else(|| id_token(config.eos_token_ids.first().copied()));
    tokenizer = tokenizer.with_special_tokens(bos, eos);
    check_vocab(&config, &tokenizer)?;
    // Newer transformers save the template as chat_template.jinja next to tokenizer_config.json.
    let jinja = dir.join("chat_template.jinja");
    let chat_template = match tokenizer_config
        .as_ref()
        .and_then(|tc| chat_template_of(tc.get("chat_template")?))
    {
        Some(t) => Some(t),
        None if jinja.exists() => {
            Some(std::fs::read_to_string(&jinja).map_err(|e| ModelError::io(&jinja, e))?)
        }
        None => None,
    };
    let cfg_path = dir.join("config.json");
    let raw: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?,
    )
    .map_err(|e| ModelError::Config(format!("{}: {e}", cfg_path.display())))?;
    let fp8 = fp8_scales_of(&raw)?;
    let set = SafetensorsSet::open(dir)?.with_fp8(fp8);
    let weights = load_safetensors_weights(&set, &config, opts.progress)?;
    Ok(Parts {
        config,
        weights,
        tokenizer,
        chat_template,
        tensors: set.tensor_descs(),
        fp8_checkpoint: fp8.is_some(),
    })
}

/// `chat_template` is a string, or a list of named templates of which "default" is the chat one.
fn chat_template_of(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// The tokenizer may have fewer ids than the embedding (padded vocabularies) but never more.
fn check_vocab(config: &ModelConfig, tokenizer: &Tokenizer) -> Result<(), ModelError> {
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(ModelError::Config(format!(
            "tokenizer has {} ids but the model only {}",
            tokenizer.vocab_size(),
            config.vocab_size
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_default_named_template() {
        let v = serde_json::json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]);
        assert_eq!(chat_template_of(&v).as_deref(), Some("D"));
        assert_eq!(
            chat_template_of(&serde_json::json!("S")).as_deref(),
            Some("S")
        );
        assert_eq!(chat_template_of(&serde_json::json!(null)), None);
    }

    #[test]
    fn missing_path_is_an_io_error_naming_it() {
        let err = load(
            Path::new("/nonexistent/model.gguf"),
            &LoadOptions::default(),
        )
        .unwrap_err();
        assert!(matches!(err, ModelError::Io { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/model.gguf"));
    }
}
