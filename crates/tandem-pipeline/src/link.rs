//! The pipeline stage link: a typed request/reply channel between the first pipeline stage (the client,
//! inside the worker's engine thread) and a stage server hosting later layers of the same model.
//!
//! It speaks the KV transfer crate's frame header ([`tandem_kv::wire`]) over a blocking TCP stream, since its caller (a
//! `Backend` on the engine thread) is synchronous. One connection carries, in order:
//!
//! - `StageHello(StageHello)` → `StageHelloReply(StageHello)`: the client states the model identity, the
//!   stage it expects (index, count, layer range), the hidden size and the KV pool shape (block size,
//!   number of blocks); the server compares them with its own and refuses a difference with an `Error`
//!   frame naming the field ([`KvError::Mismatch`]). A server whose KV pool is not sized yet adopts the
//!   client's block size and block count, within its own KV budget (a bigger pool is refused).
//! - `StageForward` → `StageReply`: the header's `transfer_id` is the request number (echoed in the reply),
//!   `layer` the length of the JSON [`ForwardBatch`] that starts the payload, and the rest of the payload
//!   the raw hidden states (tokens × hidden, little-endian, in the stages' [`Activations`] type: f32 on
//!   CPU, the bf16 residual stream on GPUs). The reply's payload is the next stage's hidden states, or
//!   f32 logits rows from the last stage. With `n_blocks` non-zero (only to a last
//!   stage whose hello says `samples`), the batch is followed by `n_blocks` bytes of JSON
//!   [`DeviceSampling`] rows, one per logits row, and the reply is the drawn token ids as little-endian
//!   u32: the logits never cross the link.
//! - `StageExport{layer, n_blocks, payload = block ids}` → `StageBlock` (the blocks' bytes back to back);
//!   `StageImport{layer, n_blocks, payload = block ids, then their bytes}` → `StageOk` (ids as
//!   little-endian u32: a request's blocks of one layer move in one round trip);
//!   `StageCopy{first_block = src, n_blocks = dst}` → `StageOk`. Layers are global model layers; the server
//!   refuses one it does not own.
//!
//! With a cluster secret ([`ClusterKey`]) the server answers the hello with `tandem_kv::auth`'s
//! challenge-response (`AuthChallenge` → `AuthProof` → `AuthProof`) before it sizes its pool or replies:
//! a client without the secret is refused, and a client with one refuses a server that does not ask.
//!
//! Every read and write is bounded by [`StageTimeouts`]; a closed or silent peer becomes a typed error,
//! never a hang. Every length is bounded before a buffer is sized from it: the server checks a request's
//! against its pool and the batch, the client a reply's against what it asked for
//! ([`KvError::ReplyLength`]). A client whose connection failed stays failed ([`StageClient`] docs say why).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tandem_engine::DeviceSampling;
use tandem_model::ForwardBatch;

use tandem_kv::auth::{self, AuthChallenge, AuthProof};
use tandem_kv::wire::{FrameHeader, FrameKind, WireError, HEADER_LEN, MAX_CONTROL_LEN};
use tandem_kv::{check_field, ClusterKey, KvError};

/// Element type of the hidden states crossing a link: what the stages' models keep their residual
/// stream in, so nothing is converted on the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// 32-bit floats (the CPU model).
    F32,
    /// bfloat16 (the CUDA model).
    Bf16,
}

impl Activations {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            Activations::F32 => 4,
            Activations::Bf16 => 2,
        }
    }
}

impl std::fmt::Display for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Activations::F32 => "f32",
            Activations::Bf16 => "bf16",
        })
    }
}

/// What both ends of a stage link must agree on before any activation or KV byte crosses it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageHello {
    /// The model identity hash: activations of another model's layers are garbage even when shapes agree.
    pub model_id: String,
    /// Index of the stage the server hosts.
    pub stage: usize,
    /// Pipeline stages in all.
    pub stages: usize,
    /// First global layer of the stage.
    pub layer_start: usize,
    /// One past the last global layer of the stage.
    pub layer_end: usize,
    /// Width of one hidden-state row.
    pub hidden_size: usize,
    /// Width of one logits row: a last stage's forward reply is this many f32 per logits row, which the
    /// client checks before reading it.
    #[serde(default)]
    pub vocab_size: usize,
    /// Element type of the hidden states (a CPU stage and a GPU stage do not mix).
    pub activations: Activations,
    /// Tokens per KV block (the engine's block pool is shared by all stages).
    pub block_size: usize,
    /// Blocks in the KV pool; block ids travel in the batch, so every stage needs the same pool.
    pub num_blocks: usize,
    /// The server draws tokens on its device (a last stage on a GPU); informational, not compared.
    #[serde(default)]
    pub samples: bool,
}

