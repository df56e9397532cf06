//! `tandem serve`: load the model, start the engine thread, serve the HTTP API until a signal.

use std::sync::Arc;

use anyhow::{Context, Result};
use tandem_api::{ApiConfig, AppState, ModelCodec};
use tandem_engine::EngineHandle;
use tandem_model::{LoadOptions, LoadedModel};
use tracing::info;

use crate::config::Settings;
use crate::process::{resolve_model, shutdown_signal};

/// A loaded model behind a running engine, ready to be served over HTTP.
struct Prepared {
    engine: EngineHandle,
    state: Arc<AppState>,
    served_name: String,
}

/// What the API serves a model with: its codec, the name clients use, whether the reasoning parser runs.
pub(crate) struct ApiModel {
    /// The tokenizer with the settings' chat template, else the model's own.
    pub codec: ModelCodec,
    /// `--served-model-name`, else the model's name.
    pub served_name: String,
    /// `--reasoning-parser`, `auto` resolved against the template in use.
    pub reasoning_parser: bool,
}

/// The API's side of a loaded model ([`ApiModel`]); shared by the colocated server and the P/D
/// ingress (workers only generate tokens, so the ingress alone parses reasoning).
pub(crate) fn api_model(settings: &Settings, loaded: &LoadedModel) -> Result<ApiModel> {
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
    let reasoning_parser = settings
        .reasoning_parser
        .unwrap_or_default()
        .enabled(template.as_deref());
    if reasoning_parser {
        info!("reasoning parser on: <think> blocks are returned as reasoning_content");
    }
    Ok(ApiModel {
        codec,
        served_name,
        reasoning_parser,
    })
}

/// Loads the model, starts the engine thread and builds the API state: everything but the listener.
fn prepare(settings: &Settings) -> Result<Prepared> {
    let model_path = resolve_model(settings.model.as_deref())?;
    info!(path = %model_path.display(), "loading model");
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: true })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let ApiModel {
        codec,
        served_name,
        reasoning_parser,
    } = api_model(settings, &loaded)?;
    let fingerprint = format!(
        "fp_{}",
        loaded.identity.0.chars().take(16).collect::<String>()
    );
    let model_root = loaded.name.clone();

    settings.engine.validate()?;
    let mut engine_config = settings.engine.engine_config();
    engine_config.kv_offload.model_identity = loaded.identity.0.clone();
    let engine = crate::device::start_engine(
        loaded,
        &model_path,
        &engine_config,
        settings.device(),
        &settings.cuda,
    )?;
    info!(
        device = %settings.device(),
        max_model_len = engine.max_model_len(),
        block_size = engine_config.block_size,
        kv_cache_memory = engine_config.kv_cache_memory,
        "engine started"
    );

    let config = ApiConfig {
        served_model_names: vec![served_name.clone()],
        model_root,
        api_key: settings.server.api_key.clone(),
        system_fingerprint: fingerprint,
        max_body_bytes: settings.max_body_bytes(),
        probes_need_key: settings.probes_need_key(),
        reasoning_parser,
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
pub fn run(settings: Settings) -> Result<()> {
    // First, so a busy port fails before a model is fetched or loaded.
    let listener = crate::process::bind_api(&settings.host(), settings.port())?;
    let tls = settings.server.tls.server_config()?;
    let Prepared {
        engine,
        state,
        served_name,
    } = prepare(&settings)?;
    let result = http_runtime()?.block_on(async {
        let listener = tokio::net::TcpListener::from_std(listener).context("the API's listener")?;
        let address = listener.local_addr()?;
        info!(%address, model = %served_name, "serving the OpenAI API");
        crate::process::print_serving(
            address,
            &served_name,
            settings.server.api_key.is_some(),
            tls.is_some(),
        );
        tandem_api::serve_router_tls(
            listener,
            tandem_api::router(state),
            settings.server.listen.limits(),
            tls,
            shutdown_signal(),
        )
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
    /// The engine behind it, for callers that read its counters (`tandem profile`).
    pub engine: EngineHandle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl LocalServer {
    /// Loads the model and serves it on 127.0.0.1 with an OS-chosen port; returns once it accepts connections.
    pub fn start(mut settings: Settings) -> Result<Self> {
        settings.server.host = Some("127.0.0.1".to_owned());
        let Prepared { engine, state, .. } = prepare(&settings)?;
        let limits = settings.server.listen.limits();
        let runtime = http_runtime()?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(("127.0.0.1", 0)))
            .context("binding a loopback port")?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let handle = engine.clone();
        let thread = std::thread::Builder::new()
            .name("tandem-local-server".to_owned())
            .spawn(move || {
                let result = runtime.block_on(async {
                    let shutdown = async {
                        // A dropped sender means the chat ended: stop either way.
                        let _ = stopped.await;
                    };
                    tandem_api::serve(listener, state, limits, shutdown)
                        .await
                        .context("HTTP server")
                });
                engine.shutdown();
                result
            })
            .context("spawning the local server thread")?;
        Ok(Self {
            url,
            engine: handle,
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
