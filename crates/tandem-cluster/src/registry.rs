//! The ingress's worker registry: registration with the KV handshake check, load polling and health, and
//! the listing served on `/v1/cluster/workers`.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tandem_kv::KvError;

use crate::error::ClusterError;
use crate::ingress::{secs, Ingress};
use crate::prefix::PrefixTracker;
use crate::protocol::{
    ErrorBody, RegisterRequest, Role, WorkerInfo, WorkerLoad, PATH_INFO, PATH_LOAD, PATH_REGISTER,
};
use crate::routing::DecodeLoad;
use crate::rpc::get_json;

/// Everything the ingress knows about one registered worker.
pub struct WorkerEntry {
    /// Base URL of its RPC server.
    pub url: String,
    /// Its registration record.
    pub info: WorkerInfo,
    pub(crate) healthy: AtomicBool,
    /// Load polls failed in a row: one slow answer under load is not a death.
    failed_polls: AtomicU32,
    pub(crate) in_flight: Arc<AtomicUsize>,
    pub(crate) load: Mutex<WorkerLoad>,
    pub(crate) prefix: Mutex<PrefixTracker>,
}

/// Consecutive failed load polls after which a worker counts as gone (at the default 0.5 s interval,
/// about 1.5 s of silence, each poll allowed at least 1 s).
pub const DEAD_AFTER_FAILED_POLLS: u32 = 3;

impl WorkerEntry {
    /// Records an answered poll; true when the worker was unhealthy until now.
    fn poll_answered(&self) -> bool {
        self.failed_polls.store(0, Ordering::Relaxed);
        !self.healthy.swap(true, Ordering::Relaxed)
    }

    /// Records a failed poll; true when this one marks the worker unhealthy.
    fn poll_failed(&self) -> bool {
        let n = self.failed_polls.fetch_add(1, Ordering::Relaxed) + 1;
        n >= DEAD_AFTER_FAILED_POLLS && self.healthy.swap(false, Ordering::Relaxed)
    }

    /// Whether its last poll or RPC succeeded.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Its last polled load.
    pub fn load(&self) -> WorkerLoad {
        self.load.lock().clone()
    }

    pub(crate) fn track(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(&self.in_flight))
    }

    pub(crate) fn decode_load(&self) -> DecodeLoad {
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
pub(crate) struct InFlight(Arc<AtomicUsize>);

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

impl Ingress {
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
            failed_polls: AtomicU32::new(0),
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
                    if w.poll_answered() {
                        tracing::info!(url = %w.url, "worker is back");
                    }
                }
                Err(e) => {
                    if w.poll_failed() {
                        tracing::warn!(url = %w.url, error = %e, polls = DEAD_AFTER_FAILED_POLLS, "worker stopped answering");
                    } else {
                        tracing::debug!(url = %w.url, error = %e, "load poll failed");
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

    pub(crate) fn healthy(&self, role: Role) -> Vec<Arc<WorkerEntry>> {
        self.inner
            .workers
            .read()
            .iter()
            .filter(|w| w.info.role == role && w.healthy())
            .cloned()
            .collect()
    }

    pub(crate) fn block_size(&self) -> usize {
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
