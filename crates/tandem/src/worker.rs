//! `tandem worker`: one prefill or decode worker of a disaggregated deployment, on this host.
//!
//! It loads the model, starts an engine, serves the worker RPC of `tandem-cluster` and (prefill) a KV
//! server. `tandem serve` starts these as child processes; on other hosts start them by hand with
//! `--register http://INGRESS:PORT` so the ingress adds them (and adds them again after it restarts:
//! a worker the ingress has not polled for [`REREGISTER_AFTER`] registers again), or let the ingress
//! find them by DNS (`deployment.discovery`).
//!
//! The address it advertises (RPC URL and KV endpoint) is `--advertise-host`, else the `--host` it binds,
//! else, when that is a wildcard (`0.0.0.0`, `::`), this host's outward address: the local address of a
//! UDP socket connected toward the ingress (`--register`), else the hostname's first non-loopback
//! address (a container's or pod's IP), else the address of the default route; 127.0.0.1 only when none
//! exists (logged).
//!
//! SIGTERM drains it: `/health` fails, the ingress stops routing to it, in-flight requests and pins
//! finish within `--drain-grace-secs`, then it exits 0.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use tandem_cluster::protocol::{ErrorBody, RegisterRequest, PATH_REGISTER};
use tandem_cluster::{
    peer_info, KvTransferConfig, Role, TransportKind, WorkerConfig, WorkerService,
};
use tandem_model::LoadOptions;
use tracing::{info, warn};

use crate::config::{EngineSettings, ListenSettings};
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
    /// File holding the cluster token (a mounted secret); else `TANDEM_CLUSTER_TOKEN` is used.
    #[arg(long)]
    #[serde(default)]
    pub cluster_token_file: Option<PathBuf>,
    /// Serve without a cluster token although --host is reachable beyond loopback (0.0.0.0, ::, a LAN
    /// address); without it such a worker refuses to start with no token set.
    #[arg(long)]
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// Seconds a SIGTERM'd worker waits for its in-flight requests and pins before it exits anyway.
    #[arg(long, default_value_t = DEFAULT_DRAIN_GRACE_SECS)]
    #[serde(default = "default_drain_grace_secs")]
    pub drain_grace_secs: f64,
    /// Ask for the cluster token on `/metrics` too (from the launcher: the head's `server.probes_need_key`);
    /// by default it is open, like `/health`.
    #[arg(long)]
    #[serde(default)]
    pub metrics_need_token: bool,
    /// Read timeouts and connection limit of the RPC listener (from the launcher: the head's `server:` ones).
    #[command(flatten)]
    #[serde(default)]
    pub listen: ListenSettings,
    /// KV transfer settings (by hand: `--transport`, `--kv-streams` and `--pin-timeout` over the defaults).
    #[arg(skip)]
    pub kv_transfer: KvTransferConfig,
    /// Engine knobs; `block_size` must match every other worker's.
    #[command(flatten)]
    pub engine: EngineSettings,
    /// CUDA backend settings (from the launcher's `cuda:` section; by hand, the `--cuda-*` flags).
    #[command(flatten)]
    #[serde(default)]
    pub cuda: crate::cuda_settings::CudaSettings,
}

/// The drain grace period when none is given (Kubernetes' default termination grace is 30 s as well).
pub const DEFAULT_DRAIN_GRACE_SECS: f64 = 30.0;

/// Serde's default for `drain_grace_secs` (a document without the key).
fn default_drain_grace_secs() -> f64 {
    DEFAULT_DRAIN_GRACE_SECS
}

/// How long a worker started with `--register` goes unpolled before it registers again: its ingress
/// restarted (losing its registry) or never got it.
const REREGISTER_AFTER: Duration = Duration::from_secs(10);

/// How long the HTTP server may take to close its connections once the drain is over.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// The KV transfer flags of a worker started by hand, each setting one `kv_transfer` key.
#[derive(Clone, Debug, Args)]
pub struct KvTransferFlags {
    /// KV data plane: auto (NIXL on a GPU worker where it loads, else tcp), tcp, shm (same host) or nixl.
    #[arg(long, default_value = "auto")]
    pub transport: TransportKind,
    /// Parallel TCP connections per KV pull.
    #[arg(long, default_value_t = 4)]
    pub kv_streams: usize,
    /// Seconds a prefill worker keeps KV pinned waiting for the pull's ack.
    #[arg(long, default_value_t = 30.0)]
    pub pin_timeout: f64,
    /// NIXL's `libnixl_capi.so`, its folder, or an unpacked `nixl-cu13` wheel [default: the loader's path].
    #[arg(long)]
    pub nixl_library: Option<PathBuf>,
    /// NIXL backend plugin: ucx, or libfabric (AWS EFA).
    #[arg(long, default_value = "ucx")]
    pub nixl_backend: tandem_cluster::NixlBackend,
    /// MiB of NIXL staging memory registered where the KV lives (0: none).
    #[arg(long, default_value_t = KvTransferConfig::default().staging_mib)]
    pub staging_mib: usize,
}

