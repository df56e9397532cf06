//! TCP transport: several connections per pull, each carrying a subset of layers in large frames.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::tls::MaybeTls;
use tokio::task::JoinSet;

use crate::error::timed;
use crate::wire::{self, FrameHeader, FrameKind, FrameReader, PullRequest};
use crate::{KvError, KvSink, PeerInfo, PullSelection, TransferHandle};

/// Knobs of the socket transports.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Parallel connections per pull (capped at the layer count); layer `l` goes on connection `l % streams`.
    pub streams: usize,
    /// Bound on connecting.
    pub connect_timeout: Duration,
    /// Bound on every read and write.
    pub io_timeout: Duration,
    /// Ask the server to CRC32 every data frame (costs throughput; for untrusted links and debugging).
    pub checksum: bool,
    /// The cluster secret to prove to the server, which must ask for it ([`crate::auth`]).
    pub cluster_key: Option<crate::ClusterKey>,
    /// Mutual TLS to the server (`deployment.cluster_tls`); `None` connects in plain TCP.
    pub tls: Option<Arc<crate::ClusterTls>>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            streams: 4,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(10),
            checksum: false,
            cluster_key: None,
            tls: None,
        }
    }
}

/// Pulls over TCP from a [`crate::KvServer`] listening at the handle's endpoint.
pub struct TcpTransport {
    local: PeerInfo,
    config: TcpConfig,
}

impl TcpTransport {
    /// A TCP transport for a decode side described by `local`.
    pub fn new(local: PeerInfo, config: TcpConfig) -> Self {
        TcpTransport { local, config }
    }

    async fn pull_impl(
        &self,
        handle: &TransferHandle,
        selection: &PullSelection,
        sink: Arc<dyn KvSink>,
    ) -> Result<u64, KvError> {
        if selection.is_empty() {
            return ack_only(handle, &self.local, &self.config, &*sink).await;
        }
        let n_layers = handle.layout.n_layers;
        let streams = self.config.streams.clamp(1, n_layers.max(1));
        let selection = Arc::new(selection.clone());
        let mut set = JoinSet::new();
        for s in 0..streams {
            let job = StreamJob {
                endpoint: handle.endpoint.clone(),
                local: self.local.clone(),
                config: self.config.clone(),
                transfer_id: handle.transfer_id,
                layers: (s..n_layers).step_by(streams).map(|l| l as u32).collect(),
                control: s == 0,
                selection: Arc::clone(&selection),
                n_layers,
                block_bytes: handle.layout.block_bytes(),
                sink: Arc::clone(&sink),
            };
            set.spawn(job.run());
        }
        let mut control = None;
        let mut bytes = 0u64;
        let mut err = None;
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok(Ok((c, b))) => {
                    control = control.or(c);
                    bytes += b;
                }
                Ok(Err(e)) => {
                    if err.is_none() {
                        set.abort_all();
                        err = Some(e);
                    }
                }
                Err(j) if j.is_cancelled() => {}
                Err(j) => {
                    set.abort_all();
                    err = err.or(Some(KvError::Protocol(format!(
                        "pull stream task failed: {j}"
                    ))));
                }
            }
        }
        let err = match err {
            None => sink.complete().err(),
            e => e,
        };
        let Some(mut c) = control else {
            // The control connection is gone, so the server releases the pin as a disconnect, unless that
            // stream was cancelled before its request reached the server: then abort on a fresh connection.
            abort_unclaimed(handle, &self.local, &self.config).await;
            return Err(err.unwrap_or_else(|| KvError::Protocol("control stream missing".into())));
        };
        let io = self.config.io_timeout;
        let tid = handle.transfer_id;
        finish_on_control(&mut c, tid, err, io)
            .await
            .map(|()| bytes)
    }
}

/// Acks on success (waiting for `AckOk`) or aborts on failure over the control connection.
pub(crate) async fn finish_on_control(
    c: &mut FrameReader<MaybeTls>,
    tid: u64,
    err: Option<KvError>,
    io: Duration,
) -> Result<(), KvError> {
    match err {
        None => {
            wire::send(
                c.get_mut(),
                FrameHeader::control(FrameKind::Ack, tid, 0),
                &[],
                io,
            )
            .await?;
            let h = c.expect_frame().await?;
            if h.kind != FrameKind::AckOk || h.transfer_id != tid {
                return Err(KvError::Protocol(format!(
                    "expected AckOk for {tid}, got {:?}",
                    h.kind
                )));
            }
            Ok(())
        }
        Some(e) => {
            // Best effort: if this fails the server still releases on disconnect or timeout.
            let _ = wire::send(
                c.get_mut(),
                FrameHeader::control(FrameKind::Abort, tid, 0),
                &[],
                io,
            )
            .await;
            Err(e)
        }
    }
}

/// Best-effort `Abort` of `handle` on a new connection, for a pull whose control stream never claimed the pin
/// (it would otherwise stay pinned until the server's timeout); a pin already released is left alone.
async fn abort_unclaimed(handle: &TransferHandle, local: &PeerInfo, config: &TcpConfig) {
    if let Ok(mut c) = connect(&handle.endpoint, local, config).await {
        let abort = FrameHeader::control(FrameKind::Abort, handle.transfer_id, 0);
        let _ = wire::send(c.get_mut(), abort, &[], config.io_timeout).await;
    }
}

