//! The ingress side: registers workers (with the KV handshake), polls their load, and implements
//! [`GenerateBackend`] by routing each request through a prefill worker and a decode worker.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures::future::BoxFuture;
use futures::StreamExt;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tandem_api::{BackendError, GenerateBackend, TokenStream};
use tandem_engine::{EngineStats, RequestId, SamplingParams, TokenOutput};
use tandem_kv::{KvError, PeerInfo};
use tokio::sync::mpsc;

use crate::error::ClusterError;
use crate::metrics::{ClusterMetrics, PrefillPath};
use crate::prefix::{block_hashes, PrefixTracker};
use crate::protocol::{
    DecodeRequest, ErrorBody, PrefillRequest, PrefillResponse, Prefilled, RegisterRequest,
    ReleaseRequest, Role, StreamEvent, WorkerInfo, WorkerLoad, PATH_DECODE, PATH_INFO, PATH_LOAD,
    PATH_PREFILL, PATH_REGISTER, PATH_RELEASE,
};
use crate::routing::{pick_decode, pick_prefill, DecodeLoad, PrefillCandidate, RoutingConfig};

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
        }
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.001))
}

/// Everything the ingress knows about one registered worker.
pub struct WorkerEntry {
    /// Base URL of its RPC server.
    pub url: String,
    /// Its registration record.
    pub info: WorkerInfo,
    healthy: AtomicBool,
    in_flight: Arc<AtomicUsize>,
    load: Mutex<WorkerLoad>,
    prefix: Mutex<PrefixTracker>,
}

impl WorkerEntry {
    /// Whether its last poll or RPC succeeded.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Its last polled load.
    pub fn load(&self) -> WorkerLoad {
        self.load.lock().clone()
    }

    fn track(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(&self.in_flight))
    }

    fn decode_load(&self) -> DecodeLoad {
        let l = self.load.lock();
        DecodeLoad {
            kv_blocks_used: l.engine.kv_blocks_used,
            kv_blocks_total: l.engine.kv_blocks_total,
            seqs: l.engine.running + l.engine.waiting,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            max_num_seqs: self.info.max_num_seqs,
        }
    }
}

/// Decrements a worker's in-flight count when the request is done with it.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One worker as listed on `GET /v1/cluster/workers`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// Base URL.
    pub url: String,
    /// Registration record.
    pub info: WorkerInfo,
    /// Whether it answers.
    pub healthy: bool,
    /// Last polled load.
    pub load: WorkerLoad,
}

struct Inner {
    routing: RoutingConfig,
    timeouts: TimeoutConfig,
    http: reqwest::Client,
    workers: RwLock<Vec<Arc<WorkerEntry>>>,
    /// The handshake every worker must match: the ingress model's id, then the first worker's layout.
    reference: Mutex<Option<PeerInfo>>,
    model_id: Option<String>,
    metrics: ClusterMetrics,
}

/// The P/D router: a [`GenerateBackend`] over remote workers. Cheap to clone.
#[derive(Clone)]
pub struct Ingress {
    inner: Arc<Inner>,
}

