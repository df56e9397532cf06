//! The prefill side: pins transfers, serves pulls over TCP and shared memory, releases pins.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};

use crate::tls::MaybeTls;
use tokio::task::JoinSet;

use crate::metrics::ReleaseReason;
use crate::registry::PinRegistry;
use crate::registry::ReadGuard;
use crate::shm_pool::{default_copy_threads, ShmPool, ShmSegment, StopFlag};
use crate::wire::{
    self, FrameHeader, FrameKind, FrameReader, PullRequest, ShmOpen, ShmPullRequest, WireError,
    FLAG_CHECKSUM,
};
use crate::{
    BlockSelection, KvError, KvMetrics, KvSource, PeerInfo, PullSelection, TransferHandle,
};

/// Knobs of a [`KvServer`].
#[derive(Clone, Debug)]
pub struct KvServerConfig {
    /// This worker's name, copied into every handle.
    pub worker_id: String,
    /// How long a pin may wait for its ack before the reaper releases it.
    pub pin_timeout: Duration,
    /// Bound on every socket read and write.
    pub io_timeout: Duration,
    /// Largest data frame payload; a layer's blocks are split into frames of at most this many bytes.
    pub max_frame_bytes: usize,
    /// Directory for shared-memory transfer files.
    pub shm_dir: PathBuf,
    /// Bytes of idle shared-memory segments kept mapped for reuse.
    pub shm_cache_bytes: usize,
    /// Threads copying one shared-memory pull's layers into its segment (at least 1): one core's memcpy
    /// cannot saturate a many-core host's memory bandwidth.
    pub shm_copy_threads: usize,
    /// The cluster secret every client must prove it holds ([`crate::auth`]); `None` serves anyone.
    pub cluster_key: Option<crate::ClusterKey>,
    /// Mutual TLS on every connection (`deployment.cluster_tls`): a client without a certificate from the
    /// cluster's CA is refused in the handshake. `None` serves plain TCP.
    pub tls: Option<Arc<crate::ClusterTls>>,
}

impl Default for KvServerConfig {
    fn default() -> Self {
        KvServerConfig {
            worker_id: "prefill-0".into(),
            pin_timeout: Duration::from_secs(30),
            io_timeout: Duration::from_secs(10),
            max_frame_bytes: 64 << 20,
            shm_dir: default_shm_dir(),
            shm_cache_bytes: 2 << 30,
            shm_copy_threads: default_copy_threads(),
            cluster_key: None,
            tls: None,
        }
    }
}

/// `/dev/shm` when present (memory-backed on Linux), else the temp dir, so the fast path degrades instead of failing.
pub fn default_shm_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

pub(crate) struct ServerInner {
    pub(crate) config: KvServerConfig,
    pub(crate) info: PeerInfo,
    pub(crate) registry: Arc<PinRegistry>,
    pub(crate) metrics: Arc<KvMetrics>,
    pub(crate) shm_pool: ShmPool,
    /// The NIXL agent exporting pinned transfers, once [`KvServer::enable_nixl`] ran.
    pub(crate) nixl: std::sync::OnceLock<crate::nixl::NixlAgent>,
    next_id: AtomicU64,
    endpoint: Mutex<String>,
}

/// Serves pinned KV to decode workers; cheap to clone (shared state).
#[derive(Clone)]
pub struct KvServer {
    pub(crate) inner: Arc<ServerInner>,
}

/// A running TCP listener; dropping it stops accepting and closes its connections.
pub struct KvListener {
    addr: SocketAddr,
    tasks: JoinSet<()>,
}

impl KvListener {
    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and drops every open connection (their pins are then released as disconnects).
    pub fn shutdown(mut self) {
        self.tasks.abort_all();
    }
}

