//! The first stage's end of a stage link: [`StageClient`] sends requests and checks every reply's
//! length against what it asked for before reading it.

use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};

use tandem_engine::DeviceSampling;
use tandem_kv::wire::{FrameHeader, FrameKind};
use tandem_kv::{ClusterKey, ClusterTls, KvError};
use tandem_model::{ForwardBatch, LayerExpertTokens};

use super::{
    decode_expert_tokens, expert_tokens_len, io_err, Conn, StageHello, StageTimeouts,
    EXPERT_TOKENS_VERSION,
};

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
        Self::connect_tls(addr, hello, timeouts, key, None)
    }

    /// [`Self::connect`] under the cluster's mutual TLS when `tls` is given: the handshake (this
    /// process's certificate, the server's checked against the CA) comes before the hello.
    pub fn connect_tls(
        addr: impl ToSocketAddrs,
        hello: &StageHello,
        timeouts: StageTimeouts,
        key: Option<&ClusterKey>,
        tls: Option<&ClusterTls>,
    ) -> Result<StageClient, KvError> {
        let peer = addr
            .to_socket_addrs()
            .map_err(io_err("resolving a stage address", timeouts.connect))?
            .next()
            .ok_or_else(|| KvError::Protocol("stage address resolves to nothing".into()))?;
        let stream = TcpStream::connect_timeout(&peer, timeouts.connect)
            .map_err(io_err("connecting to a stage", timeouts.connect))?;
        let endpoint = peer.to_string();
        let mut conn = Conn::new(
            stream,
            timeouts.io,
            tls.map(|t| (t, Some(endpoint.as_str()))),
        )?;
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
            let _ = self.conn.stream.tcp().shutdown(Shutdown::Both);
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

    /// Whether the server answers [`Self::expert_tokens`] (its hello says a link version that has it).
    pub fn answers_expert_tokens(&self) -> bool {
        self.remote.version >= EXPERT_TOKENS_VERSION
    }

    /// Replaces `out` with the server's mixture-of-experts routing counts since load: its layers
    /// (whole-model indices) of `experts` experts each. A server whose version does not answer
    /// ([`Self::answers_expert_tokens`]) is not asked: the call fails without touching the link.
    pub fn expert_tokens(
        &mut self,
        experts: usize,
        out: &mut Vec<LayerExpertTokens>,
    ) -> Result<(), KvError> {
        if !self.answers_expert_tokens() {
            return Err(KvError::Protocol(format!(
                "stage at {} speaks link version {}, which has no expert token counts (version {EXPERT_TOKENS_VERSION} has)",
                self.peer, self.remote.version
            )));
        }
        let layers = self.local.layer_start..self.local.layer_end;
        self.guarded(|c, id, expect| {
            c.send(
                FrameHeader::control(FrameKind::StageExpertTokens, id, 0),
                &[],
            )?;
            let r = c.expect(FrameKind::StageExpertTokensReply)?;
            let most = expert_tokens_len(layers.len(), experts);
            if r.payload_len > most {
                expect.len("expert token counts", r.payload_len, most)?;
            }
            let mut buf = Vec::new();
            c.bytes_payload(r.payload_len, &mut buf)?;
            decode_expert_tokens(&buf, layers, experts, out)
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