impl StageHello {
    /// Refuses a peer that would compute something else, naming the first differing field.
    pub fn check_compatible(&self, remote: &StageHello) -> Result<(), KvError> {
        let (l, r) = (self, remote);
        check_field("model_id", &l.model_id, &r.model_id)?;
        check_field("stages", &l.stages, &r.stages)?;
        check_field("stage", &l.stage, &r.stage)?;
        check_field("layer_start", &l.layer_start, &r.layer_start)?;
        check_field("layer_end", &l.layer_end, &r.layer_end)?;
        check_field("hidden_size", &l.hidden_size, &r.hidden_size)?;
        check_field("vocab_size", &l.vocab_size, &r.vocab_size)?;
        check_field("activations", &l.activations, &r.activations)?;
        check_field("block_size", &l.block_size, &r.block_size)?;
        check_field("num_blocks", &l.num_blocks, &r.num_blocks)
    }

    /// Refuses a forward whose hidden states are not `tokens` rows of this stage's width, or whose
    /// batch has more tokens than the KV pool has slots: the server sizes its receive buffer from the
    /// frame, so an unchecked length from the wire would be an allocation of any size.
    pub fn check_hidden(&self, tokens: usize, hidden_len: u64) -> Result<(), KvError> {
        let want = tokens as u64 * self.hidden_size as u64 * self.activations.bytes() as u64;
        if tokens > self.num_blocks.saturating_mul(self.block_size) || hidden_len != want {
            return Err(KvError::Protocol(format!(
                "{hidden_len} bytes of hidden states for {tokens} tokens (want {want}; the pool holds {} tokens)",
                self.num_blocks.saturating_mul(self.block_size)
            )));
        }
        Ok(())
    }

    /// Whether this is the pipeline's last stage (its forward reply is logits rows, not hidden states).
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// Bytes of this stage's reply to a forward of `batch`: the next stage's hidden states (tokens ×
    /// hidden × element size), or from the last stage f32 logits rows (logits rows × vocab × 4). Computed
    /// in u128 so no batch overflows it; a length beyond u64 is no reply any server could send.
    pub fn forward_reply_len(&self, batch: &ForwardBatch) -> u64 {
        let n = if self.is_last() {
            batch.logits_rows() as u128 * self.vocab_size as u128 * 4
        } else {
            batch.tokens.len() as u128 * self.hidden_size as u128 * self.activations.bytes() as u128
        };
        u64::try_from(n).unwrap_or(u64::MAX)
    }
}

/// Deadlines of a stage link: how long connecting, and each read or write, may take.
#[derive(Clone, Copy, Debug)]
pub struct StageTimeouts {
    /// TCP connect.
    pub connect: Duration,
    /// Each frame read or write; a forward of a long prefill chunk must finish within it.
    pub io: Duration,
}

impl Default for StageTimeouts {
    fn default() -> Self {
        StageTimeouts {
            connect: Duration::from_secs(5),
            io: Duration::from_secs(60),
        }
    }
}

fn io_err(context: &'static str, timeout: Duration) -> impl FnOnce(std::io::Error) -> KvError {
    move |source| match source.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => KvError::Timeout {
            context,
            after: timeout,
        },
        _ => KvError::Io { context, source },
    }
}

/// One end of a stage connection: header + payload framing over a blocking socket with deadlines.
struct Conn {
    stream: TcpStream,
    io: Duration,
    /// Reused receive buffer for control payloads and block bytes.
    buf: Vec<u8>,
}

impl Conn {
    fn new(stream: TcpStream, io: Duration) -> Result<Conn, KvError> {
        let to = io_err("configuring a stage socket", io);
        stream.set_nodelay(true).map_err(to)?;
        stream
            .set_read_timeout(Some(io))
            .map_err(io_err("configuring a stage socket", io))?;
        stream
            .set_write_timeout(Some(io))
            .map_err(io_err("configuring a stage socket", io))?;
        Ok(Conn {
            stream,
            io,
            buf: Vec::new(),
        })
    }