/// What `--settings-json` conflicts with: every settings flag (the flattened sections by their group, the engine's by its flag ids,
/// the visible CUDA flags by their ids).
fn with_flags() -> impl Iterator<Item = &'static str> {
    [
        "role",
        "model",
        "worker_id",
        "host",
        "port",
        "advertise_host",
        "kv_port",
        "register",
        "cluster_token_file",
        "allow_unauthenticated",
        "drain_grace_secs",
        "KvTransferFlags",
        "ListenSettings",
    ]
    .into_iter()
    .chain(crate::config::ENGINE_FLAG_IDS)
    .chain(crate::cuda_settings::CudaSettings::FLAG_IDS)
}

/// Flags of `tandem worker`.
#[derive(Clone, Debug, Args)]
pub struct WorkerArgs {
    /// The whole resolved settings as one JSON document (how `tandem serve` starts its workers: no
    /// quoting or flag spelling to get wrong); no settings flag may come with it.
    #[arg(long, hide = true, conflicts_with_all = with_flags())]
    pub settings_json: Option<String>,
    /// The settings given as flags.
    #[command(flatten)]
    pub settings: WorkerSettings,
    /// KV transfer flags.
    #[command(flatten)]
    pub kv: KvTransferFlags,
    /// Exit when stdin closes: set by `tandem serve`, whose death closes the pipe.
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
}

impl WorkerArgs {
    /// The settings this worker runs with: the launcher's document, or the flags.
    pub fn resolve(&self) -> Result<WorkerSettings> {
        if let Some(doc) = &self.settings_json {
            let mut settings: WorkerSettings =
                serde_json::from_str(doc).context("parsing --settings-json")?;
            settings.cuda.tuning = self.settings.cuda.tuning.clone();
            return Ok(settings);
        }
        let mut settings = self.settings.clone();
        settings.kv_transfer = KvTransferConfig {
            transport: self.kv.transport,
            streams: self.kv.kv_streams,
            pin_timeout_secs: self.kv.pin_timeout,
            nixl_library: self.kv.nixl_library.clone(),
            nixl_backend: self.kv.nixl_backend,
            staging_mib: self.kv.staging_mib,
            ..KvTransferConfig::default()
        };
        Ok(settings)
    }
}

impl WorkerArgs {
    /// The tag on this worker's log lines: its id and role (none when the settings do not parse, which
    /// `run` then reports).
    pub fn log_tag(&self) -> Option<crate::logging::ProcessTag> {
        let settings = self.resolve().ok()?;
        let role = settings.role?;
        Some(crate::logging::ProcessTag {
            name: worker_id(&settings, role),
            role: role.to_string(),
        })
    }
}

/// The worker's id: the configured one, else `{role}-{pid}`.
fn worker_id(settings: &WorkerSettings, role: Role) -> String {
    settings
        .worker_id
        .clone()
        .unwrap_or_else(|| format!("{role}-{}", std::process::id()))
}

/// How a registration the ingress did not refuse ended.
enum Registration {
    /// The ingress added this worker (or already had it).
    Done,
    /// The ingress did not answer; it is tried again later.
    Unreachable(reqwest::Error),
}

/// Asks the ingress to add this worker; a refusal (e.g. a `block_size` mismatch) is an error naming the field.
async fn register(ingress: &str, url: &str) -> Result<Registration> {
    let client = tandem_cluster::with_cluster_tls(
        reqwest::Client::builder(),
        crate::tls::cluster()?.as_deref(),
    )
    .build()
    .context("building the registration client")?;
    let sent = client
        .post(format!("{}{PATH_REGISTER}", ingress.trim_end_matches('/')))
        .headers(tandem_cluster::auth::token_headers(
            crate::token::key().as_ref(),
        ))
        .json(&RegisterRequest {
            url: url.to_owned(),
        })
        .timeout(Duration::from_secs(30))
        .send()
        .await;
    let resp = match sent {
        Ok(resp) => resp,
        Err(e) => return Ok(Registration::Unreachable(e)),
    };
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let message = serde_json::from_str::<ErrorBody>(&text)
            .map(|b| b.error)
            .unwrap_or(text);
        bail!("the ingress at {ingress} refused this worker ({status}): {message}");
    }
    info!(%ingress, "registered with the ingress");
    Ok(Registration::Done)
}

