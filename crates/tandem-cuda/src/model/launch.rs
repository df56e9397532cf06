//! The loaded kernel functions and the launch helpers every kernel launch goes through.

use std::sync::Arc;

use cudarc::driver::sys as drv;
use cudarc::driver::{CudaFunction, CudaModule};

use super::gemv::{fused_smem_bytes, FUSED_SMEM_MAX};
use super::{CudaLlama, WFormat};
use crate::error::CudaError;
use crate::kernels;

/// The loaded kernel functions.
pub(super) struct Funcs {
    pub(super) init_uniform: CudaFunction,
    pub(super) fill_bf16: CudaFunction,
    pub(super) embed_gather: CudaFunction,
    pub(super) add_rmsnorm: CudaFunction,
    pub(super) gather_rows: CudaFunction,
    pub(super) silu_mul: CudaFunction,
    pub(super) rope_kv_write: CudaFunction,
    pub(super) qk_norm: CudaFunction,
    /// Final-logit soft-capping (`cap · tanh(x / cap)`).
    pub(super) softcap: CudaFunction,
    pub(super) argmax_rows: CudaFunction,
    pub(super) sample_rows: CudaFunction,
    pub(super) mask_rows: CudaFunction,
    pub(super) attn_simple: CudaFunction,
    pub(super) attn_prefill: CudaFunction,
    pub(super) attn_decode: CudaFunction,
    pub(super) attn_decode_small: CudaFunction,
    /// Mixture-of-experts routing, grouping, grouped GEMMs (16- and 64-row blocks) and combine.
    pub(super) moe_route: CudaFunction,
    pub(super) moe_align: CudaFunction,
    pub(super) moe_gemm_16: CudaFunction,
    pub(super) moe_gemm_64: CudaFunction,
    pub(super) moe_combine: CudaFunction,
    pub(super) moe_gemv_silu: CudaFunction,
    pub(super) moe_gemv_down: CudaFunction,
    /// The GEMV kernels, `[format][family][m - 1]` computing m rows: formats in `WFormat` order,
    /// families in `GemvFamily` order (plain, residual add, RMSNorm + gate/up + SiLU·mul, RMSNorm +
    /// QKV + bias + RoPE + K/V write).
    pub(super) gemv: [[Vec<CudaFunction>; 4]; 4],
    /// bf16 → FP8 block quantization at load, and FP8 → bf16 for the cuBLAS steps.
    pub(super) quant_fp8: CudaFunction,
    pub(super) dequant_fp8: CudaFunction,
    /// Activations to E4M3 per token and 128-value group, for the FP8 tensor-core GEMMs.
    pub(super) quant_act_fp8: CudaFunction,
    /// Packed GGUF matrices (4- and 8-bit codes) → bf16 for the cuBLAS steps.
    pub(super) dequant_q4: CudaFunction,
    pub(super) dequant_q8: CudaFunction,
}

impl Funcs {
    /// The module's kernels; the GEMVs of formats outside `formats` (`KernelShape::formats`) were
    /// not compiled and stay empty.
    pub(super) fn load(module: &Arc<CudaModule>, formats: u8) -> Result<Funcs, CudaError> {
        let f = |n: &str| module.load_function(n);
        let gemv_family = |prefix: &str| {
            (1..=kernels::GEMV_MAX_ROWS)
                .map(|m| f(&format!("{prefix}{m}")))
                .collect::<Result<Vec<_>, _>>()
        };
        let mut gemv: [[Vec<CudaFunction>; 4]; 4] = Default::default();
        for (format, families) in kernels::GEMV_FORMAT_FAMILIES.iter().enumerate() {
            if (formats | 1) & (1 << format) == 0 {
                continue;
            }
            for (family, prefix) in families.iter().enumerate() {
                gemv[format][family] = gemv_family(prefix)?;
            }
        }
        Ok(Funcs {
            init_uniform: f("init_uniform")?,
            fill_bf16: f("fill_bf16")?,
            embed_gather: f("embed_gather")?,
            add_rmsnorm: f("add_rmsnorm")?,
            gather_rows: f("gather_rows")?,
            silu_mul: f("silu_mul")?,
            rope_kv_write: f("rope_kv_write")?,
            qk_norm: f("qk_norm")?,
            softcap: f("softcap")?,
            argmax_rows: f("argmax_rows")?,
            sample_rows: f("sample_rows")?,
            mask_rows: f("mask_rows")?,
            attn_simple: f("attn_simple")?,
            attn_prefill: f("attn_prefill")?,
            attn_decode: f("attn_decode")?,
            attn_decode_small: f("attn_decode_small")?,
            moe_route: f("moe_route")?,
            moe_align: f("moe_align")?,
            moe_gemm_16: f("moe_gemm_16")?,
            moe_gemm_64: f("moe_gemm_64")?,
            moe_combine: f("moe_combine")?,
            moe_gemv_silu: f("moe_gemv_silu")?,
            moe_gemv_down: f("moe_gemv_down")?,
            gemv,
            quant_fp8: f("quant_fp8")?,
            dequant_fp8: f("dequant_fp8")?,
            quant_act_fp8: f("quant_act_fp8")?,
            dequant_q4: f("dequant_q4")?,
            dequant_q8: f("dequant_q8")?,
        })
    }