    fn send(&mut self, h: FrameHeader, parts: &[&[u8]]) -> Result<(), KvError> {
        let mut h = h;
        h.payload_len = parts.iter().map(|p| p.len() as u64).sum();
        let io = self.io;
        self.stream
            .write_all(&h.encode())
            .map_err(io_err("writing a stage frame", io))?;
        for p in parts {
            self.stream
                .write_all(p)
                .map_err(io_err("writing a stage frame", io))?;
        }
        Ok(())
    }

    fn send_json<T: Serialize>(&mut self, kind: FrameKind, body: &T) -> Result<(), KvError> {
        let bytes = serde_json::to_vec(body)
            .map_err(|e| KvError::Protocol(format!("encode {kind:?}: {e}")))?;
        self.send(FrameHeader::control(kind, 0, 0), &[&bytes])
    }

    /// Reads the next header; `Ok(None)` on a clean end of stream between frames.
    fn header(&mut self) -> Result<Option<FrameHeader>, KvError> {
        let mut b = [0u8; HEADER_LEN];
        let io = self.io;
        let first = self
            .stream
            .read(&mut b)
            .map_err(io_err("waiting for a stage frame", io))?;
        if first == 0 {
            return Ok(None);
        }
        self.stream
            .read_exact(&mut b[first..])
            .map_err(io_err("reading a stage frame header", io))?;
        FrameHeader::decode(&b).map(Some)
    }

    /// Reads the next header, failing on end of stream and turning an `Error` frame into its error.
    fn next(&mut self) -> Result<FrameHeader, KvError> {
        let h = self
            .header()?
            .ok_or_else(|| KvError::Protocol("stage peer closed the connection".into()))?;
        if h.kind == FrameKind::Error {
            let w: WireError = self.json(&h)?;
            return Err(w.into());
        }
        Ok(h)
    }

    /// Reads the next header, which must be a `kind` frame.
    fn expect(&mut self, kind: FrameKind) -> Result<FrameHeader, KvError> {
        let h = self.next()?;
        if h.kind != kind {
            return Err(KvError::Protocol(format!(
                "expected {kind:?}, got {:?}",
                h.kind
            )));
        }
        Ok(h)
    }

    /// Client side of the challenge after the hello: answers it when the server sends one (with `key`
    /// set it must) and returns the header of the server's hello reply.
    fn answer_challenge(&mut self, key: Option<&ClusterKey>) -> Result<FrameHeader, KvError> {
        let first = self.next()?;
        match (first.kind == FrameKind::AuthChallenge, key) {
            (false, None) => Ok(first),
            (false, Some(_)) => Err(auth::unchallenged()),
            (true, None) => Err(auth::missing_token()),
            (true, Some(key)) => {
                let challenge: AuthChallenge = self.json(&first)?;
                let own = auth::nonce();
                let proof = AuthProof {
                    mac: key.prove(auth::CLIENT_LABEL, &challenge.nonce, &own),
                    nonce: own.clone(),
                };
                self.send_json(FrameKind::AuthProof, &proof)?;
                let h = self.expect(FrameKind::AuthProof)?;
                let back: AuthProof = self.json(&h)?;
                auth::check_server(key, &own, &challenge.nonce, &back)?;
                self.next()
            }
        }
    }

    /// Server side of the challenge: a client without `key` fails here.
    fn challenge(&mut self, key: &ClusterKey) -> Result<(), KvError> {
        let nonce = auth::nonce();
        self.send_json(
            FrameKind::AuthChallenge,
            &AuthChallenge {
                nonce: nonce.clone(),
            },
        )?;
        let h = self.expect(FrameKind::AuthProof)?;
        let proof: AuthProof = self.json(&h)?;
        let back = auth::check_client(key, &nonce, &proof)?;
        self.send_json(FrameKind::AuthProof, &back)
    }

    /// Reads `len` payload bytes into `out`.
    fn read_into(&mut self, out: &mut [u8]) -> Result<(), KvError> {
        let io = self.io;
        self.stream
            .read_exact(out)
            .map_err(io_err("reading a stage payload", io))
    }

