//! The prefill side of a NIXL pull: export the pinned blocks into a registered buffer, tell the client
//! where each layer is, and let it READ them; pin, ack and release stay with the KV server.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{MemRegion, PoolLease};
use crate::registry::ReadGuard;
use crate::server::{copy_and_announce, selected_layers, ServerInner};
use crate::wire::{self, FrameHeader, FrameKind};
use crate::{KvError, PullSelection};

/// Body of a `NixlPull` frame.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct NixlPullRequest {
    /// Blocks to export of each layer (some non-empty), as indices into the transfer's block list.
    pub selection: PullSelection,
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
    /// Where each layer's selected blocks sit, packed, in the server's registered memory (one per layer;
    /// empty for a layer of no block).
    pub layers: Vec<MemRegion>,
}

/// What a NIXL transfer keeps until it ends (ack, abort, disconnect), because the client READs until then:
/// the registered buffer the blocks were copied into, or — for an export already in registered staging
/// memory — the read guard that keeps the pin, and so that memory, from being released.
pub(crate) enum NixlHold {
    /// A pooled registered buffer holding a copy.
    Lease { _lease: PoolLease },
    /// The pin of a staged export.
    Pin { _guard: ReadGuard },
}

/// Serves one `NixlPull`. When the source's export sits in registered staging memory, the client READs it
/// in place: `NixlOpen` names each layer's selected run there, and each layer is announced once its export
/// has landed. Otherwise it leases a registered buffer big enough for the selected blocks of every layer,
/// copies the layers in and announces each. Either way what the client READs is parked in `slot` until the
/// transfer ends.
pub(crate) async fn send_nixl(
    inner: &Arc<ServerInner>,
    w: &mut crate::tls::MaybeTls,
    tid: u64,
    req: &NixlPullRequest,
    guard: ReadGuard,
    slot: &mut Option<NixlHold>,
) -> Result<(), KvError> {
    let agent = inner
        .nixl
        .get()
        .ok_or_else(|| KvError::Protocol("this KV server does not serve NIXL pulls".into()))?;
    let layout = inner.info.layout;
    let blocks = selected_layers(layout.n_layers, &guard.blocks, &req.selection)?;
    if req.selection.is_empty() {
        return Err(KvError::Protocol("a NIXL pull of no block".into()));
    }
    let n_total = guard.blocks.len();
    let packed = req
        .selection
        .packed_layers(layout.n_layers, layout.block_bytes());
    let staged = inner.registry.source().staged(tid)?;
    let (layers, lease) = match staged {
        Some(region) => (
            staged_layers(&region, &req.selection, layout.n_layers, n_total)?,
            None,
        ),
        None => {
            let total = packed.last().map_or(0, |&(off, len)| off + len);
            let lease = agent.lease(total)?;
            let layers = lease.region().pieces(&packed);
            (layers, Some(lease))
        }
    };
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
        layers,
    };
    wire::send_json(w, FrameKind::NixlOpen, tid, &open, inner.config.io_timeout).await?;
    let counts: Vec<usize> = blocks.iter().map(Vec::len).collect();
    let Some(lease) = lease else {
        inner.metrics.served_in_place();
        let res = announce_staged(inner, w, tid, &counts).await;
        *slot = Some(NixlHold::Pin { _guard: guard });
        return res;
    };
    let (lease, res) =
        copy_and_announce(inner, w, tid, guard, blocks, lease, FrameKind::NixlLayer).await?;
    *slot = Some(NixlHold::Lease { _lease: lease });
    res
}

/// Each layer's selected blocks within a staged export (`n_layers` layers of `n_total` blocks each, back
/// to back): one region per layer, so each layer's selection must be one run of blocks (or none).
pub(crate) fn staged_layers(
    export: &MemRegion,
    selection: &PullSelection,
    n_layers: usize,
    n_total: usize,
) -> Result<Vec<MemRegion>, KvError> {
    if selection.blocks.runs().len() > 1 {
        return Err(KvError::Protocol(format!(
            "a pull from staged KV must select one run of blocks, not {}",
            selection.blocks.runs().len()
        )));
    }
    selection.check(n_total, n_layers)?;
    let full_layer = export.len / n_layers.max(1) as u64;
    let block = full_layer / n_total.max(1) as u64;
    if full_layer * n_layers as u64 != export.len || block * n_total as u64 != full_layer {
        return Err(KvError::Source(format!(
            "a staged export of {} bytes is not {n_layers} layers of {n_total} blocks",
            export.len
        )));
    }
    Ok((0..n_layers)
        .map(|l| {
            let (start, len) = selection
                .layer(l)
                .runs()
                .first()
                .map_or((0, 0), |r| (r.start as u64, (r.end - r.start) as u64));
            export.slice(l as u64 * full_layer + start * block, len * block)
        })
        .collect())
}

/// Announces each layer of a staged export (`counts[l]` blocks of layer `l`) as soon as the source says it
/// has landed (the waits run on the blocking pool, in layer order).
async fn announce_staged(
    inner: &Arc<ServerInner>,
    w: &mut crate::tls::MaybeTls,
    tid: u64,
    counts: &[usize],
) -> Result<(), KvError> {
    let bb = inner.info.layout.block_bytes();
    for (layer, &n) in counts.iter().enumerate() {
        let waiter = Arc::clone(inner);
        tokio::task::spawn_blocking(move || waiter.registry.source().wait_staged(tid, layer))
            .await
            .map_err(|e| KvError::Source(format!("KV export wait failed: {e}")))??;
        let mut h = FrameHeader::control(FrameKind::NixlLayer, tid, 0);
        h.layer = layer as u32;
        h.n_blocks = n as u32;
        wire::send(w, h, &[], inner.config.io_timeout).await?;
        inner.metrics.add_sent((n * bb) as u64);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nixl::MemKind;
    use crate::BlockSelection;

    fn export(len: u64) -> MemRegion {
        MemRegion {
            addr: 1 << 20,
            len,
            kind: MemKind::Vram,
            device: 2,
        }
    }

    #[test]
    fn staged_layers_name_the_selected_run_of_each_layer() {
        // 3 layers of 4 blocks of 100 bytes; blocks 1..3 selected.
        let all = PullSelection::uniform(BlockSelection::range(1..3));
        let r = staged_layers(&export(1200), &all, 3, 4).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].addr, (1 << 20) + 100);
        assert_eq!(r[2].addr, (1 << 20) + 800 + 100);
        assert!(r
            .iter()
            .all(|x| x.len == 200 && x.kind == MemKind::Vram && x.device == 2));
        // A windowed third layer starting at block 2 reads only its last selected block; one starting
        // past the selection reads nothing.
        let cut = PullSelection::with_layer_from(BlockSelection::range(1..3), vec![0, 3, 2]);
        let r = staged_layers(&export(1200), &cut, 3, 4).unwrap();
        assert_eq!((r[0].addr, r[0].len), ((1 << 20) + 100, 200));
        assert_eq!(r[1].len, 0);
        assert_eq!((r[2].addr, r[2].len), ((1 << 20) + 800 + 200, 100));
    }

    #[test]
    fn staged_layers_refuse_gaps_and_odd_sizes() {
        let gaps = PullSelection::uniform(BlockSelection::from_indices([0, 2]));
        let e = staged_layers(&export(1200), &gaps, 3, 4).unwrap_err();
        assert!(e.to_string().contains("one run"), "{e}");
        let all = PullSelection::uniform(BlockSelection::all(4));
        let e = staged_layers(&export(1100), &all, 3, 4).unwrap_err();
        assert!(e.to_string().contains("not 3 layers of 4 blocks"), "{e}");
    }
}