/// Registers again whenever the ingress has not polled this worker for [`REREGISTER_AFTER`] (it
/// restarted, or was down at start-up), until the worker drains.
async fn keep_registered(service: Arc<WorkerService>, ingress: String, url: String) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last_try = Instant::now();
    loop {
        tick.tick().await;
        if service.is_draining() {
            return;
        }
        if service.since_polled() < REREGISTER_AFTER || last_try.elapsed() < REREGISTER_AFTER {
            continue;
        }
        last_try = Instant::now();
        info!(%ingress, unpolled_secs = service.since_polled().as_secs(), "the ingress stopped polling this worker; registering again");
        match register(&ingress, &url).await {
            Ok(Registration::Done) => {}
            Ok(Registration::Unreachable(e)) => {
                warn!(%ingress, error = %e, "the ingress does not answer; trying again later")
            }
            Err(e) => warn!(%ingress, error = format!("{e:#}"), "the ingress refused this worker"),
        }
    }
}

/// `host` as it goes before `:port` (IPv6 literals in brackets).
fn bracketed(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

/// The host others reach this worker at (RPC URL and KV endpoint); see the module doc for the order.
fn advertise_host(settings: &WorkerSettings) -> String {
    if let Some(host) = &settings.advertise_host {
        return host.clone();
    }
    let wildcard = settings
        .host
        .trim_matches(['[', ']'])
        .parse::<IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified());
    if !wildcard {
        return settings.host.clone();
    }
    match outward_ip(settings.register.as_deref()) {
        Some(ip) => {
            info!(%ip, "advertising this host's outward address (--advertise-host sets another)");
            ip.to_string()
        }
        None => {
            warn!("no outward address found; advertising 127.0.0.1 (set --advertise-host)");
            "127.0.0.1".to_owned()
        }
    }
}

/// This host's outward address: toward the ingress at `ingress` (a URL), else the hostname's first
/// non-loopback address, else the default route's source address.
fn outward_ip(ingress: Option<&str>) -> Option<IpAddr> {
    let ingress = ingress.and_then(|url| {
        let rest = url.split_once("://").map_or(url, |(_, r)| r);
        let authority = rest.split('/').next()?;
        let with_port = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        with_port.to_socket_addrs().ok()?.next()
    });
    if let Some(ip) = ingress.and_then(source_toward) {
        // An ingress on loopback is on this host, and reaches this worker there.
        return Some(ip);
    }
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty());
    let by_name = hostname.and_then(|h| {
        (h.as_str(), 0)
            .to_socket_addrs()
            .ok()?
            .map(|a| a.ip())
            .find(|ip| !ip.is_loopback() && !ip.is_unspecified())
    });
    // TEST-NET-1 (RFC 5737): connecting a UDP socket sends nothing, it only consults the routing table.
    by_name.or_else(|| {
        source_toward(SocketAddr::from(([192, 0, 2, 1], 9))).filter(|ip| !ip.is_loopback())
    })
}

/// The local address this host sends from toward `target` (a UDP socket "connected" to it: no packet).
fn source_toward(target: SocketAddr) -> Option<IpAddr> {
    let bind = if target.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    };
    let socket = UdpSocket::bind(bind).ok()?;
    socket.connect(target).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// Sets what NIXL and UCX read from the environment when this worker may use NIXL (`transport: nixl`,
/// or `auto` on a GPU worker): the library sets none, and here no other thread runs yet. UCX's CUDA-IPC
/// switch goes only to hosts with NVIDIA devices (elsewhere UCX warns about it), never over a value the
/// user set.
fn set_nixl_env(kv: &KvTransferConfig, gpu: bool) {
    let nixl = match kv.transport {
        TransportKind::Nixl => true,
        TransportKind::Auto => gpu,
        _ => false,
    };
    if !nixl {
        return;
    }
    let env = tandem_kv::NixlEnv::for_config(&tandem_kv::NixlConfig {
        library: kv.nixl_library.clone(),
        backend: kv.nixl_backend,
        ..tandem_kv::NixlConfig::default()
    });
    if let Some(dir) = &env.plugin_dir {
        info!(dir = %dir.display(), "setting {}", tandem_kv::NixlEnv::PLUGIN_DIR);
        std::env::set_var(tandem_kv::NixlEnv::PLUGIN_DIR, dir);
    }
    let (key, value) = tandem_kv::NixlEnv::UCX_CUDA_IPC_GET_ZCOPY;
    let gpu_host = std::path::Path::new("/dev/nvidiactl").exists();
    if env.ucx_cuda_ipc_get_zcopy && gpu_host && std::env::var_os(key).is_none() {
        info!("setting {key}={value} (UCX's CUDA-IPC reads; without it they go over TCP)");
        std::env::set_var(key, value);
    }
}

