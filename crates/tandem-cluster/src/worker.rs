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
//!
//! Modules by job: `config` (the worker's and the deployment's KV transfer settings), `http` (routes
//! and handlers); this file is the service: start-up, drain, load, prefill and decode.

mod config;
mod http;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tandem_engine::{
    EngineError, EngineHandle, EngineRequest, FinishReason, KvStaging, RequestMode, RequestStream,
};
use tandem_kv::{
    BlockSelection, KvClient, KvListener, KvServer, KvServerConfig, KvSink, KvSource,
    NixlTransport, PeerInfo, PullSelection, Registration, ShmTransport, TcpConfig, TcpTransport,
};

use crate::engine_kv::{register_staging, EngineSink, EngineSource, PinnedKv};
use crate::error::ClusterError;
use crate::protocol::{
    DecodeRequest, PrefillRequest, PrefillResponse, Role, StreamEvent, WireToken, WorkerInfo,
    WorkerLoad,
};

pub use config::{peer_info, KvTransferConfig, TransportKind, WorkerConfig};

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
    metrics: tandem_telemetry::Metrics,
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
                        tls: config.tls.clone(),
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
                    tls: config.tls.clone(),
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
        let metrics = tandem_telemetry::Metrics::new().map_err(|e| ClusterError::Protocol {
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
        // cached the pull only acks, which still releases the prefill worker's pin. A sliding-window
        // layer pulls only the blocks its window still reaches.
        let n_layers = pre.handle.layout.n_layers;
        let wanted = PullSelection::with_layer_from(
            BlockSelection::range(plan.cached as u32..plan.num_blocks as u32),
            (0..n_layers)
                .map(|l| plan.layer_needed(l).start as u32)
                .collect(),
        );
        let sink = Arc::new(EngineSink::new(
            &self.engine,
            id,
            &pre.handle.layout,
            (0..n_layers).map(|l| plan.layer_needed(l)).collect(),
            self.staged.as_ref().map(|(_, s)| Arc::clone(s)),
        ));
        let stats = client
            .pull_selection(&pre.handle, &wanted, Arc::clone(&sink) as Arc<dyn KvSink>)
            .await;
        // Settle even after a failed pull so no import outlives the request.
        let settled = sink.settle().await;
        let stats = stats?;
        settled?;
        self.engine.start_decoding(id).wait().await?;
        tracing::debug!(
            transfer_id = pre.handle.transfer_id,
            pulled = wanted.blocks.len(),
            cached = plan.cached,
            "KV imported"
        );
        let event = StreamEvent::Transfer {
            bytes: stats.bytes,
            seconds: stats.elapsed.as_secs_f64(),
            blocks: wanted.blocks.len(),
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
