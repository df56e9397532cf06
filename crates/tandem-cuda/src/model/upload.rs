//! Weight upload: host weights converted to bf16, or random weights generated on the device.

use std::sync::Arc;

use cudarc::driver::{result as drv_result, CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use tandem_kernels::Matrix;
use tandem_model::{MlpKind, MlpWeights, ModelConfig, MoeWeights};

use super::launch::Funcs;
use super::moe::MoeBufs;
use super::{widths, FfnBufs, LayerBufs, WFormat, Weight, WeightSource, FP8_BLOCK};
use crate::error::CudaError;
use crate::memory::{bf16_bits, DeviceBuf, BF16};

/// The uploaded weights of a layer range: the bf16 embedding (when the range starts the model or its
/// last layer reads it as the tied head), the layers, the final norm and the output head (only with
/// the last layer; `None` there: the bf16 embedding is the tied head).
pub(super) type Weights = (Option<DeviceBuf>, Vec<LayerBufs>, DeviceBuf, Option<Weight>);

/// Weight upload helpers (host conversion to bf16, or generation on the device).
pub(super) struct Uploader<'a> {
    pub(super) ctx: &'a Arc<CudaContext>,
    pub(super) stream: &'a Arc<CudaStream>,
    pub(super) funcs: &'a Funcs,
    pub(super) seed: u64,
    /// Quantize the layers' projection matrices to FP8 (`CudaOptions::fp8_weights`).
    pub(super) fp8: bool,
    /// Keep GGUF block-quantized matrices packed (`CudaOptions::gguf_packed`; never with `fp8`).
    pub(super) packed: bool,
}

