//! Starts the engine on the chosen backend: the CPU model, or the CUDA model in binaries built with
//! the `cuda` feature.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tandem_cpu::CpuBackend;
use tandem_engine::{Backend, Engine, EngineConfig, EngineHandle, GuideEnv, StageModel};
use tandem_model::{CpuLlama, LoadedModel, Partition, TokenPiece};
use tandem_pipeline::{CpuStage, PipelineBackend, PipelineConfig};

use crate::config::{Device, EngineSettings};
use crate::cuda_settings::CudaSettings;

/// Moves the loaded model onto `device` and starts an engine thread over it.
pub fn start_engine(
    loaded: LoadedModel,
    model_path: &Path,
    config: &EngineConfig,
    device: Device,
    cuda: &CudaSettings,
) -> Result<EngineHandle> {
    let pieces = loaded.tokenizer.token_pieces();
    check_device_settings(device, cuda)?;
    set_kernel_orders(config, device)?;
    if config.pipeline_parallel_size > 1 {
        if config.tensor_parallel_size > 1 {
            bail!(
                "pipeline_parallel_size {} needs tensor_parallel_size 1",
                config.pipeline_parallel_size
            );
        }
        let backend = pipeline_backend(loaded, model_path, config, device, cuda)?;
        return start_guided(backend, config, &pieces);
    }
    match device {
        Device::Cpu => {
            let backend = cpu_backend(loaded, config)?;
            start_guided(backend, config, &pieces)
        }
        Device::Cuda => {
            if config.tensor_parallel_size > 1 {
                bail!(
                    "tensor_parallel_size {} on --device cuda: CUDA tensor parallelism (NCCL) is not built yet; \
                     use the CPU backend or tensor_parallel_size 1",
                    config.tensor_parallel_size
                );
            }
            start_cuda(loaded, config, cuda, &pieces)
        }
    }
}

/// Refuses CUDA-only settings on the CPU, and `--device cuda` in a binary built without the `cuda`
/// feature.
pub fn check_device_settings(device: Device, cuda: &CudaSettings) -> Result<()> {
    if device == Device::Cpu && cuda.quantization.is_some() {
        bail!(
            "cuda.quantization (--quantization) quantizes weights on the GPU (--device cuda); on the CPU, \
             serve a quantized GGUF (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) instead"
        );
    }
    if device == Device::Cpu && cuda.kv_cache_dtype.is_some() {
        bail!(
            "cuda.kv_cache_dtype (--kv-cache-dtype) sets the GPU's KV cache (--device cuda); the CPU \
             backend's KV cache is f32"
        );
    }
    if device == Device::Cuda && !cfg!(feature = "cuda") {
        bail!(NO_CUDA);
    }
    Ok(())
}

/// Applies `engine.llamacpp_orders` to this process's CPU kernels (a process-wide choice, made before
/// the first kernel call), refusing it on CUDA, whose kernels have an arithmetic of their own, and a
/// second engine in the process that asks for the other orders.
pub fn set_kernel_orders(config: &EngineConfig, device: Device) -> Result<()> {
    let on = config.llamacpp_orders;
    if on && device == Device::Cuda {
        bail!(
            "engine.llamacpp_orders (--llamacpp-orders) picks the CPU kernels' summation orders; \
             --device cuda has its own arithmetic: unset it or serve on the CPU"
        );
    }
    if !tandem_kernels::set_llamacpp_batch_orders(on)
        && tandem_kernels::llamacpp_batch_orders() != on
    {
        bail!(
            "engine.llamacpp_orders {on}: this process's kernels already run with it {}",
            !on
        );
    }
    Ok(())
}

/// The refusal of `--device cuda` by a binary built without the `cuda` feature.
pub const NO_CUDA: &str =
    "--device cuda needs a binary built with `cargo build --release --features cuda`";

/// Starts the engine with guided decoding over the tokenizer's vocabulary. Should the vocabulary not
/// make a token trie, the engine still serves, refusing guided requests (400) rather than answering
/// them unconstrained.
fn start_guided<B: Backend>(
    backend: B,
    config: &EngineConfig,
    pieces: &[TokenPiece],
) -> Result<EngineHandle> {
    let guide = match GuideEnv::new(pieces, backend.eos_token_ids(), backend.vocab_size()) {
        Ok(env) => Some(env),
        Err(e) => {
            tracing::warn!(error = %e, "guided decoding unavailable: response_format requests will be refused");
            None
        }
    };
    Engine::start_guided(backend, config.clone(), guide).context("starting the engine")
}