    /// The kernels of GEMV `family` over weights in `format`, `[rows - 1]`.
    pub(super) fn gemv_family(&self, family: usize, format: WFormat) -> &[CudaFunction] {
        &self.gemv[format as usize][family]
    }

    /// Lets the fused-norm GEMVs of m rows take m × `hidden` bf16 values of dynamic shared memory
    /// (above the default 48 KiB for m × hidden > 24,576).
    pub(super) fn allow_norm_smem(&self, hidden: usize) -> Result<(), CudaError> {
        for i in 0..kernels::GEMV_MAX_ROWS {
            let bytes = fused_smem_bytes(i + 1, hidden);
            if bytes <= FUSED_SMEM_MAX {
                let fused = self.gemv.iter().flat_map(|f| [f[2].get(i), f[3].get(i)]);
                for func in fused.flatten() {
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

/// Launches a kernel with a grid, a block and scalar/pointer arguments.
macro_rules! launch {
    ($stream:expr, $f:expr, $grid:expr, $block:expr, $($arg:tt)*) => {{
        let mut b = $stream.launch_builder(&$f);
        push_args!(b, $($arg)*);
        let cfg = LaunchConfig { grid_dim: $grid, block_dim: $block, shared_mem_bytes: 0 };
        // SAFETY: the argument lists match the kernels' signatures in llama.cu, and every pointer
        // is a live allocation sized for the step (checked by the plan against MetaLayout).
        unsafe { b.launch(cfg) }?;
    }};
}

/// [`launch!`] with dynamic shared memory.
macro_rules! launch_smem {
    ($stream:expr, $f:expr, $grid:expr, $block:expr, $smem:expr, $($arg:tt)*) => {{
        let mut b = $stream.launch_builder(&$f);
        push_args!(b, $($arg)*);
        let cfg = LaunchConfig { grid_dim: $grid, block_dim: $block, shared_mem_bytes: $smem };
        // SAFETY: as in launch!; the dynamic shared memory was allowed at load (CudaLlama::new).
        unsafe { b.launch(cfg) }?;
    }};
}

/// Pushes the arguments of [`launch!`] and [`launch_smem!`] onto the launch builder `$b` in order:
/// each expression as one parameter, and `@seq g` as the parameters of a [`SeqAttnArgs`] `g`, field
/// by field. Every value lives until the launch (the bindings outlast the builder's borrows).
macro_rules! push_args {
    ($b:ident $(,)?) => {};
    ($b:ident, @seq $g:expr $(, $($rest:tt)*)?) => {
        let g = $g;
        $b.arg(&g.seq_qrow);
        $b.arg(&g.seq_nq);
        $b.arg(&g.seq_pos);
        $b.arg(&g.seq_bt);
        $b.arg(&g.block_tables);
        $b.arg(&g.cache);
        $b.arg(&g.out);
        $b.arg(&g.nh);
        $b.arg(&g.nkv);
        push_args!($b $(, $($rest)*)?);
    };
    ($b:ident, $arg:expr $(, $($rest:tt)*)?) => {
        let a = $arg;
        $b.arg(&a);
        push_args!($b $(, $($rest)*)?);
    };
}

/// The parameters the sequence attention kernels (`attn_simple`, `attn_prefill`) share, in their
/// order, after their own leading ones: per sequence its first query row, query count, position
/// and block-table row; the block tables; the layer's KV cache; the output; the head counts.
pub(super) struct SeqAttnArgs {
    pub(super) seq_qrow: u64,
    pub(super) seq_nq: u64,
    pub(super) seq_pos: u64,
    pub(super) seq_bt: u64,
    pub(super) block_tables: u64,
    pub(super) cache: u64,
    pub(super) out: u64,
    pub(super) nh: i32,
    pub(super) nkv: i32,
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
pub(super) trait KernelArg {
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
pub(super) const MAX_KERNEL_ARGS: usize = 20;

impl CudaLlama {
    /// Launches `f` with `args` (as [`KernelArg`] slots) on the model's stream; with `opts.pdl` as a
    /// programmatic dependent launch, so that it starts (and streams its weights) while the kernel
    /// before it finishes. Only for kernels that call `pdl_wait()` before their first dependent read.
    pub(super) fn launch_ex(
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
}
