//! `tandem stage`: hosts one later pipeline stage (layers of stage `I` of `N`) for one worker, on the CPU
//! or with `--device cuda` on GPU `--cuda-device`. A worker starts its stages on this host with
//! `crate::process::spawn_local_stages`, handing each its settings as one JSON document
//! (`--settings-json`: the worker's `engine:` and `cuda:` sections as it resolved them); by hand, the
//! same settings are flags (`--kv-cache-memory`, `--max-num-seqs`, `--cuda-device`, ...), which should
//! be the worker's. With `TANDEM_CLUSTER_TOKEN` set (a worker's stages inherit it) only a worker
//! proving the token is served.

use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use tandem_model::LoadOptions;

use crate::config::EngineSettings;
use crate::cuda_settings::CudaSettings;
use crate::device::{stage_model, step_limits};
use crate::process::{exit_when_parent_goes, resolve_model, STAGE_READY_PREFIX};

/// Everything one stage runs with: the flags of a stage started by hand, or the one JSON document
/// (`--settings-json`) a worker hands each stage it starts.
#[derive(Clone, Debug, Args, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct StageSettings {
    /// GGUF file or HF folder (default: models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Index of the stage to host (1 or later; stage 0 runs inside the worker).
    #[arg(long, required_unless_present = "settings_json")]
    pub stage: Option<usize>,
    /// Pipeline stages in all (the worker's pipeline_parallel_size).
    #[arg(long, required_unless_present = "settings_json")]
    pub stages: Option<usize>,
    /// Address to listen on (port 0 = any free port; the chosen one is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Seconds any one read or write of a request may take.
    #[arg(long, default_value_t = 60.0)]
    pub io_timeout: f64,
    /// Serve without a cluster token although --listen is reachable beyond loopback; without it such a
    /// stage refuses to start with no `TANDEM_CLUSTER_TOKEN` set.
    #[arg(long)]
    pub allow_unauthenticated: bool,
    /// The worker's engine settings: `kv_cache_memory` is the whole model's KV budget the stage accepts
    /// (a worker asking for a bigger pool is refused, so no client sizes this process's memory); the step
    /// limits (`max_num_batched_tokens`, `max_num_seqs`, `max_model_len`, chunked prefill) size a CUDA
    /// stage's buffers; `threads` and `device` are this stage's own.
    #[command(flatten)]
    pub engine: EngineSettings,
    /// CUDA settings of this stage (`--cuda-device` picks its GPU).
    #[command(flatten)]
    pub cuda: CudaSettings,
}

impl Default for StageSettings {
    fn default() -> Self {
        StageSettings {
            model: None,
            stage: None,
            stages: None,
            listen: "127.0.0.1:0".into(),
            io_timeout: 60.0,
            allow_unauthenticated: false,
            engine: EngineSettings::default(),
            cuda: CudaSettings::default(),
        }
    }
}

/// Flags of `tandem stage`.
#[derive(Clone, Debug, Args)]
pub struct StageArgs {
    /// The whole settings as one JSON document (how a worker starts its stages); no settings flag may
    /// come with it.
    #[arg(long, hide = true, conflicts_with_all = with_flags())]
    pub settings_json: Option<String>,
    /// The settings given as flags.
    #[command(flatten)]
    pub settings: StageSettings,
    /// Exit when stdin closes (set by a launching worker, so stages never outlive it).
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
    /// The tag of the process that started this stage (`decode-0`), so its lines read `[decode-0/stage-1]`.
    #[arg(long, hide = true)]
    pub parent: Option<String>,
}

/// What `--settings-json` conflicts with: every settings flag (the engine section by its flag ids, the
/// visible CUDA flags by their ids).
fn with_flags() -> impl Iterator<Item = &'static str> {
    [
        "model",
        "stage",
        "stages",
        "listen",
        "io_timeout",
        "allow_unauthenticated",
    ]
    .into_iter()
    .chain(crate::config::ENGINE_FLAG_IDS)
    .chain(CudaSettings::FLAG_IDS)
}

impl StageArgs {
    /// The settings this stage runs with: the worker's document, or the flags.
    pub fn resolve(&self) -> Result<StageSettings> {
        let Some(doc) = &self.settings_json else {
            return Ok(self.settings.clone());
        };
        let mut settings: StageSettings =
            serde_json::from_str(doc).context("parsing --settings-json")?;
        settings.cuda.tuning = self.settings.cuda.tuning.clone();
        Ok(settings)
    }

    /// The tag on the log lines of stage `stage` (`decode-0/stage-1`; `?` when the settings name none).
    pub fn log_tag(&self, stage: Option<usize>) -> crate::logging::ProcessTag {
        let stage = stage.map_or_else(|| "?".to_owned(), |i| i.to_string());
        crate::logging::ProcessTag {
            name: stage_name(self.parent.as_deref(), &stage),
            role: "stage".into(),
        }
    }
}

/// The name of stage `stage` of the worker `parent` in logs and process lists (`decode-0/stage-1`).
pub fn stage_name(parent: Option<&str>, stage: &str) -> String {
    match parent {
        Some(parent) => format!("{parent}/stage-{stage}"),
        None => format!("stage-{stage}"),
    }
}

/// Runs the stage server with `settings` (`args` resolved) until killed.
pub fn run(args: StageArgs, settings: StageSettings) -> Result<()> {
    if args.exit_with_stdin {
        exit_when_parent_goes("the worker")?;
    }
    crate::worker::log_settings("stage", &settings.engine, &settings.cuda);
    let stage = settings.stage.context("--stage is required")?;
    let stages = settings.stages.context("--stages is required")?;
    // Bound first, so a busy or open port fails before the model is loaded.
    let listener = TcpListener::bind(&settings.listen)
        .with_context(|| format!("binding {}", settings.listen))?;
    crate::token::check_exposure(
        "the stage's port (--listen)",
        listener.local_addr()?,
        settings.allow_unauthenticated,
    )?;
    let model_path = resolve_model(settings.model.as_deref())?;
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: false })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let identity = loaded.identity.clone();
    let part = tandem_model::Partition::stage(&loaded.config, stage, stages)?;
    let engine = settings.engine.engine_config();
    crate::device::set_kernel_orders(&engine, settings.engine.device.unwrap_or_default())?;
    let limits = step_limits(&engine, loaded.config.max_position_embeddings);
    let model = stage_model(
        loaded,
        part,
        settings.engine.device.unwrap_or_default(),
        engine.threads,
        &settings.cuda,
        settings.cuda.device.unwrap_or(0),
        limits,
    )?;
    let server = tandem_pipeline::serve_stage(
        model,
        &identity,
        stage,
        stages,
        listener,
        tandem_pipeline::StageServing {
            io: Duration::from_secs_f64(settings.io_timeout),
            kv_cache_memory: engine.kv_cache_memory,
            key: crate::token::key(),
            tls: crate::tls::cluster()?,
        },
    )?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{STAGE_READY_PREFIX}{}", server.addr())?;
    out.flush()?;
    drop(out);
    server.join();
    Ok(())
}
