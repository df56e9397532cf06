//! A prefill or decode worker: one engine behind the control RPC, plus its side of the KV transfer.
//!
//! Prefill: run the prompt prefill-only, keep its blocks pinned in the engine, copy them out once and
//! register them with the [`KvServer`]; the server's release (ack, abort, disconnect, timeout) unpins
//! them in the engine. Decode: share the blocks the engine's prefix cache already holds, reserve the
//! rest, pull only those through a [`KvSink`] that forwards each block to the engine thread, then start
//! decoding with zero prefill compute.
//!
//! Drain ([`WorkerService::drain`], on SIGTERM): `/health` answers 503 and the load says `draining`, so
//! orchestrators and the ingress send nothing new; requests in flight finish and pins are pulled or
//! released within the grace period, then the caller stops the server.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tandem_engine::{
    EngineError, EngineHandle, EngineRequest, FinishReason, KvStaging, RequestMode, RequestStream,
};
use tandem_kv::{
    BlockSelection, KvClient, KvError, KvListener, KvServer, KvServerConfig, KvSink, KvSource,
    NixlAgent, NixlBackend, NixlConfig, NixlTransport, PeerInfo, Registration, ShmTransport,
    TcpConfig, TcpTransport, WireDtype, WireLayout,
};
use tracing::Instrument;

use crate::engine_kv::{register_staging, EngineSink, EngineSource, PinnedKv};
use crate::error::ClusterError;
use crate::protocol::{
    DecodeRequest, PrefillRequest, PrefillResponse, ReleaseRequest, Role, StreamEvent, WireToken,
    WorkerInfo, WorkerLoad, PATH_DECODE, PATH_HEALTH, PATH_INFO, PATH_LOAD, PATH_METRICS,
    PATH_PREFILL, PATH_RELEASE,
};

/// How decode workers pull KV (YAML `kv_transfer.transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// NIXL on GPU workers where the library loads (device-to-device READs), TCP otherwise — decided
    /// by each worker at start-up and logged; a NIXL decode worker pulls over TCP from a prefill
    /// worker without NIXL (`TransferHandle::nixl`), so workers deciding differently still agree.
    #[default]
    Auto,
    /// TCP, several connections per pull: works across hosts.
    Tcp,
    /// Shared-memory file plus a TCP control connection: same host only, fewer copies through the kernel.
    Shm,
    /// NIXL (loaded at run time) moves the bytes by one-sided READs from the prefill worker's registered
    /// memory; handshake, pins and acks stay on a TCP control connection. Every worker of the deployment
    /// needs the library (`nixl_library`); a worker that cannot load it fails at start-up naming why.
    Nixl,
}

impl std::str::FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            "nixl" => Ok(TransportKind::Nixl),
            other => Err(format!(
                "unknown KV transport `{other}` (expected auto, tcp, shm or nixl)"
            )),
        }
    }
}

/// KV transfer settings shared by every worker of a deployment (YAML `kv_transfer:`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvTransferConfig {
    /// Data plane used by decode workers.
    pub transport: TransportKind,
    /// Parallel TCP connections per pull.
    pub streams: usize,
    /// Seconds a prefill worker keeps KV pinned without an ack.
    pub pin_timeout_secs: f64,
    /// Seconds bound on every KV socket read or write.
    pub io_timeout_secs: f64,
    /// CRC32 every data frame.
    pub checksum: bool,
    /// NIXL backend plugin (`transport: nixl`): ucx, or libfabric (AWS EFA).
    pub nixl_backend: NixlBackend,
    /// `libnixl_capi.so`, its directory, or an unpacked `nixl-cu13` wheel (`transport: nixl`); unset: the
    /// system loader's search path.
    pub nixl_library: Option<std::path::PathBuf>,
    /// MiB of staging memory (`transport: nixl`), allocated where the KV lives (GPU memory on CUDA workers)
    /// and registered once: prefill exports into it and decode READs into it, so KV moves GPU to GPU with
    /// no host copy. A transfer that finds it full goes through registered host buffers instead. 0: none.
    pub staging_mib: usize,
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        KvTransferConfig {
            transport: TransportKind::Auto,
            streams: 4,
            pin_timeout_secs: 30.0,
            io_timeout_secs: 10.0,
            checksum: false,
            nixl_backend: NixlBackend::Ucx,
            nixl_library: None,
            staging_mib: 1024,
        }
    }
}