    /// Reads the whole payload into the reusable buffer.
    fn payload(&mut self, h: &FrameHeader) -> Result<(), KvError> {
        let len = usize::try_from(h.payload_len)
            .map_err(|_| KvError::Protocol("payload too large".into()))?;
        let mut buf = std::mem::take(&mut self.buf);
        buf.resize(len, 0);
        let r = self.read_into(&mut buf);
        self.buf = buf;
        r
    }

    fn json<T: serde::de::DeserializeOwned>(&mut self, h: &FrameHeader) -> Result<T, KvError> {
        if h.payload_len > MAX_CONTROL_LEN {
            return Err(KvError::Protocol(format!(
                "{:?} frame of {} bytes exceeds the control limit",
                h.kind, h.payload_len
            )));
        }
        self.payload(h)?;
        serde_json::from_slice(&self.buf)
            .map_err(|e| KvError::Protocol(format!("decode {:?}: {e}", h.kind)))
    }

    /// Sends request `id` (a batch, its sampling rows if any, its hidden states) and waits for the
    /// header of its reply; returns the reply's payload length.
    fn request(
        &mut self,
        id: u64,
        batch: &ForwardBatch,
        rows: Option<&[DeviceSampling]>,
        hidden: &[u8],
    ) -> Result<u64, KvError> {
        let meta = serde_json::to_vec(batch)
            .map_err(|e| KvError::Protocol(format!("encode batch: {e}")))?;
        let rows = match rows {
            Some(r) => serde_json::to_vec(r)
                .map_err(|e| KvError::Protocol(format!("encode sampling rows: {e}")))?,
            None => Vec::new(),
        };
        let mut h = FrameHeader::control(FrameKind::StageForward, id, 0);
        h.layer = meta.len() as u32;
        h.n_blocks = rows.len() as u32;
        self.send(h, &[&meta, &rows, hidden])?;
        let r = self.expect(FrameKind::StageReply)?;
        if r.transfer_id != id {
            return Err(KvError::Protocol(format!(
                "reply {} to request {id}",
                r.transfer_id
            )));
        }
        Ok(r.payload_len)
    }

    /// Reads `len` bytes of JSON control payload as a `T`.
    fn json_part<T: serde::de::DeserializeOwned>(
        &mut self,
        len: u64,
        what: &str,
    ) -> Result<T, KvError> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.resize(len as usize, 0);
        let r = self.read_into(&mut buf);
        self.buf = buf;
        r?;
        serde_json::from_slice(&self.buf)
            .map_err(|e| KvError::Protocol(format!("decode {what}: {e}")))
    }

    /// Reads a raw payload of `len` bytes into `out` (resized to fit).
    fn bytes_payload(&mut self, len: u64, out: &mut Vec<u8>) -> Result<(), KvError> {
        let len =
            usize::try_from(len).map_err(|_| KvError::Protocol("payload too large".into()))?;
        out.resize(len, 0);
        self.read_into(out)
    }
}

/// The first stage's end of a link to one stage server.
///
/// A failed operation (timeout, disconnect, protocol error) poisons the client: the server may have lost
/// its KV with its process, so silently reconnecting could read garbage blocks. The owner reports the
/// failure and the worker is restarted (or replaced) as a whole.
pub struct StageClient {
    conn: Conn,
    next_id: u64,
    peer: SocketAddr,
    failed: Option<String>,
    /// The hello this client sent: what it asked for, so it knows every reply's length before reading it.
    local: StageHello,
    /// The server's hello reply.
    remote: StageHello,
}

impl StageClient {
    /// Connects to `addr` and handshakes with `hello` (the stage this client expects), proving `key`
    /// when set.
    pub fn connect(
        addr: impl ToSocketAddrs,
        hello: &StageHello,
        timeouts: StageTimeouts,
        key: Option<&ClusterKey>,
    ) -> Result<StageClient, KvError> {
        let peer = addr
            .to_socket_addrs()
            .map_err(io_err("resolving a stage address", timeouts.connect))?
            .next()
            .ok_or_else(|| KvError::Protocol("stage address resolves to nothing".into()))?;
        let stream = TcpStream::connect_timeout(&peer, timeouts.connect)
            .map_err(io_err("connecting to a stage", timeouts.connect))?;
        let mut conn = Conn::new(stream, timeouts.io)?;
        conn.send_json(FrameKind::StageHello, hello)?;
        let h = conn.answer_challenge(key)?;
        if h.kind != FrameKind::StageHelloReply {
            return Err(KvError::Protocol(format!(
                "expected StageHelloReply, got {:?}",
                h.kind
            )));
        }
        let remote: StageHello = conn.json(&h)?;
        hello.check_compatible(&remote)?;
        Ok(StageClient {
            conn,
            next_id: 1,
            peer,
            failed: None,
            local: hello.clone(),
            remote,
        })
    }

