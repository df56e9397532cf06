//! `tandem stage`: hosts one later pipeline stage (layers of stage `I` of `N`) for one worker (a worker
//! starts its stages on this host with `crate::process::spawn_local_stages`). With `TANDEM_CLUSTER_TOKEN`
//! set (a worker's stages inherit it) only a worker proving the token is served.

use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tandem_model::LoadOptions;

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
    /// Seconds any one read or write of a request may take.
    #[arg(long, default_value_t = 60.0)]
    pub io_timeout: f64,
    /// Exit when stdin closes (set by a launching worker, so stages never outlive it).
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
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
    let server = tandem_pipeline::serve_stage(
        &loaded.config,
        &loaded.weights,
        &loaded.identity,
        args.stage,
        args.stages,
        args.threads,
        listener,
        Duration::from_secs_f64(args.io_timeout),
        crate::token::key(),
    )?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{STAGE_READY_PREFIX}{}", server.addr())?;
    out.flush()?;
    drop(out);
    server.join();
    Ok(())
}