/// A pipeline of `pipeline_parallel_size` stages on `device`: stage 0 here, the others at
/// `pipeline_stages` or, when none are given, in `tandem stage` processes started on this host (which
/// live as long as the backend). On the CPU threads are shared out: each of the N stages gets
/// `threads / N` (all cores when `threads` is 0); on CUDA each stage runs on its ordinal of
/// `cuda.pipeline_devices` (default: all on `cuda.device`).
pub fn pipeline_backend(
    loaded: LoadedModel,
    model_path: &Path,
    config: &EngineConfig,
    device: Device,
    cuda: &CudaSettings,
) -> Result<PipelineBackend> {
    let n = config.pipeline_parallel_size;
    let total = tandem_kernels::resolve_threads(config.threads);
    let per_stage = (total / n).max(1);
    let devices = cuda.stage_devices(n).map_err(anyhow::Error::msg)?;
    let limits = step_limits(config, loaded.config.max_position_embeddings);
    let (addrs, procs) = if config.pipeline_stages.is_empty() {
        let launch = crate::process::StageLaunch {
            engine: EngineSettings {
                threads: Some(per_stage),
                ..EngineSettings::of(config, device)
            },
            cuda,
            devices: &devices,
        };
        let (a, p) = crate::process::spawn_local_stages(model_path, n, &launch)?;
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
        micro_batches: micro_batches(config, device, &devices),
        min_micro_batch_tokens: tandem_pipeline::DEFAULT_MIN_MICRO_BATCH_TOKENS,
        block_size: config.block_size,
        kv_cache_memory: config.kv_cache_memory,
        timeouts: Default::default(),
        cluster_key: crate::token::key(),
        tls: crate::tls::cluster()?,
        expert_counts_every: tandem_pipeline::DEFAULT_EXPERT_COUNTS_EVERY,
    };
    let identity = loaded.identity.clone();
    let part = Partition::stage(&loaded.config, 0, n)?;
    let first = stage_model(loaded, part, device, per_stage, cuda, devices[0], limits)?;
    let mut backend = PipelineBackend::connect(first, &identity, &addrs, &cfg)
        .context("connecting the pipeline stages")?;
    if let Some(p) = procs {
        backend.keep_alive(Box::new(p));
    }
    Ok(backend)
}

/// Micro-batches per step of a pipeline on `device` with stages on `devices`: the configured count,
/// except that 0 (one per stage) means 1 when every stage runs here on one GPU. Stages sharing a GPU
/// time-slice it and cannot overlap, so cutting a step only multiplies each stage's weight reads (H200,
/// 8B shape, c64: 0.68x PP=1 with 2 micro-batches, 0.90x with 1).
fn micro_batches(config: &EngineConfig, device: Device, devices: &[usize]) -> usize {
    let one_gpu = device == Device::Cuda
        && config.pipeline_stages.is_empty()
        && devices.iter().all(|&d| Some(&d) == devices.first());
    match config.pipeline_micro_batches {
        0 if one_gpu => 1,
        m => m,
    }
}

/// What a CUDA step holds at most: tokens, sequences, and the context (`None`: the model's).
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA backend only
pub struct StepLimits {
    /// Most tokens in one step.
    pub max_tokens: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Longest context.
    pub max_model_len: Option<usize>,
}

/// The step limits of an engine run with `config` on a model of `model_len` positions.
pub fn step_limits(config: &EngineConfig, model_len: usize) -> StepLimits {
    // A step never carries more than the token budget, except whole prompts when chunking is off.
    let mut max_tokens = config.max_num_batched_tokens.max(config.max_num_seqs);
    if !config.enable_chunked_prefill {
        max_tokens = max_tokens.max(config.max_model_len.unwrap_or(model_len));
    }
    StepLimits {
        max_tokens,
        max_seqs: config.max_num_seqs,
        max_model_len: config.max_model_len,
    }
}

/// One pipeline stage's model: `part`'s layers on the CPU (`threads` kernel threads) or on CUDA device
/// `cuda_device` under the `cuda` settings and `limits`.
pub fn stage_model(
    loaded: LoadedModel,
    part: Partition,
    device: Device,
    threads: usize,
    cuda: &CudaSettings,
    cuda_device: usize,
    limits: StepLimits,
) -> Result<Box<dyn StageModel>> {
    match device {
        Device::Cpu => Ok(Box::new(CpuStage::new(
            &loaded.config,
            &loaded.weights,
            threads,
            part,
        )?)),
        Device::Cuda => cuda_stage(loaded, part, cuda, cuda_device, limits),
    }
}

