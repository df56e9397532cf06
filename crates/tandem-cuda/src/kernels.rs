//! The CUDA C kernel source and its compilation by NVRTC for the device at hand.
//!
//! The source lives in `kernels/llama.cu` and `kernels/moe.cu` (mixture-of-experts layers, which use
//! llama.cu's helpers); the model's shape is prepended as `#define`s so that loops
//! over head dimensions and GQA groups unroll at compile time.

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::error::CudaError;

/// The kernels' CUDA C source, embedded in the binary.
pub const SOURCE: &str = concat!(
    include_str!("../kernels/llama.cu"),
    include_str!("../kernels/moe.cu")
);

/// Most keys per decode attention partition (`DEC_PART`, the kernel's shared score buffer).
pub const DECODE_PARTITION: usize = 256;

/// Most keys per partition of `attn_decode_small` (`DS_KEYS`: each thread holds its share of the
/// partition's K and V in registers), the kernel of steps with few decoding sequences.
pub const DECODE_PARTITION_SMALL: usize = 64;

// The large kernel's shared score buffer holds DECODE_PARTITION keys; no partition may be longer.
const _: () = assert!(DECODE_PARTITION_SMALL <= DECODE_PARTITION);

/// Decode batches up to this size use [`DECODE_PARTITION_SMALL`].
pub const SMALL_DECODE_BATCH: usize = 32;

/// Keys per decode partition for a step of `n_decode` single-token sequences; `small` is the
/// partition length of small steps (at most [`DECODE_PARTITION_SMALL`], which selects
/// `attn_decode_small`).
pub fn decode_partition(n_decode: usize, small: usize) -> usize {
    if n_decode <= SMALL_DECODE_BATCH {
        small.clamp(1, DECODE_PARTITION_SMALL)
    } else {
        DECODE_PARTITION
    }
}

/// Every kernel the backend launches, by its `extern "C"` name.
pub const KERNEL_NAMES: [&str; 30] = [
    "init_uniform",
    "fill_bf16",
    "embed_gather",
    "add_rmsnorm",
    "gather_rows",
    "silu_mul",
    "rope_kv_write",
    "qk_norm",
    "softcap",
    "argmax_rows",
    "sample_rows",
    "mask_rows",
    "attn_simple",
    "attn_prefill",
    "attn_decode",
    "attn_decode_small",
    "kv_gather",
    "kv_scatter",
    "moe_route",
    "moe_align",
    "moe_gemm_16",
    "moe_gemm_64",
    "moe_combine",
    "moe_gemv_silu",
    "moe_gemv_down",
    "quant_fp8",
    "dequant_fp8",
    "quant_act_fp8",
    "dequant_q4",
    "dequant_q8",
];

/// Largest row count the small-batch GEMV kernels (`gemv_1` .. `gemv_8`) handle (the tensor-core
/// path of the packed formats has 8 activation columns an MMA).
pub const GEMV_MAX_ROWS: usize = 8;

/// Values of padding after each activation row the fused-norm GEMVs keep in shared memory
/// (`GV_XPAD` in llama.cu).
pub const GEMV_SMEM_PAD: usize = 16;

/// Dynamic shared memory of `attn_prefill` (`PF_SMEM_BYTES` in llama.cu): two stages of a 64-key K
/// tile and V tile plus the 128-row Q tile, rows padded by 8 values.
pub fn prefill_smem_bytes(head_dim: usize) -> usize {
    (2 * 2 * 64 + crate::plan::PREFILL_TILE_ROWS) * (head_dim + 8) * 2
}

/// Name prefixes of the GEMV kernels, each instantiated for 1..=GEMV_MAX_ROWS rows (`gemv_add_3`):
/// plain, residual add, RMSNorm + gate/up + SiLU·mul, RMSNorm + QKV + RoPE + K/V write.
pub const GEMV_FAMILIES: [&str; 4] = ["gemv_", "gemv_add_", "gemv_silu_", "gemv_qkv_"];

