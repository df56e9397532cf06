//! Starts the engine on the chosen backend: the CPU model, or the CUDA model in binaries built with
//! the `cuda` feature.

use anyhow::{bail, Context, Result};
use tandem_engine::{CpuBackend, Engine, EngineConfig, EngineHandle};
use tandem_model::{CpuLlama, LoadedModel};

use crate::config::Device;

/// Moves the loaded model onto `device` and starts an engine thread over it.
pub fn start_engine(
    loaded: LoadedModel,
    config: &EngineConfig,
    device: Device,
) -> Result<EngineHandle> {
    match device {
        Device::Cpu => {
            let backend = cpu_backend(loaded, config)?;
            Engine::start(backend, config.clone()).context("starting the engine")
        }
        Device::Cuda => {
            if config.tensor_parallel_size > 1 {
                bail!(
                    "tensor_parallel_size {} on --device cuda: CUDA tensor parallelism (NCCL) is not built yet; \
                     use the CPU backend or tensor_parallel_size 1",
                    config.tensor_parallel_size
                );
            }
            start_cuda(loaded, config)
        }
    }
}

/// The CPU backend for `config`: one model, or `tensor_parallel_size` ranks as threads.
pub fn cpu_backend(loaded: LoadedModel, config: &EngineConfig) -> Result<CpuBackend> {
    if config.tensor_parallel_size <= 1 {
        let model = CpuLlama::new(loaded.config, loaded.weights, config.threads);
        return Ok(CpuBackend::new(
            model,
            config.block_size,
            config.kv_cache_bytes,
        ));
    }
    CpuBackend::tensor_parallel(
        &loaded.config,
        &loaded.weights,
        config.tensor_parallel_size,
        config.threads,
        config.block_size,
        config.kv_cache_bytes,
    )
    .context("splitting the model over tensor-parallel ranks")
}

#[cfg(feature = "cuda")]
fn start_cuda(loaded: LoadedModel, config: &EngineConfig) -> Result<EngineHandle> {
    use tandem_cuda::{CudaBackend, CudaLlama, CudaOptions, WeightSource};
    let max_model_len = config.max_model_len;
    // A step never carries more than the token budget, except whole prompts when chunking is off.
    let mut max_tokens = config.max_num_batched_tokens.max(config.max_num_seqs);
    if !config.enable_chunked_prefill {
        max_tokens = max_tokens.max(max_model_len.unwrap_or(loaded.config.max_position_embeddings));
    }
    let opts = CudaOptions {
        block_size: config.block_size,
        kv_cache_bytes: config.kv_cache_bytes,
        max_tokens,
        max_seqs: config.max_num_seqs,
        max_model_len,
        ..CudaOptions::default()
    }
    .with_env_overrides();
    let model = CudaLlama::new(
        loaded.config.clone(),
        WeightSource::Host(&loaded.weights),
        opts,
    )
    .context("loading the model onto the GPU")?;
    drop(loaded);
    Engine::start(CudaBackend::new(model), config.clone()).context("starting the engine")
}

#[cfg(not(feature = "cuda"))]
fn start_cuda(_loaded: LoadedModel, _config: &EngineConfig) -> Result<EngineHandle> {
    anyhow::bail!("--device cuda needs a binary built with `cargo build --release --features cuda`")
}
