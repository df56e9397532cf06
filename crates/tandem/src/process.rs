//! Process helpers shared by the commands: finding the model, the API's listening socket and the line
//! that says where it serves, the ready lines children print, starting and watching child processes
//! (workers, pipeline stages), exiting with the parent, and the shutdown signal.
//!
//! Children learn they are orphaned through their stdin (a pipe from the parent): when it closes they
//! exit, so no child outlives a killed parent.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tracing::info;

use crate::config::DEFAULT_MODEL;

/// The line a worker prints on stdout once it serves, so a launcher can learn its address.
pub const WORKER_READY_PREFIX: &str = "TANDEM_WORKER_READY ";

/// The line a stage prints on stdout once it serves, so the worker that started it learns its address.
pub const STAGE_READY_PREFIX: &str = "TANDEM_STAGE_READY ";

/// Binds an HTTP port (the API's, a worker's RPC) before anything slow happens (loading a model, starting
/// workers), so a busy port fails at once; the socket is non-blocking, ready for
/// `tokio::net::TcpListener::from_std`.
pub fn bind_api(host: &str, port: u16) -> Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind((host.trim_matches(['[', ']']), port))
        .with_context(|| format!("binding {host}:{port}"))?;
    listener
        .set_nonblocking(true)
        .context("making the listener non-blocking")?;
    Ok(listener)
}

/// Where a person reaches a server listening on `addr` (over HTTPS when `tls`): a wildcard address is
/// reached over loopback.
pub fn local_url(addr: std::net::SocketAddr, tls: bool) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{}", std::net::SocketAddr::new(ip, addr.port()))
}

/// Tells the person who started `tandem serve` where it serves and what to paste to try it (stdout, and
/// only with text logs: JSON log streams are read by machines, and the log line has the address).
pub fn print_serving(addr: std::net::SocketAddr, model: &str, api_key: bool, tls: bool) {
    if crate::logging::format() != crate::config::LogFormat::Text {
        return;
    }
    let url = local_url(addr, tls);
    let exe = std::env::current_exe().map_or_else(|_| "tandem".into(), |p| p.display().to_string());
    let auth = if api_key {
        " -H \"authorization: Bearer $TANDEM_API_KEY\""
    } else {
        ""
    };
    println!(
        "\ntandem serves {model} at {url} (Ctrl-C stops it). Try:\n\n  \
         curl -s {url}/v1/chat/completions -H 'content-type: application/json'{auth} \\\n    \
         -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'\n\n  \
         {exe} chat --url {url}\n"
    );
}

/// Where the default model fetch script lives, relative to the repository root.
const FETCH_SCRIPT: &str = "scripts/fetch-model.sh";

/// Directories that may be the repository root: the working directory and the binary's ancestors
/// (target/release/tandem sits three levels below it).
fn candidate_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd);
    }
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).take(4).map(Path::to_path_buf));
    }
    roots
}

/// The model to load: the one given, or the default model, fetched with scripts/fetch-model.sh if missing.
pub fn resolve_model(model: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = model {
        if !path.exists() {
            bail!("model path {} does not exist", path.display());
        }
        return Ok(path.to_path_buf());
    }
    let roots = candidate_roots();
    if let Some(found) = roots
        .iter()
        .map(|r| r.join(DEFAULT_MODEL))
        .find(|p| p.is_file())
    {
        return Ok(found);
    }
    let Some(root) = roots.iter().find(|r| r.join(FETCH_SCRIPT).is_file()) else {
        bail!("no model given, {DEFAULT_MODEL} is missing and {FETCH_SCRIPT} was not found to fetch it");
    };
    info!(script = %root.join(FETCH_SCRIPT).display(), "fetching the default model");
    let status = Command::new("bash")
        .arg(root.join(FETCH_SCRIPT))
        .status()
        .with_context(|| format!("running {FETCH_SCRIPT}"))?;
    if !status.success() {
        bail!("{FETCH_SCRIPT} failed ({status})");
    }
    let path = root.join(DEFAULT_MODEL);
    if !path.is_file() {
        bail!(
            "{FETCH_SCRIPT} succeeded but {} is still missing",
            path.display()
        );
    }
    Ok(path)
}

/// Resolves on Ctrl-C or SIGTERM, so that in-flight requests finish before exit.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    info!("shutting down");
}

/// Exits this process once stdin reaches EOF: the parent (`who`) holds the other end of the pipe for as
/// long as it lives, so a child started with `--exit-with-stdin` never outlives it.
pub fn exit_when_parent_goes(who: &'static str) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            tracing::info!("{who} is gone; exiting");
            std::process::exit(0);
        })?;
    Ok(())
}

