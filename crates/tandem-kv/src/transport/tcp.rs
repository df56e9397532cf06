//! TCP transport: several connections per pull, each carrying a subset of layers in large frames.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::error::timed;
use crate::transport::{KvTransport, PullFuture};
use crate::wire::{self, FrameHeader, FrameKind, FrameReader, PullRequest};
use crate::{KvError, KvSink, PeerInfo, TransferHandle};

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
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            streams: 4,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(10),
            checksum: false,
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
        sink: Arc<dyn KvSink>,
    ) -> Result<u64, KvError> {
        let n_layers = handle.layout.n_layers;
        let streams = self.config.streams.clamp(1, n_layers.max(1));
        let mut set = JoinSet::new();
        for s in 0..streams {
            let job = StreamJob {
                endpoint: handle.endpoint.clone(),
                local: self.local.clone(),
                config: self.config.clone(),
                transfer_id: handle.transfer_id,
                layers: (s..n_layers).step_by(streams).map(|l| l as u32).collect(),
                control: s == 0,
                n_blocks: handle.block_ids.len(),
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
            // The control connection is gone, so the server releases the pin as a disconnect.
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
    c: &mut FrameReader<TcpStream>,
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

/// Opens a connection to `endpoint` and runs the client handshake on it.
pub(crate) async fn connect(
    endpoint: &str,
    local: &PeerInfo,
    config: &TcpConfig,
) -> Result<FrameReader<TcpStream>, KvError> {
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
    let mut r = FrameReader::new(stream, config.io_timeout);
    wire::client_handshake(&mut r, local, config.io_timeout).await?;
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
    n_blocks: usize,
    n_layers: usize,
    block_bytes: usize,
    sink: Arc<dyn KvSink>,
}

impl StreamJob {
    /// Receives this connection's layers into the sink; returns the connection if it carries the ack.
    async fn run(self) -> Result<(Option<FrameReader<TcpStream>>, u64), KvError> {
        let mut r = connect(&self.endpoint, &self.local, &self.config).await?;
        let req = PullRequest {
            layers: self.layers.clone(),
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
        // Blocks still expected per layer; u32::MAX marks layers not assigned to this connection.
        let mut remaining = vec![u32::MAX; self.n_layers];
        for &l in &self.layers {
            remaining[l as usize] = self.n_blocks as u32;
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
                    let left = remaining.get(layer).copied().unwrap_or(u32::MAX);
                    let end = h.first_block as u64 + h.n_blocks as u64;
                    if left == u32::MAX
                        || h.n_blocks > left
                        || end > self.n_blocks as u64
                        || h.payload_len != h.n_blocks as u64 * self.block_bytes as u64
                    {
                        return Err(KvError::Protocol(format!(
                            "bad data frame: layer {layer}, blocks {}+{}, {} bytes",
                            h.first_block, h.n_blocks, h.payload_len
                        )));
                    }
                    let payload = r.payload(&h).await?;
                    self.sink.write(layer, h.first_block as usize, payload)?;
                    bytes += h.payload_len;
                    remaining[layer] = left - h.n_blocks;
                    if remaining[layer] == 0 {
                        self.sink.layer_complete(layer)?;
                    }
                }
                FrameKind::PullDone => {
                    if let Some(&l) = self.layers.iter().find(|&&l| remaining[l as usize] != 0) {
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

impl KvTransport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn local(&self) -> &PeerInfo {
        &self.local
    }

    fn pull<'a>(&'a self, handle: &'a TransferHandle, sink: Arc<dyn KvSink>) -> PullFuture<'a> {
        Box::pin(self.pull_impl(handle, sink))
    }
}
