//! `tandem worker`: one prefill or decode worker of a disaggregated deployment, on this host.
//!
//! It loads the model, starts an engine, serves the worker RPC of `tandem-cluster` and (prefill) a KV
//! server. `tandem serve` starts these as child processes; on other hosts start them by hand with
//! `--register http://INGRESS:PORT` so the ingress adds them.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_cluster::protocol::{ErrorBody, RegisterRequest, PATH_REGISTER};
use tandem_cluster::{
    peer_info, KvTransferConfig, Role, TransportKind, WorkerConfig, WorkerService,
};
use tandem_model::LoadOptions;
use tracing::info;

use crate::config::EngineArgs;

/// The line a worker prints on stdout once it serves, so a launcher can learn its address.
pub const READY_PREFIX: &str = "TANDEM_WORKER_READY ";

/// Flags of `tandem worker`.
#[derive(Clone, Debug, Args)]
pub struct WorkerArgs {
    /// prefill or decode.
    #[arg(long)]
    pub role: Role,
    /// GGUF file or HF folder (default: models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Name in logs, metrics and transfer handles [default: ROLE-PID].
    #[arg(long)]
    pub worker_id: Option<String>,
    /// Address of the RPC server.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port of the RPC server (0 = any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Host other machines use to reach this worker (RPC and KV) when --host is a wildcard like 0.0.0.0.
    #[arg(long)]
    pub advertise_host: Option<String>,
    /// Port of the KV server of a prefill worker (0 = any free port); it binds the --host address.
    #[arg(long, default_value_t = 0)]
    pub kv_port: u16,
    /// Ingress to register with once serving, e.g. http://10.0.0.1:8000.
    #[arg(long)]
    pub register: Option<String>,
    /// KV data plane of a decode worker: tcp or shm (same host).
    #[arg(long, default_value = "tcp")]
    pub transport: TransportKind,
    /// Parallel TCP connections per KV pull.
    #[arg(long, default_value_t = 4)]
    pub kv_streams: usize,
    /// Seconds a prefill worker keeps KV pinned waiting for the pull's ack.
    #[arg(long, default_value_t = 30.0)]
    pub pin_timeout: f64,
    /// Engine knobs; `block_size` must match every other worker's.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// CUDA backend flags (with --device cuda).
    #[command(flatten)]
    pub cuda: crate::cuda_settings::CudaArgs,
    /// Exit when stdin closes: set by `tandem serve`, whose death closes the pipe.
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
}

/// Asks the ingress to add this worker; a refusal (e.g. a `block_size` mismatch) is an error naming the field.
async fn register(ingress: &str, url: &str) -> Result<()> {
    let resp = reqwest::Client::new()
        .post(format!("{}{PATH_REGISTER}", ingress.trim_end_matches('/')))
        .json(&RegisterRequest {
            url: url.to_owned(),
        })
        .send()
        .await
        .with_context(|| format!("registering with {ingress}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let message = serde_json::from_str::<ErrorBody>(&text)
            .map(|b| b.error)
            .unwrap_or(text);
        bail!("the ingress at {ingress} refused this worker ({status}): {message}");
    }
    info!(%ingress, "registered with the ingress");
    Ok(())
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

/// Runs the worker until a signal.
pub fn run(args: WorkerArgs) -> Result<()> {
    if args.exit_with_stdin {
        exit_when_parent_goes("the launcher")?;
    }
    let model_path = crate::serve::resolve_model(args.model.as_deref())?;
    info!(path = %model_path.display(), role = %args.role, "loading model");
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: false })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let engine_config = args.engine.engine_config();
    let n_heads = loaded.config.num_heads;
    let model_id = loaded.identity.0.clone();
    let engine = crate::device::start_engine(
        loaded,
        &model_path,
        &engine_config,
        args.engine.device.unwrap_or_default(),
        &args.cuda.as_section(),
    )?;
    let worker_id = args
        .worker_id
        .clone()
        .unwrap_or_else(|| format!("{}-{}", args.role, std::process::id()));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("tandem-worker")
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let result = runtime.block_on(async {
        let config = WorkerConfig {
            worker_id: worker_id.clone(),
            role: args.role,
            kv_listen: format!("{}:{}", args.host, args.kv_port),
            kv_advertise_host: args.advertise_host.clone(),
            kv: KvTransferConfig {
                transport: args.transport,
                streams: args.kv_streams,
                pin_timeout_secs: args.pin_timeout,
                ..KvTransferConfig::default()
            },
            max_num_seqs: engine_config.max_num_seqs,
        };
        let peer = peer_info(&engine, model_id, n_heads);
        let service = WorkerService::start(engine.clone(), peer, config).await.context("starting the KV side")?;
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let local = listener.local_addr()?;
        let url = match &args.advertise_host {
            Some(host) => format!("http://{host}:{}", local.port()),
            None => format!("http://{local}"),
        };
        info!(%url, worker = %worker_id, role = %args.role, kv = %service.info().kv_endpoint, "worker serving");
        let server = axum::serve(listener, Arc::clone(&service).router())
            .with_graceful_shutdown(crate::serve::shutdown_signal());
        let server = tokio::spawn(async move { server.await });
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{READY_PREFIX}{url}")?;
            out.flush()?;
        }
        if let Some(ingress) = &args.register {
            register(ingress, &url).await?;
        }
        server.await.context("worker server task")?.context("worker HTTP server")
    });
    engine.shutdown();
    result
}
