//! Direct calls into a [`KvServer`] in the same process: engine tests and single-process P/D.

use parking_lot::Mutex;

use crate::metrics::ReleaseReason;
use crate::server::selected_layers;
use crate::{KvError, KvServer, KvSink, PeerInfo, PullSelection, TransferHandle};

/// Pulls from a server object directly, with the same handshake and release rules as the socket transports.
pub struct InProcTransport {
    server: KvServer,
    local: PeerInfo,
    /// Idle layer buffers, reused so a pull does not fault in fresh pages.
    bufs: Mutex<Vec<Vec<u8>>>,
}

impl InProcTransport {
    /// A transport into `server` for a decode side described by `local`.
    pub fn new(server: KvServer, local: PeerInfo) -> Self {
        InProcTransport {
            server,
            local,
            bufs: Mutex::new(Vec::new()),
        }
    }

    fn pull_sync(
        &self,
        handle: &TransferHandle,
        selection: &PullSelection,
        sink: &dyn KvSink,
    ) -> Result<u64, KvError> {
        let inner = &self.server.inner;
        self.local.check_compatible(&inner.info)?;
        let tid = handle.transfer_id;
        let mut buf = self.bufs.lock().pop().unwrap_or_default();
        let res = (|| {
            let guard = inner.registry.begin_read(tid)?;
            let n_layers = inner.info.layout.n_layers;
            let layers = selected_layers(n_layers, &guard.blocks, selection)?;
            let bb = inner.info.layout.block_bytes();
            let mut bytes = 0;
            for (layer, ids) in layers.iter().enumerate() {
                let layer_bytes = ids.len() * bb;
                if buf.len() < layer_bytes {
                    buf.resize(layer_bytes, 0);
                }
                let buf = &mut buf[..layer_bytes];
                if !ids.is_empty() {
                    inner.registry.source().copy_blocks(tid, layer, ids, buf)?;
                    inner.metrics.add_sent(layer_bytes as u64);
                }
                for (first, off, len) in selection.layer(layer).packed_runs(bb) {
                    sink.write(layer, first, &buf[off..off + len])?;
                }
                sink.layer_complete(layer)?;
                bytes += layer_bytes as u64;
            }
            drop(guard);
            sink.complete()?;
            Ok(bytes)
        })();
        self.bufs.lock().push(buf);
        let why = if res.is_ok() {
            ReleaseReason::Ack
        } else {
            ReleaseReason::Abort
        };
        inner.registry.finish(tid, why);
        res
    }
}

kv_transport!(
    InProcTransport,
    "inproc",
    |this, handle, selection, sink| async move { this.pull_sync(handle, selection, &*sink) }
);