/// Logs the engine and CUDA settings a process runs with, as it received them (from its launcher's
/// document or its flags): what an operator checks first when a child behaves unlike its config.
pub fn log_settings(
    what: &str,
    engine: &EngineSettings,
    cuda: &crate::cuda_settings::CudaSettings,
) {
    info!(
        engine = %serde_json::to_string(engine).unwrap_or_default(),
        cuda = %serde_json::to_string(cuda).unwrap_or_default(),
        "{what} settings"
    );
}

/// Runs the worker until a signal.
pub fn run(args: WorkerArgs) -> Result<()> {
    let settings = args.resolve()?;
    let gpu = settings.engine.device.unwrap_or_default() != crate::config::Device::Cpu;
    set_nixl_env(&settings.kv_transfer, gpu);
    log_settings("worker", &settings.engine, &settings.cuda);
    if let Some(file) = &settings.cluster_token_file {
        // Before any thread starts: the environment is process-wide.
        crate::token::export(crate::token::resolve(None, Some(file))?.as_deref());
    }
    if args.exit_with_stdin {
        exit_when_parent_goes("the launcher")?;
    }
    settings.listen.validate()?;
    // Checked before anything slow: a bad file fails at once, naming its setting.
    let cluster_tls = crate::tls::cluster()?;
    let role = settings.role.context("--role is required")?;
    // The RPC port first (and a prefill worker's KV port), so a busy one fails before a model is fetched
    // or loaded.
    let listener = crate::process::bind_api(&settings.host, settings.port)?;
    let allow = settings.allow_unauthenticated;
    crate::token::check_exposure(
        "the worker's RPC port (--host, --port)",
        listener.local_addr()?,
        allow,
    )?;
    let kv_listener = match role {
        Role::Prefill => {
            let kv = crate::process::bind_api(&settings.host, settings.kv_port)
                .context("the KV port (--kv-port)")?;
            crate::token::check_exposure(
                "the worker's KV port (--host, --kv-port)",
                kv.local_addr()?,
                allow,
            )?;
            Some(kv)
        }
        Role::Decode => None,
    };
    let model_path = resolve_model(settings.model.as_deref())?;
    info!(path = %model_path.display(), %role, "loading model");
    let loaded = tandem_model::load(&model_path, &LoadOptions { progress: false })
        .with_context(|| format!("loading {}", model_path.display()))?;
    settings.engine.validate()?;
    let mut engine_config = settings.engine.engine_config();
    engine_config.kv_offload.model_identity = loaded.identity.0.clone();
    let n_heads = loaded.config.num_heads;
    let model_id = loaded.identity.0.clone();
    let engine = crate::device::start_engine(
        loaded,
        &model_path,
        &engine_config,
        settings.engine.device.unwrap_or_default(),
        &settings.cuda,
    )?;
    let worker_id = worker_id(&settings, role);

    // A TCP pull moves its layers over `streams` connections, each a task copying at memory speed: with
    // fewer runtime threads than connections they take turns (on the H200, 3.3 GB/s with 4 or 8
    // connections on 2 threads). One thread per connection plus one for the RPCs, within the cores.
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    let threads = (settings.kv_transfer.streams + 1).clamp(2, cores.max(2));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("tandem-worker")
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let advertise = bracketed(&advertise_host(&settings));
    let result = runtime.block_on(async {
        // Listen for SIGTERM from here on, so one that comes while the worker registers still drains it.
        let (signalled, mut signal) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = signalled.send(());
        });
        let config = WorkerConfig {
            worker_id: worker_id.clone(),
            role,
            kv_listen: format!("{}:{}", bracketed(&settings.host), settings.kv_port),
            kv_advertise_host: Some(advertise.clone()),
            kv: settings.kv_transfer.clone(),
            max_num_seqs: engine_config.max_num_seqs,
            gpu: settings.engine.device.unwrap_or_default() != crate::config::Device::Cpu,
            cluster_key: crate::token::key(),
            tls: cluster_tls.clone(),
            metrics_need_token: settings.metrics_need_token,
        };
        let peer = peer_info(&engine, model_id, n_heads);
        let service = WorkerService::start_bound(engine.clone(), peer, config, kv_listener)
            .await
            .context("starting the KV side")?;
        let listener =
            tokio::net::TcpListener::from_std(listener).context("the worker's listener")?;
        let url = format!(
            "{}://{advertise}:{}",
            crate::tls::scheme(cluster_tls.as_deref()),
            listener.local_addr()?.port()
        );
        info!(%url, worker = %worker_id, %role, kv = %service.info().kv_endpoint, "worker serving");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tandem_api::serve_router_tls(
            listener,
            Arc::clone(&service).router(),
            settings.listen.limits(),
            cluster_tls.as_ref().map(|t| t.server_config()),
            async move {
                let _ = stopped.await;
            },
        );
        let mut server = tokio::spawn(server);
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{WORKER_READY_PREFIX}{url}")?;
            out.flush()?;
        }
        let keeper = match &settings.register {
            Some(ingress) => {
                if let Registration::Unreachable(e) = register(ingress, &url).await? {
                    warn!(%ingress, error = %e, "the ingress does not answer yet; registering again later");
                }
                Some(tokio::spawn(keep_registered(
                    Arc::clone(&service),
                    ingress.clone(),
                    url.clone(),
                )))
            }
            None => None,
        };
        tokio::select! {
            ended = &mut server => {
                return ended.context("worker server task")?.context("worker HTTP server");
            }
            _ = &mut signal => {}
        }
        if let Some(keeper) = keeper {
            keeper.abort();
        }
        service
            .drain(Duration::from_secs_f64(settings.drain_grace_secs.max(0.0)))
            .await;
        let _ = stop.send(());
        match tokio::time::timeout(STOP_WAIT, server).await {
            Ok(ended) => ended.context("worker server task")?.context("worker HTTP server"),
            Err(_) => {
                warn!("connections still open {STOP_WAIT:?} after the drain; closing them");
                Ok(())
            }
        }
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
        assert_eq!(s.drain_grace_secs, DEFAULT_DRAIN_GRACE_SECS);
        assert_eq!(advertise_host(&s), "10.0.0.5");
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
    fn the_nixl_flags_set_the_kv_transfer_keys() {
        let s = parse(&["--role", "decode"]).unwrap().resolve().unwrap();
        assert_eq!(s.kv_transfer.transport, TransportKind::Auto);
        assert_eq!(
            s.kv_transfer.staging_mib,
            KvTransferConfig::default().staging_mib
        );
        let s = parse(&[
            "--role",
            "decode",
            "--transport",
            "nixl",
            "--nixl-library",
            "/opt/nixl",
            "--nixl-backend",
            "libfabric",
            "--staging-mib",
            "0",
        ])
        .unwrap()
        .resolve()
        .unwrap();
        let kv = &s.kv_transfer;
        assert_eq!(kv.transport, TransportKind::Nixl);
        assert_eq!(
            kv.nixl_library.as_deref(),
            Some(std::path::Path::new("/opt/nixl"))
        );
        assert_eq!(kv.nixl_backend, tandem_cluster::NixlBackend::Libfabric);
        assert_eq!(kv.staging_mib, 0);
    }

    #[test]
    fn a_wildcard_bind_never_advertises_loopback_to_a_remote_ingress() {
        let mut s = parse(&[
            "--role",
            "prefill",
            "--host",
            "127.0.0.2",
            "--drain-grace-secs",
            "5",
        ])
        .unwrap()
        .resolve()
        .unwrap();
        assert_eq!(s.drain_grace_secs, 5.0);
        assert_eq!(
            advertise_host(&s),
            "127.0.0.2",
            "a concrete bind address is advertised"
        );
        s.host = "0.0.0.0".into();
        // Toward an ingress on loopback, loopback is right; toward any other, this host's outward address.
        s.register = Some("http://127.0.0.1:8000".into());
        assert_eq!(advertise_host(&s), "127.0.0.1");
        if let Some(ip) = source_toward(SocketAddr::from(([192, 0, 2, 1], 9))) {
            s.register = Some("http://192.0.2.1:8000/".into());
            let got: IpAddr = advertise_host(&s).parse().unwrap();
            assert_eq!(got, ip);
            assert!(!got.is_loopback() && !got.is_unspecified());
        }
        assert_eq!(bracketed("::1"), "[::1]");
        assert_eq!(bracketed("10.0.0.5"), "10.0.0.5");
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
