//! The weights of a model, loaded zero-copy from GGUF or from (sharded) safetensors; the names each
//! format gives them are in weights/names.rs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use tandem_kernels::{dequantize, DType, Matrix, WeightBytes};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::gguf::GgufFile;

mod assemble;
pub mod fp8;

use assemble::{assemble, Names, TensorSource};

/// The three projections of a gated MLP: `down(act(gate·x) ⊙ up·x)`.
#[derive(Clone, Debug)]
pub struct GatedMlp {
    /// Gate projection (ffn × hidden).
    pub gate: Matrix,
    /// Up projection (ffn × hidden).
    pub up: Matrix,
    /// Down projection (hidden × ffn).
    pub down: Matrix,
}

/// The shared expert of a Qwen2-MoE layer: a gated MLP every token passes through, scaled by
/// sigmoid(gate · x).
#[derive(Clone, Debug)]
pub struct SharedExpert {
    /// The expert's MLP.
    pub mlp: GatedMlp,
    /// Its gate's weight row (hidden).
    pub gate: Vec<f32>,
}

/// The weights of a mixture-of-experts MLP.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// Router (experts × hidden): one logit per expert.
    pub router: Matrix,
    /// The routed experts this partition holds, whole (never sliced), in increasing id: all of them,
    /// or under expert parallelism those its rank's [`crate::ExpertMap`] entry places there.
    pub experts: Vec<GatedMlp>,
    /// The expert id of each entry of `experts` (`0..num_experts` when it holds them all).
    pub expert_ids: Vec<usize>,
    /// The shared expert, if the model has one.
    pub shared: Option<SharedExpert>,
}

/// A layer's feed-forward weights, as its [`crate::spec::MlpKind`] says.
#[derive(Clone, Debug)]
pub enum MlpWeights {
    /// One gated MLP.
    Dense(GatedMlp),
    /// A mixture of experts.
    Moe(MoeWeights),
}

impl MlpWeights {
    /// The dense MLP, or `None` for a mixture of experts.
    pub fn dense(&self) -> Option<&GatedMlp> {
        match self {
            MlpWeights::Dense(m) => Some(m),
            MlpWeights::Moe(_) => None,
        }
    }
}

/// Weights of one transformer block.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection (q_dim × hidden).
    pub wq: Matrix,
    /// Key projection (kv_dim × hidden).
    pub wk: Matrix,
    /// Value projection (kv_dim × hidden).
    pub wv: Matrix,
    /// Attention output projection (hidden × q_dim).
    pub wo: Matrix,
    /// Query bias (Qwen2).
    pub bq: Option<Vec<f32>>,
    /// Key bias (Qwen2).
    pub bk: Option<Vec<f32>>,
    /// Value bias (Qwen2).
    pub bv: Option<Vec<f32>>,
    /// Per-head RMSNorm weight of the queries (head_dim; `qk_norm` models).
    pub q_norm: Option<Vec<f32>>,
    /// Per-head RMSNorm weight of the keys (head_dim; `qk_norm` models).
    pub k_norm: Option<Vec<f32>>,
    /// RMSNorm weight of the attention output before the residual add (`sandwich_norms` models).
    pub post_attn_norm: Option<Vec<f32>>,
    /// RMSNorm weight before the MLP.
    pub ffn_norm: Vec<f32>,
    /// The MLP.
    pub mlp: MlpWeights,
    /// RMSNorm weight of the MLP output before the residual add (`sandwich_norms` models).
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// All weights of a model in the layout the CPU forward pass consumes.
#[derive(Clone, Debug)]
pub struct LlamaWeights {
    /// Token embedding (vocab × hidden); also the output head when tied.
    pub embed: Matrix,
    /// The transformer blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight.
    pub norm: Vec<f32>,
    /// Output head (vocab × hidden); `None` when tied to `embed`.
    pub lm_head: Option<Matrix>,
}

impl LlamaWeights {
    /// The matrix that maps the final hidden state to logits.
    pub fn output_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Name, dtype and shape of one stored tensor: what the model identity hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// The tensor's name in the file.
    pub name: String,
    /// Its dtype as the file names it.
    pub dtype: String,
    /// Its shape as the file stores it.
    pub shape: Vec<usize>,
    /// The first bytes of its data, so that two fine-tunes of one architecture differ.
    pub head: Vec<u8>,
}

/// How many leading bytes of each tensor go into the identity.
const IDENTITY_SAMPLE: usize = 64;

