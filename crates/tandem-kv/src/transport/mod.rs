//! Client-side transports behind one trait, and the [`KvClient`] that meters them.
//!
//! [`nixl::NixlTransport`] is the one-sided-read instance of this seam. Adding a transport: implement [`KvTransport::pull`] so that it (1) handshakes
//! with [`PeerInfo::check_compatible`], (2) delivers every `(layer, block range)` of the requested
//! [`PullSelection`] to the sink, calling `layer_complete` per layer (also for a layer of no block) and
//! `complete` once, then (3) acks so
//! the server releases the pin, or aborts on failure. An empty selection (the decode side had every block
//! cached) still handshakes and acks, so the pin is released the same way. On the serving side the registry's pin/read-guard/finish protocol is reused unchanged: an RDMA
//! server would register the engine's KV buffers as memory regions once, send `(rkey, offset, len)` per
//! layer instead of `ShmLayer` offsets, and let the client issue one-sided reads straight into its own
//! registered cache (the sink then becomes a no-op copy). Only the data plane differs; the handshake,
//! handle and release rules stay as they are.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{BlockSelection, KvError, KvMetrics, KvSink, PeerInfo, PullSelection, TransferHandle};

/// Implements [`KvTransport`] for a transport with a `local: PeerInfo` field: its `name`, and `pull` as
/// `$body`, a future over the transport (`$this`) and the pull's arguments, so each transport writes only
/// what differs.
macro_rules! kv_transport {
    ($ty:ty, $name:literal, |$this:ident, $handle:ident, $blocks:ident, $sink:ident| $body:expr) => {
        impl $crate::transport::KvTransport for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn local(&self) -> &$crate::PeerInfo {
                &self.local
            }

            fn pull<'a>(
                &'a self,
                $handle: &'a $crate::TransferHandle,
                $blocks: &'a $crate::PullSelection,
                $sink: std::sync::Arc<dyn $crate::KvSink>,
            ) -> $crate::transport::PullFuture<'a> {
                let $this = self;
                Box::pin($body)
            }
        }
    };
}

mod control;
pub mod inproc;
pub mod nixl;
pub mod shm;
pub mod tcp;

/// The boxed future a transport returns: dyn-compatible so a client can pick its transport at runtime.
pub type PullFuture<'a> = Pin<Box<dyn Future<Output = Result<u64, KvError>> + Send + 'a>>;

/// A way to move a pinned transfer from a prefill worker into a decode worker's sink.
pub trait KvTransport: Send + Sync {
    /// Short name for logs and benchmarks.
    fn name(&self) -> &'static str;

    /// The decode worker's identity and layout, sent in the handshake.
    fn local(&self) -> &PeerInfo;

    /// Moves the selected blocks of each layer of `handle` into `sink`, acking on success and aborting on
    /// failure; returns payload bytes. `selection` has been checked against the handle's blocks and layers.
    fn pull<'a>(
        &'a self,
        handle: &'a TransferHandle,
        selection: &'a PullSelection,
        sink: Arc<dyn KvSink>,
    ) -> PullFuture<'a>;
}

/// The result of a successful pull.
#[derive(Clone, Copy, Debug)]
pub struct PullStats {
    /// Payload bytes moved.
    pub bytes: u64,
    /// Wall time from first connect to ack.
    pub elapsed: Duration,
}

impl PullStats {
    /// Throughput in GB/s (10^9 bytes), the unit the benchmark target is stated in.
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-12) / 1e9
    }
}

/// The decode worker's entry point: pulls handles through one transport and keeps metrics.
#[derive(Clone)]
pub struct KvClient {
    transport: Arc<dyn KvTransport>,
    metrics: Arc<KvMetrics>,
}

impl KvClient {
    /// A client over `transport`.
    pub fn new(transport: Arc<dyn KvTransport>) -> Self {
        KvClient {
            transport,
            metrics: Arc::new(KvMetrics::default()),
        }
    }

    /// Pulls every block of `handle` into `sink`. A layout mismatch against the handle is refused before any connection.
    pub async fn pull(
        &self,
        handle: &TransferHandle,
        sink: Arc<dyn KvSink>,
    ) -> Result<PullStats, KvError> {
        self.pull_blocks(handle, &BlockSelection::all(handle.block_ids.len()), sink)
            .await
    }

    /// Pulls only the `blocks` of `handle` (indices into its block list) into `sink`, then acks; the rest
    /// never leaves the prefill worker. An empty selection only acks, releasing the pin.
    pub async fn pull_blocks(
        &self,
        handle: &TransferHandle,
        blocks: &BlockSelection,
        sink: Arc<dyn KvSink>,
    ) -> Result<PullStats, KvError> {
        self.pull_selection(handle, &PullSelection::uniform(blocks.clone()), sink)
            .await
    }

    /// Pulls the blocks `selection` names of each layer of `handle` into `sink`, then acks: a layer that
    /// starts later (sliding window) leaves its earlier blocks on the prefill worker too.
    pub async fn pull_selection(
        &self,
        handle: &TransferHandle,
        selection: &PullSelection,
        sink: Arc<dyn KvSink>,
    ) -> Result<PullStats, KvError> {
        let start = Instant::now();
        let res = async {
            self.transport
                .local()
                .layout
                .check_compatible(&handle.layout)?;
            selection.check(handle.block_ids.len(), handle.layout.n_layers)?;
            self.transport.pull(handle, selection, sink).await
        }
        .await;
        let elapsed = start.elapsed();
        match res {
            Ok(bytes) => {
                self.metrics.add_received(bytes);
                let pulled = selection.blocks.len();
                self.metrics
                    .add_blocks(pulled, handle.block_ids.len() - pulled);
                self.metrics.pull_done(true, elapsed.as_nanos() as u64);
                tracing::debug!(
                    transfer_id = handle.transfer_id,
                    bytes,
                    ?elapsed,
                    transport = self.transport.name(),
                    "KV pull done"
                );
                Ok(PullStats { bytes, elapsed })
            }
            Err(e) => {
                self.metrics.pull_done(false, 0);
                tracing::warn!(transfer_id = handle.transfer_id, error = %e, transport = self.transport.name(), "KV pull failed");
                Err(e)
            }
        }
    }

    /// This client's counters.
    pub fn metrics(&self) -> Arc<KvMetrics> {
        Arc::clone(&self.metrics)
    }
}

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod tests;