impl KvTransferConfig {
    fn pin_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.pin_timeout_secs.max(0.001))
    }

    /// The NIXL agent of a worker of a `transport: nixl` deployment (both roles have one).
    /// This worker's NIXL agent: required with `transport: nixl` (a load failure is an error naming
    /// what is missing), tried on GPU workers with `auto` (a failure logs why and means TCP).
    fn nixl_agent(&self, worker_id: &str, gpu: bool) -> Result<Option<NixlAgent>, KvError> {
        let config = NixlConfig {
            library: self.nixl_library.clone(),
            backend: self.nixl_backend,
            ..NixlConfig::default()
        };
        match self.transport {
            TransportKind::Nixl => NixlAgent::new(worker_id, &config).map(Some),
            TransportKind::Auto if gpu => match NixlAgent::new(worker_id, &config) {
                Ok(agent) => {
                    tracing::info!("KV transfer: NIXL (transport: auto on a GPU worker)");
                    Ok(Some(agent))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV transfer: TCP (transport: auto could not load NIXL; set nixl_library)");
                    Ok(None)
                }
            },
            _ => Ok(None),
        }
    }

    fn io_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.io_timeout_secs.max(0.001))
    }
}

/// Settings of one worker process.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Unique name in the deployment.
    pub worker_id: String,
    /// Prefill or decode.
    pub role: Role,
    /// Address the KV server binds (prefill workers), e.g. `127.0.0.1:0`.
    pub kv_listen: String,
    /// Host decode workers should dial for KV when `kv_listen` binds a wildcard (e.g. `0.0.0.0`).
    pub kv_advertise_host: Option<String>,
    /// KV transfer settings.
    pub kv: KvTransferConfig,
    /// The engine's batch size, reported to the router.
    pub max_num_seqs: usize,
    /// The engine runs on a GPU: `transport: auto` then tries NIXL.
    pub gpu: bool,
    /// The cluster secret callers and KV peers must prove (`crate::auth`); `None` leaves the ports open.
    pub cluster_key: Option<tandem_kv::ClusterKey>,
    /// `/metrics` asks for the cluster token too (with one set); by default it is open, like `/health`.
    pub metrics_need_token: bool,
}

/// Builds the handshake record of an engine: the model identity plus its KV shape.
///
/// The query head count is not part of the engine's layout, so the caller passes it from the model config.
pub fn peer_info(engine: &EngineHandle, model_id: String, n_heads: usize) -> PeerInfo {
    let l = engine.kv_layout();
    let dtype = if l.dtype.size() == 2 {
        WireDtype::Bf16
    } else {
        WireDtype::F32
    };
    PeerInfo {
        model_id,
        layout: WireLayout {
            n_layers: l.n_layers,
            n_heads,
            n_kv_heads: l.n_kv_heads,
            head_dim: l.head_dim,
            block_size: l.block_size,
            dtype,
        },
    }
}

/// How often a decode whose import found the KV cache full tries again.
const IMPORT_RETRY: Duration = Duration::from_millis(20);

/// One decode import counted in `imports_waiting` until dropped.
struct ImportWaiting<'a>(&'a AtomicUsize);

impl<'a> ImportWaiting<'a> {
    /// Counts one more waiting import, or refuses it (`QueueFull`) when `max` already wait.
    fn enter(count: &'a AtomicUsize, max: usize) -> Result<Self, EngineError> {
        let waiting = count.fetch_add(1, Ordering::AcqRel);
        let entered = ImportWaiting(count);
        if waiting >= max {
            return Err(EngineError::QueueFull { waiting });
        }
        Ok(entered)
    }
}

impl Drop for ImportWaiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
/// How often a drain checks whether the worker's work is done.
const DRAIN_CHECK: Duration = Duration::from_millis(50);

