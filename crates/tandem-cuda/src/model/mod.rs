//! The bf16 Llama forward pass on one GPU: weights and the paged KV cache in device memory, cuBLAS for
//! every projection, our NVRTC kernels for the rest, and CUDA graphs for decode-only steps.
//!
//! [`CudaLlama`] and its construction live here; its jobs live in the submodules: kernel loading and
//! launch helpers (`launch`), GEMV launch shapes (`gemv`), weight upload (`upload`), the forward pass
//! (`forward`), decode graphs (`graphs`), token choice on the device (`sample`) and KV block I/O
//! (`kv_io`).

// First: its launch macros are used by the modules after it.
#[macro_use]
mod launch;

mod forward;
mod fp8_gemm;
mod gemv;
mod graphs;
mod kv_io;
mod moe;
mod sample;
mod stage_io;
mod upload;

use std::sync::Arc;

use cudarc::cublas::sys as blas_sys;
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys as drv;
use cudarc::driver::{result as drv_result, CudaContext, CudaStream};
use tandem_kernels::RopeTable;
use tandem_model::{KvDtype, KvLayout, LlamaWeights, MlpWeights, ModelConfig};

use crate::error::CudaError;
use crate::kernels::{self, KernelShape, DECODE_PARTITION, SMALL_DECODE_BATCH};
use crate::memory::{DeviceBuf, PinnedBuf, BF16, STAGING_CHUNK};
use crate::options::{AttnMode, CudaOptions};
use crate::packed::PackedFormat;
use crate::plan::{MetaLayout, PlanLimits, Region, StepPlan, REGIONS};

use forward::NORM_CHUNKS;
use graphs::{Graphs, GRAPH_SIZES};
use launch::Funcs;
pub use sample::SampleRow;
use sample::SAMPLE_ROW_WORDS;
use upload::Uploader;

/// Where the weights come from.
pub enum WeightSource<'a> {
    /// Weights loaded on the host (safetensors or GGUF), converted to bf16 on upload.
    Host(&'a LlamaWeights),
    /// Uniform random bf16 weights generated on the device (speed runs; no file behind them).
    Random {
        /// Seed of the generator.
        seed: u64,
    },
}

/// How a projection matrix is held on the device; the GEMV kernels have a family for each (the order
/// of `kernels::GEMV_FORMAT_FAMILIES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WFormat {
    /// bf16 rows.
    Bf16 = 0,
    /// FP8 E4M3 codes with one fp32 scale per row and 128 columns.
    Fp8 = 1,
    /// GGUF weights packed with 4-bit codes (`crate::packed`).
    Q4 = 2,
    /// GGUF weights packed with 8-bit codes (`crate::packed`).
    Q8 = 3,
}

impl WFormat {
    /// The packed GGUF layout of this format (`None`: bf16 or FP8).
    fn packed(self) -> Option<PackedFormat> {
        match self {
            WFormat::Q4 => Some(PackedFormat::Q4),
            WFormat::Q8 => Some(PackedFormat::Q8),
            WFormat::Bf16 | WFormat::Fp8 => None,
        }
    }
}

impl From<PackedFormat> for WFormat {
    fn from(p: PackedFormat) -> WFormat {
        match p {
            PackedFormat::Q4 => WFormat::Q4,
            PackedFormat::Q8 => WFormat::Q8,
        }
    }
}

/// A projection matrix on the device: bf16 rows, FP8 E4M3 codes with one fp32 scale per row and
/// 128 columns (`CudaOptions::fp8_weights`), or a GGUF matrix's packed codes with one (scale, min)
/// pair per 16-byte chunk (`CudaOptions::gguf_packed`): decode's GEMVs read the stored format,
/// larger steps take a bf16 copy or the FP8 tensor-core GEMMs.
struct Weight {
    buf: DeviceBuf,
    format: WFormat,
    /// The FP8 scales, `rows` × `cols.div_ceil(128)`, or the packed formats' (scale, min) pairs,
    /// row by row (`None`: bf16).
    scales: Option<DeviceBuf>,
    /// The same scales group by group (the rows of one 128-column group next to each other): the
    /// outer-dimension-major order of cuBLASLt's VEC128 scales, made when the FP8 GEMMs run.
    lt_scales: Option<DeviceBuf>,
    rows: usize,
    cols: usize,
}

impl Weight {
    /// The scales' pointer for the GEMV kernels (0 for bf16, whose kernels ignore it).
    fn scale_ptr(&self) -> u64 {
        self.scales.as_ref().map_or(0, |s| s.ptr)
    }