impl Uploader<'_> {
    pub(super) fn upload<T>(&self, data: &[T]) -> Result<DeviceBuf, CudaError> {
        let buf = DeviceBuf::new(self.ctx, std::mem::size_of_val(data))?;
        // SAFETY: buf holds exactly data's bytes; the stream is synchronised before data is dropped.
        unsafe { drv_result::memcpy_htod_async(buf.ptr, data, self.stream.cu_stream()) }?;
        self.stream.synchronize()?;
        Ok(buf)
    }

    pub(super) fn vector(&self, v: &[f32]) -> Result<DeviceBuf, CudaError> {
        let bits: Vec<u16> = v.iter().map(|&x| bf16_bits(x)).collect();
        self.upload(&bits)
    }

    /// Row-concatenates matrices (same column count) into one bf16 device matrix.
    pub(super) fn matrices(&self, ms: &[&Matrix]) -> Result<DeviceBuf, CudaError> {
        self.upload(&Self::matrix_bits(ms))
    }

    /// A projection: matrices (same column count) row-concatenated, in the upload's format.
    fn weight(&self, ms: &[&Matrix]) -> Result<Weight, CudaError> {
        if let Some(w) = self.packed(ms)? {
            return Ok(w);
        }
        let rows = ms.iter().map(|m| m.rows()).sum();
        self.finish(self.matrices(ms)?, rows, ms[0].cols())
    }

    /// The output head: packed like the layers' projections when it is a GGUF block-quantized
    /// matrix, else bf16 (never FP8: the logits keep the checkpoint's precision).
    fn head(&self, m: &Matrix) -> Result<Weight, CudaError> {
        match self.packed(&[m])? {
            Some(w) => Ok(w),
            None => Ok(Weight::bf16(self.matrices(&[m])?, m.rows(), m.cols())),
        }
    }

    /// Matrices (same column count) row-concatenated in a packed GGUF format (`crate::packed`), when
    /// the upload keeps them packed and every one of them is block-quantized; `None` otherwise.
    fn packed(&self, ms: &[&Matrix]) -> Result<Option<Weight>, CudaError> {
        let Some(format) = crate::packed::format_of(ms).filter(|_| self.packed) else {
            return Ok(None);
        };
        let p = crate::packed::pack(ms, format);
        Ok(Some(Weight {
            buf: self.upload(&p.codes)?,
            format: WFormat::from(format),
            scales: Some(self.upload(&p.params)?),
            lt_scales: None,
            rows: p.rows,
            cols: p.cols,
        }))
    }

    /// A random projection of `rows` × `cols` (see [`Self::random`]), in the upload's format.
    fn random_weight(&mut self, rows: usize, cols: usize, scale: f32) -> Result<Weight, CudaError> {
        let buf = self.random(rows * cols, scale)?;
        self.finish(buf, rows, cols)
    }

    /// `bf16` as a [`Weight`]: kept, or with `fp8` quantized on the device (`quant_fp8`: E4M3 codes,
    /// one scale per row and 128 columns) and the bf16 copy freed.
    fn finish(&self, bf16: DeviceBuf, rows: usize, cols: usize) -> Result<Weight, CudaError> {
        if !self.fp8 {
            return Ok(Weight::bf16(bf16, rows, cols));
        }
        let kb = cols.div_ceil(FP8_BLOCK);
        let codes = DeviceBuf::new(self.ctx, rows * cols)?;
        let scales = DeviceBuf::new(self.ctx, rows * kb * 4)?;
        // One warp per (row, group), eight warps a block.
        launch!(
            self.stream,
            self.funcs.quant_fp8,
            ((rows * kb).div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            bf16.ptr,
            codes.ptr,
            scales.ptr,
            rows as i32,
            cols as i32
        );
        // The bf16 copy is freed only after the kernel has read it.
        self.stream.synchronize()?;
        drop(bf16);
        Ok(Weight {
            buf: codes,
            format: WFormat::Fp8,
            scales: Some(scales),
            lt_scales: None,
            rows,
            cols,
        })
    }

    /// The bf16 bits of matrices (same column count) concatenated by rows.
    fn matrix_bits(ms: &[&Matrix]) -> Vec<u16> {
        let cols = ms[0].cols();
        let rows: usize = ms.iter().map(|m| m.rows()).sum();
        let mut bits: Vec<u16> = Vec::with_capacity(rows * cols);
        let mut row = vec![0f32; cols];
        for m in ms {
            debug_assert_eq!(m.cols(), cols);
            if m.dtype() == tandem_kernels::DType::BF16 {
                bits.extend(
                    m.bytes()
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]])),
                );
            } else {
                for r in 0..m.rows() {
                    m.dequantize_row(r, &mut row);
                    bits.extend(row.iter().map(|&x| bf16_bits(x)));
                }
            }
        }
        bits
    }

    /// A mixture of experts' weights: the router with the shared expert's gate row after it, every
    /// expert's [gate; up] rows and down projections stacked expert after expert.
    fn moe(&self, w: &MoeWeights) -> Result<MoeBufs, CudaError> {
        let mut router = Self::matrix_bits(&[&w.router]);
        if let Some(sh) = &w.shared {
            router.extend(sh.gate.iter().map(|&x| bf16_bits(x)));
        }
        let gate_up: Vec<&Matrix> = w.experts.iter().flat_map(|x| [&x.gate, &x.up]).collect();
        let down: Vec<&Matrix> = w.experts.iter().map(|x| &x.down).collect();
        Ok(MoeBufs {
            router: self.upload(&router)?,
            gate_up: self.matrices(&gate_up)?,
            down: self.matrices(&down)?,
            shared: match &w.shared {
                Some(sh) => Some((
                    self.matrices(&[&sh.mlp.gate, &sh.mlp.up])?,
                    self.matrices(&[&sh.mlp.down])?,
                )),
                None => None,
            },
        })
    }

    /// Random feed-forward weights of one layer of `c` (see [`Self::ffn_draws`]).
    fn random_ffn(&mut self, c: &ModelConfig, l: usize) -> Result<FfnBufs, CudaError> {
        let h = c.hidden_size;
        let hs = 1.0 / (h as f32).sqrt();
        Ok(match (c.layer(l).mlp, &c.moe) {
            (MlpKind::Moe, Some(m)) => {
                let (e, f) = (m.num_experts, m.expert_ffn);
                let width = e + usize::from(m.shared_ffn.is_some());
                FfnBufs::Moe(MoeBufs {
                    router: self.random(width * h, hs)?,
                    gate_up: self.random(e * 2 * f * h, hs)?,
                    down: self.random(e * h * f, 1.0 / (f as f32).sqrt())?,
                    shared: match m.shared_ffn {
                        Some(fs) => Some((
                            self.random(2 * fs * h, hs)?,
                            self.random(h * fs, 1.0 / (fs as f32).sqrt())?,
                        )),
                        None => None,
                    },
                })
            }
            _ => {
                let f = c.intermediate_size;
                FfnBufs::Dense {
                    gate_up: self.random_weight(2 * f, h, hs)?,
                    down: self.random_weight(h, f, 1.0 / (f as f32).sqrt())?,
                }
            }
        })
    }

    /// Generator draws of [`Self::random_ffn`] for layer `l` (a stage skips another stage's).
    fn ffn_draws(c: &ModelConfig, l: usize) -> usize {
        match (c.layer(l).mlp, &c.moe) {
            (MlpKind::Moe, Some(m)) => 3 + 2 * usize::from(m.shared_ffn.is_some()),
            _ => 2,
        }
    }

    pub(super) fn fill_random(
        &mut self,
        buf: &DeviceBuf,
        n: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let seed = self.seed;
        launch!(
            self.stream,
            self.funcs.init_uniform,
            (4096, 1, 1),
            (256, 1, 1),
            buf.ptr,
            n as u64,
            seed,
            scale
        );
        Ok(())
    }

    /// Advances the generator past one `random` call without making its buffer, so that a layer
    /// range's random weights are the whole model's weights for those layers.
    fn skip_random(&mut self) {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
    }

    pub(super) fn random(&mut self, n: usize, scale: f32) -> Result<DeviceBuf, CudaError> {
        let buf = DeviceBuf::new(self.ctx, n * BF16)?;
        self.fill_random(&buf, n, scale)?;
        Ok(buf)
    }

    pub(super) fn constant(&self, n: usize, value: f32) -> Result<DeviceBuf, CudaError> {
        let buf = DeviceBuf::new(self.ctx, n * BF16)?;
        launch!(
            self.stream,
            self.funcs.fill_bf16,
            (n.div_ceil(256).min(4096) as u32, 1, 1),
            (256, 1, 1),
            buf.ptr,
            n as u64,
            value
        );
        Ok(buf)
    }

    /// Uploads (or generates) the weights of global layers `range`: see [`Weights`].
    pub(super) fn weights(
        &mut self,
        weights: WeightSource<'_>,
        c: &ModelConfig,
        range: std::ops::Range<usize>,
    ) -> Result<Weights, CudaError> {
        let up = self;
        let (h, q, kv, _, v) = widths(c);
        let last = range.end == c.num_layers;
        let want_embed = range.start == 0 || (last && c.tie_word_embeddings);
        Ok(match weights {
            WeightSource::Host(w) => {
                // A tied head over a block-quantized embedding streams the packed codes (not the
                // bf16 copy the embedding gather reads).
                let lm_head = match (&w.lm_head, last) {
                    (Some(m), true) => Some(up.head(m)?),
                    (None, true) => up.packed(&[&w.embed])?,
                    _ => None,
                };
                let embed = if range.start == 0 || (last && lm_head.is_none()) {
                    Some(up.matrices(&[&w.embed])?)
                } else {
                    None
                };
                let mut layers = Vec::with_capacity(range.len());
                for lw in &w.layers[range.clone()] {
                    let bqkv = match (&lw.bq, &lw.bk, &lw.bv) {
                        (Some(a), Some(b), Some(cc)) => {
                            let all: Vec<f32> = a.iter().chain(b).chain(cc).copied().collect();
                            Some(up.vector(&all)?)
                        }
                        _ => None,
                    };
                    let ffn = match &lw.mlp {
                        MlpWeights::Dense(mlp) => FfnBufs::Dense {
                            gate_up: up.weight(&[&mlp.gate, &mlp.up])?,
                            down: up.weight(&[&mlp.down])?,
                        },
                        MlpWeights::Moe(mw) => FfnBufs::Moe(up.moe(mw)?),
                    };
                    let qk_norm = match (&lw.q_norm, &lw.k_norm) {
                        (Some(qn), Some(kn)) => Some((up.vector(qn)?, up.vector(kn)?)),
                        _ => None,
                    };
                    let optional =
                        |n: &Option<Vec<f32>>| n.as_deref().map(|n| up.vector(n)).transpose();
                    layers.push(LayerBufs {
                        attn_norm: up.vector(&lw.attn_norm)?,
                        wqkv: up.weight(&[&lw.wq, &lw.wk, &lw.wv])?,
                        bqkv,
                        qk_norm,
                        wo: up.weight(&[&lw.wo])?,
                        ffn_norm: up.vector(&lw.ffn_norm)?,
                        post_attn_norm: optional(&lw.post_attn_norm)?,
                        post_ffn_norm: optional(&lw.post_ffn_norm)?,
                        ffn,
                    });
                }
                let norm = up.vector(&w.norm)?;
                (embed, layers, norm, lm_head)
            }
            WeightSource::Random { seed } => {
                up.seed = seed;
                let embed = if want_embed {
                    Some(up.random(v * h, 1.0)?)
                } else {
                    up.skip_random();
                    None
                };
                let mut layers = Vec::with_capacity(range.len());
                for l in 0..c.num_layers {
                    if !range.contains(&l) {
                        // wqkv, the bias, wo and the MLP of a layer another stage holds.
                        for _ in 0..2 + usize::from(c.attention_bias) + Uploader::ffn_draws(c, l) {
                            up.skip_random();
                        }
                        continue;
                    }
                    layers.push(LayerBufs {
                        attn_norm: up.constant(h, 1.0)?,
                        wqkv: up.random_weight(q + 2 * kv, h, 1.0 / (h as f32).sqrt())?,
                        bqkv: if c.attention_bias {
                            Some(up.random(q + 2 * kv, 0.02)?)
                        } else {
                            None
                        },
                        // Constants draw nothing from the generator, so no stage skips them.
                        qk_norm: if c.qk_norm {
                            Some((up.constant(c.head_dim, 1.0)?, up.constant(c.head_dim, 1.0)?))
                        } else {
                            None
                        },
                        wo: up.random_weight(h, q, 1.0 / (q as f32).sqrt())?,
                        ffn_norm: up.constant(h, 1.0)?,
                        post_attn_norm: c
                            .sandwich_norms
                            .then(|| up.constant(h, 1.0))
                            .transpose()?,
                        post_ffn_norm: c.sandwich_norms.then(|| up.constant(h, 1.0)).transpose()?,
                        ffn: up.random_ffn(c, l)?,
                    });
                }
                let norm = up.constant(h, 1.0)?;
                let lm_head = if c.tie_word_embeddings || !last {
                    None
                } else {
                    Some(Weight::bf16(
                        up.random(v * h, 1.0 / (h as f32).sqrt())?,
                        v,
                        h,
                    ))
                };
                (embed, layers, norm, lm_head)
            }
        })
    }
}
