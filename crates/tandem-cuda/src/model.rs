//! The bf16 Llama forward pass on one GPU: weights and the paged KV cache in device memory, cuBLAS for
//! every projection, our NVRTC kernels for the rest, and CUDA graphs for decode-only steps.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::sys as blas_sys;
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys as drv;
use cudarc::driver::{
    result as drv_result, CudaContext, CudaFunction, CudaGraph, CudaModule, CudaStream,
    LaunchConfig, PushKernelArg,
};
use tandem_kernels::{Matrix, RopeTable};
use tandem_model::{ForwardBatch, KvDtype, KvLayout, LlamaWeights, ModelConfig};

use crate::error::CudaError;
use crate::kernels::{
    self, KernelShape, DECODE_PARTITION, DECODE_PARTITION_SMALL, SMALL_DECODE_BATCH,
};
use crate::plan::{MetaLayout, PlanLimits, Region, StepPlan, REGIONS};

/// Which attention kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnMode {
    /// Tensor-core flash attention for prefill chunks, split-K flash decoding for single tokens.
    Fast,
    /// The one-warp-per-(token, head) reference kernel for everything: the on-device check.
    Simple,
}

/// Sizes of the preallocated buffers and of the KV cache.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Bytes of KV cache across all layers.
    pub kv_cache_bytes: usize,
    /// Most tokens in one step (the activation buffers are sized for it).
    pub max_tokens: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Longest context; `None` = the model's.
    pub max_model_len: Option<usize>,
    /// Rows of logits computed per output-head GEMM (more rows are done in chunks).
    pub logits_chunk_rows: usize,
    /// Attention kernels.
    pub attn: AttnMode,
    /// Capture CUDA graphs for decode-only steps.
    pub graphs: bool,
    /// Use our GEMV kernels instead of cuBLAS for projections of at most `gemv_max_rows` rows.
    pub gemv: bool,
    /// Most rows (tokens of a step) our GEMV kernels take (at most `GEMV_MAX_ROWS`); larger
    /// steps use cuBLAS, which is faster there ([`GEMV_ROWS_DEFAULT`]).
    pub gemv_max_rows: usize,
    /// Programmatic dependent launch for our kernels that support it (Hopper and later): the next
    /// kernel starts streaming its weights while the previous one finishes. Off by default: on the
    /// H200 it made a batch-1 decode step slower (4.96 against 4.84 ms, 2026-12-03).
    pub pdl: bool,
    /// Keys per decode-attention partition in steps of at most `SMALL_DECODE_BATCH` sequences (at
    /// most `DECODE_PARTITION_SMALL`): shorter partitions put more blocks to work on a short batch.
    pub decode_partition_small: usize,
    /// Warps a small-batch GEMV launch aims for through split-K ([`GEMV_TARGET_WARPS`] by default).
    pub gemv_target_warps: usize,
    /// Compile-time tuning of the GEMV kernels.
    pub gemv_tuning: kernels::GemvTuning,
    /// Persistent GEMV launches: a grid of the blocks the GPU holds at once, each streaming group
    /// after group of rows, instead of one block per group.
    pub gemv_persistent: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device: 0,
            block_size: 16,
            kv_cache_bytes: 4 << 30,
            max_tokens: 2048,
            max_seqs: 256,
            max_model_len: None,
            logits_chunk_rows: 256,
            attn: AttnMode::Fast,
            graphs: true,
            gemv: true,
            gemv_max_rows: GEMV_ROWS_DEFAULT,
            pdl: false,
            decode_partition_small: DECODE_PARTITION_SMALL,
            gemv_target_warps: GEMV_TARGET_WARPS,
            gemv_tuning: kernels::GemvTuning::default(),
            gemv_persistent: false,
        }
    }
}

impl CudaOptions {
    /// Applies `TANDEM_CUDA_ATTN=simple`, `TANDEM_CUDA_GRAPHS=0`, `TANDEM_CUDA_GEMV=0`,
    /// `TANDEM_CUDA_PDL=0|1`, `TANDEM_CUDA_DEC_PART=<keys>`, `TANDEM_CUDA_GEMV_WARPS=<warps>`,
    /// `TANDEM_CUDA_GV_U=<chunks>`, `TANDEM_CUDA_GV_MINB=<blocks>`, `TANDEM_CUDA_GEMV_PERSIST=0|1`
    /// and `TANDEM_CUDA_GEMV_ROWS=<rows>` from the environment (on-device checks and A/B timings).
    pub fn with_env_overrides(mut self) -> Self {
        if std::env::var("TANDEM_CUDA_ATTN").is_ok_and(|v| v == "simple") {
            self.attn = AttnMode::Simple;
        }
        if std::env::var("TANDEM_CUDA_GRAPHS").is_ok_and(|v| v == "0") {
            self.graphs = false;
        }
        if std::env::var("TANDEM_CUDA_GEMV").is_ok_and(|v| v == "0") {
            self.gemv = false;
        }
        if let Ok(v) = std::env::var("TANDEM_CUDA_PDL") {
            self.pdl = v == "1";
        }
        if let Some(n) = std::env::var("TANDEM_CUDA_DEC_PART")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            self.decode_partition_small = n;
        }
        let number = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
        if let Some(n) = number("TANDEM_CUDA_GEMV_WARPS") {
            self.gemv_target_warps = n;
        }
        if let Some(n) = number("TANDEM_CUDA_GV_U") {
            self.gemv_tuning.unroll = n;
        }
        if let Some(n) = number("TANDEM_CUDA_GV_MINB") {
            self.gemv_tuning.min_blocks = n;
        }
        if let Some(n) = number("TANDEM_CUDA_GEMV_ROWS") {
            self.gemv_max_rows = n;
        }
        if let Ok(v) = std::env::var("TANDEM_CUDA_GEMV_PERSIST") {
            self.gemv_persistent = v == "1";
        }
        self
    }
}

/// One logits row's draw on the device (the `SampleParams` of `sample_rows` in llama.cu): the
/// host sampler's temperature, top-k, top-p and min-p, and the seed of this one draw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRow {
    /// 0 (or below 1e-5): greedy.
    pub temperature: f32,
    /// 1.0: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// 0: off.
    pub top_k: u32,
    /// The draw's random seed (the request's generator at this output index).
    pub seed: u64,
}

/// 32-bit words of one `SampleRow` on the device (24 bytes, the C struct's layout).
const SAMPLE_ROW_WORDS: usize = 6;

impl SampleRow {
    /// The C struct's words: three floats, an int, a little-endian u64.
    fn words(&self) -> [u32; SAMPLE_ROW_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.top_k.min(i32::MAX as u32),
            self.seed as u32,
            (self.seed >> 32) as u32,
        ]
    }
}

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