    /// What the server said of itself at the handshake.
    pub fn remote(&self) -> &StageHello {
        &self.remote
    }

    /// The server's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    fn guarded<T>(
        &mut self,
        f: impl FnOnce(&mut Conn, u64, &Expect) -> Result<T, KvError>,
    ) -> Result<T, KvError> {
        if let Some(why) = &self.failed {
            return Err(KvError::Remote(format!(
                "stage link to {} failed earlier: {why}",
                self.peer
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        let expect = Expect {
            peer: self.peer,
            hello: &self.local,
        };
        let r = f(&mut self.conn, id, &expect);
        if let Err(e) = &r {
            self.failed = Some(e.to_string());
            let _ = self.conn.stream.shutdown(Shutdown::Both);
        }
        r
    }

    /// Sends `batch` with its hidden states `buf` (tokens × hidden) and replaces `buf` with the reply:
    /// the next stage's hidden states, or the batch's f32 logits rows from the last stage.
    pub fn forward(&mut self, batch: &ForwardBatch, buf: &mut Vec<u8>) -> Result<(), KvError> {
        self.guarded(|c, id, expect| {
            let len = c.request(id, batch, None, buf)?;
            expect.len("forward reply", len, expect.hello.forward_reply_len(batch))?;
            c.bytes_payload(len, buf)
        })
    }

    /// Sends `batch` with its hidden states `buf` to a last stage that draws tokens on its device
    /// (`remote().samples`), one per logits row under `rows`; `ids` gets the drawn tokens.
    pub fn forward_sampled(
        &mut self,
        batch: &ForwardBatch,
        rows: &[DeviceSampling],
        buf: &[u8],
        ids: &mut Vec<u32>,
    ) -> Result<(), KvError> {
        self.guarded(|c, id, expect| {
            let len = c.request(id, batch, Some(rows), buf)?;
            // One drawn token id (u32) per sampling row.
            expect.len("sampled reply", len, rows.len() as u64 * 4)?;
            ids.resize(rows.len(), 0);
            c.read_into(bytemuck::cast_slice_mut(ids))
        })
    }

    /// Copies one (global layer, block) of the stage's KV into `out` (exactly one block's bytes).
    pub fn export_block(
        &mut self,
        layer: usize,
        block: u32,
        out: &mut [u8],
    ) -> Result<(), KvError> {
        self.export_blocks(layer, &[block], out)
    }

    /// Copies `blocks` of one global layer of the stage's KV into `out` (their bytes back to back).
    pub fn export_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<(), KvError> {
        self.guarded(|c, id, expect| {
            let mut h = FrameHeader::control(FrameKind::StageExport, id, 0);
            h.layer = layer as u32;
            h.n_blocks = blocks.len() as u32;
            c.send(h, &[bytemuck::cast_slice(blocks)])?;
            let r = c.expect(FrameKind::StageBlock)?;
            expect.len("block export", r.payload_len, out.len() as u64)?;
            c.read_into(out)
        })
    }

    /// Overwrites one (global layer, block) of the stage's KV.
    pub fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), KvError> {
        self.import_blocks(layer, &[block], data)
    }

    /// Overwrites `blocks` of one global layer of the stage's KV with `data` (their bytes back to back).
    pub fn import_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        data: &[u8],
    ) -> Result<(), KvError> {
        self.guarded(|c, id, _| {
            let mut h = FrameHeader::control(FrameKind::StageImport, id, 0);
            h.layer = layer as u32;
            h.n_blocks = blocks.len() as u32;
            c.send(h, &[bytemuck::cast_slice(blocks), data])?;
            c.expect(FrameKind::StageOk).map(|_| ())
        })
    }

    /// Copies block `src` to `dst` in every layer of the stage.
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), KvError> {
        self.guarded(|c, id, _| {
            let mut h = FrameHeader::control(FrameKind::StageCopy, id, 0);
            h.first_block = src;
            h.n_blocks = dst;
            c.send(h, &[])?;
            c.expect(FrameKind::StageOk).map(|_| ())
        })
    }
}

