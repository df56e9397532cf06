//! Entry points for the libFuzzer targets under `fuzz/` (built by `cargo fuzz`, which sets `--cfg
//! fuzzing`; absent from every other build): the NIXL control bodies are crate-private, so their
//! decoders and checks are reached through here, in the order the server and the client run them.

use crate::nixl::server::{staged_layers, NixlOpen, NixlPullRequest};
use crate::nixl::{MemKind, MemRegion};
use crate::server::selected_layers;
use crate::transport::nixl::check_open;
use crate::KvError;

/// What a prefill worker's KV server does with a `NixlPull` body before touching NIXL: decode it, pick
/// the selected blocks out of a transfer of `pinned` blocks, and (when the export is staged, `staged`
/// bytes per block) cut each of `n_layers` layers' run out of the staged region.
pub fn nixl_pull(
    body: &[u8],
    pinned: &[u32],
    n_layers: usize,
    staged: Option<u64>,
) -> Result<(), KvError> {
    let req: NixlPullRequest = serde_json::from_slice(body)
        .map_err(|e| KvError::Protocol(format!("decode NixlPull: {e}")))?;
    selected_layers(n_layers, pinned, &req.selection)?;
    if req.selection.is_empty() {
        return Err(KvError::Protocol("a NIXL pull of no block".into()));
    }
    if let Some(block) = staged {
        let export = MemRegion {
            addr: 1 << 20,
            len: block * pinned.len() as u64 * n_layers as u64,
            kind: MemKind::Dram,
            device: 0,
        };
        staged_layers(&export, &req.selection, n_layers, pinned.len())?;
    }
    Ok(())
}

/// What a decode worker does with a `NixlOpen` body before its first READ: decode it, check it against
/// its pull (`n_layers` layers of `n_blocks` blocks of `block_bytes`), read the remote memory kind and
/// lay out its own receive regions.
pub fn nixl_open(
    body: &[u8],
    n_layers: usize,
    n_blocks: usize,
    block_bytes: usize,
) -> Result<(), KvError> {
    let open: NixlOpen = serde_json::from_slice(body)
        .map_err(|e| KvError::Protocol(format!("decode NixlOpen: {e}")))?;
    let layer_bytes = n_blocks * block_bytes;
    let packed: Vec<(usize, usize)> = (0..n_layers)
        .map(|l| (l * layer_bytes, layer_bytes))
        .collect();
    check_open(&open, &packed)?;
    let local = MemRegion {
        addr: 1 << 20,
        len: (n_layers * layer_bytes) as u64,
        kind: open.layers[0].kind,
        device: 0,
    };
    local.pieces(&packed);
    Ok(())
}