/// Longest a drain waits for the ingress to notice it (two load polls after it began, so routing has
/// seen `draining`) before an idle worker may stop: with no ingress polling, it must not wait out the grace.
const DRAIN_NOTICE: Duration = Duration::from_secs(5);

/// Releases an engine pin unless disarmed: covers a prefill whose HTTP caller went away mid-handler.
struct EnginePinGuard {
    engine: EngineHandle,
    request: u64,
    armed: bool,
}

impl Drop for EnginePinGuard {
    fn drop(&mut self) {
        if self.armed {
            self.engine.release_pin(self.request);
        }
    }
}

/// Counts a request as in flight for as long as it lives.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(c: &Arc<AtomicUsize>) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(c))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One worker's engine, KV endpoint and RPC handlers.
pub struct WorkerService {
    engine: EngineHandle,
    info: WorkerInfo,
    config: WorkerConfig,
    source: Arc<EngineSource>,
    kv_server: Option<KvServer>,
    kv_client: Option<KvClient>,
    /// The NIXL registration of the engine's staging memory, and the memory (`transport: nixl`,
    /// `staging_mib` > 0); the registration drops first, while the memory is still alive.
    staged: Option<(Registration, Arc<KvStaging>)>,
    _listener: Option<KvListener>,
    next_id: AtomicU64,
    in_flight: Arc<AtomicUsize>,
    /// Decode imports waiting for KV blocks, at most the engine's `max_waiting`.
    imports_waiting: AtomicUsize,
    /// Taken by a waiting import while it retries, so imports are admitted in arrival order (tokio's
    /// mutex is fair).
    import_turn: tokio::sync::Mutex<()>,
    /// Set on SIGTERM: readiness fails and the load says so.
    draining: AtomicBool,
    /// Load polls answered, and when the last one came: how a drain knows the ingress saw it, and how
    /// a self-registered worker notices its ingress is gone (restarted) and registers again.
    polls: AtomicU64,
    last_poll: Mutex<Instant>,
    /// The engine's Prometheus gauges and counters, served on `/metrics`.
    metrics: tandem_api::metrics::Metrics,
}

impl WorkerService {
    /// Starts the role's KV side (the listener of a prefill worker, the client of a decode worker).
    pub async fn start(
        engine: EngineHandle,
        peer: PeerInfo,
        config: WorkerConfig,
    ) -> Result<Arc<Self>, ClusterError> {
        Self::start_bound(engine, peer, config, None).await
    }