/// What a client's request implies about its reply, for [`StageClient::guarded`]'s operations.
struct Expect<'a> {
    peer: SocketAddr,
    hello: &'a StageHello,
}

impl Expect<'_> {
    /// Refuses a reply whose header states `stated` bytes where the request implies `expected`, before
    /// any buffer is sized from it: even an authenticated server could otherwise ask for any allocation.
    fn len(&self, what: &'static str, stated: u64, expected: u64) -> Result<(), KvError> {
        if stated != expected {
            return Err(KvError::ReplyLength {
                peer: self.peer,
                what,
                stated,
                expected,
            });
        }
        Ok(())
    }
}

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
    /// Runs the stage's layers on one batch: `hidden_in` from the previous stage, `out` for the next
    /// (or f32 logits rows from the last stage).
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        hidden_in: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), Self::Error>;
    /// Runs the last stage's layers and draws one token per logits row under `rows` into `out`.
    fn forward_sampled(
        &mut self,
        batch: &ForwardBatch,
        hidden_in: &[u8],
        rows: &[DeviceSampling],
        out: &mut Vec<u32>,
    ) -> Result<(), Self::Error>;
    /// Bytes of one block of the KV layout.
    fn block_bytes(&self) -> usize;
    /// Copies `blocks` of one global layer out, back to back.
    fn export_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<(), Self::Error>;
    /// Overwrites `blocks` of one global layer from `data` (their bytes back to back).
    fn import_blocks(
        &mut self,
        layer: usize,
        blocks: &[u32],
        data: &[u8],
    ) -> Result<(), Self::Error>;
    /// Copies a block across the stage's layers.
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), Self::Error>;
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
        let addr = listener
            .local_addr()
            .map_err(io_err("reading the stage listener address", io))?;
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(Mutex::new(None));
        let (s, c) = (stop.clone(), current.clone());
        let thread = std::thread::Builder::new()
            .name(format!("stage-{addr}"))
            .spawn(move || accept_loop(listener, handler, io, key, s, c))
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
        match serve_conn(stream, &mut handler, io, key.as_ref()) {
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
) -> Result<(), KvError> {
    let mut c = Conn::new(stream, io)?;
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
        .set_read_timeout(None)
        .map_err(io_err("configuring a stage socket", io))?;
    let mut hidden: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    let mut ids: Vec<u32> = Vec::new();
    let mut block: Vec<u8> = Vec::new();
    let mut block_ids: Vec<u32> = Vec::new();
    loop {
        let Some(h) = c.header()? else { return Ok(()) };
        c.stream
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
                match rows {
                    None => handler.forward(&batch, &hidden, &mut out).map(|()| reply),
                    Some(rows) => {
                        // Marks the reply as token ids (n_blocks is unused on a reply otherwise).
                        reply.n_blocks = 1;
                        handler
                            .forward_sampled(&batch, &hidden, &rows, &mut ids)
                            .map(|()| reply)
                    }
                }
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
                let layer = h.layer as usize;
                if h.kind == FrameKind::StageExport {
                    block.resize(n as usize * handler.block_bytes(), 0);
                    handler
                        .export_blocks(layer, &block_ids, &mut block)
                        .map(|()| FrameHeader::control(FrameKind::StageBlock, h.transfer_id, 0))
                } else {
                    block.resize(data as usize, 0);
                    c.read_into(&mut block)?;
                    handler
                        .import_blocks(layer, &block_ids, &block)
                        .map(|()| FrameHeader::control(FrameKind::StageOk, h.transfer_id, 0))
                }
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
                _ => c.send(r, &[])?,
            },
            Err(e) => return refuse(&mut c, KvError::Remote(e.to_string())),
        }
        c.stream
            .set_read_timeout(None)
            .map_err(io_err("configuring a stage socket", io))?;
    }
}

/// Sends the error to the client, then closes (returning the error for the server's log).
fn refuse(c: &mut Conn, e: KvError) -> Result<(), KvError> {
    let _ = c.send_json(FrameKind::Error, &WireError::from(&e));
    Err(e)
}

#[cfg(test)]
mod tests;