impl Ingress {
    /// An ingress with no worker yet; `model_id` (the served model's identity hash) is required of every worker.
    pub fn new(
        routing: RoutingConfig,
        timeouts: TimeoutConfig,
        model_id: Option<String>,
    ) -> Result<Self, ClusterError> {
        let http = reqwest::Client::builder()
            .connect_timeout(secs(timeouts.connect_secs))
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
            }),
        })
    }

    /// Fetches a worker's info, runs the handshake check and adds it; a mismatch is refused naming the field.
    pub async fn register(&self, url: &str) -> Result<WorkerInfo, ClusterError> {
        let url = url.trim_end_matches('/').to_owned();
        let info: WorkerInfo = get_json(
            &self.inner.http,
            &url,
            PATH_INFO,
            secs(self.inner.timeouts.connect_secs) * 5,
        )
        .await?;
        self.admit(url, info)
    }

    /// Like [`Self::register`], retrying connection failures until the worker is up or the startup timeout passes.
    pub async fn register_when_up(&self, url: &str) -> Result<WorkerInfo, ClusterError> {
        let deadline = tokio::time::Instant::now() + secs(self.inner.timeouts.worker_startup_secs);
        loop {
            match self.register(url).await {
                Err(ClusterError::Rpc { .. }) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => return other,
            }
        }
    }

    fn admit(&self, url: String, info: WorkerInfo) -> Result<WorkerInfo, ClusterError> {
        let refuse = |source: KvError| ClusterError::Refused {
            url: url.clone(),
            source,
        };
        {
            let mut reference = self.inner.reference.lock();
            if let Some(model_id) = &self.inner.model_id {
                if &info.peer.model_id != model_id {
                    return Err(refuse(KvError::Mismatch {
                        field: "model_id",
                        local: format!("{model_id:?}"),
                        remote: format!("{:?}", info.peer.model_id),
                    }));
                }
            }
            match &*reference {
                Some(r) => r.check_compatible(&info.peer).map_err(refuse)?,
                None => *reference = Some(info.peer.clone()),
            }
        }
        let entry = Arc::new(WorkerEntry {
            prefix: Mutex::new(PrefixTracker::new(16_384)),
            url: url.clone(),
            info: info.clone(),
            healthy: AtomicBool::new(true),
            in_flight: Arc::new(AtomicUsize::new(0)),
            load: Mutex::new(WorkerLoad::default()),
        });
        let mut workers = self.inner.workers.write();
        workers.retain(|w| w.url != url);
        workers.push(entry);
        tracing::info!(%url, worker = %info.worker_id, role = %info.role, "worker registered");
        Ok(info)
    }

    /// Every registered worker.
    pub fn workers(&self) -> Vec<WorkerStatus> {
        self.inner
            .workers
            .read()
            .iter()
            .map(|w| WorkerStatus {
                url: w.url.clone(),
                info: w.info.clone(),
                healthy: w.healthy(),
                load: w.load(),
            })
            .collect()
    }

    /// Polls every worker's load once (marks unanswering workers unhealthy).
    pub async fn poll_once(&self) {
        let workers: Vec<Arc<WorkerEntry>> = self.inner.workers.read().clone();
        let timeout = secs(self.inner.timeouts.poll_interval_secs).max(Duration::from_secs(1));
        let polls = workers.iter().map(|w| async move {
            match get_json::<WorkerLoad>(&self.inner.http, &w.url, PATH_LOAD, timeout).await {
                Ok(load) => {
                    if let Some(cap) =
                        (load.engine.kv_blocks_total > 0).then_some(load.engine.kv_blocks_total)
                    {
                        let mut p = w.prefix.lock();
                        if p.is_empty() {
                            *p = PrefixTracker::new(cap);
                        }
                    }
                    *w.load.lock() = load;
                    if !w.healthy.swap(true, Ordering::Relaxed) {
                        tracing::info!(url = %w.url, "worker is back");
                    }
                }
                Err(e) => {
                    if w.healthy.swap(false, Ordering::Relaxed) {
                        tracing::warn!(url = %w.url, error = %e, "worker stopped answering");
                    }
                }
            }
        });
        futures::future::join_all(polls).await;
    }

    /// Polls worker loads forever (spawn it).
    pub async fn poll_forever(self) {
        let mut tick = tokio::time::interval(secs(self.inner.timeouts.poll_interval_secs));
        loop {
            tick.tick().await;
            self.poll_once().await;
        }
    }

    /// Routes of the ingress itself: worker registration and listing.
    pub fn routes(&self) -> Router {
        Router::new()
            .route(
                PATH_REGISTER,
                post(register_handler)
                    .get(|State(i): State<Ingress>| async move { Json(i.workers()) }),
            )
            .with_state(self.clone())
    }

    fn healthy(&self, role: Role) -> Vec<Arc<WorkerEntry>> {
        self.inner
            .workers
            .read()
            .iter()
            .filter(|w| w.info.role == role && w.healthy())
            .cloned()
            .collect()
    }

    fn block_size(&self) -> usize {
        self.inner
            .reference
            .lock()
            .as_ref()
            .map_or(16, |r| r.layout.block_size)
    }
}

