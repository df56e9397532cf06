//! Same-host fast path: the server copies the blocks into a `/dev/shm` file and only offsets cross the socket.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::shm_pool::{MapCache, FILE_PREFIX};
use crate::transport::tcp::{ack_only, connect, finish_on_control, TcpConfig};
use crate::transport::{KvTransport, PullFuture};
use crate::wire::{self, FrameKind, ShmOpen, ShmPullRequest};
use crate::{BlockSelection, KvError, KvSink, PeerInfo, TransferHandle};

/// Pulls through shared memory, with the TCP connection used only for control.
pub struct ShmTransport {
    local: PeerInfo,
    config: TcpConfig,
    shm_dir: PathBuf,
    maps: MapCache,
}

impl ShmTransport {
    /// A shared-memory transport; `shm_dir` must be the server's `KvServerConfig::shm_dir`.
    pub fn new(local: PeerInfo, config: TcpConfig, shm_dir: PathBuf) -> Self {
        ShmTransport {
            local,
            config,
            shm_dir,
            maps: MapCache::new(16),
        }
    }

    /// Accepts only files the server could have created, so a hostile peer cannot make us map arbitrary paths.
    fn check_path(&self, path: &Path) -> Result<(), KvError> {
        let name_ok = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(FILE_PREFIX));
        if name_ok && path.parent() == Some(self.shm_dir.as_path()) {
            Ok(())
        } else {
            Err(KvError::Protocol(format!(
                "refusing shared-memory path {}",
                path.display()
            )))
        }
    }

    async fn pull_impl(
        &self,
        handle: &TransferHandle,
        blocks: &BlockSelection,
        sink: Arc<dyn KvSink>,
    ) -> Result<u64, KvError> {
        if blocks.is_empty() {
            return ack_only(handle, &self.local, &self.config, &*sink).await;
        }
        let tid = handle.transfer_id;
        let io = self.config.io_timeout;
        let mut c = connect(&handle.endpoint, &self.local, &self.config).await?;
        let req = ShmPullRequest {
            blocks: blocks.clone(),
        };
        wire::send_json(c.get_mut(), FrameKind::ShmPull, tid, &req, io).await?;
        let res = self.receive(&mut c, handle, blocks, &*sink).await;
        let res = match res {
            Ok(b) => sink.complete().map(|()| b),
            e => e,
        };
        match res {
            Ok(bytes) => finish_on_control(&mut c, tid, None, io)
                .await
                .map(|()| bytes),
            Err(e) => finish_on_control(&mut c, tid, Some(e), io)
                .await
                .map(|()| 0),
        }
    }

    async fn receive(
        &self,
        c: &mut wire::FrameReader<tokio::net::TcpStream>,
        handle: &TransferHandle,
        blocks: &BlockSelection,
        sink: &dyn KvSink,
    ) -> Result<u64, KvError> {
        let n_layers = handle.layout.n_layers;
        let n_blocks = blocks.len();
        let bb = handle.layout.block_bytes();
        let layer_bytes = n_blocks * bb;
        let h = c.expect_frame().await?;
        if h.kind != FrameKind::ShmOpen {
            return Err(KvError::Protocol(format!(
                "expected ShmOpen, got {:?}",
                h.kind
            )));
        }
        let open: ShmOpen = c.json(&h).await?;
        let path = PathBuf::from(&open.path);
        self.check_path(&path)?;
        if open.n_blocks as usize != n_blocks || open.total_len != (n_layers * layer_bytes) as u64 {
            return Err(KvError::Protocol(format!(
                "shared-memory file of {} bytes / {} blocks does not match the handle",
                open.total_len, open.n_blocks
            )));
        }
        if open.total_len > open.map_len {
            return Err(KvError::Protocol(format!(
                "transfer of {} bytes in a file of {}",
                open.total_len, open.map_len
            )));
        }
        let map = self.maps.get(&path, open.map_len as usize)?;
        let mut seen = vec![false; n_layers];
        let mut bytes = 0u64;
        loop {
            let h = c.expect_frame().await?;
            match h.kind {
                FrameKind::ShmLayer => {
                    let layer = h.layer as usize;
                    if layer >= n_layers || seen[layer] {
                        return Err(KvError::Protocol(format!(
                            "bad or repeated shared-memory layer {layer}"
                        )));
                    }
                    seen[layer] = true;
                    // The file packs the selected blocks of a layer back to back, run after run.
                    let mut off = layer * layer_bytes;
                    for run in blocks.runs() {
                        let len = (run.end - run.start) as usize * bb;
                        sink.write(layer, run.start as usize, &map[off..off + len])?;
                        off += len;
                    }
                    sink.layer_complete(layer)?;
                    bytes += layer_bytes as u64;
                }
                FrameKind::PullDone => {
                    return if seen.iter().all(|&s| s) {
                        Ok(bytes)
                    } else {
                        Err(KvError::Protocol("shared-memory pull ended early".into()))
                    };
                }
                k => {
                    return Err(KvError::Protocol(format!(
                        "unexpected {k:?} during a shared-memory pull"
                    )))
                }
            }
        }
    }
}

impl KvTransport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn local(&self) -> &PeerInfo {
        &self.local
    }

    fn pull<'a>(
        &'a self,
        handle: &'a TransferHandle,
        blocks: &'a BlockSelection,
        sink: Arc<dyn KvSink>,
    ) -> PullFuture<'a> {
        Box::pin(self.pull_impl(handle, blocks, sink))
    }
}
