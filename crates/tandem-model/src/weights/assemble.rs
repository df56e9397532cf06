//! The per-layer assembly of a model's weights from named tensors, written once for GGUF and HF
//! checkpoints: the [`ModelConfig`]'s description says which tensors a layer has, [`Names`] how
//! each format spells them.

use indicatif::ProgressBar;
use tandem_kernels::Matrix;

use super::{GatedMlp, LayerWeights, LlamaWeights, MlpWeights, MoeWeights, SharedExpert};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::spec::MlpKind;

/// Source-independent access to named tensors, so the per-layer assembly is written once.
pub(super) trait TensorSource {
    /// A 2-D weight with `rows` output features of `cols` inputs, validated against the expected shape.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError>;
    /// `n` stacked 2-D weights of `rows` × `cols` (one 3-D tensor, the outermost dimension `n`), as one
    /// matrix of `n * rows` rows.
    fn stacked(&self, name: &str, n: usize, rows: usize, cols: usize)
        -> Result<Matrix, ModelError>;
    /// A 1-D f32 vector (norm weight or bias) of length `len`.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError>;
    /// Whether a tensor exists.
    fn has(&self, name: &str) -> bool;

    /// A weight row of `len` stored either as a vector or as a 1 × `len` matrix (HF's shared-expert gate).
    fn row(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        match self.vector(name, len) {
            Err(ModelError::Shape { .. }) => {
                let m = self.matrix(name, 1, len)?;
                let mut out = vec![0.0; len];
                m.dequantize_row(0, &mut out);
                Ok(out)
            }
            other => other,
        }
    }
}

/// Reads a norm weight by name and length, applying the checkpoint's norm convention.
type NormReader<'a> = dyn Fn(&str, usize) -> Result<Vec<f32>, ModelError> + 'a;

/// Which spelling of the tensor names a checkpoint uses: GGUF's or HF's.
#[derive(Clone, Copy)]
pub(super) enum Names {
    Gguf,
    Hf,
}

