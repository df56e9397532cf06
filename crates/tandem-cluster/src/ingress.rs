//! The ingress's request path: implements [`GenerateBackend`] by routing each request through a prefill
//! worker and a decode worker, with failover (prefill retried elsewhere or done locally, a lost decode
//! worker replaced by resuming). The worker registry is in `registry`, the RPC helpers in `rpc`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::StreamExt;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tandem_api::{
    BackendError, ClusterView, GenerateBackend, GenerateRequest, TokenStream, WorkerView,
};
use tandem_engine::{EngineStats, RequestId, SamplingParams, TokenOutput};
use tandem_kv::PeerInfo;
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::admission::{Admission, Reservation};
use crate::error::ClusterError;
use crate::metrics::{ClusterMetrics, PrefillPath};
use crate::prefix::block_hashes;
use crate::protocol::{
    DecodeRequest, PrefillRequest, PrefillResponse, Prefilled, Role, StreamEvent, WorkerLoad,
    PATH_DECODE, PATH_PREFILL,
};
use crate::registry::InFlight;
pub use crate::registry::{WorkerEntry, WorkerStatus};
use crate::routing::{
    pick_decode, pick_decode_cached, pick_prefill, wants_remote_prefill, DecodeLoad,
    PrefillCandidate, RoutingConfig,
};
use crate::rpc::{check_status, post_json, rpc, with_request_id, RemotePin};

/// Time limits of the ingress (YAML `timeouts:`), in seconds.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutConfig {
    /// Connecting to a worker.
    pub connect_secs: f64,
    /// A whole prefill RPC (queueing plus compute).
    pub prefill_secs: f64,
    /// Until a decode worker starts streaming (includes the KV pull).
    pub decode_start_secs: f64,
    /// Longest silence of a decode worker's token stream before the ingress gives up on that worker and
    /// resumes the request elsewhere: a frozen or partitioned worker must not hang the client.
    pub token_stall_secs: f64,
    /// Between load polls of every worker.
    pub poll_interval_secs: f64,
    /// How long startup waits for a worker to answer its first info request.
    pub worker_startup_secs: f64,
    /// Longest a request waits at the head, before its prefill, for KV room on a decode worker; then
    /// it is refused with 503.
    pub admission_secs: f64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig {
            connect_secs: 2.0,
            prefill_secs: 300.0,
            decode_start_secs: 300.0,
            token_stall_secs: 120.0,
            poll_interval_secs: 0.5,
            worker_startup_secs: 300.0,
            admission_secs: 300.0,
        }
    }
}

/// A duration from a setting in seconds, at least a millisecond.
pub(crate) fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.001))
}

/// The ingress's shared state: settings, the HTTP client, the worker registry and metrics.
pub(crate) struct Inner {
    pub(crate) routing: RoutingConfig,
    pub(crate) timeouts: TimeoutConfig,
    pub(crate) http: reqwest::Client,
    pub(crate) workers: RwLock<Vec<Arc<WorkerEntry>>>,
    /// The handshake every worker must match: the ingress model's id, then the first worker's layout.
    pub(crate) reference: Mutex<Option<PeerInfo>>,
    pub(crate) model_id: Option<String>,
    pub(crate) metrics: ClusterMetrics,
    /// The cluster secret its calls carry and registrations must carry (`crate::auth`).
    pub(crate) cluster_key: Option<tandem_kv::ClusterKey>,
    /// The cluster's mutual TLS, when on: worker URLs are `https://`.
    pub(crate) tls: Option<Arc<tandem_kv::ClusterTls>>,
    /// Requests waiting for decode KV room before their prefill.
    pub(crate) admission: Admission,
    /// Checks guided requests' constraints before routing, so one that does not compile is a 400
    /// up front instead of an error from the prefill worker mid-request.
    pub(crate) guide: std::sync::OnceLock<Arc<tandem_engine::GuideEnv>>,
    /// The context length to assume while no worker is registered ([`Ingress::assume_max_model_len`]).
    pub(crate) model_len: std::sync::OnceLock<usize>,
}

/// The P/D router: a [`GenerateBackend`] over remote workers. Cheap to clone.
#[derive(Clone)]
pub struct Ingress {
    pub(crate) inner: Arc<Inner>,
}

