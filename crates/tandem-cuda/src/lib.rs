//! The CUDA backend of tandem: a Llama-family model (bf16, FP8 or GGUF block-quantized weights) on
//! one NVIDIA GPU behind the engine's [`tandem_engine::Backend`] seam, with a paged bf16 KV cache in
//! the block layout the CPU backend and the KV transfer use.
//!
//! GEMMs run on cuBLAS (bf16 inputs, fp32 accumulation); everything else is our own CUDA C in
//! `kernels/llama.cu`, compiled at start-up by NVRTC for the device's compute capability. Nothing
//! here links CUDA at build time: the driver, NVRTC and cuBLAS are loaded at run time, so the crate
//! builds on machines without CUDA.

pub mod backend;
pub mod error;
pub mod kernel_cache;
pub mod kernels;
pub mod kv_bulk;
mod memory;
pub mod model;
pub mod options;
pub mod packed;
pub mod plan;
pub mod stage;

pub use backend::CudaBackend;
pub use error::CudaError;
pub use model::{driver_available, CudaLlama, SampleRow, WeightSource};
pub use options::{AttnMode, CudaOptions};
pub use stage::CudaStage;
