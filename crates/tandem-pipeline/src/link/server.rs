//! A stage server's end of a stage link: [`StageServer`] accepts its worker's connection and answers
//! each request through a [`StageHandler`], refusing a malformed one with an `Error` frame.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_engine::{DeviceSampling, LayerBlocks, StageInput, StageOutput};
use tandem_kv::wire::{FrameHeader, FrameKind, WireError, MAX_CONTROL_LEN};
use tandem_kv::{ClusterKey, ClusterTls, KvError};
use tandem_model::{ForwardBatch, LayerExpertTokens};

use super::{encode_expert_tokens, io_err, Conn, StageHello};

/// What a stage server does with the requests of its link; implemented over the model by the stage server
/// ([`crate::serve_stage`]).
pub trait StageHandler: Send + 'static {
    /// Why a request failed; the server sends its message to the client in an `Error` frame and closes.
    type Error: std::error::Error;
    /// This stage's handshake. `block_size`/`num_blocks` of 0 mean "not sized yet": the server then calls
    /// [`StageHandler::size_pool`] with the client's values.
    fn hello(&self) -> StageHello;
    /// Allocates the KV pool for the client's block size and count (only while unsized).
    fn size_pool(&mut self, block_size: usize, num_blocks: usize) -> Result<(), Self::Error>;
    /// Runs the stage's layers on one batch from the previous stage's hidden states: `output` gets the
    /// next stage's hidden states (f32 logits rows from the last stage), or from a last stage that
    /// samples on its device one token per logits row.
    fn forward(&mut self, input: StageInput, output: StageOutput) -> Result<(), Self::Error>;
    /// Bytes of one block of the KV layout.
    fn block_bytes(&self) -> usize;
    /// Copies the blocks of one global layer out, back to back.
    fn export_blocks(&mut self, at: LayerBlocks, out: &mut [u8]) -> Result<(), Self::Error>;
    /// Overwrites the blocks of one global layer from `data` (their bytes back to back).
    fn import_blocks(&mut self, at: LayerBlocks, data: &[u8]) -> Result<(), Self::Error>;
    /// Copies a block across the stage's layers.
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), Self::Error>;
    /// Copies into `out` the token rows routed to each expert of the stage's mixture-of-experts layers
    /// since load (whole-model layer indices; empty for dense layers or a device that does not count).
    fn expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) {
        out.clear();
    }
}

/// A running stage server: serves one connection at a time (its worker's first stage) until shut down.
pub struct StageServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// The connection being served, so shutdown can cut it.
    current: Arc<Mutex<Option<TcpStream>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StageServer {
    /// Starts serving `listener` with `handler` on a thread of its own; `io` bounds each frame read/write
    /// after the first frame of a request (an idle link waits for the next request indefinitely); with
    /// `key` set, only clients proving it are served.
    pub fn start<H: StageHandler>(
        listener: TcpListener,
        handler: H,
        io: Duration,
        key: Option<ClusterKey>,
    ) -> Result<StageServer, KvError> {
        Self::start_tls(listener, handler, io, key, None)
    }

    /// [`Self::start`] under the cluster's mutual TLS when `tls` is given: a client without a certificate
    /// from the cluster's CA is refused in the handshake, before its hello is read.
    pub fn start_tls<H: StageHandler>(
        listener: TcpListener,
        handler: H,
        io: Duration,
        key: Option<ClusterKey>,
        tls: Option<Arc<ClusterTls>>,
    ) -> Result<StageServer, KvError> {
        let addr = listener
            .local_addr()
            .map_err(io_err("reading the stage listener address", io))?;
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(Mutex::new(None));
        let (s, c) = (stop.clone(), current.clone());
        let thread = std::thread::Builder::new()
            .name(format!("stage-{addr}"))
            .spawn(move || accept_loop(listener, handler, io, key, tls, s, c))
            .map_err(io_err("spawning the stage server thread", io))?;
        Ok(StageServer {
            addr,
            stop,
            current,
            thread: Some(thread),
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Blocks until the server stops (for a process that only hosts a stage).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Stops accepting, cuts the connection being served (its client sees a disconnect) and joins.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(s) = self.current.lock().expect("stage lock").take() {
            let _ = s.shutdown(Shutdown::Both);
        }
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StageServer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop_now();
        }
    }
}

fn accept_loop<H: StageHandler>(
    listener: TcpListener,
    mut handler: H,
    io: Duration,
    key: Option<ClusterKey>,
    tls: Option<Arc<ClusterTls>>,
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<TcpStream>>>,
) {
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "stage accept failed");
                continue;
            }
        };
        let peer = stream.peer_addr().ok();
        match stream.try_clone() {
            Ok(c) => *current.lock().expect("stage lock") = Some(c),
            Err(e) => {
                tracing::warn!(error = %e, "stage socket clone failed");
                continue;
            }
        }
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match serve_conn(stream, &mut handler, io, key.as_ref(), tls.as_deref()) {
            Ok(()) => tracing::info!(?peer, "stage client disconnected"),
            Err(e) => tracing::warn!(?peer, error = %e, "stage connection ended"),
        }
        current.lock().expect("stage lock").take();
    }
}

