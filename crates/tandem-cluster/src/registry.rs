//! The ingress's worker registry: registration with the KV handshake check, load polling and health,
//! draining (a worker that reports it, or one DNS discovery lost) and removal once its requests end, and
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
use crate::prefix::{KvLevel, PrefixTracker};
use crate::protocol::{
    ErrorBody, RegisterRequest, Role, WorkerInfo, WorkerLoad, PATH_INFO, PATH_LOAD, PATH_REGISTER,
};
use crate::routing::DecodeLoad;
use crate::rpc::get_json;

/// How a worker joined: it decides who may take it out again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Started by this process or registered itself (`POST /v1/cluster/workers`): stays until it drains away.
    Static,
    /// Found by DNS discovery: drained when its address leaves the name.
    Dns,
}

/// Everything the ingress knows about one registered worker.
pub struct WorkerEntry {
    /// Base URL of its RPC server.
    pub url: String,
    /// Its registration record.
    pub info: WorkerInfo,
    pub(crate) origin: Origin,
    pub(crate) healthy: AtomicBool,
    /// The worker said it is draining (its load poll): no new work.
    pub(crate) draining: AtomicBool,
    /// DNS discovery no longer lists its address: no new work, removed once its requests end.
    pub(crate) vanished: AtomicBool,
    /// Load polls failed in a row: one slow answer under load is not a death.
    failed_polls: AtomicU32,
    pub(crate) in_flight: Arc<AtomicUsize>,
    /// KV blocks this ingress admitted here for requests whose decode has not started (`crate::admission`).
    pub(crate) pending_blocks: Arc<AtomicUsize>,
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

    /// Whether it is on its way out (it drains, or DNS lost it): routing skips it.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed) || self.vanished.load(Ordering::Relaxed)
    }

    /// Whether new requests may go to it.
    pub(crate) fn routable(&self) -> bool {
        self.healthy() && !self.draining()
    }

    /// Whether it can leave the registry: DNS lost it, or it drained and stopped answering, and no
    /// request of this ingress is still on it.
    fn removable(&self) -> bool {
        let gone = self.vanished.load(Ordering::Relaxed)
            || (self.draining.load(Ordering::Relaxed) && !self.healthy());
        gone && self.in_flight.load(Ordering::Relaxed) == 0
    }

    /// Its last polled load.
    pub fn load(&self) -> WorkerLoad {
        self.load.lock().clone()
    }

    pub(crate) fn track(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(&self.in_flight))
    }

    /// Free KV blocks for new work (as last polled, less what this ingress admitted since and has not
    /// started) and the pool's size; `None` before the worker reported its pool.
    pub(crate) fn kv_room(&self) -> Option<(usize, usize)> {
        let (total, used) = {
            let l = self.load.lock();
            (l.engine.kv_blocks_total, l.engine.kv_blocks_used)
        };
        let pending = self.pending_blocks.load(Ordering::Relaxed);
        (total > 0).then(|| (total.saturating_sub(used).saturating_sub(pending), total))
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
    /// Whether it drains (it said so, or DNS discovery lost it): it gets no new work.
    #[serde(default)]
    pub draining: bool,
    /// Last polled load.
    pub load: WorkerLoad,
}

impl Ingress {
    /// Fetches a worker's info, runs the handshake check and adds it; a mismatch is refused naming the field.
    pub async fn register(&self, url: &str) -> Result<WorkerInfo, ClusterError> {
        self.register_as(url, None, Origin::Static).await
    }