async fn register_handler(
    State(ingress): State<Ingress>,
    Json(req): Json<RegisterRequest>,
) -> Response {
    match ingress.register(&req.url).await {
        Ok(info) => Json(info).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "worker registration refused");
            (
                e.status(),
                Json(ErrorBody {
                    error: e.to_string(),
                }),
            )
                .into_response()
        }
    }
}

async fn get_json<T: serde::de::DeserializeOwned>(
    http: &reqwest::Client,
    url: &str,
    path: &str,
    timeout: Duration,
) -> Result<T, ClusterError> {
    let resp = http
        .get(format!("{url}{path}"))
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| rpc(url, e))?;
    read_json(url, resp).await
}

async fn post_json<B: Serialize, T: serde::de::DeserializeOwned>(
    http: &reqwest::Client,
    url: &str,
    path: &str,
    body: &B,
    timeout: Duration,
) -> Result<T, ClusterError> {
    let resp = http
        .post(format!("{url}{path}"))
        .json(body)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| rpc(url, e))?;
    read_json(url, resp).await
}

fn rpc(url: &str, source: reqwest::Error) -> ClusterError {
    ClusterError::Rpc {
        url: url.to_owned(),
        source,
    }
}

async fn check_status(
    url: &str,
    resp: reqwest::Response,
) -> Result<reqwest::Response, ClusterError> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    let message = serde_json::from_str::<ErrorBody>(&text)
        .map(|b| b.error)
        .unwrap_or(text);
    Err(ClusterError::Remote {
        url: url.to_owned(),
        status,
        message,
    })
}

async fn read_json<T: serde::de::DeserializeOwned>(
    url: &str,
    resp: reqwest::Response,
) -> Result<T, ClusterError> {
    let resp = check_status(url, resp).await?;
    resp.json().await.map_err(|e| rpc(url, e))
}

/// Unpins a prefill worker's transfer unless disarmed (the client went away between prefill and pull).
struct RemotePin {
    http: reqwest::Client,
    url: String,
    transfer_id: u64,
    armed: bool,
}

impl Drop for RemotePin {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (http, url, transfer_id) = (self.http.clone(), self.url.clone(), self.transfer_id);
        rt.spawn(async move {
            let req = ReleaseRequest { transfer_id };
            if let Err(e) = post_json::<_, bool>(&http, &url, PATH_RELEASE, &req, Duration::from_secs(5)).await {
                tracing::warn!(%url, transfer_id, error = %e, "could not release a prefill pin (its timeout will)");
            }
        });
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
    tx: mpsc::UnboundedSender<Result<TokenOutput, BackendError>>,
}

impl Job {
    async fn run(self) {
        let tx = self.tx.clone();
        if let Err(e) = self.route().await {
            tracing::warn!(error = %e, "P/D request failed");
            let _ = tx.send(Err(BackendError::Failed(e.to_string())));
        }
    }