/// An owned device allocation, freed on drop.
struct DeviceBuf {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl DeviceBuf {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceBuf, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain cuMemAlloc of a non-zero size in the bound context.
        let ptr = unsafe { drv_result::malloc_sync(bytes.max(16)) }?;
        Ok(DeviceBuf {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// Device address `elems` elements of `size` bytes into the buffer.
    fn at(&self, elems: usize, size: usize) -> u64 {
        debug_assert!(elems * size <= self.bytes);
        self.ptr + (elems * size) as u64
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from cuMemAlloc in this context and is freed once.
            if let Err(e) = unsafe { drv_result::free_sync(self.ptr) } {
                tracing::warn!(error = %e, "cuMemFree failed");
            }
        }
    }
}

/// Page-locked host memory for staging logits: device-to-host copies into pageable memory go
/// through the driver's own small staging buffer at a fraction of the bus speed.
struct PinnedBuf {
    ctx: Arc<CudaContext>,
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by one model, which is moved between threads but
// never shared.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedBuf, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: cuMemHostAlloc of len floats, no flags (cached, readable by the CPU at full speed).
        let ptr = unsafe { drv_result::malloc_host(len * 4, 0) }? as *mut f32;
        Ok(PinnedBuf {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    fn slice_mut(&mut self, start: usize, n: usize) -> &mut [f32] {
        assert!(start + n <= self.len);
        // SAFETY: in bounds of the allocation; &mut self makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }

    fn slice(&self, start: usize, n: usize) -> &[f32] {
        assert!(start + n <= self.len);
        // SAFETY: in bounds of the allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.add(start), n) }
    }

    /// The first `n` bytes, writable.
    fn bytes_mut(&mut self, n: usize) -> &mut [u8] {
        assert!(n <= self.len * 4);
        // SAFETY: in bounds of the allocation; &mut self makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, n) }
    }

    /// The first `n` bytes.
    fn bytes(&self, n: usize) -> &[u8] {
        assert!(n <= self.len * 4);
        // SAFETY: in bounds of the allocation.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, n) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc and freed once.
            if let Err(e) = unsafe { drv_result::free_host(self.ptr as *mut std::ffi::c_void) } {
                tracing::warn!(error = %e, "cuMemFreeHost failed");
            }
        }
    }
}

/// Floats per slot of the logits staging buffer (two slots: copy one while the other fills).
const STAGING_CHUNK: usize = 2 << 20;

/// One layer's device weights.
struct LayerBufs {
    attn_norm: DeviceBuf,
    /// [q; k; v] rows fused into one matrix: one GEMM per layer for the three projections.
    wqkv: DeviceBuf,
    bqkv: Option<DeviceBuf>,
    wo: DeviceBuf,
    ffn_norm: DeviceBuf,
    /// [gate; up] rows fused.
    w_gate_up: DeviceBuf,
    w_down: DeviceBuf,
}

/// The loaded kernel functions.
struct Funcs {
    init_uniform: CudaFunction,
    fill_bf16: CudaFunction,
    embed_gather: CudaFunction,
    add_rmsnorm: CudaFunction,
    gather_rows: CudaFunction,
    silu_mul: CudaFunction,
    rope_kv_write: CudaFunction,
    argmax_rows: CudaFunction,
    sample_rows: CudaFunction,
    attn_simple: CudaFunction,
    attn_prefill: CudaFunction,
    attn_decode: CudaFunction,
    attn_decode_small: CudaFunction,
    /// `gemv[m - 1]` computes m rows.
    gemv: Vec<CudaFunction>,
    /// GEMV adding into the residual stream (`gemv_add_m`).
    gemv_add: Vec<CudaFunction>,
    /// RMSNorm + gate/up GEMV + SiLU·mul (`gemv_silu_m`).
    gemv_silu: Vec<CudaFunction>,
    /// RMSNorm + QKV GEMV + bias + RoPE + K/V write (`gemv_qkv_m`).
    gemv_qkv: Vec<CudaFunction>,
}

impl Funcs {
    fn load(module: &Arc<CudaModule>) -> Result<Funcs, CudaError> {
        let f = |n: &str| module.load_function(n);
        let gemv_family = |prefix: &str| {
            (1..=kernels::GEMV_MAX_ROWS)
                .map(|m| f(&format!("{prefix}{m}")))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Funcs {
            init_uniform: f("init_uniform")?,
            fill_bf16: f("fill_bf16")?,
            embed_gather: f("embed_gather")?,
            add_rmsnorm: f("add_rmsnorm")?,
            gather_rows: f("gather_rows")?,
            silu_mul: f("silu_mul")?,
            rope_kv_write: f("rope_kv_write")?,
            argmax_rows: f("argmax_rows")?,
            sample_rows: f("sample_rows")?,
            attn_simple: f("attn_simple")?,
            attn_prefill: f("attn_prefill")?,
            attn_decode: f("attn_decode")?,
            attn_decode_small: f("attn_decode_small")?,
            gemv: gemv_family(kernels::GEMV_FAMILIES[0])?,
            gemv_add: gemv_family(kernels::GEMV_FAMILIES[1])?,
            gemv_silu: gemv_family(kernels::GEMV_FAMILIES[2])?,
            gemv_qkv: gemv_family(kernels::GEMV_FAMILIES[3])?,
        })
    }

    /// Lets the fused-norm GEMVs of m rows take m × `hidden` bf16 values of dynamic shared memory
    /// (above the default 48 KiB for m × hidden > 24,576).
    fn allow_norm_smem(&self, hidden: usize) -> Result<(), CudaError> {
        for (i, (silu, qkv)) in self.gemv_silu.iter().zip(&self.gemv_qkv).enumerate() {
            let bytes = fused_smem_bytes(i + 1, hidden);
            if bytes <= FUSED_SMEM_MAX {
                for func in [silu, qkv] {
                    func.set_attribute(
                        drv::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )?;
                }
            }
        }
        Ok(())
    }
}

impl Funcs {
    /// Blocks of each GEMV kernel one GPU runs at once (multiprocessors × blocks per
    /// multiprocessor at the kernel's registers and shared memory).
    fn gemv_caps(
        &self,
        ctx: &Arc<CudaContext>,
        hidden: usize,
    ) -> Result<[[u32; kernels::GEMV_MAX_ROWS]; 4], CudaError> {
        let sms = ctx
            .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as u32;
        let mut caps = [[1u32; kernels::GEMV_MAX_ROWS]; 4];
        for (fam, funcs) in [&self.gemv, &self.gemv_add, &self.gemv_silu, &self.gemv_qkv]
            .into_iter()
            .enumerate()
        {
            for (i, f) in funcs.iter().enumerate() {
                let smem = if fam >= 2 {
                    fused_smem_bytes(i + 1, hidden)
                } else {
                    0
                };
                let per_sm = if smem <= FUSED_SMEM_MAX {
                    f.occupancy_max_active_blocks_per_multiprocessor(
                        32 * GEMV_WARPS as u32,
                        smem,
                        None,
                    )?
                } else {
                    1
                };
                caps[fam][i] = (sms * per_sm).max(1);
            }
        }
        Ok(caps)
    }
}

/// Dynamic shared memory of a fused-norm GEMV over `m` rows of `hidden` bf16 values.
fn fused_smem_bytes(m: usize, hidden: usize) -> usize {
    m * hidden * BF16
}

/// Most dynamic shared memory a fused-norm GEMV block asks for (Hopper allows 227 KiB per block;
/// beyond this a step falls back to the unfused kernels).
const FUSED_SMEM_MAX: usize = 160 << 10;

/// Warps per block of the GEMV kernels (`GV_WARPS` in llama.cu); each warp owns two weight rows.
const GEMV_WARPS: usize = 8;

/// 16-byte chunks of a row each thread of `add_rmsnorm` holds (`NORM_CHUNKS` in llama.cu).
const NORM_CHUNKS: usize = 2;

/// The GEMV kernel families (the order of `kernels::GEMV_FAMILIES`).
#[derive(Clone, Copy)]
enum GemvFamily {
    Plain,
    Add,
    Silu,
    Qkv,
}

/// Block-groups of a GEMV launch with one warp per work item.
fn gemv_blocks(warps: usize) -> u32 {
    warps.div_ceil(GEMV_WARPS) as u32
}

/// Steps of up to this many tokens use our GEMV kernels by default. Measured on the H200
/// (2026-12-03 14:43, 8B shape, graphs, step ms GEMV / cuBLAS): 1 row 4.37 / 4.88, 2 rows 5.05 /
/// 4.96, 4 rows 6.18 / 5.12, 8 rows 8.98 / 5.31 — past one row the kernels' per-row work outweighs
/// streaming the weights once.
pub const GEMV_ROWS_DEFAULT: usize = 1;

/// Warps a GEMV launch aims for through split-K: about the warps an H200 holds at once (16 per
/// multiprocessor at the GEMV's register use). Measured on the H200 (2026-12-03, batch-1 decode of
/// the 8B shape): 2,048 (no split for any of its projections) 4.53 ms per step, 8,192 4.68 ms,
/// 16,384 5.33 ms — more, shorter warps lose to the ramp of each wave.
pub const GEMV_TARGET_WARPS: usize = 2048;

/// K slices per row pair of a GEMV (split-K, a power of two dividing `GEMV_WARPS`): the fewest
/// that reach `target` warps (`CudaOptions::gemv_target_warps`), keeping slices at least 256 values
/// long.
fn gemv_split(pairs: usize, k: usize, target: usize) -> usize {
    let mut ks = 1;
    while ks < GEMV_WARPS && pairs * ks < target && k / (2 * ks) >= 256 {
        ks *= 2;
    }
    ks
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
    part_m: DeviceBuf,
    part_l: DeviceBuf,
    part_o: DeviceBuf,
    /// Finished decode partitions per (sequence, kv head); zero between launches.
    dec_done: DeviceBuf,
    meta: DeviceBuf,
    _blas_workspace: DeviceBuf,
}

/// Captured decode graphs by padded batch size.
#[derive(Default)]
struct Graphs(HashMap<usize, CudaGraph>);

// SAFETY: a graph exec handle is plain driver state usable from any thread with the context bound
// (forward binds it first); the model owns its graphs and is moved to, never shared with, the
// engine thread.
unsafe impl Send for Graphs {}

/// bf16 bytes per element.
const BF16: usize = 2;

/// Decode batch sizes graphs are captured for (a step is padded up to the next one).
const GRAPH_SIZES: [usize; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

/// Launches a kernel with a grid, a block and scalar/pointer arguments.
macro_rules! launch {
    ($stream:expr, $f:expr, $grid:expr, $block:expr, $($arg:expr),* $(,)?) => {{
        let mut b = $stream.launch_builder(&$f);
        $( let a = $arg; b.arg(&a); )*
        let cfg = LaunchConfig { grid_dim: $grid, block_dim: $block, shared_mem_bytes: 0 };
        // SAFETY: the argument lists match the kernels' signatures in llama.cu, and every pointer
        // is a live allocation sized for the step (checked by the plan against MetaLayout).
        unsafe { b.launch(cfg) }?;
    }};
}

/// [`launch!`] with dynamic shared memory.
macro_rules! launch_smem {
    ($stream:expr, $f:expr, $grid:expr, $block:expr, $smem:expr, $($arg:expr),* $(,)?) => {{
        let mut b = $stream.launch_builder(&$f);
        $( let a = $arg; b.arg(&a); )*
        let cfg = LaunchConfig { grid_dim: $grid, block_dim: $block, shared_mem_bytes: $smem };
        // SAFETY: as in launch!; the dynamic shared memory was allowed at load (CudaLlama::new).
        unsafe { b.launch(cfg) }?;
    }};
}

/// Launches one of our kernels that call `pdl_wait()` before their first dependent read, through
/// [`CudaLlama::launch_ex`] (programmatic dependent launch when enabled).
macro_rules! launch_pdl {
    ($model:expr, $f:expr, $grid:expr, $block:expr, $smem:expr, $($arg:expr),* $(,)?) => {{
        $model.launch_ex(&$f, $grid, $block, $smem as u32, &[$(KernelArg::slot($arg)),*])?;
    }};
}

/// A kernel parameter of at most 8 bytes, passed as the bytes of one `u64` slot (little-endian, so
/// a 4-byte parameter is the slot's first 4 bytes).
trait KernelArg {
    fn slot(self) -> u64;
}

impl KernelArg for u64 {
    fn slot(self) -> u64 {
        self
    }
}

impl KernelArg for i32 {
    fn slot(self) -> u64 {
        self as u32 as u64
    }
}

impl KernelArg for f32 {
    fn slot(self) -> u64 {
        self.to_bits() as u64
    }
}

/// Most parameters of a kernel launched through [`CudaLlama::launch_ex`].
const MAX_KERNEL_ARGS: usize = 20;

/// The Llama-family model on one GPU with its paged bf16 KV cache.
pub struct CudaLlama {
    config: ModelConfig,
    opts: CudaOptions,
    shape: KernelShape,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: Funcs,
    embed: DeviceBuf,
    layers: Vec<LayerBufs>,
    norm: DeviceBuf,
    lm_head: Option<DeviceBuf>,
    rope_cos: DeviceBuf,
    rope_sin: DeviceBuf,
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
    /// Page-locked staging of one KV block for export/import (the P/D transfer's host side); a
    /// mutex because export takes `&self`.
    kv_staging: std::sync::Mutex<PinnedBuf>,
    device_name: String,
    /// Blocks of each GEMV kernel (`[family][rows - 1]`) the GPU holds at once: the grid of a
    /// persistent launch.
    gemv_caps: [[u32; kernels::GEMV_MAX_ROWS]; 4],
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

/// Whether a CUDA driver can be loaded on this machine (tests and `--device cuda` check this first).
pub fn driver_available() -> bool {
    // SAFETY: only probes for the shared library; no symbol is called.
    unsafe { drv::is_culib_present() }
}

fn bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

impl CudaLlama {
    /// Loads the model onto the GPU: compiles the kernels, uploads (or generates) the weights,
    /// allocates the KV cache and every activation buffer.
    pub fn new(
        config: ModelConfig,
        weights: WeightSource<'_>,
        opts: CudaOptions,
    ) -> Result<CudaLlama, CudaError> {
        config.validate()?;
        if !driver_available() {
            return Err(CudaError::Unavailable("libcuda could not be loaded".into()));
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
        if opts.max_tokens > 65535 {
            return Err(CudaError::Unsupported(
                "more than 65535 tokens per step".into(),
            ));
        }
        let shape = KernelShape {
            head_dim: config.head_dim,
            gqa: config.num_heads / config.num_kv_heads,
            block_size: opts.block_size,
        };
        shape.validate()?;
        let mut opts = opts;
        if !shape.tensor_core_prefill() && opts.attn == AttnMode::Fast {
            tracing::warn!(
                head_dim = config.head_dim,
                "head_dim above 128: using the reference attention kernel"
            );
            opts.attn = AttnMode::Simple;
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
        let ptx = kernels::compile(&shape, &opts.gemv_tuning, major, minor)?;
        let module = ctx.load_module(ptx)?;
        let funcs = Funcs::load(&module)?;
        funcs.allow_norm_smem(config.hidden_size)?;
        let gemv_caps = funcs.gemv_caps(&ctx, config.hidden_size)?;
        funcs.attn_prefill.set_attribute(
            drv::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            kernels::prefill_smem_bytes(config.head_dim) as i32,
        )?;
        tracing::info!(device = %device_name, sm = format!("{major}.{minor}"), compile_ms = t0.elapsed().as_millis() as u64, "CUDA kernels compiled");
        let blas = CudaBlas::new(stream.clone())?;

        let c = &config;
        let (h, q, kv, f, v) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.vocab_size,
        );
        let mut max_model_len = opts
            .max_model_len
            .unwrap_or(c.max_position_embeddings)
            .min(c.max_position_embeddings);
        if let Some(w) = c.sliding_window.filter(|&w| w < max_model_len) {
            // Our attention kernels are dense: capping the context at the window keeps them exact.
            tracing::warn!(
                window = w,
                "sliding-window model: context capped at the window on CUDA"
            );
            max_model_len = w;
        }
        let max_tokens = opts.max_tokens.max(1);
        let max_seqs = opts.max_seqs.max(1);

        // Weights.
        let mut up = Uploader {
            ctx: &ctx,
            stream: &stream,
            funcs: &funcs,
            seed: 0,
        };
        let (embed, layers, norm, lm_head) = match weights {
            WeightSource::Host(w) => {
                let embed = up.matrices(&[&w.embed])?;
                let mut layers = Vec::with_capacity(c.num_layers);
                for lw in &w.layers {
                    let bqkv = match (&lw.bq, &lw.bk, &lw.bv) {
                        (Some(a), Some(b), Some(cc)) => {
                            let all: Vec<f32> = a.iter().chain(b).chain(cc).copied().collect();
                            Some(up.vector(&all)?)
                        }
                        _ => None,
                    };
                    layers.push(LayerBufs {
                        attn_norm: up.vector(&lw.attn_norm)?,
                        wqkv: up.matrices(&[&lw.wq, &lw.wk, &lw.wv])?,
                        bqkv,
                        wo: up.matrices(&[&lw.wo])?,
                        ffn_norm: up.vector(&lw.ffn_norm)?,
                        w_gate_up: up.matrices(&[&lw.w_gate, &lw.w_up])?,
                        w_down: up.matrices(&[&lw.w_down])?,
                    });
                }
                let norm = up.vector(&w.norm)?;
                let lm_head = match &w.lm_head {
                    Some(m) => Some(up.matrices(&[m])?),
                    None => None,
                };
                (embed, layers, norm, lm_head)
            }
            WeightSource::Random { seed } => {
                up.seed = seed;
                let embed = up.random(v * h, 1.0)?;
                let mut layers = Vec::with_capacity(c.num_layers);
                for _ in 0..c.num_layers {
                    layers.push(LayerBufs {
                        attn_norm: up.constant(h, 1.0)?,
                        wqkv: up.random((q + 2 * kv) * h, 1.0 / (h as f32).sqrt())?,
                        bqkv: if c.attention_bias {
                            Some(up.random(q + 2 * kv, 0.02)?)
                        } else {
                            None
                        },
                        wo: up.random(h * q, 1.0 / (q as f32).sqrt())?,
                        ffn_norm: up.constant(h, 1.0)?,
                        w_gate_up: up.random(2 * f * h, 1.0 / (h as f32).sqrt())?,
                        w_down: up.random(h * f, 1.0 / (f as f32).sqrt())?,
                    });
                }
                let norm = up.constant(h, 1.0)?;
                let lm_head = if c.tie_word_embeddings {
                    None
                } else {
                    Some(up.random(v * h, 1.0 / (h as f32).sqrt())?)
                };
                (embed, layers, norm, lm_head)
            }
        };

        // RoPE tables.
        let rope = RopeTable::new(
            c.head_dim,
            c.rope_theta,
            &c.rope_scaling,
            max_model_len,
            c.rope_style,
        );
        let rope_cos = up.upload(rope.cos())?;
        let rope_sin = up.upload(rope.sin())?;

        // KV cache: one extra block at the end is the scratch target of padded graph rows.
        let layout = KvLayout::for_budget(c, opts.block_size, opts.kv_cache_bytes, KvDtype::Bf16);
        let num_blocks = layout.num_blocks;
        if num_blocks == 0 {
            return Err(CudaError::Unsupported(format!(
                "a KV budget of {} bytes holds no block",
                opts.kv_cache_bytes
            )));
        }
        let kv_buf = DeviceBuf::new(&ctx, c.num_layers * (num_blocks + 1) * layout.block_bytes())?;
        // Random, not zero, so that timing runs over unwritten slots read real-looking data.
        up.fill_random(&kv_buf, kv_buf.bytes / BF16, 1.0)?;

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
            part_m: bufsz(part_slots, 4)?,
            part_l: bufsz(part_slots, 4)?,
            part_o: bufsz(part_slots * c.head_dim, 4)?,
            dec_done: bufsz(max_seqs.max(GRAPH_SIZES[0]) * c.num_kv_heads, 4)?,
            meta: bufsz(meta_layout.total(), 4)?,
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
        let kv_staging =
            std::sync::Mutex::new(PinnedBuf::new(&ctx, layout.block_bytes().div_ceil(4))?);
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
            embed,
            layers,
            norm,
            lm_head,
            rope_cos,
            rope_sin,
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
            kv_staging,
            device_name,
            gemv_caps,
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

    /// The longest context this instance serves.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
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

    /// Bytes of weights a decode step reads once: every matrix, the norms, the output head (the
    /// embedding is only gathered).
    pub fn weight_bytes_per_step(&self) -> usize {
        let c = &self.config;
        let (h, q, kv, f, v) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.vocab_size,
        );
        let per_layer = (q + 2 * kv) * h + q * h + 2 * f * h + h * f + 2 * h;
        (c.num_layers * per_layer + h + v * h) * BF16
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

    /// y[t × n] = x[t × k] · w[n × k]ᵀ in bf16 with fp32 accumulation; `f32_out` writes fp32 y.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        x: u64,
        w: u64,
        y: u64,
        t: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        if self.gemv_rows(t) && k.is_multiple_of(8) {
            let (grid, ks, groups) = self.gemv_shape(GemvFamily::Plain, t, n.div_ceil(2), k);
            launch_pdl!(
                self,
                self.funcs.gemv[t - 1],
                (grid, 1, 1),
                (32 * GEMV_WARPS as u32, 1, 1),
                0,
                x,
                w,
                y,
                n as i32,
                k as i32,
                f32_out as i32,
                ks,
                groups
            );
            return Ok(());
        }
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let c_type = if f32_out {
            blas_sys::cudaDataType::CUDA_R_32F
        } else {
            blas_sys::cudaDataType::CUDA_R_16BF
        };
        // Column-major view: Yᵀ (n × t) = W (k × n)ᵀ · Xᵀ (k × t).
        // SAFETY: pointers are live device buffers of the stated shapes.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                t as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                c_type,
                n as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }

    /// Queues the whole forward pass over the uploaded plan up to the final norm (into `xn`).
    /// `graph`: launch the decode attention over every partition the context limit allows, so that
    /// the captured launch fits any later step of the same size.
    fn enqueue_body(&self, t: usize, graph: bool) -> Result<(), CudaError> {
        let c = &self.config;
        let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let (nh, nkv) = (c.num_heads as i32, c.num_kv_heads as i32);
        let a = &self.acts;
        let s = &self.stream;
        let tt = t as u32;
        let eps = c.rms_norm_eps;
        let qkv_w = (q + 2 * kv) as i32;
        let neox = matches!(c.rope_style, tandem_kernels::RopeStyle::Neox) as i32;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let layer_elems = (self.layout.num_blocks + 1) * self.layout.block_elems();
        let p = &self.plan;
        let part_len = kernels::decode_partition(p.dec_row.len(), self.opts.decode_partition_small);
        let stride = self.max_model_len.div_ceil(part_len);
        let decode_parts = if graph {
            stride
        } else {
            p.max_dec_ctx.div_ceil(part_len)
        };
        if p.dec_row.len() * c.num_heads * stride > self.part_slots {
            return Err(CudaError::Batch(format!(
                "{} decode sequences exceed the partial-result buffers",
                p.dec_row.len()
            )));
        }

        launch!(
            s,
            self.funcs.embed_gather,
            (tt, 1, 1),
            (256, 1, 1),
            self.embed.ptr,
            self.meta(Region::Tokens),
            a.x.ptr,
            h as i32
        );
        let fused = self.fused_step(t);
        let smem = fused_smem_bytes(t, h) as u32;
        let block = (32 * GEMV_WARPS as u32, 1, 1);
        for (l, lw) in self.layers.iter().enumerate() {
            let cache = self.kv.at(l * layer_elems, BF16);
            let bias = lw.bqkv.as_ref().map_or(0u64, |b| b.ptr);
            if fused {
                // RMSNorm + QKV + bias + RoPE + K/V write; the residual is complete in x.
                let (grid, ks, groups) = self.gemv_shape(GemvFamily::Qkv, t, (q + 2 * kv) / 2, h);
                launch_pdl!(
                    self,
                    self.funcs.gemv_qkv[t - 1],
                    (grid, 1, 1),
                    block,
                    smem,
                    a.x.ptr,
                    lw.attn_norm.ptr,
                    eps,
                    lw.wqkv.ptr,
                    bias,
                    self.meta(Region::Positions),
                    self.meta(Region::Slots),
                    self.rope_cos.ptr,
                    self.rope_sin.ptr,
                    cache,
                    a.qkv.ptr,
                    nh,
                    nkv,
                    neox,
                    h as i32,
                    ks,
                    groups
                );
            } else {
                let delta = if l == 0 { 0u64 } else { a.delta.ptr };
                self.enqueue_add_rmsnorm(t, delta, lw.attn_norm.ptr)?;
                self.gemm(a.xn.ptr, lw.wqkv.ptr, a.qkv.ptr, t, q + 2 * kv, h, false)?;
                launch!(
                    s,
                    self.funcs.rope_kv_write,
                    (tt, 1, 1),
                    (256, 1, 1),
                    a.qkv.ptr,
                    bias,
                    self.meta(Region::Positions),
                    self.meta(Region::Slots),
                    self.rope_cos.ptr,
                    self.rope_sin.ptr,
                    cache,
                    nh,
                    nkv,
                    neox
                );
            }
            match self.opts.attn {
                AttnMode::Simple => {
                    let n_seq = p.seq_qrow.len() as u32;
                    launch!(
                        s,
                        self.funcs.attn_simple,
                        (p.max_nq as u32, n_seq, (nh as u32).div_ceil(4)),
                        (32, 4, 1),
                        a.qkv.ptr,
                        qkv_w,
                        self.meta(Region::SeqQrow),
                        self.meta(Region::SeqNq),
                        self.meta(Region::SeqPos),
                        self.meta(Region::SeqBt),
                        self.meta(Region::BlockTables),
                        cache,
                        a.attn.ptr,
                        nh,
                        nkv,
                        scale
                    );
                }
                AttnMode::Fast => {
                    if !p.tile_seq.is_empty() {
                        launch_smem!(
                            s,
                            self.funcs.attn_prefill,
                            (p.tile_seq.len() as u32, nh as u32, 1),
                            (128, 1, 1),
                            kernels::prefill_smem_bytes(c.head_dim) as u32,
                            a.qkv.ptr,
                            qkv_w,
                            self.meta(Region::TileSeq),
                            self.meta(Region::TileQ0),
                            self.meta(Region::SeqQrow),
                            self.meta(Region::SeqNq),
                            self.meta(Region::SeqPos),
                            self.meta(Region::SeqBt),
                            self.meta(Region::BlockTables),
                            cache,
                            a.attn.ptr,
                            nh,
                            nkv,
                            scale_log2
                        );
                    }
                    if !p.dec_row.is_empty() {
                        let nd = p.dec_row.len() as u32;
                        let kernel = if part_len <= DECODE_PARTITION_SMALL {
                            &self.funcs.attn_decode_small
                        } else {
                            &self.funcs.attn_decode
                        };
                        launch_pdl!(
                            self,
                            kernel,
                            (nd, nkv as u32, decode_parts as u32),
                            (128, 1, 1),
                            0,
                            a.qkv.ptr,
                            qkv_w,
                            self.meta(Region::DecRow),
                            self.meta(Region::DecCtx),
                            self.meta(Region::DecBt),
                            self.meta(Region::BlockTables),
                            cache,
                            a.part_m.ptr,
                            a.part_l.ptr,
                            a.part_o.ptr,
                            a.dec_done.ptr,
                            a.attn.ptr,
                            nh,
                            nkv,
                            stride as i32,
                            part_len as i32,
                            scale_log2
                        );
                    }
                }
            }
            if fused {
                // Output projection added into the residual; RMSNorm + gate/up + SiLU·mul; down
                // projection added into the residual.
                self.enqueue_gemv_add(t, a.attn.ptr, lw.wo.ptr, a.x.ptr, q)?;
                let (grid, ks, groups) = self.gemv_shape(GemvFamily::Silu, t, f, h);
                launch_pdl!(
                    self,
                    self.funcs.gemv_silu[t - 1],
                    (grid, 1, 1),
                    block,
                    smem,
                    a.x.ptr,
                    lw.ffn_norm.ptr,
                    eps,
                    lw.w_gate_up.ptr,
                    a.act.ptr,
                    f as i32,
                    h as i32,
                    ks,
                    groups
                );
                self.enqueue_gemv_add(t, a.act.ptr, lw.w_down.ptr, a.x.ptr, f)?;
                continue;
            }
            self.gemm(a.attn.ptr, lw.wo.ptr, a.delta.ptr, t, h, q, false)?;
            self.enqueue_add_rmsnorm(t, a.delta.ptr, lw.ffn_norm.ptr)?;
            self.gemm(a.xn.ptr, lw.w_gate_up.ptr, a.gu.ptr, t, 2 * f, h, false)?;
            // Eight columns per thread: ffn / 2048 blocks cover a row in one pass; one grid row per
            // token.
            let col_blocks = f.div_ceil(8 * 256) as u32;
            launch!(
                s,
                self.funcs.silu_mul,
                (col_blocks, tt, 1),
                (256, 1, 1),
                a.gu.ptr,
                a.act.ptr,
                f as i32
            );
            self.gemm(a.act.ptr, lw.w_down.ptr, a.delta.ptr, t, h, f, false)?;
        }
        // The fused path adds every delta into x itself.
        let final_delta = if self.layers.is_empty() || fused {
            0u64
        } else {
            a.delta.ptr
        };
        self.enqueue_add_rmsnorm(t, final_delta, self.norm.ptr)
    }

    /// Launches `f` with `args` (as [`KernelArg`] slots) on the model's stream; with `opts.pdl` as a
    /// programmatic dependent launch, so that it starts (and streams its weights) while the kernel
    /// before it finishes. Only for kernels that call `pdl_wait()` before their first dependent read.
    fn launch_ex(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[u64],
    ) -> Result<(), CudaError> {
        assert!(args.len() <= MAX_KERNEL_ARGS, "too many kernel arguments");
        let mut slots = [0u64; MAX_KERNEL_ARGS];
        slots[..args.len()].copy_from_slice(args);
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_KERNEL_ARGS];
        for (p, v) in params.iter_mut().zip(slots.iter_mut()) {
            *p = v as *mut u64 as *mut std::ffi::c_void;
        }
        // SAFETY: an all-zero launch attribute is plain data; its id and value are set below.
        let mut attr: drv::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = drv::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = drv::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: self.opts.pdl as u32,
        };
        // SAFETY: the argument slots match the kernel's parameters in llama.cu (each at most 8
        // bytes) and outlive the call, which copies them; every pointer among them is a live
        // allocation sized for the step.
        unsafe {
            drv::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        }?;
        Ok(())
    }

    /// Whether projections of `t` rows run on our GEMV kernels (else cuBLAS).
    fn gemv_rows(&self, t: usize) -> bool {
        self.opts.gemv && t >= 1 && t <= self.opts.gemv_max_rows.min(kernels::GEMV_MAX_ROWS)
    }

    /// The launch shape of a GEMV over `t` rows with `pairs` work items (row pairs) of `k` values:
    /// (grid, K slices, block-groups). One block per group, or with persistent launches no more
    /// blocks than the GPU holds at once.
    fn gemv_shape(&self, family: GemvFamily, t: usize, pairs: usize, k: usize) -> (u32, i32, i32) {
        let ks = gemv_split(pairs, k, self.opts.gemv_target_warps);
        let groups = gemv_blocks(pairs * ks);
        let grid = if self.opts.gemv_persistent {
            groups.min(self.gemv_caps[family as usize][t - 1])
        } else {
            groups
        };
        (grid, ks as i32, groups as i32)
    }

    /// Queues `res[t × n] += x[t × k] · w[n × k]ᵀ` through the residual-add GEMV (`n` = hidden size).
    fn enqueue_gemv_add(
        &self,
        t: usize,
        x: u64,
        w: u64,
        res: u64,
        k: usize,
    ) -> Result<(), CudaError> {
        let n = self.config.hidden_size;
        let (grid, ks, groups) = self.gemv_shape(GemvFamily::Add, t, n.div_ceil(2), k);
        launch_pdl!(
            self,
            self.funcs.gemv_add[t - 1],
            (grid, 1, 1),
            (32 * GEMV_WARPS as u32, 1, 1),
            0,
            x,
            w,
            res,
            n as i32,
            k as i32,
            ks,
            groups
        );
        Ok(())
    }

    /// Queues `x += delta` (delta 0: none) and `xn = RMSNorm(x) · weight` over `t` rows.
    fn enqueue_add_rmsnorm(&self, t: usize, delta: u64, weight: u64) -> Result<(), CudaError> {
        let h = self.config.hidden_size;
        // One 16-byte chunk of the row per thread (up to NORM_CHUNKS per thread past 1024).
        let threads = ((h / 8).div_ceil(32) * 32).clamp(32, 1024) as u32;
        launch_pdl!(
            self,
            self.funcs.add_rmsnorm,
            (t as u32, 1, 1),
            (threads, 1, 1),
            0,
            self.acts.x.ptr,
            delta,
            weight,
            self.acts.xn.ptr,
            h as i32,
            self.config.rms_norm_eps
        );
        Ok(())
    }

    /// Whether a step of `t` tokens runs the fused GEMV kernels (norm, RoPE, K/V write, SiLU and
    /// residual adds inside the projections): our GEMV on, few rows, shapes the kernels take.
    fn fused_step(&self, t: usize) -> bool {
        let c = &self.config;
        self.gemv_rows(t)
            && c.hidden_size.is_multiple_of(8)
            && c.intermediate_size.is_multiple_of(8)
            && fused_smem_bytes(t, c.hidden_size) <= FUSED_SMEM_MAX
    }

    /// Queues the output head for logits rows `start..start + n` of the plan into `acts.logits`.
    fn enqueue_head(&self, start: usize, n: usize) -> Result<(), CudaError> {
        let c = &self.config;
        let h = c.hidden_size;
        let a = &self.acts;
        // Rows start..start + n of the step (every decode step, and graphs only run those) need no
        // gather: the head reads them from xn in place.
        let lr = &self.plan.logit_rows;
        let in_place = lr.len() >= start + n
            && lr[start..start + n]
                .iter()
                .enumerate()
                .all(|(i, &r)| r as usize == start + i);
        let head_in = if in_place {
            a.xn.at(start * h, BF16)
        } else {
            let rows = self.meta(Region::LogitRows) + (start * 4) as u64;
            launch_pdl!(
                self,
                self.funcs.gather_rows,
                (n as u32, 1, 1),
                (256, 1, 1),
                0,
                a.xn.ptr,
                rows,
                a.head_in.ptr,
                h as i32
            );
            a.head_in.ptr
        };
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.gemm(head_in, head.ptr, a.logits.ptr, n, c.vocab_size, h, true)
    }

    /// Queues the choice of the tokens of logits rows `start..start + n` (in `acts.logits` from
    /// row 0) into `acts.argmax`: argmax, or the draws of `sample[start..start + n]`.
    fn enqueue_pick(
        &mut self,
        start: usize,
        n: usize,
        sample: Option<&[SampleRow]>,
    ) -> Result<(), CudaError> {
        let Some(sample) = sample else {
            return self.enqueue_argmax(n);
        };
        let mut words = std::mem::take(&mut self.pick_words);
        words.clear();
        words.extend(sample[start..start + n].iter().flat_map(SampleRow::words));
        // SAFETY: sample_params holds logits_chunk_rows rows (n <= that); the pageable host slice
        // is staged before the call returns.
        let copied = unsafe {
            drv_result::memcpy_htod_async(
                self.acts.sample_params.ptr,
                &words[..],
                self.stream.cu_stream(),
            )
        };
        self.pick_words = words;
        copied?;
        let a = &self.acts;
        launch!(
            &self.stream,
            self.funcs.sample_rows,
            (n as u32, 1, 1),
            (1024, 1, 1),
            a.logits.ptr,
            self.config.vocab_size as i32,
            a.sample_params.ptr,
            a.argmax.ptr
        );
        Ok(())
    }

    fn enqueue_argmax(&self, n: usize) -> Result<(), CudaError> {
        let a = &self.acts;
        launch_pdl!(
            self,
            self.funcs.argmax_rows,
            (n as u32, 1, 1),
            (1024, 1, 1),
            0,
            a.logits.ptr,
            self.config.vocab_size as i32,
            a.argmax.ptr
        );
        Ok(())
    }

    /// Plans the batch; pads a decode-only step to a graph size when graphs apply. Returns the graph
    /// size (0 = run eagerly).
    fn prepare(&mut self, batch: &ForwardBatch) -> Result<usize, CudaError> {
        let lim = self.limits();
        self.plan.build(batch, &lim)?;
        let p = &self.plan;
        let n = p.num_tokens();
        let decode_only = n > 0
            && p.tile_seq.is_empty()
            && p.dec_row.len() == n
            && p.logit_rows.len() == n
            && p.logit_rows
                .iter()
                .enumerate()
                .all(|(i, &r)| r as usize == i);
        let mut graph_size = 0;
        if self.opts.graphs && self.opts.attn == AttnMode::Fast && decode_only {
            if let Some(&g) = GRAPH_SIZES.iter().find(|&&g| {
                g >= n
                    && g <= self.opts.max_seqs
                    && g <= self.opts.max_tokens
                    && g <= self.opts.logits_chunk_rows
            }) {
                graph_size = g;
                // Padding rows: token 0 at position 0 writing to the scratch block past the pool.
                let scratch = self.layout.num_blocks as i32;
                let p = &mut self.plan;
                let bt = p.block_tables.len() as i32;
                p.block_tables.push(scratch);
                for i in n..g {
                    p.tokens.push(0);
                    p.positions.push(0);
                    p.slots.push(scratch * self.layout.block_size as i32);
                    p.dec_row.push(i as i32);
                    p.dec_ctx.push(1);
                    p.dec_bt.push(bt);
                    p.logit_rows.push(i as i32);
                }
            }
        }
        self.meta_layout.check(&self.plan)?;
        self.upload_plan()?;
        Ok(graph_size)
    }

    /// Queues the body and head of a decode step of `g` (padded) rows, through a graph captured on
    /// first use.
    fn run_graph(&mut self, g: usize) -> Result<(), CudaError> {
        if !self.graphs.0.contains_key(&g) {
            // Run once eagerly (cuBLAS picks and loads its kernels outside capture), then capture.
            self.enqueue_body(g, true)?;
            self.enqueue_head(0, g)?;
            self.stream.synchronize()?;
            self.stream
                .begin_capture(drv::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
            let body = self
                .enqueue_body(g, true)
                .and_then(|_| self.enqueue_head(0, g));
            let graph = self.stream.end_capture(drv::CUgraphInstantiate_flags(0))?;
            body?;
            let graph = graph
                .ok_or_else(|| CudaError::Unsupported("stream capture produced no graph".into()))?;
            tracing::debug!(batch = g, "captured decode graph");
            self.graphs.0.insert(g, graph);
            return Ok(());
        }
        self.graphs.0[&g].launch()?;
        Ok(())
    }

    /// Runs one step and returns `batch.logits_rows()` rows of fp32 logits on the host.
    pub fn forward(
        &mut self,
        batch: &ForwardBatch,
        logits: &mut Vec<f32>,
    ) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        logits.clear();
        let graph = self.prepare(batch)?;
        let rows = batch.logits_rows();
        let v = self.config.vocab_size;
        logits.resize(rows * v, 0.0);
        if graph > 0 {
            self.run_graph(graph)?;
            self.copy_logits(&mut logits[..], rows)?;
        } else {
            let t = self.plan.num_tokens();
            if t == 0 {
                return Ok(());
            }
            self.enqueue_body(t, false)?;
            let chunk = self.opts.logits_chunk_rows.max(1);
            let mut start = 0;
            while start < rows {
                let n = chunk.min(rows - start);
                self.enqueue_head(start, n)?;
                self.copy_logits(&mut logits[start * v..(start + n) * v], n)?;
                start += n;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Runs one step and returns the greedy (argmax) token of each logits row, sampled on the GPU.
    pub fn forward_greedy(
        &mut self,
        batch: &ForwardBatch,
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        self.forward_pick(batch, None, out)
    }

    /// Runs one step and draws each logits row's token on the GPU under `rows` (one per logits
    /// row, in order): the logits never leave the device.
    pub fn forward_sampled(
        &mut self,
        batch: &ForwardBatch,
        rows: &[SampleRow],
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        if rows.len() != batch.logits_rows() {
            return Err(CudaError::Batch(format!(
                "{} sampling rows for {} logits rows",
                rows.len(),
                batch.logits_rows()
            )));
        }
        self.forward_pick(batch, Some(rows), out)
    }

    /// One step, then argmax (`sample` None) or the draws of `sample` over each logits row.
    fn forward_pick(
        &mut self,
        batch: &ForwardBatch,
        sample: Option<&[SampleRow]>,
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        let t0 = std::time::Instant::now();
        out.clear();
        let graph = self.prepare(batch)?;
        let rows = batch.logits_rows();
        if graph == 0 && self.plan.num_tokens() == 0 {
            return Ok(());
        }
        let mut ids = std::mem::take(&mut self.pick_ids);
        ids.clear();
        ids.resize(rows, 0);
        let picked = self.pick_into(graph, rows, sample, &mut ids, t0);
        out.extend(ids.iter().map(|&i| i as u32));
        self.pick_ids = ids;
        picked
    }

    /// The device work of `forward_pick` after planning: the body (through graph `graph` when
    /// non-zero), then the head and the choice of each logits row, chunk by chunk, into `ids`.
    fn pick_into(
        &mut self,
        graph: usize,
        rows: usize,
        sample: Option<&[SampleRow]>,
        ids: &mut [i32],
        t0: std::time::Instant,
    ) -> Result<(), CudaError> {
        if graph > 0 {
            self.run_graph(graph)?;
            self.enqueue_pick(0, rows, sample)?;
            self.copy_i32(ids, 0)?;
        } else {
            self.enqueue_body(self.plan.num_tokens(), false)?;
            self.last_enqueue = t0.elapsed();
            let chunk = self.opts.logits_chunk_rows.max(1);
            let mut start = 0;
            while start < rows {
                let n = chunk.min(rows - start);
                self.enqueue_head(start, n)?;
                self.enqueue_pick(start, n, sample)?;
                self.copy_i32(&mut ids[start..start + n], 0)?;
                start += n;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Draws tokens on the GPU from given logits rows (`logits.len() == rows.len() * vocab`): the
    /// on-device sampler alone, for checks of its distribution against the host sampler's.
    pub fn sample_logits(
        &mut self,
        logits: &[f32],
        rows: &[SampleRow],
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        let v = self.config.vocab_size;
        let n = rows.len();
        if logits.len() != n * v || n > self.opts.logits_chunk_rows.max(1) {
            return Err(CudaError::Batch(format!(
                "{} logits for {n} rows of {v} (at most {} rows)",
                logits.len(),
                self.opts.logits_chunk_rows
            )));
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: acts.logits holds logits_chunk_rows rows of vocab fp32 (checked above); the
        // pageable host slice is staged before the call returns.
        unsafe {
            drv_result::memcpy_htod_async(self.acts.logits.ptr, logits, self.stream.cu_stream())
        }?;
        self.enqueue_pick(0, n, Some(rows))?;
        let mut ids = std::mem::take(&mut self.pick_ids);
        ids.clear();
        ids.resize(n, 0);
        let copied = self.copy_i32(&mut ids, 0);
        out.clear();
        out.extend(ids.iter().map(|&i| i as u32));
        self.pick_ids = ids;
        copied
    }

    /// Copies `rows` rows of logits to `dst` through the pinned staging buffer, two slots deep: the
    /// CPU copies one slot out while the GPU fills the other.
    fn copy_logits(&mut self, dst: &mut [f32], rows: usize) -> Result<(), CudaError> {
        let n = rows * self.config.vocab_size;
        let src = self.acts.logits.ptr;
        let stream = self.stream.clone();
        let mut pending: std::collections::VecDeque<(
            cudarc::driver::CudaEvent,
            usize,
            usize,
            usize,
        )> = std::collections::VecDeque::with_capacity(2);
        let mut off = 0;
        let mut chunk_no = 0;
        while off < n || !pending.is_empty() {
            if pending.len() == 2 || off >= n {
                let (event, slot, at, len) = pending.pop_front().expect("a pending chunk");
                event.synchronize()?;
                dst[at..at + len].copy_from_slice(self.staging.slice(slot * STAGING_CHUNK, len));
                continue;
            }
            let len = STAGING_CHUNK.min(n - off);
            let slot = chunk_no % 2;
            // SAFETY: the slot is not in use (its previous chunk was consumed above); the source
            // range lies inside acts.logits.
            unsafe {
                drv_result::memcpy_dtoh_async(
                    self.staging.slice_mut(slot * STAGING_CHUNK, len),
                    src + (off * 4) as u64,
                    stream.cu_stream(),
                )
            }?;
            pending.push_back((stream.record_event(None)?, slot, off, len));
            off += len;
            chunk_no += 1;
        }
        Ok(())
    }

    fn copy_i32(&self, dst: &mut [i32], offset: usize) -> Result<(), CudaError> {
        // SAFETY: acts.argmax holds logits_chunk_rows ints; dst is no longer.
        unsafe {
            drv_result::memcpy_dtoh_async(
                dst,
                self.acts.argmax.at(offset, 4),
                self.stream.cu_stream(),
            )
        }?;
        self.stream.synchronize()?;
        Ok(())
    }

    fn block_addr(&self, layer: usize, block: u32) -> u64 {
        let layer_elems = (self.layout.num_blocks + 1) * self.layout.block_elems();
        self.kv.at(
            layer * layer_elems + block as usize * self.layout.block_elems(),
            BF16,
        )
    }

    /// Copies one (layer, block) of KV to the host (`out.len() == kv_layout().block_bytes()`),
    /// through page-locked staging (a DMA at bus speed, then a memcpy).
    pub fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), CudaError> {
        self.check_block(layer, block, out.len())?;
        self.ctx.bind_to_thread()?;
        let mut st = self.kv_staging.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the range is inside the KV allocation (checked above) and the staging buffer holds
        // a block; the copy is complete before the buffer is read or reused (synchronised).
        unsafe {
            drv_result::memcpy_dtoh_async(
                st.bytes_mut(out.len()),
                self.block_addr(layer, block),
                self.stream.cu_stream(),
            )
        }?;
        self.stream.synchronize()?;
        out.copy_from_slice(st.bytes(out.len()));
        Ok(())
    }

    /// Overwrites one (layer, block) of KV with bytes from `export_block` of an equal layout, through
    /// the same page-locked staging.
    pub fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), CudaError> {
        self.check_block(layer, block, data.len())?;
        self.ctx.bind_to_thread()?;
        let mut st = self.kv_staging.lock().unwrap_or_else(|e| e.into_inner());
        st.bytes_mut(data.len()).copy_from_slice(data);
        // SAFETY: as in export_block; the staging buffer is not touched until the copy is done.
        unsafe {
            drv_result::memcpy_htod_async(
                self.block_addr(layer, block),
                st.bytes(data.len()),
                self.stream.cu_stream(),
            )
        }?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// Copies a block across all layers on the device.
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        for l in 0..self.layout.n_layers {
            self.check_block(l, src, self.layout.block_bytes())?;
            self.check_block(l, dst, self.layout.block_bytes())?;
            // SAFETY: both ranges are whole blocks inside the KV allocation.
            unsafe {
                drv_result::memcpy_dtod_async(
                    self.block_addr(l, dst),
                    self.block_addr(l, src),
                    self.layout.block_bytes(),
                    self.stream.cu_stream(),
                )
            }?;
        }
        self.stream.synchronize()?;
        Ok(())
    }

    fn check_block(&self, layer: usize, block: u32, len: usize) -> Result<(), CudaError> {
        if layer >= self.layout.n_layers
            || block as usize >= self.layout.num_blocks
            || len != self.layout.block_bytes()
        {
            return Err(CudaError::Batch(format!(
                "KV block access layer {layer} block {block} of {len} bytes outside {:?}",
                self.layout
            )));
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

/// Weight upload helpers (host conversion to bf16, or generation on the device).
struct Uploader<'a> {
    ctx: &'a Arc<CudaContext>,
    stream: &'a Arc<CudaStream>,
    funcs: &'a Funcs,
    seed: u64,
}

impl Uploader<'_> {
    fn upload<T>(&self, data: &[T]) -> Result<DeviceBuf, CudaError> {
        let buf = DeviceBuf::new(self.ctx, std::mem::size_of_val(data))?;
        // SAFETY: buf holds exactly data's bytes; the stream is synchronised before data is dropped.
        unsafe { drv_result::memcpy_htod_async(buf.ptr, data, self.stream.cu_stream()) }?;
        self.stream.synchronize()?;
        Ok(buf)
    }

    fn vector(&self, v: &[f32]) -> Result<DeviceBuf, CudaError> {
        let bits: Vec<u16> = v.iter().map(|&x| bf16_bits(x)).collect();
        self.upload(&bits)
    }

    /// Row-concatenates matrices (same column count) into one bf16 device matrix.
    fn matrices(&self, ms: &[&Matrix]) -> Result<DeviceBuf, CudaError> {
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
        self.upload(&bits)
    }

    fn fill_random(&mut self, buf: &DeviceBuf, n: usize, scale: f32) -> Result<(), CudaError> {
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

    fn random(&mut self, n: usize, scale: f32) -> Result<DeviceBuf, CudaError> {
        let buf = DeviceBuf::new(self.ctx, n * BF16)?;
        self.fill_random(&buf, n, scale)?;
        Ok(buf)
    }

    fn constant(&self, n: usize, value: f32) -> Result<DeviceBuf, CudaError> {
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
}