    /// Like [`Self::start`]; a prefill worker serves KV on `kv_listener` (non-blocking, bound before the
    /// model loaded, so a busy port failed at once) when given, else binds `config.kv_listen` now.
    pub async fn start_bound(
        engine: EngineHandle,
        peer: PeerInfo,
        config: WorkerConfig,
        kv_listener: Option<std::net::TcpListener>,
    ) -> Result<Arc<Self>, ClusterError> {
        let source = Arc::new(EngineSource {
            engine: engine.clone(),
            pins: Mutex::new(HashMap::new()),
        });
        let mut staged = None;
        let (kv_server, listener, kv_client) = match config.role {
            Role::Prefill => {
                let server = KvServer::new(
                    KvServerConfig {
                        worker_id: config.worker_id.clone(),
                        pin_timeout: config.kv.pin_timeout(),
                        io_timeout: config.kv.io_timeout(),
                        cluster_key: config.cluster_key.clone(),
                        ..KvServerConfig::default()
                    },
                    peer.clone(),
                    Arc::clone(&source) as Arc<dyn KvSource>,
                );
                if let Some(agent) = config.kv.nixl_agent(&config.worker_id, config.gpu)? {
                    staged = register_staging(&engine, &agent, config.kv.staging_mib).await?;
                    server.enable_nixl(agent)?;
                }
                let listener = match kv_listener {
                    Some(bound) => server.listen_on(bound)?,
                    None => server.listen(&config.kv_listen).await?,
                };
                (Some(server), Some(listener), None)
            }
            Role::Decode => {
                let tcp = TcpConfig {
                    streams: config.kv.streams.max(1),
                    io_timeout: config.kv.io_timeout(),
                    checksum: config.kv.checksum,
                    cluster_key: config.cluster_key.clone(),
                    ..TcpConfig::default()
                };
                let agent = config.kv.nixl_agent(&config.worker_id, config.gpu)?;
                let transport: Arc<dyn tandem_kv::KvTransport> = match (config.kv.transport, agent)
                {
                    (TransportKind::Shm, _) => Arc::new(ShmTransport::new(
                        peer.clone(),
                        tcp,
                        tandem_kv::default_shm_dir(),
                    )),
                    (_, Some(agent)) => {
                        staged = register_staging(&engine, &agent, config.kv.staging_mib).await?;
                        Arc::new(NixlTransport::new(peer.clone(), tcp, agent))
                    }
                    (_, None) => Arc::new(TcpTransport::new(peer.clone(), tcp)),
                };
                (None, None, Some(KvClient::new(transport)))
            }
        };
        let info = WorkerInfo {
            worker_id: config.worker_id.clone(),
            role: config.role,
            peer,
            kv_endpoint: listener
                .as_ref()
                .map(|l| match &config.kv_advertise_host {
                    Some(host) => format!("{host}:{}", l.local_addr().port()),
                    None => l.local_addr().to_string(),
                })
                .unwrap_or_default(),
            max_model_len: engine.max_model_len(),
            max_num_seqs: config.max_num_seqs,
            pid: std::process::id(),
            instance: rand::random::<u64>() | 1,
        };
        let metrics = tandem_api::metrics::Metrics::new().map_err(|e| ClusterError::Protocol {
            url: String::new(),
            message: e.to_string(),
        })?;
        Ok(Arc::new(WorkerService {
            metrics,
            engine,
            info,
            config,
            source,
            kv_server,
            kv_client,
            staged,
            _listener: listener,
            next_id: AtomicU64::new(1),
            in_flight: Arc::new(AtomicUsize::new(0)),
            imports_waiting: AtomicUsize::new(0),
            import_turn: tokio::sync::Mutex::new(()),
            draining: AtomicBool::new(false),
            polls: AtomicU64::new(0),
            last_poll: Mutex::new(Instant::now()),
        }))
    }

    /// Marks the worker draining: `/health` fails and the load says `draining`; work is still served.
    pub fn start_drain(&self) {
        if !self.draining.swap(true, Ordering::Relaxed) {
            tracing::info!(worker = %self.info.worker_id, "draining: no new work, finishing what is in flight");
        }
    }

    /// Whether [`Self::start_drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Time since the ingress last polled this worker's load (since start when it never did).
    pub fn since_polled(&self) -> Duration {
        self.last_poll.lock().elapsed()
    }

    /// Whether nothing is left to finish: no request in flight, no pin waiting for its pull.
    fn idle(&self) -> bool {
        self.in_flight.load(Ordering::Relaxed) == 0
            && self.source.pins.lock().is_empty()
            && self.kv_server.as_ref().map_or(0, KvServer::pinned) == 0
    }

    /// Drains the worker: marks it draining, waits until the ingress has seen that (or [`DRAIN_NOTICE`]
    /// passed) and every request and pin is done, for at most `grace`. True when it ended idle; false
    /// when the grace period ran out with work left (logged).
    pub async fn drain(&self, grace: Duration) -> bool {
        self.start_drain();
        let start = Instant::now();
        let polls_at_start = self.polls.load(Ordering::Relaxed);
        loop {
            let waited = start.elapsed();
            let noticed =
                self.polls.load(Ordering::Relaxed) >= polls_at_start + 2 || waited >= DRAIN_NOTICE;
            if noticed && self.idle() {
                tracing::info!(worker = %self.info.worker_id, secs = waited.as_secs_f64(), "drained");
                return true;
            }
            if waited >= grace {
                let load = self.load();
                tracing::warn!(
                    worker = %self.info.worker_id,
                    in_flight = load.in_flight,
                    pinned_transfers = load.pinned_transfers,
                    "drain grace period over with work left"
                );
                return false;
            }
            tokio::time::sleep(DRAIN_CHECK).await;
        }
    }

