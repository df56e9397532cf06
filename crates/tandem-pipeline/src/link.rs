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
//! - `StageExpertTokens` (no payload) → `StageExpertTokensReply`: the stage's mixture-of-experts routing
//!   counts since load, for its layers (whole-model layer indices), in [`encode_expert_tokens`]'s
//!   binary layout. Only sent to a server whose hello says link version ≥ 1 ([`STAGE_LINK_VERSION`]):
//!   a server from before it would refuse the unknown frame and close the link, so the client asks
//!   only a peer that says it answers, and an older peer's counts are not reported (the backend warns
//!   once at connect).
//!
//! With a cluster secret ([`ClusterKey`]) the server answers the hello with `tandem_kv::auth`'s
//! challenge-response (`AuthChallenge` → `AuthProof` → `AuthProof`) before it sizes its pool or replies:
//! a client without the secret is refused, and a client with one refuses a server that does not ask.
//!
//! Every read and write is bounded by [`StageTimeouts`]; a closed or silent peer becomes a typed error,
//! never a hang. Every length is bounded before a buffer is sized from it: the server checks a request's
//! against its pool and the batch, the client a reply's against what it asked for
//! ([`KvError::ReplyLength`]). A client whose connection failed stays failed ([`StageClient`] docs say why).
//!
//! Modules by job: this file holds what both ends share (the handshake, deadlines, framing over a
//! socket), `client` the first stage's end ([`StageClient`]), `server` a stage server's
//! ([`StageServer`], answering through a [`StageHandler`]).

mod client;
mod server;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::ops::Range;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tandem_engine::{Activations, DeviceSampling};
use tandem_model::{ForwardBatch, LayerExpertTokens};

use tandem_kv::auth::{self, AuthChallenge, AuthProof};
use tandem_kv::tls::BlockingStream;
use tandem_kv::wire::{FrameHeader, FrameKind, WireError, HEADER_LEN, MAX_CONTROL_LEN};
use tandem_kv::{check_field, ClusterKey, ClusterTls, KvError};

pub use client::StageClient;
pub use server::{StageHandler, StageServer};

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
    /// The stage link version this end speaks ([`STAGE_LINK_VERSION`]; 0 from a peer built before the
    /// field): each end uses only the requests the other's version answers, so it is not compared.
    #[serde(default)]
    pub version: u32,
}

/// The stage link version this build speaks: 1 adds `StageExpertTokens` (a stage's expert counts).
pub const STAGE_LINK_VERSION: u32 = 1;

/// First stage link version whose servers answer `StageExpertTokens`.
pub const EXPERT_TOKENS_VERSION: u32 = 1;

/// Encodes a stage's expert counts as a `StageExpertTokensReply` payload: per layer, its whole-model
/// index (u32), its expert count E (u32), then E u64 counts, all little-endian; layers in order.
pub fn encode_expert_tokens(layers: &[LayerExpertTokens], out: &mut Vec<u8>) {
    out.clear();
    for l in layers {
        out.extend_from_slice(&(l.layer as u32).to_le_bytes());
        out.extend_from_slice(&(l.tokens.len() as u32).to_le_bytes());
        for n in &l.tokens {
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
}

/// Bytes of a `StageExpertTokensReply` for `moe_layers` layers of `experts` experts each: the most a
/// client reads before decoding.
pub fn expert_tokens_len(moe_layers: usize, experts: usize) -> u64 {
    moe_layers as u64 * (8 + 8 * experts as u64)
}

/// Decodes [`encode_expert_tokens`]' payload into `out`, refusing a layer outside `layers` (the
/// stage's), out of order or repeated, one of other than `experts` experts, or bytes left over.
pub fn decode_expert_tokens(
    bytes: &[u8],
    layers: Range<usize>,
    experts: usize,
    out: &mut Vec<LayerExpertTokens>,
) -> Result<(), KvError> {
    let bad = |why: String| KvError::Protocol(format!("expert token counts: {why}"));
    let short = || bad(format!("{} bytes cut short", bytes.len()));
    out.clear();
    let mut rest = bytes;
    let mut next = layers.start;
    while !rest.is_empty() {
        let (head, tail) = rest.split_at_checked(8).ok_or_else(short)?;
        let layer = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        let n = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
        if !(next..layers.end).contains(&layer) {
            return Err(bad(format!(
                "layer {layer} out of order or outside the stage's layers {layers:?}"
            )));
        }
        if n != experts {
            return Err(bad(format!(
                "layer {layer} has {n} experts, the model {experts}"
            )));
        }
        let (counts, tail) = tail.split_at_checked(8 * n).ok_or_else(short)?;
        out.push(LayerExpertTokens {
            layer,
            tokens: counts
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        });
        next = layer + 1;
        rest = tail;
    }
    Ok(())
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
    stream: BlockingStream,
    io: Duration,
    /// Reused receive buffer for control payloads and block bytes.
    buf: Vec<u8>,
}

impl Conn {
    /// A connection over `stream` with deadlines of `io`; with `tls` its handshake runs first (as the
    /// client of `peer`, or as the server when `peer` is `None`), bounded by the same deadlines.
    fn new(
        stream: TcpStream,
        io: Duration,
        tls: Option<(&ClusterTls, Option<&str>)>,
    ) -> Result<Conn, KvError> {
        let to = io_err("configuring a stage socket", io);
        stream.set_nodelay(true).map_err(to)?;
        stream
            .set_read_timeout(Some(io))
            .map_err(io_err("configuring a stage socket", io))?;
        stream
            .set_write_timeout(Some(io))
            .map_err(io_err("configuring a stage socket", io))?;
        let stream = match tls {
            None => BlockingStream::Plain(stream),
            Some((tls, Some(peer))) => tls
                .connect_blocking(peer, stream)
                .map_err(io_err("the stage link's TLS handshake", io))?,
            Some((tls, None)) => tls
                .accept_blocking(stream)
                .map_err(io_err("the stage link's TLS handshake", io))?,
        };
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
        // A no-op on a plain socket; over TLS it sends what rustls still buffers.
        self.stream
            .flush()
            .map_err(io_err("writing a stage frame", io))
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

#[cfg(test)]
mod tests;