    /// The scales in the order the FP8 GEMMs read.
    fn lt_scale_ptr(&self) -> u64 {
        self.lt_scales.as_ref().map_or(self.scale_ptr(), |s| s.ptr)
    }

    /// A bf16 matrix.
    fn bf16(buf: DeviceBuf, rows: usize, cols: usize) -> Weight {
        Weight {
            buf,
            format: WFormat::Bf16,
            scales: None,
            lt_scales: None,
            rows,
            cols,
        }
    }

    /// f32 scale values a row (the kernels' `kb`): FP8 scale groups, or twice the packed chunks.
    fn kb(&self) -> i32 {
        self.format
            .packed()
            .map_or(self.cols.div_ceil(FP8_BLOCK), |p| p.row_params(self.cols)) as i32
    }

    /// Bytes a step that streams the matrix once reads (codes or bf16, and the scales).
    fn bytes(&self) -> usize {
        self.buf.bytes + self.scales.as_ref().map_or(0, |s| s.bytes)
    }
}

/// Columns of one FP8 scale group (and rows and columns of a block-scaled checkpoint's blocks).
const FP8_BLOCK: usize = 128;

impl Weight {
    /// Adds the scales ordered group by group (`lt_scales`, for the FP8 GEMMs): transposed through
    /// the host, once at load.
    fn order_scales_by_groups(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), CudaError> {
        let (Some(sc), WFormat::Fp8) = (&self.scales, self.format) else {
            return Ok(());
        };
        let (rows, kb) = (self.rows, self.cols.div_ceil(FP8_BLOCK));
        let mut host = vec![0f32; rows * kb];
        // SAFETY: sc holds rows × kb f32; the copy completes before the synchronize returns.
        unsafe { drv_result::memcpy_dtoh_async(&mut host, sc.ptr, stream.cu_stream()) }?;
        stream.synchronize()?;
        let by_groups: Vec<f32> = (0..rows * kb)
            .map(|i| host[(i % rows) * kb + i / rows])
            .collect();
        let buf = DeviceBuf::new(ctx, by_groups.len() * 4)?;
        // SAFETY: buf holds exactly these values; synchronised before they drop.
        unsafe { drv_result::memcpy_htod_async(buf.ptr, &by_groups, stream.cu_stream()) }?;
        stream.synchronize()?;
        self.lt_scales = Some(buf);
        Ok(())
    }
}

impl LayerBufs {
    /// The layer's projection matrices (the dense ones: MoE experts are bf16).
    fn weights(&self) -> Vec<&Weight> {
        let mut v = vec![&self.wqkv, &self.wo];
        if let FfnBufs::Dense { gate_up, down } = &self.ffn {
            v.extend([gate_up, down]);
        }
        v
    }

    /// Calls `f` on each of the layer's projection matrices (the dense ones: MoE experts are bf16).
    fn for_each_weight(
        &mut self,
        mut f: impl FnMut(&mut Weight) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        f(&mut self.wqkv)?;
        f(&mut self.wo)?;
        if let FfnBufs::Dense { gate_up, down } = &mut self.ffn {
            f(gate_up)?;
            f(down)?;
        }
        Ok(())
    }
}

/// One layer's device weights.
struct LayerBufs {
    attn_norm: DeviceBuf,
    /// [q; k; v] rows fused into one matrix: one GEMM per layer for the three projections.
    wqkv: Weight,
    bqkv: Option<DeviceBuf>,
    /// Per-head q and k norm weights (Qwen3), applied between the projection and RoPE.
    qk_norm: Option<(DeviceBuf, DeviceBuf)>,
    wo: Weight,
    ffn_norm: DeviceBuf,
    /// Gemma's norms of the attention and MLP outputs before their residual adds.
    post_attn_norm: Option<DeviceBuf>,
    post_ffn_norm: Option<DeviceBuf>,
    ffn: FfnBufs,
}

/// A layer's feed-forward weights, as its `LayerSpec::mlp` says.
enum FfnBufs {
    /// One gated MLP: [gate; up] rows fused, and down.
    Dense { gate_up: Weight, down: Weight },
    /// A mixture of experts.
    Moe(moe::MoeBufs),
}

