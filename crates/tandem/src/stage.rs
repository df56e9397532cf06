//! `tandem stage`: hosts one later pipeline stage (layers of stage `I` of `N`) for one worker, and the
//! launcher side that starts a worker's stages on this host.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_model::LoadOptions;

/// The line a stage prints on stdout once it serves, so the worker that started it learns its address.
pub const READY_PREFIX: &str = "TANDEM_STAGE_READY ";

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
        crate::worker::exit_when_parent_goes("the worker")?;
    }
    let model_path = crate::serve::resolve_model(args.model.as_deref())?;
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
    )?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{READY_PREFIX}{}", server.addr())?;
    out.flush()?;
    drop(out);
    server.join();
    Ok(())
}

/// Stage processes a worker started; killed (and reaped) when dropped, i.e. when the engine's backend goes.
pub struct StageProcesses(Vec<Child>);

impl Drop for StageProcesses {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts stages 1..`stages` of `model` as child processes on loopback and returns their addresses.
pub fn spawn_local(
    model: &Path,
    stages: usize,
    threads: usize,
) -> Result<(Vec<String>, StageProcesses)> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut procs = StageProcesses(Vec::new());
    let mut ready = Vec::new();
    for stage in 1..stages {
        let mut child = Command::new(&exe)
            .arg("stage")
            .arg("--model")
            .arg(model)
            .args([
                "--stage",
                &stage.to_string(),
                "--stages",
                &stages.to_string(),
            ])
            .args(["--listen", "127.0.0.1:0", "--threads", &threads.to_string()])
            .arg("--exit-with-stdin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting pipeline stage {stage}"))?;
        let stdout = child.stdout.take().context("stage stdout")?;
        procs.0.push(child);
        let rx = crate::launch::watch_ready(stdout, &format!("stage-{stage}"), READY_PREFIX)?;
        ready.push((stage, rx));
    }
    let mut addrs = Vec::new();
    for (stage, rx) in ready {
        match rx.recv_timeout(Duration::from_secs(300)) {
            Ok(addr) => addrs.push(addr),
            Err(_) => bail!("pipeline stage {stage} did not start (see its log above)"),
        }
    }
    tracing::info!(?addrs, "pipeline stages started");
    Ok((addrs, procs))
}
