//! Model hyper-parameters and per-layer structure, read from GGUF metadata (config/gguf.rs) or a
//! Hugging Face `config.json` (config/hf.rs).

pub use gguf::served_gguf_architectures;
pub use hf::served_hf_architectures;

mod gguf;
mod hf;

use serde::{Deserialize, Serialize};
use tandem_kernels::RopeStyle;

use crate::error::ModelError;
use crate::spec::{
    positive, validate_layers, Activation, AttentionSpan, LayerRope, LayerSpec, MlpKind, MoeSpec,
};

/// Hyper-parameters and per-layer structure of one model, read from GGUF metadata or config.json:
/// everything a backend needs to know to run it, with nothing left to the architecture's name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// The family as GGUF names it ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma3", …): for
    /// messages and the template, never for choosing a code path (the fields below do that).
    pub architecture: String,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of a dense layer's MLP gate/up projections.
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
    /// What each layer computes: its attention span, rotary embedding and MLP kind.
    pub layers: Vec<LayerSpec>,
    /// The experts of the layers whose MLP is a mixture of experts.
    pub moe: Option<MoeSpec>,
    /// Whether each head's query and key are RMS-normalised before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Whether attention and MLP outputs are RMS-normalised before the residual add (Gemma's
    /// post-attention and post-feed-forward norms).
    pub sandwich_norms: bool,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// Factor on the embedding rows before the first layer (Gemma: sqrt(hidden)); `None` = 1.
    pub embedding_scale: Option<f32>,
    /// Multiplier of q·k in attention: 1/sqrt(head_dim) unless the model says otherwise.
    pub attn_scale: f32,
    /// Logits become `cap * tanh(logits / cap)` (Gemma 2 and 3 configs that set it).
    pub final_logit_softcap: Option<f32>,
}

/// The widths of a plain dense model, for [`ModelConfig::dense`].
#[derive(Clone, Debug)]
pub struct DenseShape {
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the MLP.
    pub ffn: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Positions the rope table covers.
    pub max_positions: usize,
    /// Every layer's rope.
    pub rope: LayerRope,
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
        let widths = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in widths {
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
        if !(positive(self.rms_norm_eps) && positive(self.attn_scale)) {
            return Err(ModelError::Config(
                "rms_norm_eps and the attention scale must be positive".into(),
            ));
        }
        if self.final_logit_softcap.is_some_and(|c| !positive(c))
            || self.embedding_scale.is_some_and(|s| !positive(s))
        {
            return Err(ModelError::Config(
                "the logit soft-cap and the embedding scale must be positive".into(),
            ));
        }
        validate_layers(&self.layers, self.num_layers, self.moe.as_ref())
    }