    /// The load, counted as a poll of the ingress.
    fn polled(&self) -> WorkerLoad {
        self.polls.fetch_add(1, Ordering::Relaxed);
        *self.last_poll.lock() = Instant::now();
        self.load()
    }

    /// What the worker announces at registration.
    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// Current load and counters.
    pub fn load(&self) -> WorkerLoad {
        let kv = match (&self.kv_server, &self.kv_client) {
            (Some(s), _) => s.metrics().snapshot(),
            (None, Some(c)) => c.metrics().snapshot(),
            (None, None) => Default::default(),
        };
        WorkerLoad {
            engine: self.engine.stats(),
            pinned_blocks: self.source.pinned_blocks(),
            pinned_transfers: self.kv_server.as_ref().map_or(0, KvServer::pinned),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            kv,
            staging_bytes: self.staged.as_ref().map_or(0, |(_, s)| s.len()),
            staging_free_bytes: self.staged.as_ref().map_or(0, |(_, s)| s.free_bytes()),
            imports_waiting: self.imports_waiting.load(Ordering::Relaxed),
            max_waiting: self.engine.max_waiting(),
            // An engine that lost its device or a stage takes no work either: the ingress routes away.
            draining: self.is_draining() || self.engine.health().is_err(),
            instance: self.info.instance,
        }
    }