#[cfg(feature = "cuda")]
fn cuda_stage(
    loaded: LoadedModel,
    part: Partition,
    cuda: &CudaSettings,
    cuda_device: usize,
    limits: StepLimits,
) -> Result<Box<dyn StageModel>> {
    let mut opts = cuda_options(cuda, limits, &loaded);
    opts.device = cuda_device;
    Ok(Box::new(tandem_cuda::CudaStage::new(
        loaded.config,
        loaded.weights,
        part,
        opts,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_stage(
    _loaded: LoadedModel,
    _part: Partition,
    _cuda: &CudaSettings,
    _cuda_device: usize,
    _limits: StepLimits,
) -> Result<Box<dyn StageModel>> {
    anyhow::bail!(NO_CUDA)
}

/// The CUDA options of `cuda` over buffers sized for `limits`.
#[cfg(feature = "cuda")]
fn cuda_options(
    cuda: &CudaSettings,
    limits: StepLimits,
    loaded: &LoadedModel,
) -> tandem_cuda::CudaOptions {
    cuda.options(tandem_cuda::CudaOptions {
        max_tokens: limits.max_tokens,
        max_seqs: limits.max_seqs,
        max_model_len: limits.max_model_len,
        // An FP8 checkpoint stays FP8 on the GPU (its dequantized weights are quantized again, one
        // scale per row and 128 columns: each row of its 128 × 128 blocks gets its own) unless the
        // settings ask for bf16.
        fp8_weights: loaded.fp8_checkpoint,
        ..tandem_cuda::CudaOptions::default()
    })
}

/// The CPU backend for `config`: one model, or `tensor_parallel_size` ranks as threads.
pub fn cpu_backend(loaded: LoadedModel, config: &EngineConfig) -> Result<CpuBackend> {
    set_kernel_orders(config, Device::Cpu)?;
    if config.tensor_parallel_size <= 1 {
        let model = CpuLlama::new(loaded.config, loaded.weights, config.threads);
        return Ok(CpuBackend::new(
            model,
            config.block_size,
            config.kv_cache_memory,
        ));
    }
    CpuBackend::tensor_parallel(
        &loaded.config,
        &loaded.weights,
        config.tensor_parallel_size,
        config.expert_placement,
        config.threads,
        config.block_size,
        config.kv_cache_memory,
    )
    .context("splitting the model over tensor-parallel ranks")
}

#[cfg(feature = "cuda")]
fn start_cuda(
    loaded: LoadedModel,
    config: &EngineConfig,
    cuda: &CudaSettings,
    pieces: &[TokenPiece],
) -> Result<EngineHandle> {
    // Guided rows never go to the GPU sampler (the engine keeps them on `forward` and masks the
    // logits on the host), so the CUDA backend needs nothing of its own for them.
    start_guided(cuda_backend(loaded, config, cuda)?, config, pieces)
}

/// The CUDA backend for `config` under the `cuda` settings: the model on `cuda.device`, its buffers
/// sized for `config`'s step limits, its KV cache `config.kv_cache_memory` (what serving and
/// `tandem profile --device cuda` run).
#[cfg(feature = "cuda")]
pub fn cuda_backend(
    loaded: LoadedModel,
    config: &EngineConfig,
    cuda: &CudaSettings,
) -> Result<tandem_cuda::CudaBackend> {
    use tandem_cuda::{CudaBackend, CudaLlama, WeightSource};
    let limits = step_limits(config, loaded.config.max_position_embeddings);
    let mut opts = cuda_options(cuda, limits, &loaded);
    opts.block_size = config.block_size;
    opts.kv_cache_memory = config.kv_cache_memory;
    let model = CudaLlama::new(
        loaded.config.clone(),
        WeightSource::Host(&loaded.weights),
        opts,
    )
    .context("loading the model onto the GPU")?;
    drop(loaded);
    Ok(CudaBackend::new(model))
}

#[cfg(not(feature = "cuda"))]
fn start_cuda(
    _loaded: LoadedModel,
    _config: &EngineConfig,
    _cuda: &CudaSettings,
    _pieces: &[TokenPiece],
) -> Result<EngineHandle> {
    anyhow::bail!(NO_CUDA)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llamacpp_orders_are_refused_on_cuda_by_name() {
        let config = EngineConfig {
            llamacpp_orders: true,
            ..EngineConfig::default()
        };
        let err = set_kernel_orders(&config, Device::Cuda).unwrap_err();
        assert!(err.to_string().contains("engine.llamacpp_orders"), "{err}");
    }

    #[test]
    fn stages_sharing_one_gpu_do_not_cut_steps_unless_told() {
        let mut c = EngineConfig::default();
        assert_eq!(micro_batches(&c, Device::Cuda, &[0, 0]), 1);
        assert_eq!(micro_batches(&c, Device::Cuda, &[0, 1]), 0);
        assert_eq!(micro_batches(&c, Device::Cpu, &[0, 0]), 0);
        c.pipeline_micro_batches = 4;
        assert_eq!(micro_batches(&c, Device::Cuda, &[0, 0]), 4);
        c.pipeline_micro_batches = 0;
        c.pipeline_stages = vec!["other-host:9000".into()];
        assert_eq!(micro_batches(&c, Device::Cuda, &[0, 0]), 0);
    }
}