/// Every tensor the loader reads, as (the loader's name for it, GGUF spelling, HF spelling); the
/// layer tensors (from `attn_norm` on) are spelled after their layer's prefix. HF's
/// `post_attention_layernorm` is the pre-MLP norm of Llama-style blocks and the post-attention norm of
/// sandwich-norm blocks (whose pre-MLP norm is `pre_feedforward_layernorm`): [`Names::get`] picks.
const TENSOR_NAMES: [(&str, &str, &str); 24] = [
    ("embed", "token_embd.weight", "model.embed_tokens.weight"),
    ("norm", "output_norm.weight", "model.norm.weight"),
    ("head", "output.weight", "lm_head.weight"),
    ("attn_norm", "attn_norm.weight", "input_layernorm.weight"),
    ("q", "attn_q.weight", "self_attn.q_proj.weight"),
    ("k", "attn_k.weight", "self_attn.k_proj.weight"),
    ("v", "attn_v.weight", "self_attn.v_proj.weight"),
    ("o", "attn_output.weight", "self_attn.o_proj.weight"),
    ("bq", "attn_q.bias", "self_attn.q_proj.bias"),
    ("bk", "attn_k.bias", "self_attn.k_proj.bias"),
    ("bv", "attn_v.bias", "self_attn.v_proj.bias"),
    ("q_norm", "attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("k_norm", "attn_k_norm.weight", "self_attn.k_norm.weight"),
    (
        "post_attn_norm",
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    (
        "ffn_norm",
        "ffn_norm.weight",
        "post_attention_layernorm.weight",
    ),
    (
        "sandwich_ffn_norm",
        "ffn_norm.weight",
        "pre_feedforward_layernorm.weight",
    ),
    (
        "post_ffn_norm",
        "post_ffw_norm.weight",
        "post_feedforward_layernorm.weight",
    ),
    ("gate", "ffn_gate.weight", "mlp.gate_proj.weight"),
    ("up", "ffn_up.weight", "mlp.up_proj.weight"),
    ("down", "ffn_down.weight", "mlp.down_proj.weight"),
    ("router", "ffn_gate_inp.weight", "mlp.gate.weight"),
    (
        "shexp_gate",
        "ffn_gate_shexp.weight",
        "mlp.shared_expert.gate_proj.weight",
    ),
    (
        "shexp_up",
        "ffn_up_shexp.weight",
        "mlp.shared_expert.up_proj.weight",
    ),
    (
        "shexp_down",
        "ffn_down_shexp.weight",
        "mlp.shared_expert.down_proj.weight",
    ),
];

/// GGUF stacks the routed experts' projections (gate, up, down) in one 3-D tensor each; HF names each
/// expert's (`mlp.experts.{e}.{gate,up,down}_proj.weight`).
const GGUF_EXPERTS: [&str; 3] = [
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
];

/// The shared expert's gate row; GGUF stores it as a vector, HF as a 1 × hidden matrix.
const SHARED_GATE: (&str, &str) = ("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight");

/// HF checkpoints of these families store RMSNorm weights as `w` for a norm that scales by `1 + w`;
/// llama.cpp's converter stores `1 + w`, which is what the forward multiplies by.
const HF_NORM_PLUS_ONE: [&str; 1] = ["gemma3"];

impl Names {
    /// This format's name of tensor `part` (a first column of [`TENSOR_NAMES`]).
    pub(super) fn get(self, part: &str) -> &'static str {
        match TENSOR_NAMES.iter().find(|t| t.0 == part) {
            Some(&(_, gguf, hf)) => match self {
                Names::Gguf => gguf,
                Names::Hf => hf,
            },
            None => unreachable!("unknown tensor {part}"),
        }
    }

    /// This format's name of layer `l`'s tensor `part`.
    pub(super) fn layer(self, l: usize, part: &str) -> String {
        format!("{}.{}", self.prefix(l), self.get(part))
    }

    fn prefix(self, l: usize) -> String {
        match self {
            Names::Gguf => format!("blk.{l}"),
            Names::Hf => format!("model.layers.{l}"),
        }
    }
}

/// Reads every tensor the configuration's description calls for, checking each one's shape.
pub(super) fn assemble(
    src: &dyn TensorSource,
    names: Names,
    c: &ModelConfig,
    pb: &ProgressBar,
) -> Result<LlamaWeights, ModelError> {
    let h = c.hidden_size;
    let plus_one =
        matches!(names, Names::Hf) && HF_NORM_PLUS_ONE.contains(&c.architecture.as_str());
    let norm = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
        let mut w = src.vector(name, len)?;
        if plus_one {
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        pb.inc(1);
        Ok(w)
    };
    let embed = src.matrix(names.get("embed"), c.vocab_size, h)?;
    pb.inc(1);
    let layers = (0..c.num_layers)
        .map(|l| assemble_layer(src, names, c, l, &norm, pb))
        .collect::<Result<Vec<_>, _>>()?;
    let final_norm = norm(names.get("norm"), h)?;
    let lm_head = if c.tie_word_embeddings && !src.has(names.get("head")) {
        None
    } else {
        let m = src.matrix(names.get("head"), c.vocab_size, h)?;
        pb.inc(1);
        Some(m)
    };
    Ok(LlamaWeights {
        embed,
        layers,
        norm: final_norm,
        lm_head,
    })
}

fn assemble_layer(
    src: &dyn TensorSource,
    names: Names,
    c: &ModelConfig,
    l: usize,
    norm: &NormReader<'_>,
    pb: &ProgressBar,
) -> Result<LayerWeights, ModelError> {
    let (h, q, kv, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
    let n = |p: &str| names.layer(l, p);
    let matrix = |p: &str, rows: usize, cols: usize| {
        let m = src.matrix(&n(p), rows, cols);
        pb.inc(1);
        m
    };
    let bias = |p: &str, len: usize| -> Result<Option<Vec<f32>>, ModelError> {
        if c.attention_bias {
            pb.inc(1);
            src.vector(&n(p), len).map(Some)
        } else {
            Ok(None)
        }
    };
    let optional_norm =
        |present: bool, p: &str, len: usize| present.then(|| norm(&n(p), len)).transpose();
    let ffn_norm_name = if c.sandwich_norms {
        "sandwich_ffn_norm"
    } else {
        "ffn_norm"
    };
    Ok(LayerWeights {
        attn_norm: norm(&n("attn_norm"), h)?,
        wq: matrix("q", q, h)?,
        wk: matrix("k", kv, h)?,
        wv: matrix("v", kv, h)?,
        wo: matrix("o", h, q)?,
        bq: bias("bq", q)?,
        bk: bias("bk", kv)?,
        bv: bias("bv", kv)?,
        q_norm: optional_norm(c.qk_norm, "q_norm", hd)?,
        k_norm: optional_norm(c.qk_norm, "k_norm", hd)?,
        post_attn_norm: optional_norm(c.sandwich_norms, "post_attn_norm", h)?,
        ffn_norm: norm(&n(ffn_norm_name), h)?,
        mlp: match c.layer(l).mlp {
            MlpKind::Dense => MlpWeights::Dense(GatedMlp {
                gate: matrix("gate", c.intermediate_size, h)?,
                up: matrix("up", c.intermediate_size, h)?,
                down: matrix("down", h, c.intermediate_size)?,
            }),
            MlpKind::Moe => MlpWeights::Moe(assemble_moe(src, names, c, l, pb)?),
        },
        post_ffn_norm: optional_norm(c.sandwich_norms, "post_ffn_norm", h)?,
    })
}

fn assemble_moe(
    src: &dyn TensorSource,
    names: Names,
    c: &ModelConfig,
    l: usize,
    pb: &ProgressBar,
) -> Result<MoeWeights, ModelError> {
    let m = c.moe.as_ref().ok_or_else(|| {
        ModelError::Config(format!("layer {l} is a mixture of experts without experts"))
    })?;
    let (h, e, f) = (c.hidden_size, m.num_experts, m.expert_ffn);
    let n = |p: &str| names.layer(l, p);
    let router = src.matrix(&n("router"), e, h)?;
    pb.inc(1);
    let experts = match names {
        Names::Hf => (0..e)
            .map(|x| {
                let p = |proj: &str| format!("{}.mlp.experts.{x}.{proj}.weight", names.prefix(l));
                let mlp = GatedMlp {
                    gate: src.matrix(&p("gate_proj"), f, h)?,
                    up: src.matrix(&p("up_proj"), f, h)?,
                    down: src.matrix(&p("down_proj"), h, f)?,
                };
                pb.inc(3);
                Ok(mlp)
            })
            .collect::<Result<Vec<_>, ModelError>>()?,
        Names::Gguf => {
            let [g, u, d] = GGUF_EXPERTS.map(|t| format!("{}.{t}", names.prefix(l)));
            let gate = src.stacked(&g, e, f, h)?;
            let up = src.stacked(&u, e, f, h)?;
            let down = src.stacked(&d, e, h, f)?;
            pb.inc(3);
            (0..e)
                .map(|x| GatedMlp {
                    gate: gate.slice_rows(x * f..(x + 1) * f),
                    up: up.slice_rows(x * f..(x + 1) * f),
                    down: down.slice_rows(x * h..(x + 1) * h),
                })
                .collect()
        }
    };
    let shared = match m.shared_ffn {
        None => None,
        Some(fs) => {
            let gate_name = match names {
                Names::Gguf => SHARED_GATE.0,
                Names::Hf => SHARED_GATE.1,
            };
            let s = SharedExpert {
                mlp: GatedMlp {
                    gate: src.matrix(&n("shexp_gate"), fs, h)?,
                    up: src.matrix(&n("shexp_up"), fs, h)?,
                    down: src.matrix(&n("shexp_down"), h, fs)?,
                },
                gate: src.row(&format!("{}.{gate_name}", names.prefix(l)), h)?,
            };
            pb.inc(4);
            Some(s)
        }
    };
    Ok(MoeWeights {
        router,
        experts,
        expert_ids: (0..e).collect(),
        shared,
    })
}