    /// The worker's Prometheus text: the engine's gauges and counters (`tandem:num_requests_running`,
    /// `tandem:kv_blocks_used`, ... as a colocated server has them) and the worker's own: requests in
    /// flight, pinned KV blocks, KV bytes moved and failed transfers, draining.
    pub fn metrics_text(&self) -> Result<String, ClusterError> {
        let mut text = self
            .metrics
            .render_engine(&self.engine.stats())
            .map_err(|e| ClusterError::Protocol {
                url: String::new(),
                message: e.to_string(),
            })?;
        let load = self.load();
        let (bytes, failures) = match self.config.role {
            Role::Prefill => (load.kv.bytes_sent, load.kv.serve_errors),
            Role::Decode => (load.kv.bytes_received, load.kv.pulls_failed),
        };
        let role = self.config.role;
        for (name, kind, help, value) in [
            (
                "tandem:worker_requests_in_flight",
                "gauge",
                "Requests this worker is serving (prefills, decodes).",
                load.in_flight as u64,
            ),
            (
                "tandem:kv_pinned_blocks",
                "gauge",
                "KV blocks pinned for a decode worker to pull.",
                load.pinned_blocks as u64,
            ),
            (
                "tandem:kv_transfer_bytes_total",
                "counter",
                "KV bytes this worker sent (prefill) or received (decode).",
                bytes,
            ),
            (
                "tandem:kv_transfer_failures_total",
                "counter",
                "KV transfers that failed: served with an error (prefill), pulls that failed (decode).",
                failures,
            ),
            (
                "tandem:worker_draining",
                "gauge",
                "1 while the worker drains (SIGTERM): no new work.",
                u64::from(load.draining),
            ),
        ] {
            use std::fmt::Write;
            let _ = write!(
                text,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{role=\"{role}\"}} {value}\n"
            );
        }
        Ok(text)
    }

    /// The worker's HTTP routes: all but `/health` (and `/metrics`, unless `metrics_need_token`) need
    /// the cluster token when one is set.
    pub fn router(self: Arc<Self>) -> Router {
        let key = self.config.cluster_key.clone();
        let closed_metrics = self.config.metrics_need_token;
        let calls = Router::new()
            .route(
                PATH_INFO,
                get(|State(s): State<Arc<Self>>| async move { Json(s.info.clone()) }),
            )
            .route(
                PATH_LOAD,
                get(|State(s): State<Arc<Self>>| async move { Json(s.polled()) }),
            )
            .route(PATH_PREFILL, post(prefill))
            .route(PATH_DECODE, post(decode))
            .route(PATH_RELEASE, post(release));
        let (calls, open) = if closed_metrics {
            (calls.route(PATH_METRICS, get(metrics)), Router::new())
        } else {
            (calls, Router::new().route(PATH_METRICS, get(metrics)))
        };
        crate::auth::require_token(calls, key)
            .merge(open)
            .route(PATH_HEALTH, get(health))
            .with_state(self)
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs a prompt prefill-only and pins its KV for a pull.
    pub async fn prefill(&self, req: PrefillRequest) -> Result<PrefillResponse, ClusterError> {
        let Some(server) = &self.kv_server else {
            return Err(ClusterError::WrongRole {
                role: self.config.role,
                what: "prefill",
            });
        };
        let _busy = InFlight::new(&self.in_flight);
        let id = self.next_id();
        let prompt_len = req.prompt.len();
        let max_tokens = req.params.max_tokens;
        // The engine pin outlives the KV server's so the server's release is what normally frees it.
        let pin_timeout = self.config.kv.pin_timeout() + Duration::from_secs(5);
        let mut stream = self.engine.submit(EngineRequest {
            id,
            prompt: req.prompt,
            params: req.params,
            mode: RequestMode::PrefillOnly { pin_timeout },
        })?;
        let out = next_output(&mut stream).await?;
        let mut guard = EnginePinGuard {
            engine: self.engine.clone(),
            request: id,
            armed: true,
        };
        // A prefill-only request always ends after one token; say whether the whole request ends here.
        let finish = match out.finish {
            Some(FinishReason::Stop) => Some(FinishReason::Stop),
            _ if max_tokens <= 1 || prompt_len + 1 >= self.engine.max_model_len() => {
                Some(FinishReason::Length)
            }
            _ => None,
        };
        let first = WireToken {
            token: out.token,
            logprobs: out.logprobs,
            finish,
            prompt_logprobs: out.prompt_logprobs,
        };
        if finish.is_some() {
            return Ok(PrefillResponse {
                first,
                handle: None,
            });
        }
        let kv = Arc::new(self.engine.export_blocks(id).wait().await?);
        let mut handle = server.register((0..kv.num_blocks as u32).collect(), kv.num_tokens)?;
        handle.endpoint.clone_from(&self.info.kv_endpoint);
        self.source
            .pins
            .lock()
            .insert(handle.transfer_id, PinnedKv { request: id, kv });
        guard.armed = false;
        tracing::debug!(
            transfer_id = handle.transfer_id,
            blocks = handle.block_ids.len(),
            "prefill pinned"
        );
        Ok(PrefillResponse {
            first,
            handle: Some(handle),
        })
    }

    /// Starts a decode: pulls the prefilled KV (or prefills here) and returns the token stream.
    pub async fn start_decode(
        &self,
        req: DecodeRequest,
    ) -> Result<(Option<StreamEvent>, RequestStream), ClusterError> {
        let Some(client) = &self.kv_client else {
            return Err(ClusterError::WrongRole {
                role: self.config.role,
                what: "decode",
            });
        };
        let id = self.next_id();
        let prompt_len = req.prompt.len();
        let mut engine_req = EngineRequest::new(id, req.prompt, req.params);
        let Some(pre) = req.prefilled else {
            if !req.resume.is_empty() {
                engine_req.mode = RequestMode::Resume { output: req.resume };
            }
            return Ok((None, self.engine.submit(engine_req)?));
        };
        if !req.resume.is_empty() {
            return Err(ClusterError::Protocol {
                url: pre.handle.endpoint.clone(),
                message: "a resumed decode cannot import prefilled KV".into(),
            });
        }
        // When running sequences hold the whole KV cache, the import waits for blocks to free, like a
        // queued admission — in arrival order, at most `max_waiting` at once (past that, 503 as the
        // engine refuses submissions), for at most half the prefill pin's lifetime (so the pin is
        // still there) — instead of recomputing the prompt here.
        let deadline = tokio::time::Instant::now() + self.config.kv.pin_timeout() / 2;
        let _waiting = ImportWaiting::enter(&self.imports_waiting, self.engine.max_waiting())?;
        let turn = tokio::time::timeout_at(deadline, self.import_turn.lock())
            .await
            .map_err(|_| EngineError::KvBusy {
                id: engine_req.id,
                reason: "earlier imports are still waiting for KV blocks".into(),
            })?;
        let (stream, plan) = loop {
            let (stream, plan) = self
                .engine
                .import_prefilled(engine_req.clone(), pre.first_token)?;
            // From here on, dropping `stream` (on any error) aborts the import and frees its blocks.
            match plan.wait().await {
                Ok(plan) => break (stream, plan),
                Err(EngineError::KvBusy { .. }) if tokio::time::Instant::now() < deadline => {
                    drop(stream);
                    engine_req.id = self.next_id();
                    tokio::time::sleep(IMPORT_RETRY).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        drop((turn, _waiting));
        let id = engine_req.id;
        if plan.num_blocks != pre.handle.block_ids.len() || pre.handle.n_tokens != prompt_len {
            return Err(ClusterError::Protocol {
                url: pre.handle.endpoint.clone(),
                message: format!(
                    "handle has {} blocks of {} tokens, the prompt needs {} blocks of {prompt_len}",
                    pre.handle.block_ids.len(),
                    pre.handle.n_tokens,
                    plan.num_blocks
                ),
            });
        }
        // Blocks this engine's prefix cache already holds are shared, not pulled; with all of them
        // cached the pull only acks, which still releases the prefill worker's pin.
        let wanted = BlockSelection::range(plan.cached as u32..plan.num_blocks as u32);
        let sink = Arc::new(EngineSink::new(
            &self.engine,
            id,
            &pre.handle.layout,
            &(plan.cached..plan.num_blocks),
            self.staged.as_ref().map(|(_, s)| Arc::clone(s)),
        ));
        let stats = client
            .pull_blocks(&pre.handle, &wanted, Arc::clone(&sink) as Arc<dyn KvSink>)
            .await;
        // Settle even after a failed pull so no import outlives the request.
        let settled = sink.settle().await;
        let stats = stats?;
        settled?;
        self.engine.start_decoding(id).wait().await?;
        tracing::debug!(
            transfer_id = pre.handle.transfer_id,
            pulled = wanted.len(),
            cached = plan.cached,
            "KV imported"
        );
        let event = StreamEvent::Transfer {
            bytes: stats.bytes,
            seconds: stats.elapsed.as_secs_f64(),
            blocks: wanted.len(),
            skipped_blocks: plan.cached,
        };
        Ok((Some(event), stream))
    }
}

/// The next output of a stream, or the engine's reason for ending it.
async fn next_output(
    stream: &mut RequestStream,
) -> Result<tandem_engine::TokenOutput, ClusterError> {
    match stream.recv().await {
        Some(out) => Ok(out),
        None => Err(stream.take_error().unwrap_or(EngineError::Stopped).into()),
    }
}

/// Readiness: 200 while the worker takes work, 503 once it drains or its engine stopped (a lost device
/// or stage); the body says which worker answers (`{"status":"ok"|"draining"|"unavailable","role",
/// "worker","model"}`, `error` too when refusing, the shape the ingress reads refusals in).
async fn health(State(s): State<Arc<WorkerService>>) -> Response {
    let draining = s.is_draining();
    let engine = s.engine.health();
    let status = match (&engine, draining) {
        (Err(_), _) => "unavailable",
        (Ok(()), true) => "draining",
        (Ok(()), false) => "ok",
    };
    let mut body = serde_json::json!({
        "status": status,
        "role": s.config.role,
        "worker": s.info.worker_id,
        "model": s.info.peer.model_id,
    });
    if let Err(e) = engine {
        body["error"] = e.to_string().into();
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    } else if draining {
        body["error"] = "draining".into();
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    } else {
        (StatusCode::OK, Json(body)).into_response()
    }
}

/// `GET /metrics`: the worker's Prometheus text ([`WorkerService::metrics_text`]).
async fn metrics(State(s): State<Arc<WorkerService>>) -> Response {
    match s.metrics_text() {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The span of one RPC about a client request: the `X-Request-Id` the ingress sent (its own request
/// id), so the worker's lines about it carry the id the head's lines and the client's answer carry.
fn request_span(headers: &HeaderMap, rpc: &'static str) -> tracing::Span {
    let id = headers
        .get(tandem_api::X_REQUEST_ID.as_str())
        .and_then(|v| v.to_str().ok())
        .filter(|id| tandem_api::request_log::is_valid_request_id(id))
        .unwrap_or("");
    tracing::info_span!("request", rpc, request_id = %id)
}

async fn prefill(
    State(s): State<Arc<WorkerService>>,
    headers: HeaderMap,
    Json(req): Json<PrefillRequest>,
) -> Result<Json<PrefillResponse>, ClusterError> {
    let span = request_span(&headers, "prefill");
    let started = Instant::now();
    let prompt_tokens = req.prompt.len();
    let answer = s.prefill(req).instrument(span.clone()).await;
    span.in_scope(|| match &answer {
        Ok(_) => tracing::info!(
            prompt_tokens,
            ms = started.elapsed().as_millis() as u64,
            "prefilled"
        ),
        Err(e) => tracing::warn!(prompt_tokens, error = %e, "prefill failed"),
    });
    answer.map(Json)
}

async fn release(
    State(s): State<Arc<WorkerService>>,
    Json(req): Json<ReleaseRequest>,
) -> Json<bool> {
    Json(
        s.kv_server
            .as_ref()
            .is_some_and(|srv| srv.abort(req.transfer_id)),
    )
}

/// What a decode's last log line says: the tokens it streamed and how long since its RPC came.
struct DecodeLog {
    span: tracing::Span,
    started: Instant,
    tokens: usize,
}

fn ndjson(event: &StreamEvent) -> Bytes {
    let mut line =
        serde_json::to_vec(event).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}").into_bytes());
    line.push(b'\n');
    Bytes::from(line)
}

async fn decode(
    State(s): State<Arc<WorkerService>>,
    headers: HeaderMap,
    Json(req): Json<DecodeRequest>,
) -> Result<Response, ClusterError> {
    let span = request_span(&headers, "decode");
    let started = Instant::now();
    let busy = InFlight::new(&s.in_flight);
    let (first, stream) = match s.start_decode(req).instrument(span.clone()).await {
        Ok(started) => started,
        Err(e) => {
            span.in_scope(|| tracing::warn!(error = %e, "decode failed to start"));
            return Err(e);
        }
    };
    // The body owns the engine stream: when the ingress disconnects, the body is dropped and the
    // request aborted, which frees its blocks. Its end is logged in the request's span.
    let log = DecodeLog {
        span,
        started,
        tokens: 0,
    };
    let tokens = futures::stream::unfold(Some((stream, busy, log)), |state| async move {
        let (mut stream, busy, mut log) = state?;
        match stream.recv().await {
            Some(out) => {
                log.tokens += 1;
                let done = out.finish;
                let line = ndjson(&StreamEvent::Token(WireToken::from(out)));
                if let Some(finish) = done {
                    log.span.in_scope(|| {
                        tracing::info!(
                            tokens = log.tokens,
                            ?finish,
                            ms = log.started.elapsed().as_millis() as u64,
                            "decoded"
                        )
                    });
                    return Some((line, None));
                }
                Some((line, Some((stream, busy, log))))
            }
            None => {
                let err = stream.take_error().map_or_else(
                    || "the engine ended the request".to_owned(),
                    |e| e.to_string(),
                );
                log.span.in_scope(
                    || tracing::warn!(tokens = log.tokens, error = %err, "decode failed"),
                );
                Some((ndjson(&StreamEvent::Error(err)), None))
            }
        }
    });
    let body = futures::stream::iter(first.as_ref().map(ndjson))
        .chain(tokens)
        .map(Ok::<_, Infallible>);
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response())
}