impl KvServer {
    /// A server over `source`, announcing `info` in handshakes.
    pub fn new(config: KvServerConfig, info: PeerInfo, source: Arc<dyn KvSource>) -> Self {
        let metrics = Arc::new(KvMetrics::default());
        // Seed ids from the clock so a restarted worker does not reuse ids a stale decode worker still holds.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        KvServer {
            inner: Arc::new(ServerInner {
                registry: Arc::new(PinRegistry::new(source, Arc::clone(&metrics))),
                shm_pool: ShmPool::new(config.shm_dir.clone(), config.shm_cache_bytes),
                nixl: std::sync::OnceLock::new(),
                config,
                info,
                metrics,
                next_id: AtomicU64::new(seed << 16),
                endpoint: Mutex::new(String::new()),
            }),
        }
    }

    /// Pins `block_ids` (already pinned in the engine) for a pull and returns the handle a decode worker needs.
    ///
    /// The source's `release` is called exactly once later: on ack, abort, disconnect or after `pin_timeout`.
    pub fn register(
        &self,
        block_ids: Vec<u32>,
        n_tokens: usize,
    ) -> Result<TransferHandle, KvError> {
        if block_ids.is_empty() {
            return Err(KvError::EmptyTransfer);
        }
        let transfer_id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        self.inner.registry.register(
            transfer_id,
            Arc::from(block_ids.as_slice()),
            self.inner.config.pin_timeout,
        )?;
        Ok(TransferHandle {
            worker_id: self.inner.config.worker_id.clone(),
            endpoint: self.inner.endpoint.lock().clone(),
            transfer_id,
            block_ids,
            n_tokens,
            layout: self.inner.info.layout,
            nixl: self.inner.nixl.get().is_some(),
        })
    }

    /// Serves `NixlPull`s too: pinned transfers are exported into `agent`'s registered buffers and the
    /// client READs them. Fails if NIXL was enabled already.
    pub fn enable_nixl(&self, agent: crate::nixl::NixlAgent) -> Result<(), KvError> {
        self.inner
            .nixl
            .set(agent)
            .map_err(|_| KvError::Protocol("NIXL is already enabled on this KV server".into()))
    }

    /// Releases a transfer from the prefill side (request cancelled); returns whether it was still pinned.
    pub fn abort(&self, transfer_id: u64) -> bool {
        self.inner
            .registry
            .finish(transfer_id, ReleaseReason::Abort)
    }

    /// Releases every pin past its timeout; the TCP listener calls this periodically, in-process users may too.
    pub fn reap_expired(&self) -> usize {
        self.inner.registry.reap(Instant::now())
    }

    /// Transfers currently pinned.
    pub fn pinned(&self) -> usize {
        self.inner.registry.len()
    }

    /// This server's counters.
    pub fn metrics(&self) -> Arc<KvMetrics> {
        Arc::clone(&self.inner.metrics)
    }

    /// What this server announces in handshakes.
    pub fn info(&self) -> &PeerInfo {
        &self.inner.info
    }

    /// Binds `addr`, records it as the endpoint for new handles, and serves TCP and shared-memory pulls
    /// until the returned listener is dropped. Also runs the pin-timeout reaper.
    pub async fn listen(&self, addr: &str) -> Result<KvListener, KvError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(KvError::io("binding the KV listener"))?;
        self.serve(listener)
    }

    /// Like [`Self::listen`], on a non-blocking listener bound earlier: a worker binds its KV port before
    /// it loads its model, so a busy port fails at once. Must be called inside a tokio runtime.
    pub fn listen_on(&self, listener: std::net::TcpListener) -> Result<KvListener, KvError> {
        let listener =
            TcpListener::from_std(listener).map_err(KvError::io("adopting the KV listener"))?;
        self.serve(listener)
    }

    /// Starts accepting pulls on `listener` and reaping expired pins.
    fn serve(&self, listener: TcpListener) -> Result<KvListener, KvError> {
        let local = listener
            .local_addr()
            .map_err(KvError::io("reading the KV listener address"))?;
        *self.inner.endpoint.lock() = local.to_string();
        let mut tasks = JoinSet::new();
        let inner = Arc::clone(&self.inner);
        tasks.spawn(accept_loop(inner, listener));
        let server = self.clone();
        let period = (self.inner.config.pin_timeout / 4)
            .clamp(Duration::from_millis(5), Duration::from_secs(1));
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                let n = server.reap_expired();
                if n > 0 {
                    tracing::warn!(n, "released KV pins that were never acked");
                }
            }
        });
        tracing::info!(%local, worker = %self.inner.config.worker_id, "KV server listening");
        Ok(KvListener { addr: local, tasks })
    }
}