/// Activation buffers, sized once for the largest step.
struct Acts {
    x: DeviceBuf,
    xn: DeviceBuf,
    qkv: DeviceBuf,
    attn: DeviceBuf,
    delta: DeviceBuf,
    gu: DeviceBuf,
    act: DeviceBuf,
    head_in: DeviceBuf,
    logits: DeviceBuf,
    argmax: DeviceBuf,
    /// Per-row draw parameters of `sample_rows` (`SAMPLE_ROW_WORDS` u32 per row).
    sample_params: DeviceBuf,
    /// Guided rows' allowed-token masks for `mask_rows` (a vocabulary's bits per row), and per
    /// logits row the index of its mask or -1.
    mask_bits: DeviceBuf,
    mask_rows: DeviceBuf,
    part_m: DeviceBuf,
    part_l: DeviceBuf,
    part_o: DeviceBuf,
    /// Finished decode partitions per (sequence, kv head); zero between launches.
    dec_done: DeviceBuf,
    meta: DeviceBuf,
    /// Routing and grouped-expert buffers (mixture-of-experts models only).
    moe: Option<moe::MoeActs>,
    /// bf16 copy of one FP8 or packed GGUF matrix for the cuBLAS steps (the largest such matrix's
    /// size; empty when every matrix is bf16).
    wtile: DeviceBuf,
    /// A step's activations as E4M3 codes and their per-token group scales (FP8 GEMMs only).
    aq: DeviceBuf,
    aq_scales: DeviceBuf,
    _blas_workspace: DeviceBuf,
}

/// The Llama-family model on one GPU with its paged bf16 KV cache.
pub struct CudaLlama {
    config: ModelConfig,
    opts: CudaOptions,
    shape: KernelShape,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: Funcs,
    /// FP8 tensor-core GEMMs (`CudaOptions::fp8_gemm` with FP8 weights, when the load-time check
    /// passed).
    fp8_gemm: Option<fp8_gemm::Fp8Gemm>,
    /// The token embedding: absent on a pipeline stage that neither embeds nor reads a tied head.
    embed: Option<DeviceBuf>,
    /// Global index of `layers[0]` (0 unless this is a later pipeline stage).
    first_layer: usize,
    layers: Vec<LayerBufs>,
    norm: DeviceBuf,
    /// The output head (only with the last layer; `None` there: the bf16 embedding is the tied head).
    lm_head: Option<Weight>,
    /// Cos and sin tables of each distinct rope of the model (Gemma 3: local and global layers).
    ropes: Vec<(DeviceBuf, DeviceBuf)>,
    /// Index into `ropes` of each of this instance's layers.
    layer_rope: Vec<usize>,
    kv: DeviceBuf,
    layout: KvLayout,
    acts: Acts,
    meta_layout: MetaLayout,
    plan: StepPlan,
    max_model_len: usize,
    /// Capacity of the decode partial-result buffers, in (sequence, head, partition) entries.
    part_slots: usize,
    graphs: Graphs,
    staging: PinnedBuf,
    /// Host scratch of the token choice: ids copied back, and the draw parameters uploaded (reused,
    /// so a step allocates nothing).
    pick_ids: Vec<i32>,
    pick_words: Vec<u32>,
    pick_mask_rows: Vec<i32>,
    /// Page-locked staging of a pipeline stage's residual stream, in or out (`max_tokens` rows);
    /// only on an instance that does not hold the whole model.
    hidden_pinned: Option<PinnedBuf>,
    /// Host scratch of a last stage's logits before they become bytes.
    stage_logits: Vec<f32>,
    /// Page-locked staging of one KV block for export/import (the P/D transfer's host side); a
    /// mutex because export takes `&self`.
    kv_staging: std::sync::Mutex<PinnedBuf>,
    /// Bulk P/D KV export/import on a transfer stream of its own.
    mover: crate::kv_bulk::KvMover,
    device_name: String,
    /// Blocks of each GEMV kernel (`[family][rows - 1]`) the GPU holds at once: the grid of a
    /// persistent launch.
    gemv_caps: gemv::GemvCaps,
    /// Multiprocessors of the device (sizes the looping decode-attention grid of captured graphs).
    sms: usize,
    /// Host time of the last `forward_greedy` from its start until the body's kernels were queued
    /// (benchmarks: tells host-side stalls from GPU time).
    last_enqueue: std::time::Duration,
}

impl std::fmt::Debug for CudaLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLlama")
            .field("device", &self.device_name)
            .field("layout", &self.layout)
            .field("attn", &self.opts.attn)
            .finish_non_exhaustive()
    }
}