/// The same four families over FP8 E4M3 weights with one scale per row and 128 columns (`gemv_f8_3`).
pub const GEMV_FP8_FAMILIES: [&str; 4] =
    ["gemv_f8_", "gemv_add_f8_", "gemv_silu_f8_", "gemv_qkv_f8_"];

/// The same four families over packed GGUF weights (`crate::packed`): 4-bit codes (`gemv_q4_3`) and
/// 8-bit codes (`gemv_q8_3`), one (scale, min) pair per 16-byte chunk.
pub const GEMV_Q4_FAMILIES: [&str; 4] =
    ["gemv_q4_", "gemv_add_q4_", "gemv_silu_q4_", "gemv_qkv_q4_"];

/// See [`GEMV_Q4_FAMILIES`].
pub const GEMV_Q8_FAMILIES: [&str; 4] =
    ["gemv_q8_", "gemv_add_q8_", "gemv_silu_q8_", "gemv_qkv_q8_"];

/// Every GEMV family of every weight format, in the order of the backend's weight formats (bf16,
/// FP8, packed 4-bit, packed 8-bit).
pub const GEMV_FORMAT_FAMILIES: [[&str; 4]; 4] = [
    GEMV_FAMILIES,
    GEMV_FP8_FAMILIES,
    GEMV_Q4_FAMILIES,
    GEMV_Q8_FAMILIES,
];

/// Compile-time tuning of the small-batch GEMV kernels (`GV_U`, `GV_MINB`, `GV_MMA` in llama.cu),
/// settable for A/B timings on the device; the defaults are the measured best.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvTuning {
    /// 16-byte chunks of each of its two rows a lane loads per step (and prefetches for the next).
    pub unroll: usize,
    /// Blocks per multiprocessor the compiler must fit (`__launch_bounds__`): more caps registers.
    pub min_blocks: usize,
    /// Packed GGUF GEMVs on the tensor cores (`gv_octet`: a warp takes 8 row pairs, a chunk's dot
    /// products for every activation row are MMAs); false: the FP32-lane kernels (`gv_pair`, one row
    /// pair a warp), kept for A/B timings.
    pub packed_mma: bool,
}

impl Default for GemvTuning {
    fn default() -> Self {
        Self {
            unroll: 2,
            min_blocks: 2,
            packed_mma: true,
        }
    }
}

/// The compile-time shape the kernels are specialised for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelShape {
    /// Width of one attention head.
    pub head_dim: usize,
    /// Query heads per KV head.
    pub gqa: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Weight formats whose GEMVs are compiled: bit `f` for format `f` of
    /// [`GEMV_FORMAT_FAMILIES`] (bf16 is always compiled). Each format adds 32 kernels, so a model
    /// compiles only the formats its weights use.
    pub formats: u8,
    /// The KV cache holds FP8 E4M3 codes (`KV_FP8`, scaled by [`KV_FP8_SCALE`]) instead of bf16.
    pub kv_fp8: bool,
}

/// The per-tensor scale of FP8 KV codes (value = code × scale): 1, as vLLM uses for `kv_cache_dtype:
/// fp8` without calibrated scales — keys and values of the served families stay well inside E4M3's
/// ±448, and larger ones saturate rather than overflow.
pub const KV_FP8_SCALE: f32 = 1.0;

