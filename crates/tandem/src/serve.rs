//! `tandem serve`: load the model, start the engine thread, serve the HTTP API until a signal.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tandem_api::{ApiConfig, AppState, ModelCodec};
use tandem_engine::EngineHandle;
use tandem_model::LoadOptions;
use tracing::info;

use crate::config::{ServeSettings, DEFAULT_MODEL};

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
pub(crate) fn resolve_model(model: Option<&Path>) -> Result<PathBuf> {
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
pub(crate) async fn shutdown_signal() {
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

/// A loaded model behind a running engine, ready to be served over HTTP.
struct Prepared {
    engine: EngineHandle,
    state: Arc<AppState>,
    served_name: String,
}

/// Loads the model, starts the engine thread and builds the API state: everything but the listener.
fn prepare(settings: &ServeSettings) -> Result<Prepared> {
    let model_path = resolve_model(settings.model.as_deref())?;
    info!(path = %model_path.display(), "loading model");
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: true })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let template = match &settings.chat_template {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading chat template {}", path.display()))?,
        ),
        None => loaded.chat_template.clone(),
    };
    if template.is_none() {
        tracing::warn!("the model has no chat template; /v1/chat/completions will answer 400 (see --chat-template)");
    }
    let codec =
        ModelCodec::new(loaded.tokenizer.clone(), template.as_deref()).context("chat template")?;
    let served_name = settings
        .served_model_name
        .clone()
        .unwrap_or_else(|| loaded.name.clone());
    let fingerprint = format!(
        "fp_{}",
        loaded.identity.0.chars().take(16).collect::<String>()
    );
    let model_root = loaded.name.clone();

    let engine_config = settings.engine.clone();
    let engine = crate::device::start_engine(
        loaded,
        &model_path,
        &engine_config,
        settings.device,
        &settings.cuda,
    )?;
    info!(
        device = %settings.device,
        max_model_len = engine.max_model_len(),
        block_size = engine_config.block_size,
        kv_cache_bytes = engine_config.kv_cache_bytes,
        "engine started"
    );

    let config = ApiConfig {
        served_model_names: vec![served_name.clone()],
        model_root,
        api_key: settings.api_key.clone(),
        system_fingerprint: fingerprint,
    };
    let state = Arc::new(AppState::new(
        Arc::new(engine.clone()),
        Arc::new(codec),
        config,
    )?);
    Ok(Prepared {
        engine,
        state,
        served_name,
    })
}

/// The HTTP side's runtime: the engine computes on its own threads, so a couple of workers suffice.
fn http_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("tandem-http")
        .enable_all()
        .build()
        .context("building the tokio runtime")
}

/// Runs the server with the merged settings.
pub fn run(settings: ServeSettings) -> Result<()> {
    let Prepared {
        engine,
        state,
        served_name,
    } = prepare(&settings)?;
    let result = http_runtime()?.block_on(async {
        let listener = tokio::net::TcpListener::bind((settings.host.as_str(), settings.port))
            .await
            .with_context(|| format!("binding {}:{}", settings.host, settings.port))?;
        info!(address = %listener.local_addr()?, model = %served_name, "serving the OpenAI API");
        tandem_api::serve(listener, state, shutdown_signal())
            .await
            .context("HTTP server")
    });
    engine.shutdown();
    result
}

/// A server running inside this process on an ephemeral loopback port (`tandem chat --local`).
pub struct LocalServer {
    /// Where the server listens, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl LocalServer {
    /// Loads the model and serves it on 127.0.0.1 with an OS-chosen port; returns once it accepts connections.
    pub fn start(mut settings: ServeSettings) -> Result<Self> {
        settings.host = "127.0.0.1".to_owned();
        let Prepared { engine, state, .. } = prepare(&settings)?;
        let runtime = http_runtime()?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(("127.0.0.1", 0)))
            .context("binding a loopback port")?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("tandem-local-server".to_owned())
            .spawn(move || {
                let result = runtime.block_on(async {
                    let shutdown = async {
                        // A dropped sender means the chat ended: stop either way.
                        let _ = stopped.await;
                    };
                    tandem_api::serve(listener, state, shutdown)
                        .await
                        .context("HTTP server")
                });
                engine.shutdown();
                result
            })
            .context("spawning the local server thread")?;
        Ok(Self {
            url,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Stops accepting requests, shuts the engine down and reports how the server ended.
    pub fn stop(mut self) -> Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| anyhow::anyhow!("the local server thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop_inner() {
            tracing::warn!(error = %e, "local server ended with an error");
        }
    }
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