    /// A plain dense model of the given widths (Llama-style: every layer global with one rope, SiLU
    /// MLP, no extra norms, untied head, no special tokens): the base that tests and the synthetic
    /// benchmarks adjust.
    pub fn dense(shape: DenseShape) -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            hidden_size: shape.hidden,
            intermediate_size: shape.ffn,
            num_layers: shape.layers,
            num_heads: shape.heads,
            num_kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            vocab_size: shape.vocab,
            max_position_embeddings: shape.max_positions,
            rms_norm_eps: 1e-5,
            rope_style: RopeStyle::Neox,
            tie_word_embeddings: false,
            attention_bias: false,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            layers: LayerSpec::uniform(
                shape.layers,
                AttentionSpan::Global,
                shape.rope,
                MlpKind::Dense,
            ),
            moe: None,
            qk_norm: false,
            sandwich_norms: false,
            activation: Activation::Silu,
            embedding_scale: None,
            attn_scale: ModelConfig::default_attn_scale(shape.head_dim),
            final_logit_softcap: None,
        }
    }

    /// The layer description of layer `l`.
    pub fn layer(&self, l: usize) -> &LayerSpec {
        &self.layers[l]
    }

    /// The distinct ropes of layers `layers`, in first-use order, and each of those layers' index
    /// into them: what a backend builds one RoPE table for.
    pub fn distinct_ropes(
        &self,
        layers: std::ops::Range<usize>,
    ) -> (Vec<&crate::spec::LayerRope>, Vec<usize>) {
        let mut distinct: Vec<&crate::spec::LayerRope> = Vec::new();
        let index = self.layers[layers]
            .iter()
            .map(|spec| {
                distinct
                    .iter()
                    .position(|r| **r == spec.rope)
                    .unwrap_or_else(|| {
                        distinct.push(&spec.rope);
                        distinct.len() - 1
                    })
            })
            .collect();
        (distinct, index)
    }

    /// Whether any layer's MLP is a mixture of experts.
    pub fn has_moe(&self) -> bool {
        self.has_moe_in(0..self.layers.len())
    }

    /// Whether any of `layers` (a pipeline stage's, say) has a mixture-of-experts MLP.
    pub fn has_moe_in(&self, layers: std::ops::Range<usize>) -> bool {
        self.layers[layers].iter().any(|l| l.mlp == MlpKind::Moe)
    }

    /// The attention scale used when the model names none: 1/sqrt(head_dim).
    pub fn default_attn_scale(head_dim: usize) -> f32 {
        1.0 / (head_dim as f32).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use serde_json::json;
    use tandem_kernels::RopeScaling;

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
            c.layer(15).rope.scaling,
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
        assert_eq!(c.layer(0).rope.scaling, RopeScaling::None);
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
        assert_eq!(c.layer(0).rope.theta, 50000.0);
        assert_eq!(c.layer(0).rope.scaling, RopeScaling::None);
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
        assert_eq!(c.layer(1).rope.theta, 100000.0);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![2]);
    }

    fn gemma3_json() -> serde_json::Value {
        json!({
            "architectures": ["Gemma3ForCausalLM"], "hidden_size": 640, "intermediate_size": 2048,
            "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": null,
            "attn_logit_softcapping": null, "rope_scaling": {"rope_type": "linear", "factor": 8.0}
        })
    }

    #[test]
    fn gemma3_layers_alternate_local_and_global_with_their_ropes() {
        let c = ModelConfig::from_hf_json(&gemma3_json(), None).unwrap();
        let spans: Vec<_> = c.layers.iter().map(|l| l.attention).collect();
        let w = AttentionSpan::Window(512);
        assert_eq!(spans, vec![w, w, w, w, w, AttentionSpan::Global, w]);
        assert_eq!(c.layer(0).rope.theta, 10000.0);
        assert_eq!(c.layer(0).rope.scaling, RopeScaling::None);
        assert_eq!(c.layer(5).rope.theta, 1e6);
        assert_eq!(c.layer(5).rope.scaling, RopeScaling::Linear { factor: 8.0 });
        assert!(c.qk_norm && c.sandwich_norms && c.tie_word_embeddings);
        assert_eq!(c.activation, crate::spec::Activation::GeluTanh);
        assert_eq!(c.embedding_scale, Some(640f32.sqrt()));
        assert_eq!(c.attn_scale, 1.0 / 16.0);
        assert_eq!(c.final_logit_softcap, None);

        // transformers v5 spells the same structure as layer_types and per-type rope parameters.
        let mut j = gemma3_json();
        let obj = j.as_object_mut().unwrap();
        for k in [
            "rope_theta",
            "rope_local_base_freq",
            "rope_scaling",
            "sliding_window_pattern",
        ] {
            obj.remove(k);
        }
        j["layer_types"] = json!([
            "full_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention"
        ]);
        j["rope_parameters"] = json!({
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}});
        j["final_logit_softcapping"] = json!(30.0);
        let c = ModelConfig::from_hf_json(&j, None).unwrap();
        assert_eq!(c.layer(0).attention, AttentionSpan::Global);
        assert_eq!(c.layer(1).attention, AttentionSpan::Window(512));
        assert_eq!((c.layer(0).rope.theta, c.layer(1).rope.theta), (1e6, 1e4));
        assert_eq!(c.final_logit_softcap, Some(30.0));

        let mut j = gemma3_json();
        j["attn_logit_softcapping"] = json!(50.0);
        let err = ModelConfig::from_hf_json(&j, None).unwrap_err().to_string();
        assert!(err.contains("attn_logit_softcapping"), "{err}");
    }

    #[test]
    fn moe_configs_describe_experts_and_dense_layers() {
        let mut j = llama_json();
        j["architectures"] = json!(["Qwen3MoeForCausalLM"]);
        j["num_hidden_layers"] = json!(4);
        j["num_experts"] = json!(128);
        j["num_experts_per_tok"] = json!(8);
        j["moe_intermediate_size"] = json!(768);
        j["norm_topk_prob"] = json!(true);
        j["mlp_only_layers"] = json!([1]);
        j["rope_scaling"] = json!(null);
        let c = ModelConfig::from_hf_json(&j, None).unwrap();
        let kinds: Vec<_> = c.layers.iter().map(|l| l.mlp).collect();
        assert_eq!(
            kinds,
            vec![MlpKind::Moe, MlpKind::Dense, MlpKind::Moe, MlpKind::Moe]
        );
        let m = c.moe.clone().unwrap();
        assert_eq!((m.num_experts, m.top_k, m.expert_ffn), (128, 8, 768));
        assert!(m.norm_top_k && m.shared_ffn.is_none() && c.qk_norm && !c.attention_bias);

        j["architectures"] = json!(["Qwen2MoeForCausalLM"]);
        j["norm_topk_prob"] = json!(false);
        j["shared_expert_intermediate_size"] = json!(5632);
        j["decoder_sparse_step"] = json!(2);
        j["mlp_only_layers"] = json!([]);
        let c = ModelConfig::from_hf_json(&j, None).unwrap();
        let kinds: Vec<_> = c.layers.iter().map(|l| l.mlp).collect();
        assert_eq!(
            kinds,
            vec![MlpKind::Dense, MlpKind::Moe, MlpKind::Dense, MlpKind::Moe]
        );
        let m = c.moe.unwrap();
        assert_eq!(m.shared_ffn, Some(5632));
        assert!(!m.norm_top_k && c.attention_bias && !c.qk_norm);

        j["num_experts_per_tok"] = json!(200);
        assert!(ModelConfig::from_hf_json(&j, None).is_err());

        // transformers 5 saves the expert count as num_local_experts.
        j["num_experts_per_tok"] = json!(8);
        let n = j.as_object_mut().unwrap().remove("num_experts").unwrap();
        j["num_local_experts"] = n;
        assert_eq!(
            ModelConfig::from_hf_json(&j, None)
                .unwrap()
                .moe
                .map(|m| m.num_experts),
            Some(128)
        );
    }

    #[test]
    fn unknown_architectures_are_refused_with_the_served_list() {
        let mut j = llama_json();
        j["architectures"] = json!(["DeepseekV3ForCausalLM"]);
        let err = ModelConfig::from_hf_json(&j, None).unwrap_err().to_string();
        assert!(
            err.contains("DeepseekV3ForCausalLM") && err.contains("Qwen3MoeForCausalLM"),
            "{err}"
        );
        use crate::gguf::tests::GgufWriter;
        let mut w = GgufWriter::default();
        w.kv_str("general.architecture", "phi3");
        let f = GgufFile::parse(std::sync::Arc::new(w.finish())).unwrap();
        let err = ModelConfig::from_gguf(&f).unwrap_err().to_string();
        assert!(err.contains("phi3") && err.contains("gemma3"), "{err}");
    }

    #[test]
    fn gguf_gemma3_gets_its_window_pattern_and_fixed_features() {
        use crate::gguf::tests::GgufWriter;
        let mut w = GgufWriter::default();
        w.kv_str("general.architecture", "gemma3")
            .kv_u32("gemma3.embedding_length", 64)
            .kv_u32("gemma3.feed_forward_length", 128)
            .kv_u32("gemma3.block_count", 12)
            .kv_u32("gemma3.attention.head_count", 4)
            .kv_u32("gemma3.attention.head_count_kv", 1)
            .kv_u32("gemma3.attention.key_length", 32)
            .kv_u32("gemma3.context_length", 256)
            .kv_u32("gemma3.vocab_size", 100)
            .kv_u32("gemma3.attention.sliding_window", 16)
            .kv_f32("gemma3.rope.freq_base", 1e6);
        let f = GgufFile::parse(std::sync::Arc::new(w.finish())).unwrap();
        let c = ModelConfig::from_gguf(&f).unwrap();
        let globals: Vec<usize> = (0..12)
            .filter(|&l| c.layer(l).attention == AttentionSpan::Global)
            .collect();
        assert_eq!(globals, vec![5, 11]);
        assert_eq!((c.layer(0).rope.theta, c.layer(5).rope.theta), (1e4, 1e6));
        assert_eq!(c.rope_style, RopeStyle::Neox);
        assert!(c.qk_norm && c.sandwich_norms && c.embedding_scale == Some(8.0));
        assert_eq!(c.attn_scale, 1.0 / 32f32.sqrt());
    }
}