fn progress_bar(enabled: bool, len: usize, what: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len as u64);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tensors") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb
}

impl TensorSource for GgufFile {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let t = self
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        // ggml shapes are innermost first: [cols, rows].
        let actual: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        if actual != [cols, rows] {
            return Err(ModelError::Shape {
                tensor: name.to_string(),
                expected: vec![cols, rows],
                actual,
            });
        }
        Ok(Matrix::new(t.dtype, rows, cols, self.tensor_bytes(t))?)
    }

    fn stacked(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, ModelError> {
        let t = self
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let actual: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        if actual != [cols, rows, n] {
            return Err(ModelError::Shape {
                tensor: name.to_string(),
                expected: vec![cols, rows, n],
                actual,
            });
        }
        Ok(Matrix::new(t.dtype, n * rows, cols, self.tensor_bytes(t))?)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let t = self
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let actual: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        if actual != [len] {
            return Err(ModelError::Shape {
                tensor: name.to_string(),
                expected: vec![len],
                actual,
            });
        }
        let mut out = vec![0.0; len];
        dequantize(t.dtype, self.tensor_bytes(t).as_slice(), &mut out);
        Ok(out)
    }

    fn has(&self, name: &str) -> bool {
        self.tensor(name).is_some()
    }
}

/// Loads the weights of a GGUF file (zero-copy for matrices; norms and biases decoded to f32).
pub fn load_gguf_weights(
    gguf: &GgufFile,
    config: &ModelConfig,
    progress: bool,
) -> Result<LlamaWeights, ModelError> {
    let pb = progress_bar(progress, gguf.tensor_names().len(), "loading GGUF weights");
    let w = assemble(gguf, Names::Gguf, config, &pb);
    pb.finish_and_clear();
    w
}

/// The (name, dtype, shape, head bytes) list of a GGUF file, in file order.
pub fn gguf_tensor_descs(gguf: &GgufFile) -> Vec<TensorDesc> {
    gguf.tensor_names()
        .iter()
        .filter_map(|n| gguf.tensor(n).map(|t| (n, t)))
        .map(|(name, t)| {
            let bytes = gguf.tensor_bytes(t);
            let s = bytes.as_slice();
            TensorDesc {
                name: name.clone(),
                dtype: format!("{:?}", t.dtype),
                shape: t.shape.iter().map(|&d| d as usize).collect(),
                head: s[..s.len().min(IDENTITY_SAMPLE)].to_vec(),
            }
        })
        .collect()
}

/// One tensor of a safetensors shard: where its bytes are and what they are.
struct StTensor {
    shard: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    range: std::ops::Range<usize>,
}

/// The tensors of a (possibly sharded) safetensors checkpoint, each shard memory-mapped.
pub struct SafetensorsSet {
    shards: Vec<(PathBuf, Arc<Mmap>)>,
    tensors: HashMap<String, StTensor>,
    /// How FP8 weights are scaled (from config.json's `quantization_config`); `None`: an FP8
    /// tensor is refused.
    fp8: Option<fp8::Fp8Scales>,
}