/// Reads a child's stdout on a thread of its own: the text after `prefix` on its ready line goes to the
/// returned receiver (the address it serves on), every other line is echoed tagged with `name`.
pub fn watch_ready(
    stdout: std::process::ChildStdout,
    name: &str,
    prefix: &'static str,
) -> std::io::Result<mpsc::Receiver<String>> {
    let (tx, rx) = mpsc::channel();
    let tag = name.to_owned();
    std::thread::Builder::new()
        .name(format!("{name}-stdout"))
        .spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match line.strip_prefix(prefix) {
                    Some(addr) => {
                        let _ = tx.send(addr.trim().to_owned());
                    }
                    None => println!("[{tag}] {line}"),
                }
            }
        })?;
    Ok(rx)
}

/// Child processes (named for the log) that are killed and reaped when this value is dropped (normal
/// exit, error or panic; for stages, when the engine's backend goes).
#[derive(Default)]
pub struct Children(Vec<(String, Child)>);

impl Children {
    /// Starts `cmd` with piped stdin (so the child can exit with this process) and stdout, keeps it here,
    /// and returns its pid and a receiver for the address on its `prefix` ready line.
    pub fn spawn(
        &mut self,
        name: &str,
        cmd: &mut Command,
        prefix: &'static str,
    ) -> Result<(u32, mpsc::Receiver<String>)> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let stdout = child
            .stdout
            .take()
            .with_context(|| format!("{name} has no stdout"))?;
        let pid = child.id();
        self.0.push((name.to_owned(), child));
        Ok((pid, watch_ready(stdout, name, prefix)?))
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (name, child) in &mut self.0 {
            if let Err(e) = child.kill() {
                tracing::debug!(child = %name, error = %e, "already gone");
            }
            let _ = child.wait();
        }
    }
}

/// What a worker's local stage processes are given: its engine and CUDA settings as it resolved them,
/// each stage on its own GPU.
pub struct StageLaunch<'a> {
    /// The worker's engine settings (every key set, `threads` each stage's share of the cores): the KV
    /// budget a stage accepts and the step limits that size a CUDA stage's buffers.
    pub engine: crate::config::EngineSettings,
    /// The worker's CUDA settings (kernels, graphs) for the stages.
    pub cuda: &'a crate::cuda_settings::CudaSettings,
    /// Device ordinal of every stage, stage 0 first.
    pub devices: &'a [usize],
}

impl StageLaunch<'_> {
    /// The settings of stage `stage` of `stages` of `model`, listening on a free loopback port.
    pub fn settings(
        &self,
        model: &Path,
        stage: usize,
        stages: usize,
    ) -> crate::stage::StageSettings {
        crate::stage::StageSettings {
            model: Some(model.to_path_buf()),
            stage: Some(stage),
            stages: Some(stages),
            listen: "127.0.0.1:0".into(),
            engine: self.engine.clone(),
            cuda: crate::cuda_settings::CudaSettings {
                device: Some(self.devices[stage]),
                pipeline_devices: None,
                ..self.cuda.clone()
            },
            ..crate::stage::StageSettings::default()
        }
    }
}

/// Starts stages 1..`stages` of `model` as `tandem stage` child processes on loopback, each given its
/// settings whole as one JSON document (`--settings-json`), and returns their addresses with the
/// processes.
pub fn spawn_local_stages(
    model: &Path,
    stages: usize,
    launch: &StageLaunch<'_>,
) -> Result<(Vec<String>, Children)> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut procs = Children::default();
    let mut ready = Vec::new();
    for stage in 1..stages {
        let doc = serde_json::to_string(&launch.settings(model, stage, stages))
            .context("writing the stage's settings")?;
        let mut cmd = Command::new(&exe);
        cmd.arg("stage")
            .args(["--settings-json", &doc])
            .arg("--exit-with-stdin");
        let parent = crate::logging::process_name();
        if let Some(parent) = parent {
            cmd.args(["--parent", parent]);
        }
        let name = crate::stage::stage_name(parent, &stage.to_string());
        let (_, rx) = procs.spawn(&name, &mut cmd, STAGE_READY_PREFIX)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_explicit_model_is_an_error() {
        let err = resolve_model(Some(Path::new("/nonexistent/model.gguf"))).unwrap_err();
        assert!(err.to_string().contains("does not exist"));
    }
}
