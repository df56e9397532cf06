//! The seams to the engines: where KV bytes come from (prefill) and where they go (decode).

use serde::{Deserialize, Serialize};

use crate::nixl::MemRegion;
use crate::{BlockSelection, KvError, WireLayout};

/// Read access to a prefill worker's pinned KV blocks; implemented by the prefill worker over its engine.
///
/// The server copies into a caller-owned, reused buffer rather than borrowing the cache: the bytes must
/// outlive awaits on the socket, which a borrow of an engine-owned cache (behind its own lock) cannot.
pub trait KvSource: Send + Sync + 'static {
    /// Copies blocks `blocks` of `layer` back to back into `out` (`out.len() == blocks.len() * block_bytes`).
    ///
    /// Only called for pinned transfers, between registration and release.
    fn copy_blocks(
        &self,
        transfer_id: u64,
        layer: usize,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<(), KvError>;

    /// Where the transfer's KV sits when the prefill exported it into staging memory a zero-copy transport
    /// registered (NIXL reads it in place): the whole export, layer-major, each layer every block of the
    /// transfer back to back. `None` (the default): serve it through [`Self::copy_blocks`].
    fn staged(&self, _transfer_id: u64) -> Result<Option<MemRegion>, KvError> {
        Ok(None)
    }

    /// Blocks until `layer` of the transfer's staged export has landed (an asynchronous GPU gather).
    fn wait_staged(&self, _transfer_id: u64, _layer: usize) -> Result<(), KvError> {
        Ok(())
    }

    /// Unpins the transfer's blocks; the server calls it exactly once per registered transfer
    /// (on ack, abort, disconnect or timeout).
    fn release(&self, transfer_id: u64, blocks: &[u32]);
}

/// Write access to a decode worker's freshly allocated blocks; implemented by the decode worker.
///
/// Called concurrently from several connections, chunks in any order, so decode can start on layer 0
/// while later layers are still arriving.
pub trait KvSink: Send + Sync {
    /// Stores `data`, which holds `data.len() / block_bytes` consecutive blocks of `layer` starting at
    /// index `first_block` of the transfer's block list. A partial pull writes only its selected indices.
    fn write(&self, layer: usize, first_block: usize, data: &[u8]) -> Result<(), KvError>;

    /// Every selected block of `layer` has been written; lets decode start on that layer early.
    fn layer_complete(&self, _layer: usize) -> Result<(), KvError> {
        Ok(())
    }

    /// Registered staging memory of this sink's owner a zero-copy pull of `len` bytes may READ into
    /// directly (every layer's selected blocks back to back, layer-major), or `None` (the default) to have
    /// the bytes delivered through [`Self::write`]. Asked once per pull; the region stays the sink's.
    fn landing(&self, _len: usize) -> Result<Option<MemRegion>, KvError> {
        Ok(None)
    }

    /// All of `layer` has landed in the [`Self::landing`] region: `len` bytes at `offset`. Takes the place
    /// of `write` + `layer_complete` for that layer.
    fn landed(&self, layer: usize, _offset: usize, _len: usize) -> Result<(), KvError> {
        Err(KvError::Sink(format!(
            "layer {layer} landed in staging memory this sink never offered"
        )))
    }

    /// Every layer has been written; after this returns `Ok` the pull acks and the source unpins.
    fn complete(&self) -> Result<(), KvError> {
        Ok(())
    }
}

/// What a prefill worker hands back for a finished prefill, and all a decode worker needs to pull it.
///
/// Serializable so it can travel through the router between workers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferHandle {
    /// Name of the prefill worker holding the blocks (for logs and routing).
    pub worker_id: String,
    /// Where that worker's `KvServer` listens (`host:port`), empty for in-process servers.
    pub endpoint: String,
    /// Server-assigned id of the pinned transfer.
    pub transfer_id: u64,
    /// The pinned physical block ids on the prefill worker, in sequence order.
    pub block_ids: Vec<u32>,
    /// Tokens of KV the blocks hold (the last block may be partial).
    pub n_tokens: usize,
    /// The prefill worker's cache shape, so a decode worker can refuse a mismatch before connecting.
    pub layout: WireLayout,
    /// Whether that server also serves NIXL pulls; a NIXL client pulls over TCP from one that does
    /// not, so workers that loaded NIXL and workers that could not still work together.
    #[serde(default)]
    pub nixl: bool,
}

impl TransferHandle {
    /// Total bytes a pull of every block moves.
    pub fn total_bytes(&self) -> u64 {
        self.bytes_for(&BlockSelection::all(self.block_ids.len()))
    }

    /// Bytes a pull of only `blocks` moves.
    pub fn bytes_for(&self, blocks: &BlockSelection) -> u64 {
        (self.layout.n_layers * blocks.len() * self.layout.block_bytes()) as u64
    }
}