    /// [`Self::register`] for a worker expected in `role` (DNS discovery lists workers per role), added
    /// with its `origin`.
    pub(crate) async fn register_as(
        &self,
        url: &str,
        role: Option<Role>,
        origin: Origin,
    ) -> Result<WorkerInfo, ClusterError> {
        let url = url.trim_end_matches('/').to_owned();
        let info: WorkerInfo = get_json(
            &self.inner.http,
            &url,
            PATH_INFO,
            secs(self.inner.timeouts.connect_secs) * 5,
        )
        .await?;
        if let Some(role) = role.filter(|r| *r != info.role) {
            return Err(ClusterError::Refused {
                url,
                source: KvError::Mismatch {
                    field: "role",
                    local: role.to_string(),
                    remote: info.role.to_string(),
                },
            });
        }
        self.admit(url, info, origin)
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

    fn admit(
        &self,
        url: String,
        info: WorkerInfo,
        origin: Origin,
    ) -> Result<WorkerInfo, ClusterError> {
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
        let mut workers = self.inner.workers.write();
        // The same process registering again (it re-registers when unpolled) keeps its entry and counts.
        if workers.iter().any(|w| {
            w.url == url
                && w.info.worker_id == info.worker_id
                && w.info.pid == info.pid
                && w.info.instance == info.instance
        }) {
            return Ok(info);
        }
        let entry = Arc::new(WorkerEntry {
            prefix: Mutex::new(PrefixTracker::new(16_384)),
            url: url.clone(),
            info: info.clone(),
            origin,
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            vanished: AtomicBool::new(false),
            failed_polls: AtomicU32::new(0),
            in_flight: Arc::new(AtomicUsize::new(0)),
            pending_blocks: Arc::new(AtomicUsize::new(0)),
            load: Mutex::new(WorkerLoad::default()),
        });
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
                draining: w.draining(),
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
                Ok(load) if load.instance != w.info.instance => {
                    // A new process took the address: it must pass the handshake (it registers
                    // itself, or DNS discovery tries it) before it gets work in this one's place.
                    if w.healthy.swap(false, Ordering::Relaxed) {
                        tracing::warn!(url = %w.url, worker = %w.info.worker_id, "another process answers at this worker's address; it needs a handshake");
                    }
                }
                Ok(load) => {
                    if load.engine.kv_blocks_total > 0 {
                        // What the worker can give back without computing: its pool and the blocks its
                        // KV tiers (host, then disk) hold under it, each level weighted by what
                        // restoring from it costs. The report gives what a tier holds, not its budget:
                        // a tier still filling is credited with what it has.
                        let mut levels = vec![(KvLevel::Device, load.engine.kv_blocks_total)];
                        levels.extend(load.engine.kv_tiers.iter().map(|t| {
                            (KvLevel::from_tier_name(&t.tier), t.blocks as usize)
                        }));
                        w.prefix.lock().set_levels(&levels);
                    }
                    let draining = load.draining;
                    *w.load.lock() = load;
                    if draining != w.draining.swap(draining, Ordering::Relaxed) {
                        tracing::info!(url = %w.url, draining, "worker drain state changed");
                    }
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
        self.prune();
    }

    /// Removes the workers that left (drained away, or lost by DNS discovery) and have no request left here.
    pub(crate) fn prune(&self) {
        let mut workers = self.inner.workers.write();
        workers.retain(|w| {
            let remove = w.removable();
            if remove {
                tracing::info!(url = %w.url, worker = %w.info.worker_id, "worker removed after draining");
            }
            !remove
        });
    }

    /// Polls worker loads forever (spawn it).
    pub async fn poll_forever(self) {
        let mut tick = tokio::time::interval(secs(self.inner.timeouts.poll_interval_secs));
        loop {
            tick.tick().await;
            self.poll_once().await;
        }
    }

    /// Routes of the ingress itself: worker registration and listing (both need the cluster token
    /// when one is set).
    pub fn routes(&self) -> Router {
        let routes = Router::new().route(
            PATH_REGISTER,
            post(register_handler).get(|State(i): State<Ingress>| async move { Json(i.workers()) }),
        );
        crate::auth::require_token(routes, self.inner.cluster_key.clone()).with_state(self.clone())
    }

    /// The workers of `role` that may get new requests (healthy, not draining).
    pub(crate) fn routable(&self, role: Role) -> Vec<Arc<WorkerEntry>> {
        self.inner
            .workers
            .read()
            .iter()
            .filter(|w| w.info.role == role && w.routable())
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