async fn accept_loop(inner: Arc<ServerInner>, listener: TcpListener) {
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        match listener.accept().await {
            Ok((stream, peer)) => {
                let inner = Arc::clone(&inner);
                conns.spawn(async move {
                    if let Err(e) = serve_conn(&inner, stream).await {
                        inner.metrics.serve_error();
                        tracing::warn!(%peer, error = %e, "KV connection failed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "KV accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Per-connection state that must be cleaned up however the connection ends.
struct ConnState {
    /// Transfer whose ack this connection carries; released as a disconnect if the connection ends first.
    control: Option<u64>,
    /// The shared-memory segment of the transfer in flight; back to the pool when the transfer ends.
    shm: Option<ShmSegment>,
    /// What the NIXL transfer in flight is READ from (a registered copy, or the pin of a staged export);
    /// let go when the transfer ends.
    nixl: Option<crate::nixl::server::NixlHold>,
}

impl ConnState {
    /// The transfer in flight ended (ack, abort, disconnect): its buffers go back to their pools.
    fn end_transfer(&mut self, inner: &ServerInner) {
        if let Some(seg) = self.shm.take() {
            inner.shm_pool.put(seg);
        }
        self.nixl = None;
    }
}

async fn serve_conn(inner: &Arc<ServerInner>, stream: TcpStream) -> Result<(), KvError> {
    stream
        .set_nodelay(true)
        .map_err(KvError::io("setting TCP_NODELAY"))?;
    let io = inner.config.io_timeout;
    let stream = match &inner.config.tls {
        None => MaybeTls::Plain(stream),
        Some(tls) => {
            let tls = crate::error::timed(io, "the TLS handshake", async {
                tls.accept(stream)
                    .await
                    .map_err(KvError::io("the TLS handshake"))
            })
            .await?;
            MaybeTls::Tls(Box::new(tls.into()))
        }
    };
    let mut r = FrameReader::new(stream, io);
    let mut st = ConnState {
        control: None,
        shm: None,
        nixl: None,
    };
    let res = conn_loop(inner, &mut r, &mut st).await;
    if let Err(e) = &res {
        if !matches!(e, KvError::Io { .. } | KvError::Mismatch { .. }) {
            // Best effort: the peer may already be gone.
            let _ = wire::send_json(
                r.get_mut(),
                FrameKind::Error,
                0,
                &WireError::from(e),
                Duration::from_millis(200),
            )
            .await;
        }
    }
    if let Some(t) = st.control.take() {
        inner.registry.finish(t, ReleaseReason::Disconnect);
    }
    st.end_transfer(inner);
    res
}

async fn conn_loop(
    inner: &Arc<ServerInner>,
    r: &mut FrameReader<MaybeTls>,
    st: &mut ConnState,
) -> Result<(), KvError> {
    let io = inner.config.io_timeout;
    let h = r
        .header()
        .await?
        .ok_or_else(|| KvError::Protocol("closed before the handshake".into()))?;
    if h.kind != FrameKind::Hello {
        return Err(KvError::Protocol(format!(
            "expected Hello, got {:?}",
            h.kind
        )));
    }
    let remote: PeerInfo = r.json(&h).await?;
    if let Some(key) = &inner.config.cluster_key {
        wire::server_challenge(r, key, io).await?;
    }
    // Reply with our info even on mismatch so the client can name the differing field itself.
    wire::send_json(r.get_mut(), FrameKind::HelloReply, 0, &inner.info, io).await?;
    inner.info.check_compatible(&remote)?;

    let mut buf: Vec<u8> = Vec::new();
    while let Some(h) = r.header().await? {
        let tid = h.transfer_id;
        match h.kind {
            FrameKind::Pull => {
                let req: PullRequest = r.json(&h).await?;
                let guard = inner.registry.begin_read(tid)?;
                if req.control {
                    st.control = Some(tid);
                }
                send_layers(inner, r.get_mut(), tid, &req, &guard.blocks, &mut buf).await?;
                drop(guard);
                send_control(r.get_mut(), FrameKind::PullDone, tid, io).await?;
            }
            FrameKind::ShmPull => {
                let req: ShmPullRequest = r.json(&h).await?;
                let guard = inner.registry.begin_read(tid)?;
                st.control = Some(tid);
                let layers =
                    selected_layers(inner.info.layout.n_layers, &guard.blocks, &req.selection)?;
                if req.selection.is_empty() {
                    return Err(KvError::Protocol("a shared-memory pull of no block".into()));
                }
                send_shm(inner, r.get_mut(), tid, guard, layers, &mut st.shm).await?;
                send_control(r.get_mut(), FrameKind::PullDone, tid, io).await?;
            }
            FrameKind::NixlPull => {
                let req: crate::nixl::server::NixlPullRequest = r.json(&h).await?;
                let guard = inner.registry.begin_read(tid)?;
                st.control = Some(tid);
                st.end_transfer(inner);
                crate::nixl::server::send_nixl(inner, r.get_mut(), tid, &req, guard, &mut st.nixl)
                    .await?;
                send_control(r.get_mut(), FrameKind::PullDone, tid, io).await?;
            }
            FrameKind::Ack => {
                st.end_transfer(inner);
                st.control = None;
                if !inner.registry.finish(tid, ReleaseReason::Ack) {
                    // Already released (e.g. timed out after the last byte was read under the pin): the data is still valid.
                    tracing::debug!(
                        transfer_id = tid,
                        "ack for a transfer that was already released"
                    );
                }
                send_control(r.get_mut(), FrameKind::AckOk, tid, io).await?;
            }
            FrameKind::Abort => {
                st.end_transfer(inner);
                st.control = None;
                inner.registry.finish(tid, ReleaseReason::Abort);
            }
            k => return Err(KvError::Protocol(format!("unexpected {k:?} from a client"))),
        }
    }
    Ok(())
}

async fn send_layers(
    inner: &ServerInner,
    w: &mut MaybeTls,
    tid: u64,
    req: &PullRequest,
    blocks: &[u32],
    buf: &mut Vec<u8>,
) -> Result<(), KvError> {
    let bb = inner.info.layout.block_bytes();
    let per_frame = (inner.config.max_frame_bytes / bb).max(1);
    req.selection
        .check(blocks.len(), inner.info.layout.n_layers)?;
    for &layer in &req.layers {
        if layer as usize >= inner.info.layout.n_layers {
            return Err(KvError::Protocol(format!("layer {layer} out of range")));
        }
        // Frames never span two runs, so each carries consecutive indices as the header says.
        for run in req.selection.layer(layer as usize).runs() {
            let run_blocks = &blocks[run.start as usize..run.end as usize];
            for (i, chunk) in run_blocks.chunks(per_frame).enumerate() {
                let len = chunk.len() * bb;
                if buf.len() < len {
                    buf.resize(len, 0);
                }
                let payload = &mut buf[..len];
                inner
                    .registry
                    .source()
                    .copy_blocks(tid, layer as usize, chunk, payload)?;
                let mut h = FrameHeader::control(FrameKind::Data, tid, len);
                h.layer = layer;
                h.first_block = run.start + (i * per_frame) as u32;
                h.n_blocks = chunk.len() as u32;
                if req.checksum {
                    h.flags |= FLAG_CHECKSUM;
                    h.checksum = crc32fast::hash(payload);
                }
                wire::send(w, h, payload, inner.config.io_timeout).await?;
                inner.metrics.add_sent(len as u64);
            }
        }
    }
    Ok(())
}

/// The source block ids a selection names, in ascending index order; refuses indices past the transfer.
pub(crate) fn selected(blocks: &[u32], selection: &BlockSelection) -> Result<Vec<u32>, KvError> {
    selection.check(blocks.len())?;
    Ok(selection.iter().map(|i| blocks[i as usize]).collect())
}

/// Each layer's selected source blocks (ascending index order) of a pull of `selection` from a
/// transfer of the source blocks `pinned`, as they are packed layer after layer
/// ([`PullSelection::packed_layers`]).
pub(crate) fn selected_layers(
    n_layers: usize,
    pinned: &[u32],
    selection: &PullSelection,
) -> Result<Vec<Vec<u32>>, KvError> {
    selection.check(pinned.len(), n_layers)?;
    (0..n_layers)
        .map(|l| selected(pinned, &selection.layer(l)))
        .collect()
}

/// Bytes of every layer's blocks together.
pub(crate) fn packed_len(layers: &[Vec<u32>], block_bytes: usize) -> usize {
    layers.iter().map(Vec::len).sum::<usize>() * block_bytes
}

/// Copies every layer's selected source blocks into a pooled segment on
/// `shm_copy_threads` threads, announcing each layer as soon as it is written (layers finish in any order;
/// the client accepts that). The copy runs on the blocking pool and owns the read `guard` and the segment, so
/// the pin outlives every read of the source even if this future is dropped; on success and on error the
/// segment is parked in `slot`, so it returns to the pool when the transfer ends (if this future is dropped
/// mid-copy, the copy drops the segment when it stops, which unlinks its file).
async fn send_shm(
    inner: &Arc<ServerInner>,
    w: &mut MaybeTls,
    tid: u64,
    guard: ReadGuard,
    layers: Vec<Vec<u32>>,
    slot: &mut Option<ShmSegment>,
) -> Result<(), KvError> {
    let total = packed_len(&layers, inner.info.layout.block_bytes());
    if let Some(old) = slot.take() {
        inner.shm_pool.put(old);
    }
    let seg = slot.insert(inner.shm_pool.take(total)?);
    let open = ShmOpen {
        path: seg.path().to_string_lossy().into_owned(),
        map_len: seg.map.len() as u64,
        total_len: total as u64,
    };
    wire::send_json(w, FrameKind::ShmOpen, tid, &open, inner.config.io_timeout).await?;
    let seg = slot.take().expect("just inserted");
    let (seg, res) =
        copy_and_announce(inner, w, tid, guard, layers, seg, FrameKind::ShmLayer).await?;
    *slot = Some(seg);
    res
}

/// Copies each layer's selected source blocks (`layers`) into `buf` at the layer's offset on
/// `shm_copy_threads` threads of the blocking pool, sending a `kind` frame (no payload; `n_blocks` the
/// layer's) for each layer as soon as it is written. The copy owns the read `guard` and the buffer, so the
/// pin outlives every read of the source even if this future is dropped; the buffer comes back once no
/// thread writes it any more, with the first failure. Err only when the copy task itself died.
pub(crate) async fn copy_and_announce<B: AsMut<[u8]> + Send + 'static>(
    inner: &Arc<ServerInner>,
    w: &mut MaybeTls,
    tid: u64,
    guard: ReadGuard,
    layers: Vec<Vec<u32>>,
    mut buf: B,
    kind: FrameKind,
) -> Result<(B, Result<(), KvError>), KvError> {
    let bb = inner.info.layout.block_bytes();
    let counts: Vec<usize> = layers.iter().map(Vec::len).collect();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let stop = StopFlag::default();
    let copier = {
        let inner = Arc::clone(inner);
        let stop = stop.clone();
        let threads = inner.config.shm_copy_threads;
        tokio::task::spawn_blocking(move || {
            let res = copy_layers(
                inner.registry.source(),
                tid,
                &layers,
                buf.as_mut(),
                bb,
                threads,
                &stop,
                &done_tx,
            );
            // Only now, with every copy out of the source finished, may the pin be released.
            drop(guard);
            (buf, res)
        })
    };
    let mut announced = Ok(());
    while let Some(layer) = done_rx.recv().await {
        let mut h = FrameHeader::control(kind, tid, 0);
        h.layer = layer as u32;
        h.n_blocks = counts[layer] as u32;
        if let Err(e) = wire::send(w, h, &[], inner.config.io_timeout).await {
            announced = Err(e);
            break;
        }
        inner.metrics.add_sent((counts[layer] * bb) as u64);
    }
    // On a failed send the copiers stop after their current layer; either way wait for them, so the
    // buffer comes back and no thread still writes it when the transfer ends.
    if announced.is_err() {
        stop.raise();
    }
    let (buf, copied) = copier
        .await
        .map_err(|e| KvError::Source(format!("KV export copy task failed: {e}")))?;
    Ok((buf, announced.and(copied)))
}

/// Copies each layer's blocks into `buf` at the layer's offset on up to `threads` scoped threads taking
/// layers in ascending order, and sends each finished layer's index on `done` (a layer of no block is
/// finished at once). Stops early when `stop` is raised or a copy fails; returns the first failure.
#[allow(clippy::too_many_arguments)]
fn copy_layers(
    source: &dyn KvSource,
    tid: u64,
    layers: &[Vec<u32>],
    buf: &mut [u8],
    block_bytes: usize,
    threads: usize,
    stop: &StopFlag,
    done: &tokio::sync::mpsc::UnboundedSender<usize>,
) -> Result<(), KvError> {
    let n_layers = layers.len();
    let total = packed_len(layers, block_bytes);
    if buf.len() < total {
        return Err(KvError::Source(format!(
            "a copy of {total} bytes into a buffer of {}",
            buf.len()
        )));
    }
    // Each layer's own slice of the buffer: the layers are packed in order.
    let mut rest = &mut buf[..total];
    let mut outs = Vec::with_capacity(n_layers);
    for l in layers {
        let (out, tail) = std::mem::take(&mut rest).split_at_mut(l.len() * block_bytes);
        outs.push((l, out));
        rest = tail;
    }
    let work = Mutex::new(outs.into_iter().enumerate());
    let failure: Mutex<Option<KvError>> = Mutex::new(None);
    let worker = || loop {
        if stop.raised() {
            return;
        }
        let Some((layer, out)) = work.lock().next() else {
            return;
        };
        let (blocks, out) = out;
        let copied = if blocks.is_empty() {
            Ok(())
        } else {
            source.copy_blocks(tid, layer, blocks, out)
        };
        match copied {
            // A closed channel means the announcing side is gone; the remaining copies are useless.
            Ok(()) => {
                if done.send(layer).is_err() {
                    stop.raise();
                }
            }
            Err(e) => {
                stop.raise();
                failure.lock().get_or_insert(e);
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads.clamp(1, n_layers.max(1)) {
            // A thread that cannot be spawned only costs parallelism: the others take its layers.
            if std::thread::Builder::new()
                .name("kv-shm-copy".into())
                .spawn_scoped(s, worker)
                .is_err()
            {
                break;
            }
        }
        worker();
    });
    match failure.into_inner() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Sends a control frame without payload (`PullDone`, `AckOk`, ...) for transfer `tid`.
async fn send_control<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    tid: u64,
    io: std::time::Duration,
) -> Result<(), KvError> {
    wire::send(w, FrameHeader::control(kind, tid, 0), &[], io).await
}