impl KernelShape {
    /// Checks the limits the kernels are written for.
    pub fn validate(&self) -> Result<(), CudaError> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(16) || self.head_dim > 256 {
            return Err(CudaError::Unsupported(format!(
                "head_dim {} (the CUDA kernels need a multiple of 16, at most 256)",
                self.head_dim
            )));
        }
        // The decode kernel keeps GQA x 4 KiB of partial sums in shared memory.
        if self.gqa == 0 || self.gqa > 8 {
            return Err(CudaError::Unsupported(format!(
                "{} query heads per KV head (at most 8)",
                self.gqa
            )));
        }
        if self.block_size == 0 {
            return Err(CudaError::Unsupported("KV block size 0".into()));
        }
        Ok(())
    }

    /// Whether the tensor-core prefill kernel fits this head width (its registers hold two rows'
    /// HEAD_DIM outputs; its tiles take 104,448 bytes of shared memory at 128).
    pub fn tensor_core_prefill(&self) -> bool {
        self.head_dim <= 128
    }

    /// The full source with this shape's and the GEMV tuning's `#define`s in front.
    pub fn source(&self, tuning: &GemvTuning) -> String {
        format!(
            "#define HEAD_DIM {}\n#define GQA {}\n#define KV_BLOCK {}\n#define DEC_PART {}\n#define DS_KEYS {}\n\
             #define GV_U {}\n#define GV_MINB {}\n#define GV_MMA {}\n#define GV_FORMATS {}\n#define KV_FP8 {}\n\
             #define KV_SCALE {:?}f\n{SOURCE}",
            self.head_dim,
            self.gqa,
            self.block_size,
            DECODE_PARTITION,
            DECODE_PARTITION_SMALL,
            tuning.unroll.clamp(1, 16),
            tuning.min_blocks.clamp(1, 8),
            u8::from(tuning.packed_mma),
            self.formats | 1,
            u8::from(self.kv_fp8),
            KV_FP8_SCALE
        )
    }
}

/// Compiles the kernels to PTX for compute capability `major.minor` (`compute_90` on an H100/H200).
pub fn compile(
    shape: &KernelShape,
    tuning: &GemvTuning,
    major: i32,
    minor: i32,
) -> Result<Ptx, CudaError> {
    shape.validate()?;
    let opts = CompileOptions {
        options: vec![
            format!("--gpu-architecture=compute_{major}{minor}"),
            "--std=c++17".into(),
        ],
        use_fast_math: Some(false),
        name: Some("tandem_llama.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(shape.source(tuning), opts).map_err(|e| match e {
        CompileError::CompileError { log, .. } => {
            CudaError::Compile(log.to_string_lossy().into_owned())
        }
        other => CudaError::Compile(format!("{other:?}")),
    })
}

/// [`compile`] through the on-disk cache under `cache_dir` (see [`crate::kernel_cache`]): a restart
/// or a second worker on the same device loads the PTX instead of running NVRTC again.
pub fn compile_cached(
    shape: &KernelShape,
    tuning: &GemvTuning,
    major: i32,
    minor: i32,
    cache_dir: Option<&std::path::Path>,
) -> Result<Ptx, CudaError> {
    let Some(dir) = cache_dir else {
        return compile(shape, tuning, major, minor);
    };
    shape.validate()?;
    let key = format!(
        "{}\n// options: compute_{major}{minor} --std=c++17 no-fast-math\n",
        shape.source(tuning)
    );
    let entry = crate::kernel_cache::CacheEntry::new(dir, key);
    if let Some(ptx) = entry.load() {
        tracing::info!(dir = %dir.display(), "CUDA kernels loaded from the cache");
        return Ok(Ptx::from_src(ptx));
    }
    let ptx = compile(shape, tuning, major, minor)?;
    entry.store(&ptx.to_src());
    Ok(ptx)
}

