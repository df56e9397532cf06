//! Same-host fast path: the server copies the blocks into a `/dev/shm` file and only offsets cross the socket.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use tokio::task::JoinSet;

use crate::shm_pool::{default_copy_threads, MapCache, StopFlag, FILE_PREFIX};
use crate::transport::control::{self, ControlPull};
use crate::transport::tcp::TcpConfig;
use crate::wire::{self, FrameKind, ShmOpen, ShmPullRequest};
use crate::{KvError, KvSink, PeerInfo, PullSelection, TransferHandle};

/// Pulls through shared memory, with the TCP connection used only for control.
pub struct ShmTransport {
    local: PeerInfo,
    config: TcpConfig,
    shm_dir: PathBuf,
    maps: MapCache,
    copy_threads: usize,
}

impl ShmTransport {
    /// A shared-memory transport; `shm_dir` must be the server's `KvServerConfig::shm_dir`.
    pub fn new(local: PeerInfo, config: TcpConfig, shm_dir: PathBuf) -> Self {
        ShmTransport {
            local,
            config,
            shm_dir,
            maps: MapCache::new(16),
            copy_threads: default_copy_threads(),
        }
    }

    /// Sets how many layers may be copied into the sink at once (at least 1; default: half the cores, at
    /// most 8). The sink must accept concurrent writes to different layers, as [`KvSink`] requires.
    pub fn with_copy_threads(mut self, threads: usize) -> Self {
        self.copy_threads = threads.max(1);
        self
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

    /// Reads `ShmOpen` and then every `ShmLayer` up to `PullDone`, handing each layer to `copies`.
    async fn announced(
        &self,
        c: &mut wire::FrameReader<crate::tls::MaybeTls>,
        handle: &TransferHandle,
        selection: &PullSelection,
        sink: &Arc<dyn KvSink>,
        copies: &mut LayerCopies,
    ) -> Result<u64, KvError> {
        let n_layers = handle.layout.n_layers;
        let bb = handle.layout.block_bytes();
        let packed = selection.packed_layers(n_layers, bb);
        let total = selection.bytes(n_layers, bb);
        let open: ShmOpen = c.expect_json(FrameKind::ShmOpen).await?;
        let path = PathBuf::from(&open.path);
        self.check_path(&path)?;
        if open.total_len != total {
            return Err(KvError::Protocol(format!(
                "shared-memory transfer of {} bytes does not match the pull's {total}",
                open.total_len
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
                    let (base, len) = packed[layer];
                    copies
                        .start(LayerCopy {
                            map: Arc::clone(&map),
                            sink: Arc::clone(sink),
                            runs: selection.layer(layer).packed_runs(bb),
                            layer,
                            base,
                        })
                        .await?;
                    bytes += len as u64;
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

/// One announced layer to move from the mapping into the sink.
struct LayerCopy {
    map: Arc<Mmap>,
    sink: Arc<dyn KvSink>,
    /// The selected runs: (first block index, offset within the layer's region, bytes).
    runs: Vec<(usize, usize, usize)>,
    layer: usize,
    /// Offset of the layer's packed region in the file.
    base: usize,
}

impl LayerCopy {
    /// Writes the layer's runs to the sink and reports the layer complete.
    fn run(self) -> Result<(), KvError> {
        for &(first, off, len) in self.runs.iter() {
            let at = self.base + off;
            self.sink
                .write(self.layer, first, &self.map[at..at + len])?;
        }
        self.sink.layer_complete(self.layer)
    }
}

/// The layer copies of one pull in flight on the blocking pool, at most `limit` at a time.
struct LayerCopies {
    set: JoinSet<Result<(), KvError>>,
    limit: usize,
    /// Raised on the first failure, and when these copies are dropped (a pull future dropped mid-transfer):
    /// copies not yet begun then skip the sink; a copy already running finishes its layer.
    cancel: StopFlag,
}

impl Drop for LayerCopies {
    fn drop(&mut self) {
        self.cancel.raise();
    }
}

impl LayerCopies {
    fn new(limit: usize) -> Self {
        LayerCopies {
            set: JoinSet::new(),
            limit: limit.max(1),
            cancel: StopFlag::default(),
        }
    }

    /// Starts `copy` once fewer than `limit` copies run; fails with the first failed copy instead.
    async fn start(&mut self, copy: LayerCopy) -> Result<(), KvError> {
        while let Some(done) = self.set.try_join_next() {
            joined(done)?;
        }
        while self.set.len() >= self.limit {
            if let Some(done) = self.set.join_next().await {
                joined(done)?;
            }
        }
        let cancel = self.cancel.clone();
        self.set.spawn_blocking(move || {
            if cancel.raised() {
                return Ok(());
            }
            copy.run()
        });
        Ok(())
    }

    /// Waits for every started copy (after telling queued ones to skip if `cancel`); returns the first failure.
    async fn finish(mut self, cancel: bool) -> Result<(), KvError> {
        if cancel {
            self.cancel.raise();
        }
        let mut res = Ok(());
        while let Some(done) = self.set.join_next().await {
            if let (Ok(()), Err(e)) = (&res, joined(done)) {
                self.cancel.raise();
                res = Err(e);
            }
        }
        res
    }
}

/// A finished copy task's result, a panic counted as a sink failure.
fn joined(done: Result<Result<(), KvError>, tokio::task::JoinError>) -> Result<(), KvError> {
    done.unwrap_or_else(|e| {
        Err(KvError::Sink(format!(
            "shared-memory copy task failed: {e}"
        )))
    })
}

impl ControlPull for ShmTransport {
    type Request = ShmPullRequest;
    const KIND: FrameKind = FrameKind::ShmPull;

    fn socket(&self) -> (&PeerInfo, &TcpConfig) {
        (&self.local, &self.config)
    }

    fn request(&self, _handle: &TransferHandle, selection: &PullSelection) -> ShmPullRequest {
        ShmPullRequest {
            selection: selection.clone(),
        }
    }

    /// Receives the layer announcements and copies each announced layer into the sink on the blocking pool,
    /// up to `copy_threads` layers at once. Returns only once no copy is running, also on failure, so the
    /// sink is never written after the pull has ended (or acked/aborted).
    async fn receive(
        &self,
        c: &mut wire::FrameReader<crate::tls::MaybeTls>,
        handle: &TransferHandle,
        selection: &PullSelection,
        sink: &Arc<dyn KvSink>,
    ) -> Result<u64, KvError> {
        let mut copies = LayerCopies::new(self.copy_threads);
        let res = self
            .announced(c, handle, selection, sink, &mut copies)
            .await;
        let copied = copies.finish(res.is_err()).await;
        let bytes = res?;
        copied.map(|()| bytes)
    }
}

kv_transport!(ShmTransport, "shm", |this, handle, selection, sink| {
    control::pull(this, handle, selection, sink)
});
