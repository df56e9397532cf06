//! CPU kernels for tandem: quantized matmul over GGML block formats, paged attention, norms, RoPE and the
//! thread pool that drives them.
//!
//! Every hot kernel has a portable scalar version (the reference, always compiled) and an AVX2+FMA+F16C
//! version picked at runtime; the quantized matmul also has an AVX-512 VNNI version. [`set_isa_cap`]
//! caps the level (the `tandem` binary's `--kernels portable|avx2`, or `TANDEM_KERNELS`).

pub mod attention;
pub mod matmul;
pub mod ops;
pub mod quant;
pub mod rope;
pub mod threads;

mod dispatch;
#[cfg(test)]
mod llamacpp_q5_0;
#[cfg(target_arch = "x86_64")]
mod simd;

pub use attention::{paged_attention, write_kv, AttnParams, AttnSeq};
pub use dispatch::{
    isa, llamacpp_batch_orders, set_isa_cap, set_llamacpp_batch_orders, simd_enabled, Isa,
};
pub use matmul::{matmul, matmul_fused, MatmulScratch};
pub use ops::{
    add_inplace, gelu_tanh_mul, rms_norm, scale_inplace, silu_mul, softcap_inplace, softmax_inplace,
};
pub use quant::{
    affine_codes, affine_codes_are_u4, affine_group, dequantize, quantize_row, DType, Matrix,
    WeightBytes,
};
pub use rope::{apply_rope, RopeScaling, RopeStyle, RopeTable};
pub use threads::{resolve_threads, ThreadPool};

/// Errors from building kernel inputs: the kernels themselves assume validated shapes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// The byte length of a weight does not match its dtype and shape.
    #[error("weight of {rows}x{cols} {dtype:?} needs {expected} bytes, got {got}")]
    SizeMismatch {
        /// Element type of the weight.
        dtype: DType,
        /// Output features.
        rows: usize,
        /// Input features.
        cols: usize,
        /// Bytes implied by dtype and shape.
        expected: usize,
        /// Bytes provided.
        got: usize,
    },
    /// Row length is not a whole number of quantization blocks.
    #[error("{cols} columns is not a multiple of the {dtype:?} block length {block_len}")]
    RaggedRow {
        /// Element type of the weight.
        dtype: DType,
        /// Input features.
        cols: usize,
        /// Elements per block of `dtype`.
        block_len: usize,
    },
}
