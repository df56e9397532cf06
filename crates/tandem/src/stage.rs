//! `tandem stage`: hosts one later pipeline stage (layers of stage `I` of `N`) for one worker, on the CPU
//! or with `--device cuda` on GPU `--cuda-device` (a worker starts its stages on this host with
//! `crate::process::spawn_local_stages`, passing its device, CUDA settings and step limits). With `TANDEM_CLUSTER_TOKEN`
//! set (a worker's stages inherit it) only a worker proving the token is served.

use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tandem_model::LoadOptions;

use crate::config::{ByteSize, Device};
use crate::cuda_settings::CudaArgs;
use crate::device::{stage_model, StepLimits};
use crate::process::{exit_when_parent_goes, resolve_model, STAGE_READY_PREFIX};

/// Flags of `tandem stage`.
#[derive(Clone, Debug, Args)]
pub struct StageArgs {
    /// GGUF file or HF folder (default: models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Index of the stage to host (1 or later; stage 0 runs inside the worker).
    #[arg(long)]
    pub stage: usize,
    /// Pipeline stages in all (the worker's pipeline_parallel_size).
    #[arg(long)]
    pub stages: usize,
    /// Address to listen on (port 0 = any free port; the chosen one is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Kernel threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// The whole model's KV budget the stage accepts, as its worker's `engine.kv_cache_memory` ("1GiB",
    /// "512MiB"): a worker asking for a bigger pool is refused, so no client sizes this process's memory.
    #[arg(long, default_value_t = ByteSize(tandem_engine::EngineConfig::default().kv_cache_bytes))]
    pub kv_cache_memory: ByteSize,
    /// Seconds any one read or write of a request may take.
    #[arg(long, default_value_t = 60.0)]
    pub io_timeout: f64,
    /// Backend of this stage: cpu, or cuda in binaries built with the `cuda` feature.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// CUDA settings of this stage (`--cuda-device` picks its GPU).
    #[command(flatten)]
    pub cuda: CudaArgs,
    /// Most tokens in one step (--device cuda: sizes its buffers; a worker passes its own).
    #[arg(long, default_value_t = 2048)]
    pub max_tokens: usize,
    /// Most sequences in one step (--device cuda).
    #[arg(long, default_value_t = 256)]
    pub max_seqs: usize,
    /// Longest context (--device cuda; unset: the model's).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Exit when stdin closes (set by a launching worker, so stages never outlive it).
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
    /// The tag of the process that started this stage (`decode-0`), so its lines read `[decode-0/stage-1]`.
    #[arg(long, hide = true)]
    pub parent: Option<String>,
}

/// Runs the stage server until killed.
pub fn run(args: StageArgs) -> Result<()> {
    if args.exit_with_stdin {
        exit_when_parent_goes("the worker")?;
    }
    let model_path = resolve_model(args.model.as_deref())?;
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: false })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let listener =
        TcpListener::bind(&args.listen).with_context(|| format!("binding {}", args.listen))?;
    let identity = loaded.identity.clone();
    let part = tandem_model::Partition::stage(&loaded.config, args.stage, args.stages)?;
    let cuda = args.cuda.as_section();
    let limits = StepLimits {
        max_tokens: args.max_tokens,
        max_seqs: args.max_seqs,
        max_model_len: args.max_model_len,
    };
    let model = stage_model(
        loaded,
        part,
        args.device,
        args.threads,
        &cuda,
        cuda.device.unwrap_or(0),
        limits,
    )?;
    let server = tandem_pipeline::serve_stage(
        model,
        &identity,
        args.stage,
        args.stages,
        listener,
        tandem_pipeline::StageServing {
            io: Duration::from_secs_f64(args.io_timeout),
            kv_cache_bytes: args.kv_cache_memory.0,
            key: crate::token::key(),
        },
    )?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{STAGE_READY_PREFIX}{}", server.addr())?;
    out.flush()?;
    drop(out);
    server.join();
    Ok(())
}