/// Whether NVRTC's library can be loaded here (it needs no GPU).
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes for the shared library with dlopen; no symbol is called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_defines_every_kernel_the_host_launches() {
        for name in KERNEL_NAMES {
            let decl = format!("void {name}(");
            let at = SOURCE
                .find(&decl)
                .or_else(|| SOURCE.find(&format!(" {name}(")))
                .unwrap_or_else(|| panic!("kernel {name} is not in llama.cu"));
            let before = &SOURCE[..at];
            let line_start = before
                .rfind("extern \"C\"")
                .expect("extern C before kernel");
            assert!(
                SOURCE[line_start..at].contains("__global__"),
                "{name} must be an extern \"C\" __global__ function"
            );
        }
        for m in 1..=GEMV_MAX_ROWS {
            assert!(
                SOURCE.contains(&format!("\nGEMV({m})\n")),
                "gemv_{m} is not instantiated"
            );
        }
        // The host sizes the fused GEMVs' shared memory with the kernels' row padding.
        assert!(SOURCE.contains(&format!("\n#define GV_XPAD {GEMV_SMEM_PAD}\n")));
        // Braces balance (a cheap guard against a truncated or mangled file).
        let open = SOURCE.matches('{').count();
        let close = SOURCE.matches('}').count();
        assert_eq!(open, close);
    }

    #[test]
    fn shape_defines_come_first_and_limits_are_checked() {
        let s = KernelShape {
            head_dim: 128,
            gqa: 4,
            block_size: 16,
            formats: 0,
            kv_fp8: false,
        };
        assert!(s.validate().is_ok());
        assert!(s.tensor_core_prefill());
        let src = s.source(&GemvTuning::default());
        assert!(src.starts_with("#define HEAD_DIM 128\n#define GQA 4\n#define KV_BLOCK 16\n"));
        assert!(src.contains(
            "#define GV_U 2\n#define GV_MINB 2\n#define GV_MMA 1\n#define GV_FORMATS 1\n#define KV_FP8 0\n\
             #define KV_SCALE 1.0f\n"
        ));
        let fp8 = KernelShape { kv_fp8: true, ..s }.source(&GemvTuning::default());
        assert!(fp8.contains("#define KV_FP8 1\n"));
        assert!(src.contains(&format!("#define DEC_PART {DECODE_PARTITION}")));
        assert!(KernelShape { head_dim: 72, ..s }.validate().is_err());
        assert!(KernelShape { gqa: 0, ..s }.validate().is_err());
        assert!(KernelShape { gqa: 16, ..s }.validate().is_err());
        assert!(!KernelShape { head_dim: 256, ..s }.tensor_core_prefill());
        assert_eq!(decode_partition(1, 64), DECODE_PARTITION_SMALL);
        assert_eq!(decode_partition(1, 32), 32);
        assert_eq!(decode_partition(1, 1000), DECODE_PARTITION_SMALL);
        assert_eq!(
            decode_partition(SMALL_DECODE_BATCH + 1, 32),
            DECODE_PARTITION
        );
    }

    /// `unpack16_e4m3`'s integer decode, step for step on the host (the source must still hold
    /// those steps): every code pair comes out as its E4M3 values times 2^-120 exactly, subnormal
    /// codes as float denormals, and the two 2^60 factors the kernels apply restore the values.
    #[test]
    fn the_integer_e4m3_decode_is_exact_for_every_code() {
        let body = &SOURCE[SOURCE.find("void unpack16_e4m3(").expect("unpack16_e4m3")..];
        let body = &body[..body.find("\n}\n").expect("end of unpack16_e4m3")];
        for step in [
            "__byte_perm(w[i], 0, j ? 0x3424 : 0x1404)",
            "((y >> 4) & 0x07f007f0u) | (y & 0x80008000u)",
            "__uint_as_float(z << 16)",
            "__uint_as_float(z & 0xffff0000u)",
        ] {
            assert!(body.contains(step), "unpack16_e4m3 no longer does {step}");
        }
        assert!(SOURCE.contains("#define FP8_UNSCALE 1152921504606846976.f"));
        let unscale = 2f32.powi(60);
        use tandem_model::weights::fp8::e4m3_to_f32;
        for b0 in 0u32..=255 {
            for b1 in [b0, b0 ^ 0x80, 0x7e, 0x01] {
                // Selector 0x1404: byte 0 of the word to bits 15..8, byte 1 to bits 31..24.
                let y = (b1 << 24) | (b0 << 8);
                let z = ((y >> 4) & 0x07f0_07f0) | (y & 0x8000_8000);
                let (lo, hi) = (f32::from_bits(z << 16), f32::from_bits(z & 0xffff_0000));
                for (b, got) in [(b0, lo), (b1, hi)] {
                    let want = e4m3_to_f32(b as u8);
                    if want.is_nan() {
                        continue;
                    }
                    assert_eq!(
                        f64::from(got),
                        f64::from(want) * 2f64.powi(-120),
                        "code {b:#04x}"
                    );
                    assert_eq!(got * unscale * unscale, want, "code {b:#04x} restored");
                }
            }
        }
    }
}