fn serve_conn<H: StageHandler>(
    stream: TcpStream,
    handler: &mut H,
    io: Duration,
    key: Option<&ClusterKey>,
    tls: Option<&ClusterTls>,
) -> Result<(), KvError> {
    let mut c = Conn::new(stream, io, tls.map(|t| (t, None)))?;
    // The handshake is bounded; afterwards the link may idle between steps.
    let h = c.expect(FrameKind::StageHello)?;
    let client: StageHello = c.json(&h)?;
    if let Some(key) = key {
        if let Err(e) = c.challenge(key) {
            return refuse(&mut c, e);
        }
    }
    let mut mine = handler.hello();
    if mine.block_size == 0 && mine.num_blocks == 0 {
        if let Err(e) = handler.size_pool(client.block_size, client.num_blocks) {
            return refuse(&mut c, KvError::Remote(e.to_string()));
        }
        mine = handler.hello();
    }
    if let Err(e) = mine.check_compatible(&client) {
        return refuse(&mut c, e);
    }
    c.send_json(FrameKind::StageHelloReply, &mine)?;
    c.stream
        .tcp()
        .set_read_timeout(None)
        .map_err(io_err("configuring a stage socket", io))?;
    let mut hidden: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    let mut ids: Vec<u32> = Vec::new();
    let mut block: Vec<u8> = Vec::new();
    let mut block_ids: Vec<u32> = Vec::new();
    let mut counts: Vec<LayerExpertTokens> = Vec::new();
    let mut counts_bytes: Vec<u8> = Vec::new();
    loop {
        let Some(h) = c.header()? else { return Ok(()) };
        c.stream
            .tcp()
            .set_read_timeout(Some(io))
            .map_err(io_err("configuring a stage socket", io))?;
        let reply = match h.kind {
            FrameKind::StageForward => {
                let (meta_len, rows_len) = (h.layer as u64, h.n_blocks as u64);
                if meta_len > MAX_CONTROL_LEN
                    || rows_len > MAX_CONTROL_LEN
                    || meta_len + rows_len > h.payload_len
                {
                    return refuse(
                        &mut c,
                        KvError::Protocol(format!(
                            "batch metadata of {meta_len} + {rows_len} bytes in a {}-byte frame",
                            h.payload_len
                        )),
                    );
                }
                let batch: ForwardBatch = c.json_part(meta_len, "batch")?;
                let rows: Option<Vec<DeviceSampling>> = match rows_len {
                    0 => None,
                    n => Some(c.json_part(n, "sampling rows")?),
                };
                let hidden_len = h.payload_len - meta_len - rows_len;
                if let Err(e) = mine.check_hidden(batch.tokens.len(), hidden_len) {
                    return refuse(&mut c, e);
                }
                c.bytes_payload(hidden_len, &mut hidden)?;
                let mut reply = FrameHeader::control(FrameKind::StageReply, h.transfer_id, 0);
                let input = StageInput {
                    batch: &batch,
                    hidden: Some(&hidden),
                };
                let output = match &rows {
                    None => StageOutput::Hidden(&mut out),
                    Some(rows) => {
                        // Marks the reply as token ids (n_blocks is unused on a reply otherwise).
                        reply.n_blocks = 1;
                        StageOutput::Tokens {
                            rows,
                            out: &mut ids,
                        }
                    }
                };
                handler.forward(input, output).map(|()| reply)
            }
            FrameKind::StageExport | FrameKind::StageImport => {
                let n = h.n_blocks as u64;
                let data = if h.kind == FrameKind::StageImport {
                    n * handler.block_bytes() as u64
                } else {
                    0
                };
                if n == 0
                    || n * 4 > MAX_CONTROL_LEN
                    || n > mine.num_blocks as u64
                    || h.payload_len != n * 4 + data
                {
                    return refuse(
                        &mut c,
                        KvError::Protocol(format!(
                            "{:?} of {n} blocks (the pool has {}) in {} bytes (a block is {})",
                            h.kind,
                            mine.num_blocks,
                            h.payload_len,
                            handler.block_bytes()
                        )),
                    );
                }
                block_ids.resize(n as usize, 0);
                c.read_into(bytemuck::cast_slice_mut(&mut block_ids))?;
                let at = LayerBlocks::new(h.layer as usize, &block_ids);
                if h.kind == FrameKind::StageExport {
                    block.resize(n as usize * handler.block_bytes(), 0);
                    handler
                        .export_blocks(at, &mut block)
                        .map(|()| FrameHeader::control(FrameKind::StageBlock, h.transfer_id, 0))
                } else {
                    block.resize(data as usize, 0);
                    c.read_into(&mut block)?;
                    handler
                        .import_blocks(at, &block)
                        .map(|()| FrameHeader::control(FrameKind::StageOk, h.transfer_id, 0))
                }
            }
            FrameKind::StageExpertTokens if h.payload_len == 0 => {
                handler.expert_tokens(&mut counts);
                encode_expert_tokens(&counts, &mut counts_bytes);
                Ok(FrameHeader::control(
                    FrameKind::StageExpertTokensReply,
                    h.transfer_id,
                    0,
                ))
            }
            FrameKind::StageCopy => handler
                .copy_block(h.first_block, h.n_blocks)
                .map(|()| FrameHeader::control(FrameKind::StageOk, h.transfer_id, 0)),
            other => {
                return refuse(
                    &mut c,
                    KvError::Protocol(format!("unexpected {other:?} on a stage link")),
                )
            }
        };
        match reply {
            Ok(r) => match r.kind {
                FrameKind::StageReply if r.n_blocks == 1 => {
                    c.send(r, &[bytemuck::cast_slice(&ids)])?
                }
                FrameKind::StageReply => c.send(r, &[&out])?,
                FrameKind::StageBlock => c.send(r, &[&block])?,
                FrameKind::StageExpertTokensReply => c.send(r, &[&counts_bytes])?,
                _ => c.send(r, &[])?,
            },
            Err(e) => return refuse(&mut c, KvError::Remote(e.to_string())),
        }
        c.stream
            .tcp()
            .set_read_timeout(None)
            .map_err(io_err("configuring a stage socket", io))?;
    }
}

/// Sends the error to the client, then closes (returning the error for the server's log).
fn refuse(c: &mut Conn, e: KvError) -> Result<(), KvError> {
    let _ = c.send_json(FrameKind::Error, &WireError::from(&e));
    Err(e)
}