/// The model's widths: hidden, query, key/value, FFN and vocabulary.
fn widths(c: &ModelConfig) -> (usize, usize, usize, usize, usize) {
    (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.vocab_size,
    )
}

/// Elements of the largest matrix among `layers` and the head that is not bf16 (0 when every matrix
/// is): the size of the bf16 tile the cuBLAS steps dequantize into.
fn largest_tile(layers: &[LayerBufs], head: Option<&Weight>) -> usize {
    layers
        .iter()
        .flat_map(LayerBufs::weights)
        .chain(head)
        .filter(|w| w.format != WFormat::Bf16)
        .map(|w| w.rows * w.cols)
        .max()
        .unwrap_or(0)
}

/// Refuses, at load and naming the feature, a model structure the CUDA kernels do not compute yet.
fn check_structure(c: &ModelConfig) -> Result<(), CudaError> {
    let refused = [
        (
            c.qk_norm && c.attention_bias,
            "per-head query/key norms (qk_norm) after q/k/v biases",
        ),
        (
            c.has_moe() && (c.sandwich_norms || c.activation != tandem_model::Activation::Silu),
            "mixture-of-experts layers with post-block norms or a non-SiLU activation",
        ),
    ];
    match refused.iter().find(|r| r.0) {
        Some((_, what)) => Err(CudaError::Unsupported(format!(
            "{} on CUDA: the {} model has {what}; serve it with --device cpu",
            c.architecture, c.architecture
        ))),
        None => Ok(()),
    }
}

/// The weight formats (`KernelShape::formats` bits, `WFormat` order) the upload can produce: FP8
/// when asked for; the packed GGUF formats when kept packed and any projection or head matrix of the
/// host weights is block-quantized (both formats, as mixed GGUF files use 4- and 8-bit codes). The
/// kernels are compiled before the upload decides each fused matrix's format, so this must cover
/// every matrix the upload may pack: a format it packs without compiled GEMVs has no kernels.
fn weight_formats(weights: &WeightSource<'_>, opts: &CudaOptions) -> u8 {
    let mut formats = 1 << WFormat::Bf16 as u8;
    if opts.fp8_weights {
        formats |= 1 << WFormat::Fp8 as u8;
    } else if opts.gguf_packed {
        if let WeightSource::Host(w) = weights {
            let quantized = |m: &&tandem_kernels::Matrix| crate::packed::format_of(&[m]).is_some();
            let dense = w.layers.iter().flat_map(|l| {
                let mut ms = vec![&l.wq, &l.wk, &l.wv, &l.wo];
                if let MlpWeights::Dense(mlp) = &l.mlp {
                    ms.extend([&mlp.gate, &mlp.up, &mlp.down]);
                }
                ms
            });
            if dense
                .chain([&w.embed])
                .chain(&w.lm_head)
                .any(|m| quantized(&m))
            {
                formats |= (1 << WFormat::Q4 as u8) | (1 << WFormat::Q8 as u8);
            }
        }
    }
    formats
}

/// Whether a CUDA driver can be loaded on this machine (tests and `--device cuda` check this first).
pub fn driver_available() -> bool {
    // SAFETY: only probes for the shared library; no symbol is called.
    unsafe { drv::is_culib_present() }
}

