//! The structure of a model as data: what each layer computes, so that the CPU and CUDA forwards,
//! the KV layout, the P/D handshake (the identity hashes it) and the pipeline partition read one
//! description instead of branching on architecture names. A new family is a loader mapping onto
//! these types plus any kernel it lacks.

use serde::{Deserialize, Serialize};
use tandem_kernels::RopeScaling;

use crate::error::ModelError;

/// Which earlier positions one layer's attention reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionSpan {
    /// Every earlier position of the sequence.
    Global,
    /// Only the latest `n` positions, the token itself included (Mistral v0.1, Gemma's local layers).
    Window(usize),
}

impl AttentionSpan {
    /// The window as the attention kernels take it (`None` = global).
    pub fn window(self) -> Option<usize> {
        match self {
            AttentionSpan::Global => None,
            AttentionSpan::Window(n) => Some(n),
        }
    }
}

/// The rotary embedding of one layer: Gemma 3's local and global layers use different bases.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerRope {
    /// Base frequency.
    pub theta: f32,
    /// Long-context frequency scaling.
    pub scaling: RopeScaling,
}

/// The feed-forward block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// One gated MLP of `ModelConfig::intermediate_size` features.
    Dense,
    /// The mixture of experts the model's [`MoeSpec`] describes.
    Moe,
}

/// What one transformer block computes, beyond the model-wide settings of `ModelConfig`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    /// The positions its attention reads.
    pub attention: AttentionSpan,
    /// Its rotary embedding.
    pub rope: LayerRope,
    /// Its feed-forward block.
    pub mlp: MlpKind,
}

/// The shape of a model's mixture-of-experts layers (all of its MoE layers share it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeSpec {
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Whether the chosen experts' softmax weights are renormalised to sum to one (Qwen3-MoE) or kept
    /// as the softmax over all experts gave them (Qwen2-MoE).
    pub norm_top_k: bool,
    /// Features of one routed expert's gated MLP.
    pub expert_ffn: usize,
    /// Features of the shared expert every token also passes through, scaled by its own sigmoid gate
    /// (Qwen2-MoE); `None` when the model has none.
    pub shared_ffn: Option<usize>,
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SiLU (Llama, Qwen, Mistral).
    #[default]
    Silu,
    /// GELU with the tanh approximation (Gemma).
    GeluTanh,
}

impl LayerSpec {
    /// `n` identical layers: the description of a model whose layers do not differ.
    pub fn uniform(n: usize, attention: AttentionSpan, rope: LayerRope, mlp: MlpKind) -> Vec<Self> {
        vec![
            LayerSpec {
                attention,
                rope,
                mlp
            };
            n
        ]
    }
}

/// Whether `x` is a positive number (false for NaN), for the checks of float settings.
pub(crate) fn positive(x: f32) -> bool {
    x > 0.0
}

/// Checks a per-layer description against the model-wide settings it refers to.
pub(crate) fn validate_layers(
    layers: &[LayerSpec],
    num_layers: usize,
    moe: Option<&MoeSpec>,
) -> Result<(), ModelError> {
    if layers.len() != num_layers {
        return Err(ModelError::Config(format!(
            "{} layer descriptions for {num_layers} layers",
            layers.len()
        )));
    }
    for (l, spec) in layers.iter().enumerate() {
        if spec.attention == AttentionSpan::Window(0) {
            return Err(ModelError::Config(format!(
                "layer {l}: a sliding window of 0 positions"
            )));
        }
        if !positive(spec.rope.theta) {
            return Err(ModelError::Config(format!(
                "layer {l}: rope base {} must be positive",
                spec.rope.theta
            )));
        }
        if spec.mlp == MlpKind::Moe && moe.is_none() {
            return Err(ModelError::Config(format!(
                "layer {l} is a mixture of experts but the model describes no experts"
            )));
        }
    }
    if let Some(m) = moe {
        if m.num_experts == 0 || m.expert_ffn == 0 || m.top_k == 0 || m.top_k > m.num_experts {
            return Err(ModelError::Config(format!(
                "experts: {} of {} features each, top-k {}: need at least one expert, positive features and 1 <= top-k <= experts",
                m.num_experts, m.expert_ffn, m.top_k
            )));
        }
        if m.shared_ffn == Some(0) {
            return Err(ModelError::Config("a shared expert of 0 features".into()));
        }
    }
    Ok(())
}
