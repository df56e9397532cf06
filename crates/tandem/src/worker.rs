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
use serde::{Deserialize, Serialize};
use tandem_cluster::protocol::{ErrorBody, RegisterRequest, PATH_REGISTER};
use tandem_cluster::{
    peer_info, KvTransferConfig, Role, TransportKind, WorkerConfig, WorkerService,
};
use tandem_model::LoadOptions;
use tracing::info;

use crate::config::EngineSettings;
use crate::process::{exit_when_parent_goes, resolve_model, shutdown_signal, WORKER_READY_PREFIX};

/// Everything one worker runs with: the flags of a worker started by hand, or the one JSON document
/// (`--settings-json`) `tandem serve` resolves from its config for each worker it starts.
#[derive(Clone, Debug, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    /// prefill or decode.
    #[arg(long, required_unless_present = "settings_json")]
    pub role: Option<Role>,
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
    /// KV transfer settings (by hand: `--transport`, `--kv-streams` and `--pin-timeout` over the defaults).
    #[arg(skip)]
    pub kv_transfer: KvTransferConfig,
    /// Engine knobs; `block_size` must match every other worker's.
    #[command(flatten)]
    pub engine: EngineSettings,
    /// CUDA backend settings (from the launcher's `cuda:` section; by hand, the `--cuda-*` flags).
    #[arg(skip)]
    #[serde(default)]
    pub cuda: crate::cuda_settings::CudaSection,
}

/// The KV transfer flags of a worker started by hand, each setting one `kv_transfer` key.
#[derive(Clone, Debug, Args)]
pub struct KvTransferFlags {
    /// KV data plane of a decode worker: tcp or shm (same host).
    #[arg(long, default_value = "tcp")]
    pub transport: TransportKind,
    /// Parallel TCP connections per KV pull.
    #[arg(long, default_value_t = 4)]
    pub kv_streams: usize,
    /// Seconds a prefill worker keeps KV pinned waiting for the pull's ack.
    #[arg(long, default_value_t = 30.0)]
    pub pin_timeout: f64,
}

/// What `--settings-json` conflicts with: every settings flag (the flattened sections by their group).
const WITH_FLAGS: [&str; 10] = [
    "role",
    "model",
    "worker_id",
    "host",
    "port",
    "advertise_host",
    "kv_port",
    "register",
    "KvTransferFlags",
    "EngineSettings",
];

/// Flags of `tandem worker`.
#[derive(Clone, Debug, Args)]
pub struct WorkerArgs {
    /// The whole resolved settings as one JSON document (how `tandem serve` starts its workers: no
    /// quoting or flag spelling to get wrong); no settings flag may come with it.
    #[arg(long, hide = true, conflicts_with_all = WITH_FLAGS)]
    pub settings_json: Option<String>,
    /// The settings given as flags.
    #[command(flatten)]
    pub settings: WorkerSettings,
    /// KV transfer flags.
    #[command(flatten)]
    pub kv: KvTransferFlags,
    /// CUDA backend flags, merged over the settings' `cuda` section.
    #[command(flatten)]
    pub cuda: crate::cuda_settings::CudaArgs,
    /// Exit when stdin closes: set by `tandem serve`, whose death closes the pipe.
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
}