impl CudaLlama {
    /// Loads the model onto the GPU: compiles the kernels, uploads (or generates) the weights,
    /// allocates the KV cache and every activation buffer.
    pub fn new(
        config: ModelConfig,
        weights: WeightSource<'_>,
        mut opts: CudaOptions,
    ) -> Result<CudaLlama, CudaError> {
        config.validate()?;
        if !driver_available() {
            return Err(CudaError::Unavailable(
                "libcuda.so.1, the NVIDIA driver's library, could not be loaded: this host has no NVIDIA \
                 driver (in a container, start it with the NVIDIA Container Toolkit, e.g. `docker run --gpus all`), \
                 or serve with --device cpu"
                    .into(),
            ));
        }
        if !kernels::nvrtc_available() {
            return Err(CudaError::Unavailable(
                "libnvrtc could not be loaded (add its folder to LD_LIBRARY_PATH)".into(),
            ));
        }
        // SAFETY: only probes for the shared library.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "libcublas could not be loaded (add its folder to LD_LIBRARY_PATH)".into(),
            ));
        }
        if !config.intermediate_size.is_multiple_of(8)
            || !config.hidden_size.is_multiple_of(8)
            || config.hidden_size > 8 * NORM_CHUNKS * 1024
        {
            return Err(CudaError::Unsupported(format!(
                "hidden {} / intermediate {} (the kernels need multiples of 8, hidden at most {})",
                config.hidden_size,
                config.intermediate_size,
                8 * NORM_CHUNKS * 1024
            )));
        }
        check_structure(&config)?;
        moe::check(&config)?;
        if opts.fp8_weights
            && !(config.hidden_size.is_multiple_of(16)
                && config.intermediate_size.is_multiple_of(16)
                && config.q_dim().is_multiple_of(16))
        {
            return Err(CudaError::Unsupported(format!(
                "FP8 weights need hidden ({}), intermediate ({}) and attention ({}) widths that are \
                 multiples of 16; serve this model in bf16",
                config.hidden_size,
                config.intermediate_size,
                config.q_dim()
            )));
        }
        if opts.max_tokens > 65535 {
            return Err(CudaError::Unsupported(
                "more than 65535 tokens per step".into(),
            ));
        }
        let shape = KernelShape {
            head_dim: config.head_dim,
            gqa: config.num_heads / config.num_kv_heads,
            block_size: opts.block_size,
            formats: weight_formats(&weights, &opts),
            kv_fp8: match opts.kv_dtype {
                KvDtype::Bf16 => false,
                KvDtype::Fp8E4m3 => true,
                KvDtype::F32 => {
                    return Err(CudaError::Unsupported(
                        "an f32 KV cache (the CUDA backend holds bf16 or fp8)".into(),
                    ))
                }
            },
        };
        shape.validate()?;
        if !shape.tensor_core_prefill() && opts.attn == AttnMode::Fast {
            tracing::warn!(
                head_dim = config.head_dim,
                "head_dim above 128: prompt steps use the reference attention kernel"
            );
        }
        let ctx = CudaContext::new(opts.device)?;
        // We order all work on one stream ourselves; cudarc's per-buffer events would only add calls.
        // SAFETY: every buffer here is used from this one stream.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        let device_name = ctx.name()?;
        let t0 = std::time::Instant::now();
        let ptx = kernels::compile_cached(
            &shape,
            &opts.gemv_tuning,
            major,
            minor,
            opts.kernel_cache_dir.as_deref(),
        )?;
        let module = ctx.load_module(ptx)?;
        let funcs = Funcs::load(&module, shape.formats)?;
        funcs.allow_norm_smem(config.hidden_size)?;
        let sms = ctx
            .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as usize;
        let gemv_caps = funcs.gemv_caps(sms as u32, config.hidden_size)?;
        funcs.attn_prefill.set_attribute(
            drv::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            kernels::prefill_smem_bytes(config.head_dim) as i32,
        )?;
        tracing::info!(device = %device_name, sm = format!("{major}.{minor}"), compile_ms = t0.elapsed().as_millis() as u64, "CUDA kernels compiled");
        let blas = CudaBlas::new(stream.clone())?;

        let c = &config;
        let (h, q, kv, f, v) = widths(c);
        let max_model_len = opts
            .max_model_len
            .unwrap_or(c.max_position_embeddings)
            .min(c.max_position_embeddings);
        let max_tokens = opts.max_tokens.max(1);
        let max_seqs = opts.max_seqs.max(1);

        // Weights.
        let mut up = Uploader {
            ctx: &ctx,
            stream: &stream,
            funcs: &funcs,
            seed: 0,
            fp8: opts.fp8_weights,
            packed: opts.gguf_packed && !opts.fp8_weights,
        };
        let range = opts.layers.clone().unwrap_or(0..c.num_layers);
        if range.is_empty() || range.end > c.num_layers {
            return Err(CudaError::Unsupported(format!(
                "layers {range:?} of a {}-layer model",
                c.num_layers
            )));
        }
        let (embed, mut layers, norm, lm_head) = up.weights(weights, c, range.clone())?;
        let packed = |w: &Weight| matches!(w.format, WFormat::Q4 | WFormat::Q8);
        if layers.iter().flat_map(LayerBufs::weights).any(packed) {
            opts.gemv_max_rows = opts.packed_gemv_max_rows;
        }
        let fp8_gemm = if opts.fp8_weights && opts.fp8_gemm {
            fp8_gemm::Fp8Gemm::new(&ctx, &stream)?
        } else {
            None
        };
        if fp8_gemm
            .as_ref()
            .is_some_and(|g| g.weight_order == fp8_gemm::ScaleOrder::GroupMajor)
        {
            for l in &mut layers {
                l.for_each_weight(|w| w.order_scales_by_groups(&ctx, &stream))?;
            }
        }

        // RoPE tables: one per distinct rope among this instance's layers.
        let (distinct, layer_rope) = c.distinct_ropes(range.clone());
        let ropes = distinct
            .iter()
            .map(|r| {
                let t =
                    RopeTable::new(c.head_dim, r.theta, &r.scaling, max_model_len, c.rope_style);
                Ok((up.upload(t.cos())?, up.upload(t.sin())?))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;

        // KV cache: one extra block at the end is the scratch target of padded graph rows.
        let mut layout =
            KvLayout::for_budget(c, opts.block_size, opts.kv_cache_memory, opts.kv_dtype);
        layout.num_blocks = opts.num_blocks.unwrap_or(layout.num_blocks);
        // Only this instance's layers hold KV here.
        layout.n_layers = range.len();
        let num_blocks = layout.num_blocks;
        if num_blocks == 0 {
            return Err(CudaError::Unsupported(format!(
                "a KV budget of {} bytes holds no block",
                opts.kv_cache_memory
            )));
        }
        let kv_buf = DeviceBuf::new(
            &ctx,
            layout.n_layers * (num_blocks + 1) * layout.block_bytes(),
        )?;
        // Random, not zero, so that timing runs over unwritten slots read real-looking data (FP8: one
        // code, 0.5 — random bytes would hold NaN codes).
        if layout.dtype == KvDtype::Fp8E4m3 {
            // SAFETY: kv_buf is a live allocation of exactly this many bytes on this context.
            unsafe {
                drv_result::memset_d8_async(kv_buf.ptr, 0x30, kv_buf.bytes, stream.cu_stream())
            }?;
        } else {
            up.fill_random(&kv_buf, kv_buf.bytes / BF16, 1.0)?;
        }

        // Activations.
        let rows = opts.logits_chunk_rows.max(1);
        let part_slots = c.num_heads
            * (max_seqs * max_model_len.div_ceil(DECODE_PARTITION)).max(
                max_seqs.min(SMALL_DECODE_BATCH)
                    * max_model_len
                        .div_ceil(kernels::decode_partition(1, opts.decode_partition_small)),
            );
        let bufsz = |elems: usize, size: usize| DeviceBuf::new(&ctx, elems * size);
        let meta_layout = MetaLayout::new(
            max_tokens,
            max_seqs,
            max_model_len.div_ceil(opts.block_size),
        );
        let acts = Acts {
            x: bufsz(max_tokens * h, BF16)?,
            xn: bufsz(max_tokens * h, BF16)?,
            qkv: bufsz(max_tokens * (q + 2 * kv), BF16)?,
            attn: bufsz(max_tokens * q, BF16)?,
            delta: bufsz(max_tokens * h, BF16)?,
            gu: bufsz(max_tokens * 2 * f, BF16)?,
            act: bufsz(max_tokens * f, BF16)?,
            head_in: bufsz(rows * h, BF16)?,
            logits: bufsz(rows * v, 4)?,
            argmax: bufsz(rows, 4)?,
            sample_params: bufsz(rows * SAMPLE_ROW_WORDS, 4)?,
            mask_bits: bufsz(rows * v.div_ceil(32), 4)?,
            mask_rows: bufsz(rows, 4)?,
            part_m: bufsz(part_slots, 4)?,
            part_l: bufsz(part_slots, 4)?,
            part_o: bufsz(part_slots * c.head_dim, 4)?,
            dec_done: bufsz(max_seqs.max(GRAPH_SIZES[0]) * c.num_kv_heads, 4)?,
            meta: bufsz(meta_layout.total(), 4)?,
            moe: moe::MoeActs::new(&ctx, c, range.len(), max_tokens)?,
            wtile: bufsz(largest_tile(&layers, lm_head.as_ref()), BF16)?,
            aq: bufsz(
                if fp8_gemm.is_some() {
                    max_tokens * h.max(q).max(f)
                } else {
                    0
                },
                1,
            )?,
            aq_scales: bufsz(
                if fp8_gemm.is_some() {
                    max_tokens * h.max(q).max(f).div_ceil(FP8_BLOCK)
                } else {
                    0
                },
                4,
            )?,
            _blas_workspace: bufsz(64 << 20, 1)?,
        };
        // An explicit workspace keeps cuBLAS from allocating inside graph capture.
        // SAFETY: the workspace outlives the handle's use (both live in self).
        let ws = unsafe {
            blas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                acts._blas_workspace.ptr as *mut std::ffi::c_void,
                acts._blas_workspace.bytes,
            )
        };
        if ws != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(CudaError::Blas(cudarc::cublas::result::CublasError(ws)));
        }
        // SAFETY: dec_done is a live allocation of exactly this many bytes on this context.
        unsafe {
            drv_result::memset_d8_async(
                acts.dec_done.ptr,
                0,
                acts.dec_done.bytes,
                stream.cu_stream(),
            )
        }?;
        let staging = PinnedBuf::new(&ctx, 2 * STAGING_CHUNK)?;
        let mover = crate::kv_bulk::KvMover::new(
            &ctx,
            &module,
            &layout,
            max_model_len.div_ceil(opts.block_size).min(num_blocks),
        )?;
        let kv_staging =
            std::sync::Mutex::new(PinnedBuf::new(&ctx, layout.block_bytes().div_ceil(4))?);
        let hidden_pinned = if range == (0..c.num_layers) {
            None
        } else {
            Some(PinnedBuf::new(&ctx, (max_tokens * h * BF16).div_ceil(4))?)
        };
        stream.synchronize()?;
        let (free, total) = ctx.mem_get_info()?;
        tracing::info!(
            num_blocks,
            block_size = opts.block_size,
            free_mib = free >> 20,
            total_mib = total >> 20,
            "CUDA model ready"
        );
        Ok(CudaLlama {
            config,
            opts,
            shape,
            ctx,
            stream,
            blas,
            funcs,
            fp8_gemm,
            embed,
            first_layer: range.start,
            layers,
            norm,
            lm_head,
            ropes,
            layer_rope,
            kv: kv_buf,
            layout,
            acts,
            meta_layout,
            plan: StepPlan::default(),
            max_model_len,
            part_slots,
            graphs: Graphs::default(),
            staging,
            pick_ids: Vec::new(),
            pick_words: Vec::new(),
            pick_mask_rows: Vec::new(),
            hidden_pinned,
            stage_logits: Vec::new(),
            kv_staging,
            mover,
            device_name,
            gemv_caps,
            sms,
            last_enqueue: std::time::Duration::ZERO,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The KV cache's shape.
    pub fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    /// Global layers this instance computes (all of them unless it is a pipeline stage).
    pub fn layers(&self) -> std::ops::Range<usize> {
        self.first_layer..self.first_layer + self.layers.len()
    }

    /// Whether this instance embeds tokens (it holds layer 0); otherwise it takes hidden states.
    pub fn is_first(&self) -> bool {
        self.first_layer == 0
    }

    /// Whether this instance produces logits (it holds the last layer); otherwise hidden states.
    pub fn is_last(&self) -> bool {
        self.first_layer + self.layers.len() == self.config.num_layers
    }

    /// The longest context this instance serves.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// Whether FP8 matrices in large steps run on FP8 tensor-core GEMMs (asked for, and the load-time
    /// check passed) rather than on bf16 tiles.
    pub fn fp8_tensor_cores(&self) -> bool {
        self.fp8_gemm.is_some()
    }

    /// The GPU's name, as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Blocks the CPU until the GPU has finished all queued work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize()?;
        Ok(())
    }

    /// Host time the last `forward_greedy` took to queue the model body (benchmarks: a value close
    /// to the step time means the host, not the GPU, paced the step).
    pub fn last_enqueue_time(&self) -> std::time::Duration {
        self.last_enqueue
    }

    /// Bytes of weights a decode step of `batch` tokens reads once: every matrix, the norms, the
    /// output head (the embedding is only gathered); of a mixture of experts, the router, the shared
    /// expert and the routed experts the batch is expected to use (`top_k` at batch 1; for more tokens
    /// the expected count of distinct experts under uniform routing).
    pub fn weight_bytes_per_step(&self, batch: usize) -> usize {
        let c = &self.config;
        let (h, _, _, _, v) = widths(c);
        let per_layer: usize = self
            .layers
            .iter()
            .zip(self.layers())
            .map(|(lw, l)| {
                let attn = lw.wqkv.bytes() + lw.wo.bytes() + 2 * h * BF16;
                match (&lw.ffn, c.layer(l).mlp, &c.moe) {
                    (_, tandem_model::MlpKind::Moe, Some(m)) => {
                        let e = m.num_experts as f64;
                        let used = e * (1.0 - (1.0 - m.top_k as f64 / e).powi(batch.max(1) as i32));
                        let shared = m.shared_ffn.map_or(0, |fs| 3 * fs * h + h);
                        attn + (m.num_experts * h
                            + shared
                            + (used.round() as usize) * 3 * m.expert_ffn * h)
                            * BF16
                    }
                    (FfnBufs::Dense { gate_up, down }, _, _) => {
                        attn + gate_up.bytes() + down.bytes()
                    }
                    (FfnBufs::Moe(_), _, _) => attn,
                }
            })
            .sum();
        let head = match &self.lm_head {
            Some(w) => w.bytes(),
            None => v * h * BF16,
        };
        per_layer + h * BF16 + head
    }

    /// How the projection matrices (and the head) are held: `bf16`, `fp8`, or a GGUF file's packed
    /// blocks (`gguf-q4`, `gguf-q8`, `gguf-q4+q8`).
    pub fn weight_format(&self) -> &'static str {
        let mut has = [false; 4];
        for w in self.layers.iter().flat_map(LayerBufs::weights) {
            has[w.format as usize] = true;
        }
        match has {
            [_, true, _, _] => "fp8",
            [_, _, true, true] => "gguf-q4+q8",
            [_, _, true, false] => "gguf-q4",
            [_, _, false, true] => "gguf-q8",
            _ => "bf16",
        }
    }

    fn limits(&self) -> PlanLimits {
        PlanLimits {
            block_size: self.layout.block_size,
            num_blocks: self.layout.num_blocks,
            vocab_size: self.config.vocab_size,
            max_positions: self.max_model_len,
        }
    }

    fn meta(&self, r: Region) -> u64 {
        self.acts.meta.at(self.meta_layout.offset(r), 4)
    }

    fn upload_plan(&self) -> Result<(), CudaError> {
        for r in REGIONS {
            let data = self.plan.region(r);
            if !data.is_empty() {
                // SAFETY: the region was checked to fit; the host slice outlives the synchronous
                // pageable copy (cuMemcpyHtoDAsync from pageable memory returns once staged).
                unsafe {
                    drv_result::memcpy_htod_async(self.meta(r), data, self.stream.cu_stream())
                }?;
            }
        }
        Ok(())
    }

    /// Turns the small-batch GEMV kernel on or off (off: cuBLAS for every projection).
    pub fn set_gemv(&mut self, on: bool) {
        if self.opts.gemv != on {
            // Captured graphs embed the old choice.
            self.graphs.0.clear();
        }
        self.opts.gemv = on;
    }

    /// Turns decode-step graphs on or off (graphs already captured are kept for later).
    pub fn set_graphs(&mut self, on: bool) {
        self.opts.graphs = on;
    }

    /// The kernel shape this instance was compiled for.
    pub fn kernel_shape(&self) -> KernelShape {
        self.shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_model::{Activation, AttentionSpan, DenseShape, LayerRope, MlpKind, MoeSpec};

    fn dense() -> ModelConfig {
        ModelConfig::dense(DenseShape {
            hidden: 64,
            ffn: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 32,
            max_positions: 64,
            rope: LayerRope {
                theta: 10_000.0,
                scaling: tandem_kernels::RopeScaling::None,
            },
        })
    }

    #[test]
    fn gemma_structure_loads_and_moe_with_gelu_is_refused_by_name() {
        let mut c = dense();
        c.sandwich_norms = true;
        c.qk_norm = true;
        c.activation = Activation::GeluTanh;
        c.embedding_scale = Some(8.0);
        c.final_logit_softcap = Some(30.0);
        c.attn_scale = 0.1;
        c.layers[0].attention = AttentionSpan::Window(8);
        c.layers[0].rope.theta = 1e6;
        check_structure(&c).expect("every Gemma 3 feature runs on CUDA");

        for l in &mut c.layers {
            l.mlp = MlpKind::Moe;
        }
        c.moe = Some(MoeSpec {
            num_experts: 4,
            top_k: 2,
            norm_top_k: true,
            expert_ffn: 32,
            shared_ffn: None,
        });
        let err = check_structure(&c).unwrap_err().to_string();
        assert!(err.contains("non-SiLU activation"), "{err}");

        c.sandwich_norms = false;
        c.activation = Activation::Silu;
        c.attention_bias = true;
        let err = check_structure(&c).unwrap_err().to_string();
        assert!(err.contains("qk_norm"), "{err}");
    }
}
