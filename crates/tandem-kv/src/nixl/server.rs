//! The prefill side of a NIXL pull: export the pinned blocks into a registered buffer, tell the client
//! where each layer is, and let it READ them; pin, ack and release stay with the KV server.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;

use super::{MemRegion, PoolLease};
use crate::registry::ReadGuard;
use crate::server::{copy_and_announce, ServerInner};
use crate::wire::{self, FrameKind};
use crate::{BlockSelection, KvError};

/// Body of a `NixlPull` frame.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct NixlPullRequest {
    /// Blocks to export (non-empty), as indices into the transfer's block list.
    pub blocks: BlockSelection,
    /// The server agent whose metadata the client has loaded, and its generation: the server sends its
    /// metadata again only when that is not current.
    pub known: Option<(String, u64)>,
}

/// Body of a `NixlOpen` frame.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct NixlOpen {
    /// The server's NIXL agent, the READs' remote.
    pub agent: String,
    /// Generation of the server agent's metadata.
    pub md_gen: u64,
    /// The agent's metadata blob, when the client's copy is missing or stale.
    pub md: Option<Vec<u8>>,
    /// Blocks per layer.
    pub n_blocks: u32,
    /// Where each layer's selected blocks sit, packed, in the server's registered memory (one per layer).
    pub layers: Vec<MemRegion>,
}

/// Serves one `NixlPull`: leases a registered buffer big enough for the selected blocks of every layer,
/// sends `NixlOpen`, then copies the layers in and announces each with `NixlLayer`. The buffer is parked in
/// `slot` until the transfer ends (ack, abort, disconnect), since the client READs it until then.
pub(crate) async fn send_nixl(
    inner: &Arc<ServerInner>,
    w: &mut TcpStream,
    tid: u64,
    req: &NixlPullRequest,
    guard: ReadGuard,
    blocks: Vec<u32>,
    slot: &mut Option<PoolLease>,
) -> Result<(), KvError> {
    let agent = inner
        .nixl
        .get()
        .ok_or_else(|| KvError::Protocol("this KV server does not serve NIXL pulls".into()))?;
    if blocks.is_empty() {
        return Err(KvError::Protocol("a NIXL pull of no block".into()));
    }
    let layout = inner.info.layout;
    let layer_bytes = blocks.len() * layout.block_bytes();
    let total = layout.n_layers * layer_bytes;
    let lease = agent.lease(total)?;
    // Generation before metadata: the blob is then at least as new as the generation we announce.
    let md_gen = agent.md_generation();
    let current = req
        .known
        .as_ref()
        .is_some_and(|(name, gen)| name == agent.name() && *gen >= md_gen);
    let open = NixlOpen {
        agent: agent.name().to_string(),
        md_gen,
        md: if current {
            None
        } else {
            Some(agent.local_md()?)
        },
        n_blocks: blocks.len() as u32,
        layers: lease.region().pieces(layout.n_layers, layer_bytes as u64),
    };
    wire::send_json(w, FrameKind::NixlOpen, tid, &open, inner.config.io_timeout).await?;
    let (lease, res) = copy_and_announce(
        inner,
        w,
        tid,
        guard,
        blocks,
        lease,
        total,
        FrameKind::NixlLayer,
    )
    .await?;
    *slot = Some(lease);
    res
}