impl WorkerArgs {
    /// The settings this worker runs with: the launcher's document, or the flags.
    pub fn resolve(&self) -> Result<WorkerSettings> {
        if let Some(doc) = &self.settings_json {
            return serde_json::from_str(doc).context("parsing --settings-json");
        }
        let mut settings = self.settings.clone();
        settings.kv_transfer = KvTransferConfig {
            transport: self.kv.transport,
            streams: self.kv.kv_streams,
            pin_timeout_secs: self.kv.pin_timeout,
            ..KvTransferConfig::default()
        };
        Ok(settings)
    }
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

/// Runs the worker until a signal.
pub fn run(args: WorkerArgs) -> Result<()> {
    if args.exit_with_stdin {
        exit_when_parent_goes("the launcher")?;
    }
    let settings = args.resolve()?;
    let role = settings.role.context("--role is required")?;
    let model_path = resolve_model(settings.model.as_deref())?;
    info!(path = %model_path.display(), %role, "loading model");
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: false })
        .with_context(|| format!("loading {}", model_path.display()))?;
    let engine_config = settings.engine.engine_config();
    let n_heads = loaded.config.num_heads;
    let model_id = loaded.identity.0.clone();
    let engine = crate::device::start_engine(
        loaded,
        &model_path,
        &engine_config,
        settings.engine.device.unwrap_or_default(),
        &settings.cuda.merged(&args.cuda.as_section()),
    )?;
    let worker_id = settings
        .worker_id
        .clone()
        .unwrap_or_else(|| format!("{role}-{}", std::process::id()));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("tandem-worker")
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let result = runtime.block_on(async {
        let config = WorkerConfig {
            worker_id: worker_id.clone(),
            role,
            kv_listen: format!("{}:{}", settings.host, settings.kv_port),
            kv_advertise_host: settings.advertise_host.clone(),
            kv: settings.kv_transfer.clone(),
            max_num_seqs: engine_config.max_num_seqs,
            gpu: settings.engine.device.unwrap_or_default() != crate::config::Device::Cpu,
        };
        let peer = peer_info(&engine, model_id, n_heads);
        let service = WorkerService::start(engine.clone(), peer, config)
            .await
            .context("starting the KV side")?;
        let listener = tokio::net::TcpListener::bind((settings.host.as_str(), settings.port))
            .await
            .with_context(|| format!("binding {}:{}", settings.host, settings.port))?;
        let local = listener.local_addr()?;
        let url = match &settings.advertise_host {
            Some(host) => format!("http://{host}:{}", local.port()),
            None => format!("http://{local}"),
        };
        info!(%url, worker = %worker_id, %role, kv = %service.info().kv_endpoint, "worker serving");
        let server = axum::serve(listener, Arc::clone(&service).router())
            .with_graceful_shutdown(shutdown_signal());
        let server = tokio::spawn(async move { server.await });
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{WORKER_READY_PREFIX}{url}")?;
            out.flush()?;
        }
        if let Some(ingress) = &settings.register {
            register(ingress, &url).await?;
        }
        server
            .await
            .context("worker server task")?
            .context("worker HTTP server")
    });
    engine.shutdown();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        worker: WorkerArgs,
    }

    fn parse(args: &[&str]) -> Result<WorkerArgs, clap::Error> {
        <Cli as clap::Parser>::try_parse_from(std::iter::once("worker").chain(args.iter().copied()))
            .map(|c| c.worker)
    }

    #[test]
    fn a_worker_started_by_hand_takes_its_flags() {
        let s = parse(&[
            "--role",
            "decode",
            "--model",
            "m.gguf",
            "--host",
            "0.0.0.0",
            "--advertise-host",
            "10.0.0.5",
            "--register",
            "http://10.0.0.1:8000",
            "--transport",
            "shm",
            "--kv-streams",
            "2",
            "--block-size",
            "32",
            "--no-prefix-caching",
        ])
        .unwrap()
        .resolve()
        .unwrap();
        assert_eq!(s.role, Some(Role::Decode));
        assert_eq!((s.host.as_str(), s.port, s.kv_port), ("0.0.0.0", 0, 0));
        assert_eq!(s.advertise_host.as_deref(), Some("10.0.0.5"));
        assert_eq!(s.register.as_deref(), Some("http://10.0.0.1:8000"));
        assert_eq!(
            (
                s.kv_transfer.transport,
                s.kv_transfer.streams,
                s.kv_transfer.pin_timeout_secs
            ),
            (TransportKind::Shm, 2, 30.0)
        );
        let e = s.engine.engine_config();
        assert_eq!(e.block_size, 32);
        assert!(!e.enable_prefix_caching);
    }

    #[test]
    fn role_is_required_and_the_document_comes_alone() {
        assert!(parse(&["--model", "m.gguf"]).is_err(), "--role is required");
        let doc = serde_json::to_string(&parse(&["--role", "prefill"]).unwrap().resolve().unwrap())
            .unwrap();
        assert!(parse(&["--settings-json", &doc]).is_ok());
        for extra in [
            ["--role", "decode"],
            ["--host", "0.0.0.0"],
            ["--register", "http://h:1"],
            ["--block-size", "8"],
            ["--kv-streams", "2"],
        ] {
            let mut args = vec!["--settings-json", &doc];
            args.extend(extra);
            assert!(parse(&args).is_err(), "{extra:?} beside --settings-json");
        }
        let bad = parse(&["--settings-json", r#"{"role": "prefill", "prot": 1}"#])
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(format!("{bad:#}").contains("prot"), "{bad:#}");
    }
}