    /// Tries prefill workers (best first) until one answers; `None` when none did or none is up.
    async fn remote_prefill(&self, hashes: &[u64]) -> Option<(Arc<WorkerEntry>, PrefillResponse)> {
        let inner = &self.ingress.inner;
        let mut tried: Vec<String> = Vec::new();
        loop {
            let cands: Vec<Arc<WorkerEntry>> = self
                .ingress
                .healthy(Role::Prefill)
                .into_iter()
                .filter(|w| !tried.contains(&w.url))
                .collect();
            let scored: Vec<PrefillCandidate> = cands
                .iter()
                .map(|w| PrefillCandidate {
                    matched_blocks: w.prefix.lock().matched_blocks(hashes),
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
        let hashes = block_hashes(&self.prompt, self.ingress.block_size());
        let decoders = self.ingress.healthy(Role::Decode);
        let loads: Vec<DecodeLoad> = decoders.iter().map(|w| w.decode_load()).collect();
        let Some(i) = pick_decode(&loads, &mut rand::rng()) else {
            return Err(ClusterError::Protocol {
                url: String::new(),
                message: "no healthy decode worker".into(),
            });
        };
        let d = Arc::clone(&decoders[i]);
        let busy = d.track();
        let cached = d.prefix.lock().matched_blocks(&hashes) * self.ingress.block_size();
        let uncached = self.prompt.len().saturating_sub(cached);

        // Tokens delivered to the client so far: what a replacement decode worker resumes after.
        let mut sent: Vec<u32> = Vec::new();
        let mut path = PrefillPath::Local;
        let mut prefilled = None;
        let mut pin = None;
        if uncached >= inner.routing.local_prefill_threshold
            && !self.ingress.healthy(Role::Prefill).is_empty()
        {
            path = PrefillPath::Fallback;
            if let Some((p, resp)) = self.remote_prefill(&hashes).await {
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
        let resp = match self.start_decode(&d, &req).await {
            Ok(resp) => resp,
            Err(e) if req.prefilled.is_some() => {
                // The pull failed (prefill worker died, pin expired...): prefill on the decode worker instead.
                tracing::warn!(error = %e, "KV transfer failed; prefilling on the decode worker");
                inner.metrics.transfer_failed();
                drop(pin.take());
                path = PrefillPath::Fallback;
                req.prefilled = None;
                self.start_decode(&d, &req).await?
            }
            Err(e) => return Err(e),
        };
        // The decode worker answered, so it has acked or aborted the pull itself.
        if let Some(p) = pin.as_mut() {
            p.armed = false;
        }
        inner.metrics.request(path);
        d.prefix.lock().insert(&hashes);
        self.stream(d, busy, resp, first_sent, sent, &hashes).await
    }

    /// Relays the decode worker's tokens; if it fails mid-stream (process died, connection lost, engine
    /// error), resumes the request on another healthy decode worker after the tokens already delivered,
    /// and gives up with the error (the client's stream ends without a finish, which the API reports)
    /// when no other decode worker is left to try.
    async fn stream(
        &self,
        d: Arc<WorkerEntry>,
        busy: InFlight,
        mut resp: reqwest::Response,
        mut skip_first: bool,
        mut sent: Vec<u32>,
        hashes: &[u64],
    ) -> Result<(), ClusterError> {
        let inner = &self.ingress.inner;
        let mut tried = vec![d.url.clone()];
        // The worker streaming now, with its in-flight count held until it is replaced or we return.
        let (mut d, mut _busy) = (d, busy);
        loop {
            let err = match self.forward(&d.url, resp, skip_first, &mut sent).await {
                Ok(()) => return Ok(()),
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
            (d, _busy, resp, skip_first) = (next, next_busy, r, false);
        }
    }

    /// The least loaded healthy decode worker not yet tried for this request.
    fn next_decoder(&self, tried: &[String]) -> Option<Arc<WorkerEntry>> {
        let cands: Vec<Arc<WorkerEntry>> = self
            .ingress
            .healthy(Role::Decode)
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
        let send = inner
            .http
            .post(format!("{}{PATH_DECODE}", d.url))
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
    fn submit(
        &self,
        _id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<TokenStream, BackendError> {
        if prompt.is_empty() {
            return Err(BackendError::Invalid("the prompt is empty".into()));
        }
        if self.healthy(Role::Decode).is_empty() {
            return Err(BackendError::Unavailable(
                "no decode worker is available".into(),
            ));
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
            tx,
        };
        let guard = AbortOnDrop(tokio::spawn(job.run()));
        Ok(Box::pin(futures::stream::poll_fn(move |cx| {
            let _keep = &guard;
            rx.poll_recv(cx)
        })))
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
            .unwrap_or(0)
    }

    fn health(&self) -> BoxFuture<'static, Result<(), BackendError>> {
        let ok = !self.healthy(Role::Decode).is_empty();
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

    fn extra_metrics(&self) -> String {
        let workers = self.inner.workers.read().clone();
        let loads: Vec<(Arc<WorkerEntry>, WorkerLoad)> = workers
            .into_iter()
            .map(|w| {
                let l = w.load();
                (w, l)
            })
            .collect();
        self.inner
            .metrics
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