/// The pull of an empty selection: every block was cached on the decode side, so no data moves, but the
/// handshake still checks the peer and the ack still releases the pin.
pub(crate) async fn ack_only(
    handle: &TransferHandle,
    local: &PeerInfo,
    config: &TcpConfig,
    sink: &dyn KvSink,
) -> Result<u64, KvError> {
    let mut c = connect(&handle.endpoint, local, config).await?;
    let res = (0..handle.layout.n_layers)
        .try_for_each(|l| sink.layer_complete(l))
        .and_then(|()| sink.complete());
    finish_on_control(&mut c, handle.transfer_id, res.err(), config.io_timeout)
        .await
        .map(|()| 0)
}

/// Opens a connection to `endpoint` and runs the client handshake on it.
pub(crate) async fn connect(
    endpoint: &str,
    local: &PeerInfo,
    config: &TcpConfig,
) -> Result<FrameReader<MaybeTls>, KvError> {
    let stream = timed(
        config.connect_timeout,
        "connecting to the KV server",
        async {
            TcpStream::connect(endpoint)
                .await
                .map_err(KvError::io("connecting to the KV server"))
        },
    )
    .await?;
    stream
        .set_nodelay(true)
        .map_err(KvError::io("setting TCP_NODELAY"))?;
    let stream = match &config.tls {
        None => MaybeTls::Plain(stream),
        Some(tls) => {
            let tls = timed(config.io_timeout, "the TLS handshake", async {
                tls.connect(endpoint, stream)
                    .await
                    .map_err(KvError::io("the TLS handshake"))
            })
            .await?;
            MaybeTls::Tls(Box::new(tls.into()))
        }
    };
    let mut r = FrameReader::new(stream, config.io_timeout);
    wire::client_handshake(
        &mut r,
        local,
        config.cluster_key.as_ref(),
        config.io_timeout,
    )
    .await?;
    Ok(r)
}

/// One connection's share of a pull.
struct StreamJob {
    endpoint: String,
    local: PeerInfo,
    config: TcpConfig,
    transfer_id: u64,
    layers: Vec<u32>,
    control: bool,
    selection: Arc<PullSelection>,
    n_layers: usize,
    block_bytes: usize,
    sink: Arc<dyn KvSink>,
}

impl StreamJob {
    /// Receives this connection's layers into the sink; returns the connection if it carries the ack.
    async fn run(self) -> Result<(Option<FrameReader<MaybeTls>>, u64), KvError> {
        let mut r = connect(&self.endpoint, &self.local, &self.config).await?;
        let req = PullRequest {
            layers: self.layers.clone(),
            selection: (*self.selection).clone(),
            control: self.control,
            checksum: self.config.checksum,
        };
        wire::send_json(
            r.get_mut(),
            FrameKind::Pull,
            self.transfer_id,
            &req,
            self.config.io_timeout,
        )
        .await?;
        // Where each layer's next frame must start: (run, block index), with run == its runs' count once
        // the layer is complete. The server sends a layer's runs in order, split into frames that never
        // span two runs; layers not on this connection stay `None`, and a layer of no block is complete
        // before any frame.
        let runs: Vec<Vec<std::ops::Range<u32>>> = (0..self.n_layers)
            .map(|l| self.selection.layer(l).runs().to_vec())
            .collect();
        let mut cursor: Vec<Option<(usize, u32)>> = vec![None; self.n_layers];
        for &l in &self.layers {
            let runs = &runs[l as usize];
            cursor[l as usize] = Some((0, runs.first().map_or(0, |r| r.start)));
            if runs.is_empty() {
                self.sink.layer_complete(l as usize)?;
            }
        }
        let mut bytes = 0u64;
        loop {
            let h = r.expect_frame().await?;
            if h.transfer_id != self.transfer_id {
                return Err(KvError::Protocol(format!(
                    "frame for transfer {} on a pull of {}",
                    h.transfer_id, self.transfer_id
                )));
            }
            match h.kind {
                FrameKind::Data => {
                    let layer = h.layer as usize;
                    let at = cursor.get(layer).copied().flatten();
                    let end = h.first_block as u64 + h.n_blocks as u64;
                    let fits = at.is_some_and(|(run, next)| {
                        let runs = &runs[layer];
                        run < runs.len()
                            && h.first_block == next
                            && h.n_blocks > 0
                            && end <= runs[run].end as u64
                    });
                    if !fits || h.payload_len != h.n_blocks as u64 * self.block_bytes as u64 {
                        return Err(KvError::Protocol(format!(
                            "bad data frame: layer {layer}, blocks {}+{}, {} bytes",
                            h.first_block, h.n_blocks, h.payload_len
                        )));
                    }
                    let payload = r.payload(&h).await?;
                    self.sink.write(layer, h.first_block as usize, payload)?;
                    bytes += h.payload_len;
                    let (run, _) = at.expect("checked by `fits`");
                    let runs = &runs[layer];
                    cursor[layer] = if end < runs[run].end as u64 {
                        Some((run, end as u32))
                    } else if run + 1 < runs.len() {
                        Some((run + 1, runs[run + 1].start))
                    } else {
                        self.sink.layer_complete(layer)?;
                        Some((runs.len(), 0))
                    };
                }
                FrameKind::PullDone => {
                    let incomplete = self.layers.iter().find(|&&l| {
                        let l = l as usize;
                        cursor[l].is_some_and(|(run, _)| run < runs[l].len())
                    });
                    if let Some(l) = incomplete {
                        return Err(KvError::Protocol(format!(
                            "pull ended with layer {l} incomplete"
                        )));
                    }
                    return Ok((self.control.then_some(r), bytes));
                }
                k => return Err(KvError::Protocol(format!("unexpected {k:?} during a pull"))),
            }
        }
    }
}

kv_transport!(TcpTransport, "tcp", |this, handle, selection, sink| this
    .pull_impl(handle, selection, sink));
