//! Transfer counters, kept as atomics so the hot path never locks and the API crate can export them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

/// Why a pin was released; counted separately so a dashboard shows timeouts and aborts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseReason {
    /// The decode worker acknowledged the pull.
    Ack,
    /// The decode worker (or the prefill side) aborted.
    Abort,
    /// The pulling connection went away before acking.
    Disconnect,
    /// Nobody acked within the pin timeout.
    Timeout,
}

/// Live counters for one server or client.
#[derive(Debug, Default)]
pub struct KvMetrics {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    blocks_pulled: AtomicU64,
    blocks_skipped: AtomicU64,
    pulls_ok: AtomicU64,
    pulls_failed: AtomicU64,
    pull_nanos: AtomicU64,
    released_ack: AtomicU64,
    released_abort: AtomicU64,
    released_disconnect: AtomicU64,
    released_timeout: AtomicU64,
    serve_errors: AtomicU64,
    served_in_place: AtomicU64,
}

/// A point-in-time copy of [`KvMetrics`], for export and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvMetricsSnapshot {
    /// Payload bytes a server sent.
    pub bytes_sent: u64,
    /// Payload bytes a client received.
    pub bytes_received: u64,
    /// Blocks a client's successful pulls moved (per layer counted once).
    #[serde(default)]
    pub blocks_pulled: u64,
    /// Blocks of successful pulls' handles a client did not move because its own cache held them.
    #[serde(default)]
    pub blocks_skipped: u64,
    /// Pulls that completed and were acked.
    pub pulls_ok: u64,
    /// Pulls that failed.
    pub pulls_failed: u64,
    /// Total wall time of successful pulls, in nanoseconds.
    pub pull_nanos: u64,
    /// Pins released by ack.
    pub released_ack: u64,
    /// Pins released by abort.
    pub released_abort: u64,
    /// Pins released because the puller disconnected.
    pub released_disconnect: u64,
    /// Pins released by the timeout reaper.
    pub released_timeout: u64,
    /// Server connections that ended in an error.
    pub serve_errors: u64,
    /// Pulls a server let a zero-copy transport READ in place from registered staging memory (GPU to GPU
    /// on CUDA workers), with no copy on either side.
    #[serde(default)]
    pub served_in_place: u64,
}

impl KvMetrics {
    pub(crate) fn add_sent(&self, n: u64) {
        self.bytes_sent.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_received(&self, n: u64) {
        self.bytes_received.fetch_add(n, Relaxed);
    }
    pub(crate) fn add_blocks(&self, pulled: usize, skipped: usize) {
        self.blocks_pulled.fetch_add(pulled as u64, Relaxed);
        self.blocks_skipped.fetch_add(skipped as u64, Relaxed);
    }
    pub(crate) fn pull_done(&self, ok: bool, nanos: u64) {
        if ok {
            self.pulls_ok.fetch_add(1, Relaxed);
            self.pull_nanos.fetch_add(nanos, Relaxed);
        } else {
            self.pulls_failed.fetch_add(1, Relaxed);
        }
    }
    pub(crate) fn released(&self, why: ReleaseReason) {
        let c = match why {
            ReleaseReason::Ack => &self.released_ack,
            ReleaseReason::Abort => &self.released_abort,
            ReleaseReason::Disconnect => &self.released_disconnect,
            ReleaseReason::Timeout => &self.released_timeout,
        };
        c.fetch_add(1, Relaxed);
    }
    pub(crate) fn serve_error(&self) {
        self.serve_errors.fetch_add(1, Relaxed);
    }
    pub(crate) fn served_in_place(&self) {
        self.served_in_place.fetch_add(1, Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> KvMetricsSnapshot {
        KvMetricsSnapshot {
            bytes_sent: self.bytes_sent.load(Relaxed),
            bytes_received: self.bytes_received.load(Relaxed),
            blocks_pulled: self.blocks_pulled.load(Relaxed),
            blocks_skipped: self.blocks_skipped.load(Relaxed),
            pulls_ok: self.pulls_ok.load(Relaxed),
            pulls_failed: self.pulls_failed.load(Relaxed),
            pull_nanos: self.pull_nanos.load(Relaxed),
            released_ack: self.released_ack.load(Relaxed),
            released_abort: self.released_abort.load(Relaxed),
            released_disconnect: self.released_disconnect.load(Relaxed),
            released_timeout: self.released_timeout.load(Relaxed),
            serve_errors: self.serve_errors.load(Relaxed),
            served_in_place: self.served_in_place.load(Relaxed),
        }
    }
}