impl SafetensorsSet {
    /// Opens `model.safetensors`, or every shard listed by `model.safetensors.index.json`, in `dir`.
    pub fn open(dir: &Path) -> Result<SafetensorsSet, ModelError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Safetensors {
                    path: index.clone(),
                    message: e.to_string(),
                })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Safetensors {
                    path: index.clone(),
                    message: "no weight_map object".into(),
                })?;
            let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            return Err(ModelError::MissingTensor(format!(
                "no model.safetensors or model.safetensors.index.json in {}",
                dir.display()
            )));
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: read-only map; the checkpoint must not change while loaded.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let st_err = |e: safetensors::SafeTensorError| ModelError::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            };
            // deserialize() validates the header against the buffer (offsets inside the file, sizes consistent).
            SafeTensors::deserialize(&map).map_err(st_err)?;
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(st_err)?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                tensors.insert(
                    name,
                    StTensor {
                        shard: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        range: base + s..base + e,
                    },
                );
            }
            shards.push((path, Arc::new(map)));
        }
        Ok(SafetensorsSet {
            shards,
            tensors,
            fp8: None,
        })
    }

    /// The same set, reading its FP8 (E4M3) weights with `scales` (dequantized to bf16 at load).
    pub fn with_fp8(mut self, scales: Option<fp8::Fp8Scales>) -> SafetensorsSet {
        self.fp8 = scales;
        self
    }

    /// The FP8 weight `name` (`rows × cols`) dequantized to bf16 with its `_scale_inv` or `_scale`
    /// tensor.
    fn fp8_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let t = self.get(name)?;
        if t.shape != [rows, cols] {
            return Err(ModelError::Shape {
                tensor: name.to_string(),
                expected: vec![rows, cols],
                actual: t.shape.clone(),
            });
        }
        let scheme = self.fp8.ok_or_else(|| {
            ModelError::Config(format!(
                "tensor {name} is FP8 (F8_E4M3) but config.json has no quantization_config"
            ))
        })?;
        let scale_name = [format!("{name}_scale_inv"), format!("{name}_scale")]
            .into_iter()
            .find(|n| self.tensors.contains_key(n))
            .ok_or_else(|| {
                ModelError::MissingTensor(format!("{name}_scale_inv (or {name}_scale)"))
            })?;
        let st = self.get(&scale_name)?;
        let dtype = float_dtype(&scale_name, st.dtype)?;
        let mut scales = vec![0.0; st.shape.iter().product()];
        dequantize(dtype, self.bytes(st), &mut scales);
        let scale = fp8::ScaleTensor {
            name: &scale_name,
            values: &scales,
            shape: &st.shape,
        };
        let bits = fp8::dequantize_fp8(name, self.bytes(t), (rows, cols), scheme, scale)?;
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        Ok(Matrix::new(
            DType::BF16,
            rows,
            cols,
            WeightBytes::Owned(Arc::new(bytes)),
        )?)
    }

    /// A matrix over the tensor's bytes in its memory-mapped shard (no copy).
    fn mapped(
        &self,
        t: &StTensor,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, ModelError> {
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.shards[t.shard].1.clone();
        let range = t.range.clone();
        Ok(Matrix::new(
            dtype,
            rows,
            cols,
            WeightBytes::Shared { owner, range },
        )?)
    }

    fn bytes(&self, t: &StTensor) -> &[u8] {
        &self.shards[t.shard].1[t.range.clone()]
    }

    /// The (name, dtype, shape, head bytes) list, sorted by name (shard order is not meaningful).
    pub fn tensor_descs(&self) -> Vec<TensorDesc> {
        let mut v: Vec<TensorDesc> = self
            .tensors
            .iter()
            .map(|(name, t)| {
                let s = self.bytes(t);
                TensorDesc {
                    name: name.clone(),
                    dtype: t.dtype.to_string(),
                    shape: t.shape.clone(),
                    head: s[..s.len().min(IDENTITY_SAMPLE)].to_vec(),
                }
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    fn get(&self, name: &str) -> Result<&StTensor, ModelError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// The tensor `name` with its element type, checked to have exactly `shape` and a float dtype.
    fn checked(&self, name: &str, shape: &[usize]) -> Result<(&StTensor, DType), ModelError> {
        let t = self.get(name)?;
        if t.shape != shape {
            return Err(ModelError::Shape {
                tensor: name.to_string(),
                expected: shape.to_vec(),
                actual: t.shape.clone(),
            });
        }
        Ok((t, float_dtype(name, t.dtype)?))
    }
}

/// The kernels' element type of the float tensor `name` stored as `dtype` (others are refused).
fn float_dtype(name: &str, dtype: StDtype) -> Result<DType, ModelError> {
    match dtype {
        StDtype::F32 => Ok(DType::F32),
        StDtype::F16 => Ok(DType::F16),
        StDtype::BF16 => Ok(DType::BF16),
        other => Err(ModelError::UnsupportedDtype {
            tensor: name.to_string(),
            dtype: other.to_string(),
        }),
    }
}

impl TensorSource for SafetensorsSet {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        if self.get(name)?.dtype == StDtype::F8_E4M3 {
            return self.fp8_matrix(name, rows, cols);
        }
        let (t, dtype) = self.checked(name, &[rows, cols])?;
        self.mapped(t, dtype, rows, cols)
    }

    fn stacked(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, ModelError> {
        let (t, dtype) = self.checked(name, &[n, rows, cols])?;
        self.mapped(t, dtype, n * rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let (t, dtype) = self.checked(name, &[len])?;
        let mut out = vec![0.0; len];
        dequantize(dtype, self.bytes(t), &mut out);
        Ok(out)
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Loads the weights of an HF safetensors checkpoint (f16/bf16/f32 matrices kept as stored).
pub fn load_safetensors_weights(
    set: &SafetensorsSet,
    config: &ModelConfig,
    progress: bool,
) -> Result<LlamaWeights, ModelError> {
    let pb = progress_bar(progress, set.tensors.len(), "loading safetensors weights");
    let w = assemble(set, Names::Hf, config, &pb);
    pb.finish_and_clear();
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap as Map;

    fn tiny_config() -> ModelConfig {
        ModelConfig {
            tie_word_embeddings: true,
            ..ModelConfig::dense(crate::config::DenseShape {
                hidden: 4,
                ffn: 8,
                layers: 1,
                heads: 2,
                kv_heads: 1,
                head_dim: 2,
                vocab: 6,
                max_positions: 16,
                rope: crate::spec::LayerRope {
                    theta: 10000.0,
                    scaling: tandem_kernels::RopeScaling::None,
                },
            })
        }
    }

    /// Writes an HF-named safetensors checkpoint of `config` with bf16 matrices and f32 norms.
    fn write_checkpoint(dir: &Path, c: &ModelConfig, skip: Option<&str>) {
        let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let mut tensors: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let bf16 = |n: usize| -> Vec<u8> {
            (0..n)
                .flat_map(|i| half::bf16::from_f32(i as f32 * 0.01).to_le_bytes())
                .collect()
        };
        let f32v = |n: usize| -> Vec<u8> { (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect() };
        tensors.push((
            Names::Hf.get("embed").into(),
            StDtype::BF16,
            vec![c.vocab_size, h],
            bf16(c.vocab_size * h),
        ));
        tensors.push((Names::Hf.get("norm").into(), StDtype::F32, vec![h], f32v(h)));
        for (part, shape) in [
            ("q", [q, h]),
            ("k", [kv, h]),
            ("v", [kv, h]),
            ("o", [h, q]),
            ("gate", [f, h]),
            ("up", [f, h]),
            ("down", [h, f]),
        ] {
            tensors.push((
                Names::Hf.layer(0, part),
                StDtype::BF16,
                shape.to_vec(),
                bf16(shape[0] * shape[1]),
            ));
        }
        for part in ["attn_norm", "ffn_norm"] {
            tensors.push((Names::Hf.layer(0, part), StDtype::F32, vec![h], f32v(h)));
        }
        let views: Map<String, safetensors::tensor::TensorView> = tensors
            .iter()
            .filter(|t| Some(t.0.as_str()) != skip)
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(&views, None, &dir.join("model.safetensors")).unwrap();
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tandem-model-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn loads_bf16_safetensors_zero_copy() {
        let dir = temp_dir("st-ok");
        let c = tiny_config();
        write_checkpoint(&dir, &c, None);
        let set = SafetensorsSet::open(&dir).unwrap();
        let w = load_safetensors_weights(&set, &c, false).unwrap();
        assert_eq!(w.embed.dtype(), DType::BF16);
        assert!(w.lm_head.is_none());
        assert_eq!(w.layers[0].wq.rows(), 4);
        assert_eq!(w.layers[0].mlp.dense().unwrap().down.cols(), 8);
        assert_eq!(w.norm, vec![1.0; 4]);
        let mut row = vec![0.0; 4];
        w.embed.dequantize_row(1, &mut row);
        assert!((row[0] - 0.04).abs() < 1e-3, "{row:?}");
        assert_eq!(set.tensor_descs().len(), 11);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn missing_and_misshapen_tensors_are_named() {
        let dir = temp_dir("st-missing");
        let c = tiny_config();
        write_checkpoint(&dir, &c, Some("model.layers.0.mlp.up_proj.weight"));
        let set = SafetensorsSet::open(&dir).unwrap();
        match load_safetensors_weights(&set, &c, false) {
            Err(ModelError::MissingTensor(n)) => assert_eq!(n, "model.layers.0.mlp.up_proj.weight"),
            other => panic!("unexpected {:?}", other.map(|_| ())),
        }
        let mut wrong = c.clone();
        wrong.intermediate_size = 6;
        write_checkpoint(&dir, &c, None);
        let set = SafetensorsSet::open(&dir).unwrap();
        match load_safetensors_weights(&set, &wrong, false) {
            Err(ModelError::Shape { tensor, .. }) => {
                assert_eq!(tensor, "model.layers.0.mlp.gate_proj.weight")
            }
            other => panic!("unexpected {:?}", other.map(|_| ())),
        }
        std::fs::remove_dir_all(dir).ok();
    }
}
