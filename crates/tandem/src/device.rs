//! Starts the engine on the chosen backend: the CPU model, or the CUDA model in binaries built with
//! the `cuda` feature.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tandem_cpu::CpuBackend;
use tandem_engine::{Engine, EngineConfig, EngineHandle};
use tandem_model::{CpuLlama, LoadedModel};
use tandem_pipeline::{PipelineBackend, PipelineConfig};

use crate::config::Device;
use crate::cuda_settings::CudaSection;

/// Moves the loaded model onto `device` and starts an engine thread over it.
pub fn start_engine(
    loaded: LoadedModel,
    model_path: &Path,
    config: &EngineConfig,
    device: Device,
    cuda: &CudaSection,
) -> Result<EngineHandle> {
    if config.pipeline_parallel_size > 1 {
        if device != Device::Cpu || config.tensor_parallel_size > 1 {
            bail!(
                "pipeline_parallel_size {} needs --device cpu and tensor_parallel_size 1",
                config.pipeline_parallel_size
            );
        }
        let backend = pipeline_backend(loaded, model_path, config)?;
        return Engine::start(backend, config.clone()).context("starting the engine");
    }
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
            start_cuda(loaded, config, cuda)
        }
    }
}

/// A pipeline of `pipeline_parallel_size` stages: stage 0 here, the others at `pipeline_stages` or, when
/// none are given, in `tandem stage` processes started on this host (which live as long as the backend).
/// Threads are shared out: each of the N stages gets `threads / N` (all cores when `threads` is 0).
pub fn pipeline_backend(
    loaded: LoadedModel,
    model_path: &Path,
    config: &EngineConfig,
) -> Result<PipelineBackend> {
    let n = config.pipeline_parallel_size;
    let total = tandem_kernels::resolve_threads(config.threads);
    let per_stage = (total / n).max(1);
    let (addrs, procs) = if config.pipeline_stages.is_empty() {
        let (a, p) = crate::process::spawn_local_stages(model_path, n, per_stage)?;
        (a, Some(p))
    } else if config.pipeline_stages.len() == n - 1 {
        (config.pipeline_stages.clone(), None)
    } else {
        bail!(
            "pipeline_parallel_size {n} needs {} stage addresses, got {}",
            n - 1,
            config.pipeline_stages.len()
        );
    };
    let cfg = PipelineConfig {
        micro_batches: config.pipeline_micro_batches,
        min_micro_batch_tokens: tandem_pipeline::DEFAULT_MIN_MICRO_BATCH_TOKENS,
        threads: per_stage,
        block_size: config.block_size,
        kv_cache_bytes: config.kv_cache_bytes,
        timeouts: Default::default(),
        cluster_key: crate::token::key(),
    };
    let mut backend = PipelineBackend::connect(
        &loaded.config,
        &loaded.weights,
        &loaded.identity,
        &addrs,
        &cfg,
    )
    .context("connecting the pipeline stages")?;
    if let Some(p) = procs {
        backend.keep_alive(Box::new(p));
    }
    Ok(backend)
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
fn start_cuda(
    loaded: LoadedModel,
    config: &EngineConfig,
    cuda: &CudaSection,
) -> Result<EngineHandle> {
    use tandem_cuda::{CudaBackend, CudaLlama, CudaOptions, WeightSource};
    let max_model_len = config.max_model_len;
    // A step never carries more than the token budget, except whole prompts when chunking is off.
    let mut max_tokens = config.max_num_batched_tokens.max(config.max_num_seqs);
    if !config.enable_chunked_prefill {
        max_tokens = max_tokens.max(max_model_len.unwrap_or(loaded.config.max_position_embeddings));
    }
    let opts = cuda.options(CudaOptions {
        block_size: config.block_size,
        kv_cache_bytes: config.kv_cache_bytes,
        max_tokens,
        max_seqs: config.max_num_seqs,
        max_model_len,
        ..CudaOptions::default()
    });
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
fn start_cuda(
    _loaded: LoadedModel,
    _config: &EngineConfig,
    _cuda: &CudaSection,
) -> Result<EngineHandle> {
    anyhow::bail!("--device cuda needs a binary built with `cargo build --release --features cuda`")
}
