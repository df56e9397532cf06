//! Head-side admission of remotely prefilled requests: KV room on a decode worker is claimed before the
//! prompt is prefilled.
//!
//! A prefilled prompt's KV stays pinned on the prefill worker until a decode worker pulls it, and a
//! decode import waits for free blocks only half the pin's lifetime. Prefilling faster than decode
//! frees KV would pin prompts whose imports then fail after the client's stream has begun. So the head
//! sends a prompt to prefill only once a decode worker has room for it: its last polled free blocks,
//! less the blocks of requests this head admitted there that have not started decoding yet. Until
//! then the request waits here with nothing pinned, in arrival order, for at most
//! `timeouts.admission_secs` (then 503); past the decode workers' own waiting bounds it is refused at
//! once, like a full engine queue.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::ClusterError;
use crate::registry::WorkerEntry;

/// How often a waiting request looks again for room (polls and decode starts change it).
const ADMIT_RETRY: Duration = Duration::from_millis(20);

/// The head's queue of requests waiting for decode KV room.
#[derive(Default)]
pub(crate) struct Admission {
    /// Held by the request at the head of the queue while it waits (tokio's mutex is fair, so the
    /// others follow in arrival order).
    turn: tokio::sync::Mutex<()>,
    waiting: Arc<AtomicUsize>,
}

/// KV blocks claimed on one decode worker for an admitted request, released when dropped (once its
/// decode has started, the worker's own polled count takes over).
pub(crate) struct Reservation {
    pending: Arc<AtomicUsize>,
    blocks: usize,
}

impl Reservation {
    pub(crate) fn new(pending: &Arc<AtomicUsize>, blocks: usize) -> Self {
        pending.fetch_add(blocks, Ordering::Relaxed);
        Reservation {
            pending: Arc::clone(pending),
            blocks,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.pending.fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// Counts a request as waiting for as long as it lives.
struct Waiting(Arc<AtomicUsize>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether `need` blocks fit on `w` now and nothing waits to run there (an import queues behind what
/// waits). A worker that has not reported its pool yet, or whose whole pool is smaller than the request
/// (its own answer names that), does not hold the request back.
fn fits(w: &WorkerEntry, need: usize) -> bool {
    match w.kv_room() {
        None => true,
        Some((_, total)) if need > total => true,
        Some((room, _)) => need <= room && w.load().engine.waiting == 0,
    }
}

impl Admission {
    /// Requests waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Claims room for a request on `preferred` or, when it has none, on the decode worker (from
    /// `decoders()`, re-read each try) with the most room; `need(w)` is the request's uncached prompt
    /// blocks on `w`. Waits in arrival order until room appears, at most until `deadline`; refuses at
    /// once when `bound` requests already wait.
    pub(crate) async fn admit(
        &self,
        preferred: &Arc<WorkerEntry>,
        decoders: impl Fn() -> Vec<Arc<WorkerEntry>>,
        need: impl Fn(&WorkerEntry) -> usize,
        bound: usize,
        deadline: tokio::time::Instant,
    ) -> Result<(Arc<WorkerEntry>, Reservation), ClusterError> {
        let claim =
            |w: &Arc<WorkerEntry>| (Arc::clone(w), Reservation::new(&w.pending_blocks, need(w)));
        if self.waiting() == 0 && fits(preferred, need(preferred)) {
            return Ok(claim(preferred));
        }
        if self.waiting() >= bound {
            return Err(ClusterError::Overloaded(format!(
                "{} requests already wait for KV room on the decode workers",
                self.waiting()
            )));
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(Arc::clone(&self.waiting));
        let timed_out = || {
            ClusterError::Overloaded(
                "no decode worker had KV room for the prompt within timeouts.admission_secs".into(),
            )
        };
        let _turn = tokio::time::timeout_at(deadline, self.turn.lock())
            .await
            .map_err(|_| timed_out())?;
        loop {
            if preferred.routable() && fits(preferred, need(preferred)) {
                return Ok(claim(preferred));
            }
            let cands = decoders();
            if cands.is_empty() {
                return Err(ClusterError::Overloaded(
                    "no decode worker is available".into(),
                ));
            }
            let best = cands
                .into_iter()
                .filter(|w| fits(w, need(w)))
                .max_by_key(|w| w.kv_room().map_or(usize::MAX, |(room, _)| room));
            if let Some(w) = best {
                return Ok(claim(&w));
            }
            if tokio::time::Instant::now() + ADMIT_RETRY > deadline {
                return Err(timed_out());
            }
            tokio::time::sleep(ADMIT_RETRY).await;
        }
    }
}