impl Ingress {
    /// An ingress with no worker yet; `model_id` (the served model's identity hash) is required of every
    /// worker, and `cluster_key` (when set) goes with every call to them and is required to register.
    /// `worker_idle_close` is how long the workers keep an idle connection open (their
    /// `server.header_read_timeout_secs`).
    pub fn new(
        routing: RoutingConfig,
        timeouts: TimeoutConfig,
        model_id: Option<String>,
        cluster_key: Option<tandem_kv::ClusterKey>,
        worker_idle_close: Duration,
    ) -> Result<Self, ClusterError> {
        Self::with_tls(
            routing,
            timeouts,
            model_id,
            cluster_key,
            worker_idle_close,
            None,
        )
    }

    /// [`Self::new`] under the cluster's mutual TLS: every call to a worker is HTTPS presenting this
    /// process's certificate, and workers found by DNS are dialled at `https://`.
    pub fn with_tls(
        routing: RoutingConfig,
        timeouts: TimeoutConfig,
        model_id: Option<String>,
        cluster_key: Option<tandem_kv::ClusterKey>,
        worker_idle_close: Duration,
        tls: Option<Arc<tandem_kv::ClusterTls>>,
    ) -> Result<Self, ClusterError> {
        let http = crate::rpc::with_cluster_tls(reqwest::Client::builder(), tls.as_deref())
            .default_headers(crate::auth::token_headers(cluster_key.as_ref()))
            .connect_timeout(secs(timeouts.connect_secs))
            // A worker closes a connection left idle for `worker_idle_close`; a request sent on it just
            // then fails with "connection closed before message completed" (12% of requests sent at
            // that idle age did, in a loopback test). Retiring pooled connections at half that age
            // keeps every request on a connection the worker still serves.
            .pool_idle_timeout(worker_idle_close / 2)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ClusterError::Rpc {
                url: String::new(),
                source: e,
            })?;
        let metrics = ClusterMetrics::new().map_err(|e| ClusterError::Protocol {
            url: String::new(),
            message: e.to_string(),
        })?;
        Ok(Ingress {
            inner: Arc::new(Inner {
                routing,
                timeouts,
                http,
                workers: RwLock::new(Vec::new()),
                reference: Mutex::new(None),
                model_id,
                metrics,
                cluster_key,
                tls,
                admission: Admission::default(),
                guide: std::sync::OnceLock::new(),
                model_len: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Compiles every guided request's constraint with `guide` (the served model's vocabulary)
    /// before routing it; set once, at start-up.
    pub fn check_guidance_with(&self, guide: Arc<tandem_engine::GuideEnv>) {
        let _ = self.inner.guide.set(guide);
    }

    /// The served model's context length, assumed while no worker is registered (a head started before
    /// its workers, or restarted): without it the API would check prompts against a context of 0 and
    /// refuse every request with a 400 instead of the 503 "no decode worker" a client retries. Set
    /// once, at start-up; registered workers' own limits replace it.
    pub fn assume_max_model_len(&self, len: usize) {
        let _ = self.inner.model_len.set(len);
    }
}

/// Aborts the request's task when the client's stream is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What one request's task needs.
struct Job {
    ingress: Ingress,
    prompt: Vec<u32>,
    params: SamplingParams,
    /// The client request's id, sent to every worker that works on it.
    request_id: Option<String>,
    tx: mpsc::UnboundedSender<Result<TokenOutput, BackendError>>,
}

impl Job {
    async fn run(self) {
        let tx = self.tx.clone();
        if let Err(e) = self.route().await {
            tracing::warn!(error = %e, "P/D request failed");
            let err = match &e {
                e if e.is_busy() => BackendError::Unavailable(e.to_string()),
                // A worker refused the request itself (its parameters, its prompt): the client's error.
                ClusterError::Remote {
                    status: 400,
                    message,
                    ..
                } => BackendError::Invalid(message.clone()),
                e => BackendError::Failed(e.to_string()),
            };
            let _ = tx.send(Err(err));
        }
    }

    /// Tries prefill workers (best first) until one answers; `None` when none did or none is up.
    async fn remote_prefill(&self, hashes: &[u64]) -> Option<(Arc<WorkerEntry>, PrefillResponse)> {
        let inner = &self.ingress.inner;
        let mut tried: Vec<String> = Vec::new();
        loop {
            let cands: Vec<Arc<WorkerEntry>> = self
                .ingress
                .routable(Role::Prefill)
                .into_iter()
                .filter(|w| !tried.contains(&w.url))
                .collect();
            let scored: Vec<PrefillCandidate> = cands
                .iter()
                .map(|w| PrefillCandidate {
                    matched_score: w.prefix.lock().matched_score(hashes),
                    in_flight: w.in_flight.load(Ordering::Relaxed),
                })
                .collect();
            let p = Arc::clone(&cands[pick_prefill(&scored, inner.routing.prefill_load_bound)?]);
            tried.push(p.url.clone());
            let _busy = p.track();
            let req = PrefillRequest {
                prompt: self.prompt.clone(),
                params: self.params.clone(),
            };
            match post_json::<_, PrefillResponse>(
                &inner.http,
                &p.url,
                PATH_PREFILL,
                &req,
                secs(inner.timeouts.prefill_secs),
                self.request_id.as_deref(),
            )
            .await
            {
                Ok(resp) => {
                    p.prefix.lock().insert(hashes);
                    return Some((p, resp));
                }
                Err(e) => {
                    inner.metrics.prefill_failed();
                    if matches!(e, ClusterError::Rpc { .. }) {
                        p.healthy.store(false, Ordering::Relaxed);
                    }
                    tracing::warn!(url = %p.url, error = %e, "prefill failed; trying elsewhere");
                }
            }
        }
    }

    async fn route(self) -> Result<(), ClusterError> {
        let inner = &self.ingress.inner;
        let arrived = std::time::Instant::now();
        // Time spent in the prefill RPC, which `tandem:role_wait_seconds` charges to prefill.
        let mut prefill_time = std::time::Duration::ZERO;
        let hashes = block_hashes(&self.prompt, self.ingress.block_size());
        let decoders = self.ingress.routable(Role::Decode);
        let loads: Vec<DecodeLoad> = decoders.iter().map(|w| w.decode_load()).collect();
        let matched: Vec<usize> = decoders
            .iter()
            .map(|w| w.prefix.lock().matched_blocks(&hashes) * self.ingress.block_size())
            .collect();
        let Some(i) = pick_decode_cached(&loads, &matched, &inner.routing, &mut rand::rng()) else {
            return Err(ClusterError::Protocol {
                url: String::new(),
                message: "no healthy decode worker".into(),
            });
        };
        let d = Arc::clone(&decoders[i]);
        let busy = d.track();
        let cached = matched[i].min(self.prompt.len());
        let uncached = self.prompt.len() - cached;

        // Tokens delivered to the client so far: what a replacement decode worker resumes after.
        let mut sent: Vec<u32> = Vec::new();
        let mut path = PrefillPath::Local;
        let mut prefilled = None;
        let mut pin = None;
        let (mut d, mut busy) = (d, busy);
        // KV room claimed on the decode worker until its decode starts (remote prefills only: a local
        // prefill pins nothing and queues in the decode engine itself).
        let mut reserved = None;
        if wants_remote_prefill(
            uncached,
            cached,
            self.ingress.routable(Role::Prefill).len(),
            &inner.routing,
        ) {
            let (chosen, reservation) = self.admit(&d, &hashes).await?;
            if !Arc::ptr_eq(&chosen, &d) {
                busy = chosen.track();
                d = chosen;
            }
            reserved = Some(reservation);
            path = PrefillPath::Fallback;
            let prefill_start = std::time::Instant::now();
            let prefilled_remotely = self.remote_prefill(&hashes).await;
            prefill_time = prefill_start.elapsed();
            if prefilled_remotely.is_some() {
                inner
                    .metrics
                    .observe_wait(Role::Prefill, prefill_time.as_secs_f64());
            }
            if let Some((p, resp)) = prefilled_remotely {
                let finished = resp.first.finish.is_some();
                // The first token goes to the client now, before any KV moves.
                if self.tx.send(Ok(resp.first.clone().into())).is_err() || finished {
                    inner.metrics.request(PrefillPath::Remote);
                    return Ok(());
                }
                sent.push(resp.first.token);
                path = PrefillPath::Remote;
                if let Some(handle) = resp.handle {
                    pin = Some(RemotePin {
                        http: inner.http.clone(),
                        url: p.url.clone(),
                        transfer_id: handle.transfer_id,
                        armed: true,
                    });
                    prefilled = Some(Prefilled {
                        first_token: resp.first.token,
                        handle,
                    });
                }
            }
        }
        let first_sent = !sent.is_empty();
        let mut req = DecodeRequest {
            prompt: self.prompt.clone(),
            params: self.params.clone(),
            prefilled,
            resume: Vec::new(),
        };
        if !d.routable() {
            // It began draining (or stopped answering) while the prompt was prefilled: a draining worker
            // may stop as soon as its own streams end, so this one goes to a worker that stays.
            if let Some(next) = self.next_decoder(std::slice::from_ref(&d.url)) {
                busy = next.track();
                d = next;
            }
        }
        // Whether another decode worker should take the request as it is: this one's KV cache and
        // import queue are full (the KV stays pinned on the prefill worker for another to pull), or the
        // request never reached it (it stopped since it was chosen).
        let elsewhere =
            |e: &ClusterError| (req.prefilled.is_some() && e.is_busy()) || e.never_arrived();
        let resp = match self.start_decode(&d, &req).await {
            Err(e) if elsewhere(&e) => {
                // With no other worker left the request fails with the last answer: overloaded (503)
                // rather than recomputed where there is no room.
                let mut tried = vec![d.url.clone()];
                if e.never_arrived() {
                    d.healthy.store(false, Ordering::Relaxed);
                }
                let mut last = e;
                loop {
                    let Some(next) = self.next_decoder(&tried) else {
                        return Err(last);
                    };
                    tried.push(next.url.clone());
                    let next_busy = next.track();
                    match self.start_decode(&next, &req).await {
                        Ok(resp) => {
                            (d, busy) = (next, next_busy);
                            break Ok(resp);
                        }
                        Err(e) if elsewhere(&e) => {
                            if e.never_arrived() {
                                next.healthy.store(false, Ordering::Relaxed);
                            }
                            last = e;
                        }
                        Err(e) => {
                            (d, busy) = (next, next_busy);
                            break Err(e);
                        }
                    }
                }
            }
            Err(e) if req.prefilled.is_some() => {
                // The pull failed (prefill worker died, pin expired...): prefill on the decode worker instead.
                tracing::warn!(error = %e, "KV transfer failed; prefilling on the decode worker");
                inner.metrics.transfer_failed();
                drop(pin.take());
                path = PrefillPath::Fallback;
                req.prefilled = None;
                self.start_decode(&d, &req).await
            }
            started => started,
        };
        // Started (its blocks now count in the worker's own load) or failed: the claim has done its job.
        drop(reserved);
        if resp.is_ok() {
            inner.metrics.observe_wait(
                Role::Decode,
                arrived.elapsed().saturating_sub(prefill_time).as_secs_f64(),
            );
        }
        let resp = match resp {
            // The decode worker answered, so it has acked or aborted the pull itself.
            Ok(r) => {
                if let Some(p) = pin.as_mut() {
                    p.armed = false;
                }
                Ok(r)
            }
            // It refused the request itself (a full queue, a bad prompt): its answer is the client's.
            Err(e @ ClusterError::Remote { .. }) => return Err(e),
            // Unreachable (gone, or drained away since it was chosen): another decode worker takes it
            // in `stream`, as if it had failed before its first token.
            Err(e) => {
                drop(pin.take());
                Err(e)
            }
        };
        inner.metrics.request(path);
        d.prefix.lock().insert(&hashes);
        self.stream(d, busy, resp, first_sent, sent, &hashes).await
    }

    /// Relays the decode worker's tokens (`resp` is its answer, or the error of a start that found it
    /// unreachable); if it fails mid-stream (process died, connection lost, engine error), resumes the request on another healthy decode worker after the tokens already delivered,
    /// and gives up with the error (the client's stream ends without a finish, which the API reports)
    /// when no other decode worker is left to try.
    async fn stream(
        &self,
        d: Arc<WorkerEntry>,
        busy: InFlight,
        mut resp: Result<reqwest::Response, ClusterError>,
        mut skip_first: bool,
        mut sent: Vec<u32>,
        hashes: &[u64],
    ) -> Result<(), ClusterError> {
        let inner = &self.ingress.inner;
        let mut tried = vec![d.url.clone()];
        // The worker streaming now, with its in-flight count held until it is replaced or we return.
        let (mut d, mut _busy) = (d, busy);
        loop {
            let err = match resp {
                Ok(r) => match self.forward(&d.url, r, skip_first, &mut sent).await {
                    Ok(()) => {
                        self.remember_answer(&d, &sent);
                        return Ok(());
                    }
                    Err(e) => e,
                },
                Err(e) => e,
            };
            if !matches!(err, ClusterError::Remote { .. }) {
                // Not an error the worker reported: it is gone or unreachable.
                d.healthy.store(false, Ordering::Relaxed);
            }
            inner.metrics.decode_failed();
            let req = DecodeRequest {
                prompt: self.prompt.clone(),
                params: self.params.clone(),
                prefilled: None,
                resume: sent.clone(),
            };
            let mut restarted = None;
            while let Some(next) = self.next_decoder(&tried) {
                tried.push(next.url.clone());
                tracing::warn!(from = %d.url, to = %next.url, delivered = sent.len(), error = %err, "decode worker lost mid-stream; resuming elsewhere");
                let next_busy = next.track();
                match self.start_decode(&next, &req).await {
                    Ok(r) => {
                        restarted = Some((next, next_busy, r));
                        break;
                    }
                    Err(e) => {
                        if !matches!(e, ClusterError::Remote { .. }) {
                            next.healthy.store(false, Ordering::Relaxed);
                        }
                        tracing::warn!(url = %next.url, error = %e, "resuming failed");
                    }
                }
            }
            let Some((next, next_busy, r)) = restarted else {
                return Err(err);
            };
            inner.metrics.decode_resumed();
            next.prefix.lock().insert(hashes);
            (d, _busy, resp, skip_first) = (next, next_busy, Ok(r), false);
        }
    }

    /// Records that decode worker `d` now caches the prompt followed by the answer it streamed (all
    /// but the last token, whose KV is never computed): a chat client's next turn sends exactly that
    /// history again, and the routing finds it there.
    fn remember_answer(&self, d: &WorkerEntry, answer: &[u32]) {
        let Some((_, computed)) = answer.split_last() else {
            return;
        };
        let mut history = Vec::with_capacity(self.prompt.len() + computed.len());
        history.extend_from_slice(&self.prompt);
        history.extend_from_slice(computed);
        d.prefix
            .lock()
            .insert(&block_hashes(&history, self.ingress.block_size()));
    }

    /// Waits (`crate::admission`) until `preferred` or another decode worker has KV room for the
    /// prompt's blocks it does not cache, and claims it there.
    async fn admit(
        &self,
        preferred: &Arc<WorkerEntry>,
        hashes: &[u64],
    ) -> Result<(Arc<WorkerEntry>, Reservation), ClusterError> {
        let inner = &self.ingress.inner;
        let block_size = self.ingress.block_size().max(1);
        // The prompt's blocks plus the one its first generated token may open.
        let blocks = (self.prompt.len() + 1).div_ceil(block_size);
        let need = |w: &WorkerEntry| blocks.saturating_sub(w.prefix.lock().matched_blocks(hashes));
        // As many may wait here as the decode workers would queue themselves (no bound while one
        // reports none, like `WorkerLoad::saturated`).
        let bounds: Vec<usize> = self
            .ingress
            .routable(Role::Decode)
            .iter()
            .map(|w| w.load().max_waiting)
            .collect();
        let bound = if bounds.contains(&0) {
            usize::MAX
        } else {
            bounds.iter().sum()
        };
        let deadline = tokio::time::Instant::now() + secs(inner.timeouts.admission_secs);
        let waited = Instant::now();
        let admitted = inner
            .admission
            .admit(
                preferred,
                || self.ingress.routable(Role::Decode),
                need,
                bound,
                deadline,
            )
            .await;
        let secs_waited = waited.elapsed().as_secs_f64();
        if secs_waited > 0.1 {
            tracing::debug!(
                secs = secs_waited,
                ok = admitted.is_ok(),
                "waited for decode KV room"
            );
        }
        admitted
    }

    /// The least loaded routable decode worker not yet tried for this request.
    fn next_decoder(&self, tried: &[String]) -> Option<Arc<WorkerEntry>> {
        let cands: Vec<Arc<WorkerEntry>> = self
            .ingress
            .routable(Role::Decode)
            .into_iter()
            .filter(|w| !tried.contains(&w.url))
            .collect();
        let loads: Vec<DecodeLoad> = cands.iter().map(|w| w.decode_load()).collect();
        let i = pick_decode(&loads, &mut rand::rng())?;
        Some(Arc::clone(&cands[i]))
    }

    async fn start_decode(
        &self,
        d: &WorkerEntry,
        req: &DecodeRequest,
    ) -> Result<reqwest::Response, ClusterError> {
        let inner = &self.ingress.inner;
        let send = with_request_id(
            inner.http.post(format!("{}{PATH_DECODE}", d.url)),
            self.request_id.as_deref(),
        )
        .json(req)
        .send();
        let resp = tokio::time::timeout(secs(inner.timeouts.decode_start_secs), send)
            .await
            .map_err(|_| ClusterError::Protocol {
                url: d.url.clone(),
                message: "decode did not start in time".into(),
            })?
            .map_err(|e| rpc(&d.url, e))?;
        check_status(&d.url, resp).await
    }

    /// Relays the decode worker's NDJSON tokens to the client, skipping the repeated first token and
    /// recording each delivered token in `sent`. `Ok` once the request finished or the client left.
    async fn forward(
        &self,
        url: &str,
        resp: reqwest::Response,
        mut skip_first: bool,
        sent: &mut Vec<u32>,
    ) -> Result<(), ClusterError> {
        let mut body = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        let stall = self.ingress.inner.timeouts.token_stall_secs;
        loop {
            let chunk = match tokio::time::timeout(secs(stall), body.next()).await {
                Ok(Some(chunk)) => chunk,
                Ok(None) => break,
                Err(_) => {
                    return Err(ClusterError::Protocol {
                        url: url.to_owned(),
                        message: format!("no token for {stall} s (timeouts.token_stall_secs)"),
                    })
                }
            };
            buf.extend_from_slice(&chunk.map_err(|e| rpc(url, e))?);
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let event: StreamEvent =
                    serde_json::from_slice(&buf[..nl]).map_err(|e| ClusterError::Protocol {
                        url: url.to_owned(),
                        message: e.to_string(),
                    })?;
                buf.drain(..=nl);
                match event {
                    StreamEvent::Transfer {
                        bytes,
                        seconds,
                        blocks,
                        skipped_blocks,
                    } => self.ingress.inner.metrics.observe_transfer(
                        bytes,
                        seconds,
                        blocks,
                        skipped_blocks,
                    ),
                    StreamEvent::Token(_) if skip_first => skip_first = false,
                    StreamEvent::Token(t) => {
                        let done = t.finish.is_some();
                        sent.push(t.token);
                        if self.tx.send(Ok(t.into())).is_err() || done {
                            return Ok(());
                        }
                    }
                    StreamEvent::Error(message) => {
                        return Err(ClusterError::Remote {
                            url: url.to_owned(),
                            status: 200,
                            message,
                        })
                    }
                }
            }
        }
        Err(ClusterError::Protocol {
            url: url.to_owned(),
            message: "token stream ended before a finish".into(),
        })
    }
}

impl GenerateBackend for Ingress {
    fn submit(&self, req: GenerateRequest) -> Result<TokenStream, BackendError> {
        // The id is the engine's: each worker's engine numbers its own requests.
        let GenerateRequest { prompt, params, .. } = req;
        if prompt.is_empty() {
            return Err(BackendError::Invalid("the prompt is empty".into()));
        }
        if let (Some(g), Some(env)) = (&params.guidance, self.inner.guide.get()) {
            env.compile(g)
                .map_err(|e| BackendError::Invalid(e.to_string()))?;
        }
        let decoders = self.routable(Role::Decode);
        if decoders.is_empty() {
            return Err(BackendError::Unavailable(
                "no decode worker is available".into(),
            ));
        }
        // Like the colocated engine's queue bound: refused up front (503 + Retry-After) only when every
        // decode worker last reported as many requests and imports waiting as it allows.
        let waiting: Vec<Option<usize>> = decoders.iter().map(|w| w.load().saturated()).collect();
        if waiting.iter().all(Option::is_some) {
            return Err(BackendError::QueueFull {
                waiting: waiting.into_iter().flatten().sum(),
            });
        }
        let max_model_len = self.max_model_len();
        // Same rule as the engine: the prompt must leave room for one generated token.
        if prompt.len() >= max_model_len {
            return Err(BackendError::PromptTooLong {
                prompt: prompt.len(),
                max_tokens: params.max_tokens,
                max_model_len,
            });
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let job = Job {
            ingress: self.clone(),
            prompt,
            params,
            request_id: tandem_api::current_request_id(),
            tx,
        };
        // The job runs in the HTTP request's span, so its warnings carry the request id too.
        let guard = AbortOnDrop(tokio::spawn(job.run().instrument(tracing::Span::current())));
        Ok(Box::pin(futures::stream::poll_fn(move |cx| {
            let _keep = &guard;
            rx.poll_recv(cx)
        })))
    }

    fn role(&self) -> &'static str {
        "head"
    }

    fn abort(&self, _id: RequestId) {
        // Requests end when their stream is dropped (the API drops it on abort): that aborts the task,
        // which closes the decode connection (the worker aborts) and releases any prefill pin.
    }

    fn stats(&self) -> EngineStats {
        // Every request passes through exactly one decode worker, so their sum counts each once.
        let mut total = EngineStats::default();
        for w in self
            .inner
            .workers
            .read()
            .iter()
            .filter(|w| w.info.role == Role::Decode)
        {
            let s = w.load.lock().engine.clone();
            total.running += s.running;
            total.waiting += s.waiting;
            total.kv_blocks_total += s.kv_blocks_total;
            total.kv_blocks_used += s.kv_blocks_used;
            total.kv_blocks_cached += s.kv_blocks_cached;
            total.prefix_cache_queries += s.prefix_cache_queries;
            total.prefix_cache_hits += s.prefix_cache_hits;
            total.prompt_tokens_total += s.prompt_tokens_total;
            total.generation_tokens_total += s.generation_tokens_total;
            total.prefill_tokens_computed += s.prefill_tokens_computed;
            total.import_blocks_cached += s.import_blocks_cached;
            total.import_blocks_needed += s.import_blocks_needed;
            total.preemptions_total += s.preemptions_total;
            total.requests_finished_total += s.requests_finished_total;
            total.steps_total += s.steps_total;
        }
        total
    }

    fn max_model_len(&self) -> usize {
        self.inner
            .workers
            .read()
            .iter()
            .map(|w| w.info.max_model_len)
            .min()
            .unwrap_or_else(|| self.inner.model_len.get().copied().unwrap_or(0))
    }

    fn health(&self) -> BoxFuture<'static, Result<(), BackendError>> {
        let ok = !self.routable(Role::Decode).is_empty();
        Box::pin(async move {
            if ok {
                Ok(())
            } else {
                Err(BackendError::Unavailable(
                    "no decode worker is available".into(),
                ))
            }
        })
    }

    fn cluster(&self) -> ClusterView {
        let workers = self.inner.workers.read().clone();
        ClusterView {
            model: String::new(),
            workers: workers
                .iter()
                .map(|w| {
                    let load = w.load();
                    WorkerView {
                        healthy: w.healthy(),
                        draining: w.draining(),
                        pinned_blocks: load.pinned_blocks,
                        ..WorkerView::from_stats(
                            w.info.worker_id.clone(),
                            w.info.role.to_string(),
                            w.url.clone(),
                            &load.engine,
                        )
                    }
                })
                .collect(),
            routing: self.inner.metrics.routing(),
            kv_bytes_moved: self.inner.metrics.transfer_bytes(),
        }
    }

    fn extra_metrics(&self) -> String {
        let workers = self.inner.workers.read().clone();
        let loads: Vec<(Arc<WorkerEntry>, WorkerLoad)> = workers
            .into_iter()
            .map(|w| {
                let l = w.load();
                (w, l)
            })
            .collect();
        let metrics = &self.inner.metrics;
        metrics.set_admission_waiting(self.inner.admission.waiting());
        metrics
            .render(
                loads
                    .iter()
                    .map(|(w, l)| (w.info.worker_id.as_str(), w.info.role, w.healthy(), l)),
            )
            .unwrap_or_else(|e| {
                tracing::error!(error = %e, "cannot render cluster metrics");
                String::new()
            })
    }
}
