//! Frame encoding shared by the socket transports (format documented in the crate docs); public because the
//! pipeline crate's stage link speaks the same header with the `Stage*` frame kinds.

use std::io::IoSlice;
use std::time::Duration;

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::auth::{self, AuthChallenge, AuthProof};
use crate::error::timed;
use crate::{ClusterKey, KvError, PeerInfo, PullSelection};

/// `b"TNKV"` read as a little-endian u32: lets a reader reject a stray connection on the first 4 bytes.
pub const MAGIC: u32 = u32::from_le_bytes(*b"TNKV");
/// Wire format version; bumped on any incompatible change and refused on mismatch.
///
/// Version 2: `Pull` and `ShmPull` name the blocks they want (a [`crate::BlockSelection`]). Version 3: per layer
/// (a [`PullSelection`]), so a sliding-window layer's blocks behind its window are not sent.
pub const VERSION: u16 = 3;
/// Size of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 40;
/// Upper bound on a JSON control payload, so a corrupt length cannot make a reader allocate gigabytes.
pub const MAX_CONTROL_LEN: u64 = 1 << 20;
/// Header flag: the `checksum` field holds the CRC32 of the payload.
pub const FLAG_CHECKSUM: u8 = 1;

/// What a frame carries; the discriminant is the byte at header offset 6.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Client → server: JSON [`PeerInfo`], first frame on every connection.
    Hello = 1,
    /// Server → client: the server's JSON [`PeerInfo`]; the client checks it too.
    HelloReply = 2,
    /// Client → server: JSON [`PullRequest`] for the header's transfer id.
    Pull = 3,
    /// Server → client: raw bytes of `n_blocks` consecutive blocks of one layer.
    Data = 4,
    /// Server → client: every layer requested on this connection has been sent.
    PullDone = 5,
    /// Client → server: all KV landed; release the pin.
    Ack = 6,
    /// Server → client: the pin is released.
    AckOk = 7,
    /// Client → server: the pull failed; release the pin now.
    Abort = 8,
    /// Either way: JSON [`WireError`], then the sender closes.
    Error = 9,
    /// Client → server: JSON [`ShmPullRequest`]: send these blocks through a shared-memory file.
    ShmPull = 10,
    /// Server → client: JSON [`ShmOpen`] naming the file.
    ShmOpen = 11,
    /// Server → client: one layer is complete in the file (no payload).
    ShmLayer = 12,
    /// Stage link, first stage → stage server: JSON `StageHello` (`tandem_pipeline::link`).
    StageHello = 13,
    /// Stage link, server → first stage: the server's JSON `StageHello` (`tandem_pipeline::link`).
    StageHelloReply = 14,
    /// Stage link: JSON batch metadata (`layer` bytes) then raw f32 hidden states.
    StageForward = 15,
    /// Stage link: raw f32 hidden states or logits answering a `StageForward`.
    StageReply = 16,
    /// Stage link: send (`layer`, block `first_block`) of the stage's KV.
    StageExport = 17,
    /// Stage link: one block's raw bytes answering a `StageExport`.
    StageBlock = 18,
    /// Stage link: overwrite (`layer`, block `first_block`) with the payload.
    StageImport = 19,
    /// Stage link: copy block `first_block` to block `n_blocks` in every layer of the stage.
    StageCopy = 20,
    /// Stage link: the import or copy is done.
    StageOk = 21,
    /// Client → server: JSON `NixlPullRequest`: export these blocks into registered memory for a NIXL READ.
    NixlPull = 22,
    /// Server → client: JSON `NixlOpen`: the server's NIXL agent and each layer's registered region.
    NixlOpen = 23,
    /// Server → client: one layer is ready to READ (no payload).
    NixlLayer = 24,
    /// Server → client, after a `Hello` or `StageHello` when a cluster secret is set: JSON
    /// [`crate::auth::AuthChallenge`].
    AuthChallenge = 25,
    /// Either way: JSON [`crate::auth::AuthProof`], the client's answer and then the server's.
    AuthProof = 26,
    /// Stage link, first stage → stage server (link version ≥ 1): send your mixture-of-experts routing
    /// counts (no payload).
    StageExpertTokens = 27,
    /// Stage link: the stage's per-layer expert token counts answering a `StageExpertTokens`
    /// (`tandem_pipeline::link::encode_expert_tokens`).
    StageExpertTokensReply = 28,
}

impl FrameKind {
    fn from_u8(v: u8) -> Result<Self, KvError> {
        use FrameKind::*;
        Ok(match v {
            1 => Hello,
            2 => HelloReply,
            3 => Pull,
            4 => Data,
            5 => PullDone,
            6 => Ack,
            7 => AckOk,
            8 => Abort,
            9 => Error,
            10 => ShmPull,
            11 => ShmOpen,
            12 => ShmLayer,
            13 => StageHello,
            14 => StageHelloReply,
            15 => StageForward,
            16 => StageReply,
            17 => StageExport,
            18 => StageBlock,
            19 => StageImport,
            20 => StageCopy,
            21 => StageOk,
            22 => NixlPull,
            23 => NixlOpen,
            24 => NixlLayer,
            25 => AuthChallenge,
            26 => AuthProof,
            27 => StageExpertTokens,
            28 => StageExpertTokensReply,
            _ => return Err(KvError::Protocol(format!("unknown frame kind {v}"))),
        })
    }
}

/// The fixed 40-byte header in front of every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Bit set of `FLAG_*`.
    pub flags: u8,
    /// The transfer the frame belongs to (0 for handshake frames).
    pub transfer_id: u64,
    /// Layer of a `Data` / `ShmLayer` frame.
    pub layer: u32,
    /// Index (into the transfer's block list) of the first block carried.
    pub first_block: u32,
    /// Number of consecutive blocks carried.
    pub n_blocks: u32,
    /// CRC32 of the payload when `FLAG_CHECKSUM` is set.
    pub checksum: u32,
    /// Bytes following the header.
    pub payload_len: u64,
}

impl FrameHeader {
    /// A header with only kind, transfer and payload length set: the shape of every control frame.
    pub fn control(kind: FrameKind, transfer_id: u64, payload_len: usize) -> Self {
        FrameHeader {
            kind,
            flags: 0,
            transfer_id,
            layer: 0,
            first_block: 0,
            n_blocks: 0,
            checksum: 0,
            payload_len: payload_len as u64,
        }
    }

    /// Serializes to the little-endian wire layout.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6] = self.kind as u8;
        b[7] = self.flags;
        b[8..16].copy_from_slice(&self.transfer_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.layer.to_le_bytes());
        b[20..24].copy_from_slice(&self.first_block.to_le_bytes());
        b[24..28].copy_from_slice(&self.n_blocks.to_le_bytes());
        b[28..32].copy_from_slice(&self.checksum.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parses and validates magic and version.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, KvError> {
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(KvError::Protocol(format!("bad magic {magic:#010x}")));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(KvError::Mismatch {
                field: "wire_version",
                local: VERSION.to_string(),
                remote: version.to_string(),
            });
        }
        Ok(FrameHeader {
            kind: FrameKind::from_u8(b[6])?,
            flags: b[7],
            transfer_id: u64_at(8),
            layer: u32_at(16),
            first_block: u32_at(20),
            n_blocks: u32_at(24),
            checksum: u32_at(28),
            payload_len: u64_at(32),
        })
    }
}

/// Body of a `Pull` frame: which layers (and blocks of each) this connection should carry.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PullRequest {
    /// Layers to send on this connection, in order.
    pub layers: Vec<u32>,
    /// Blocks to send of each layer, as indices into the transfer's block list; sent run by run, in order.
    pub selection: PullSelection,
    /// Whether this connection will carry the `Ack`/`Abort`; its loss before an ack releases the pin.
    pub control: bool,
    /// Ask the server to CRC32 each data payload.
    pub checksum: bool,
}

/// Body of a `ShmPull` frame.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShmPullRequest {
    /// Blocks to copy into the file of each layer (some non-empty), as indices into the transfer's block list.
    pub selection: PullSelection,
}

/// Body of a `ShmOpen` frame.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShmOpen {
    /// Absolute path of the shared-memory file.
    pub path: String,
    /// Length of the whole file, which is reused across transfers and may exceed this one.
    pub map_len: u64,
    /// Bytes this transfer uses: every layer's selected blocks, packed layer after layer in ascending
    /// index order ([`PullSelection::packed_layers`]).
    pub total_len: u64,
}

/// Body of an `Error` frame, structured so a handshake mismatch or unknown transfer stays typed across the wire.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireError {
    /// Human-readable description.
    pub message: String,
    /// Set when the error is an unknown/released transfer.
    pub unknown_transfer: Option<u64>,
}

impl From<&KvError> for WireError {
    fn from(e: &KvError) -> Self {
        let unknown_transfer = match e {
            KvError::UnknownTransfer(t) => Some(*t),
            _ => None,
        };
        WireError {
            message: e.to_string(),
            unknown_transfer,
        }
    }
}

impl From<WireError> for KvError {
    fn from(w: WireError) -> Self {
        match w.unknown_transfer {
            Some(t) => KvError::UnknownTransfer(t),
            None => KvError::Remote(w.message),
        }
    }
}

/// Writes header and payload with vectored writes, so a multi-megabyte payload is never copied
/// next to its header.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &FrameHeader,
    payload: &[u8],
) -> std::io::Result<()> {
    let hdr = header.encode();
    let (mut h, mut p): (&[u8], &[u8]) = (&hdr, payload);
    while !h.is_empty() {
        let n = w
            .write_vectored(&[IoSlice::new(h), IoSlice::new(p)])
            .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let from_h = n.min(h.len());
        h = &h[from_h..];
        p = &p[n - from_h..];
    }
    w.write_all(p).await?;
    // A no-op on a plain socket; over TLS it pushes out the last record rustls still holds.
    w.flush().await
}

/// Writes a control frame with a JSON body, bounded by `io`.
pub async fn send_json<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    kind: FrameKind,
    transfer_id: u64,
    body: &T,
    io: Duration,
) -> Result<(), KvError> {
    let bytes =
        serde_json::to_vec(body).map_err(|e| KvError::Protocol(format!("encode {kind:?}: {e}")))?;
    send(
        w,
        FrameHeader::control(kind, transfer_id, bytes.len()),
        &bytes,
        io,
    )
    .await
}

/// Writes one frame, bounded by `io`.
pub async fn send<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: FrameHeader,
    payload: &[u8],
    io: Duration,
) -> Result<(), KvError> {
    timed(io, "writing a frame", async {
        write_frame(w, &header, payload)
            .await
            .map_err(KvError::io("writing a frame"))
    })
    .await
}

/// Reads frames into a reusable, grow-only buffer, so a pull allocates once per connection rather than per block.
pub struct FrameReader<R> {
    inner: R,
    buf: Vec<u8>,
    io: Duration,
}

impl<R: tokio::io::AsyncRead + Unpin> FrameReader<R> {
    /// Wraps a stream; every read waits at most `io`.
    pub fn new(inner: R, io: Duration) -> Self {
        FrameReader {
            inner,
            buf: Vec::new(),
            io,
        }
    }

    /// The stream, for writing replies on the same connection.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Reads the next header; `Ok(None)` on a clean end of stream between frames.
    pub async fn header(&mut self) -> Result<Option<FrameHeader>, KvError> {
        let mut b = [0u8; HEADER_LEN];
        let inner = &mut self.inner;
        let n = timed(self.io, "waiting for a frame", async {
            let first = inner
                .read(&mut b)
                .await
                .map_err(KvError::io("reading a frame header"))?;
            if first == 0 {
                return Ok(0);
            }
            inner
                .read_exact(&mut b[first..])
                .await
                .map_err(KvError::io("reading a frame header"))?;
            Ok(HEADER_LEN)
        })
        .await?;
        if n == 0 {
            return Ok(None);
        }
        FrameHeader::decode(&b).map(Some)
    }

    /// Reads the header's payload into the reusable buffer, checking its CRC when flagged.
    pub async fn payload(&mut self, h: &FrameHeader) -> Result<&[u8], KvError> {
        let len = usize::try_from(h.payload_len)
            .map_err(|_| KvError::Protocol("payload too large".into()))?;
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        let (inner, buf) = (&mut self.inner, &mut self.buf[..len]);
        timed(self.io, "reading a frame payload", async {
            inner
                .read_exact(buf)
                .await
                .map_err(KvError::io("reading a frame payload"))
                .map(|_| ())
        })
        .await?;
        let buf = &self.buf[..len];
        if h.flags & FLAG_CHECKSUM != 0 && crc32fast::hash(buf) != h.checksum {
            return Err(KvError::Checksum {
                transfer_id: h.transfer_id,
                layer: h.layer,
            });
        }
        Ok(buf)
    }

    /// Reads a JSON control payload of at most [`MAX_CONTROL_LEN`] bytes.
    pub async fn json<T: DeserializeOwned>(&mut self, h: &FrameHeader) -> Result<T, KvError> {
        if h.payload_len > MAX_CONTROL_LEN {
            return Err(KvError::Protocol(format!(
                "{:?} frame of {} bytes exceeds the control limit",
                h.kind, h.payload_len
            )));
        }
        let kind = h.kind;
        let bytes = self.payload(h).await?;
        serde_json::from_slice(bytes)
            .map_err(|e| KvError::Protocol(format!("decode {kind:?}: {e}")))
    }

    /// Reads the next frame header, failing on end of stream and turning an `Error` frame into its error.
    pub async fn expect_frame(&mut self) -> Result<FrameHeader, KvError> {
        let h = self
            .header()
            .await?
            .ok_or_else(|| KvError::Protocol("peer closed the connection".into()))?;
        if h.kind == FrameKind::Error {
            let w: WireError = self.json(&h).await?;
            return Err(w.into());
        }
        Ok(h)
    }

    /// Reads the next frame, which must be a `kind` frame, and decodes its JSON payload: the reply a
    /// client waits for after a request.
    pub async fn expect_json<T: DeserializeOwned>(
        &mut self,
        kind: FrameKind,
    ) -> Result<T, KvError> {
        let h = self.expect_frame().await?;
        if h.kind != kind {
            return Err(KvError::Protocol(format!(
                "expected {kind:?}, got {:?}",
                h.kind
            )));
        }
        self.json(&h).await
    }
}

/// Client half of the handshake: sends our info, answers the server's challenge when it sends one
/// (see [`crate::auth`]; with `key` set it must), reads the server's info and checks it field by field.
pub async fn client_handshake<S>(
    r: &mut FrameReader<S>,
    local: &PeerInfo,
    key: Option<&ClusterKey>,
    io: Duration,
) -> Result<(), KvError>
where
    S: tokio::io::AsyncRead + AsyncWrite + Unpin,
{
    send_json(r.get_mut(), FrameKind::Hello, 0, local, io).await?;
    let first = r.expect_frame().await?;
    let reply = match (first.kind == FrameKind::AuthChallenge, key) {
        (false, None) => first,
        (false, Some(_)) => return Err(auth::unchallenged()),
        (true, None) => return Err(auth::missing_token()),
        (true, Some(key)) => {
            let challenge: AuthChallenge = r.json(&first).await?;
            let own = auth::nonce();
            let proof = AuthProof {
                mac: key.prove(auth::CLIENT_LABEL, &challenge.nonce, &own),
                nonce: own.clone(),
            };
            send_json(r.get_mut(), FrameKind::AuthProof, 0, &proof, io).await?;
            let back: AuthProof = r.expect_json(FrameKind::AuthProof).await?;
            auth::check_server(key, &own, &challenge.nonce, &back)?;
            r.expect_frame().await?
        }
    };
    if reply.kind != FrameKind::HelloReply {
        return Err(KvError::Protocol(format!(
            "expected HelloReply, got {:?}",
            reply.kind
        )));
    }
    let remote: PeerInfo = r.json(&reply).await?;
    local.check_compatible(&remote)
}

/// Server half of the challenge (see [`crate::auth`]), after the client's hello: challenges, checks
/// the client's proof and sends its own. A client without the secret is refused before it learns
/// anything of this server.
pub async fn server_challenge<S>(
    r: &mut FrameReader<S>,
    key: &ClusterKey,
    io: Duration,
) -> Result<(), KvError>
where
    S: tokio::io::AsyncRead + AsyncWrite + Unpin,
{
    let challenge = auth::nonce();
    let body = AuthChallenge {
        nonce: challenge.clone(),
    };
    send_json(r.get_mut(), FrameKind::AuthChallenge, 0, &body, io).await?;
    let proof: AuthProof = r.expect_json(FrameKind::AuthProof).await?;
    let back = auth::check_client(key, &challenge, &proof)?;
    send_json(r.get_mut(), FrameKind::AuthProof, 0, &back, io).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn header_round_trips(kind in 1u8..=28, flags: u8, transfer_id: u64, layer: u32, first_block: u32, n_blocks: u32, checksum: u32, payload_len: u64) {
            let h = FrameHeader { kind: FrameKind::from_u8(kind).unwrap(), flags, transfer_id, layer, first_block, n_blocks, checksum, payload_len };
            prop_assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        }
    }

    #[test]
    fn bad_magic_and_version_are_refused() {
        let mut b = FrameHeader::control(FrameKind::Ack, 7, 0).encode();
        b[4] = 9;
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(KvError::Mismatch {
                field: "wire_version",
                ..
            })
        ));
        b[0] = 0;
        assert!(matches!(FrameHeader::decode(&b), Err(KvError::Protocol(_))));
    }

    #[tokio::test]
    async fn vectored_write_then_read_with_checksum() {
        let (mut a, b) = tokio::io::duplex(64);
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 31) as u8).collect();
        let mut h = FrameHeader::control(FrameKind::Data, 3, payload.len());
        h.flags = FLAG_CHECKSUM;
        h.checksum = crc32fast::hash(&payload);
        let p2 = payload.clone();
        let w = tokio::spawn(async move { write_frame(&mut a, &h, &p2).await });
        let mut r = FrameReader::new(b, Duration::from_secs(5));
        let got = r.header().await.unwrap().unwrap();
        assert_eq!(got, h);
        assert_eq!(r.payload(&got).await.unwrap(), &payload[..]);
        w.await.unwrap().unwrap();
        let mut bad = h;
        bad.checksum ^= 1;
        let (mut a, b) = tokio::io::duplex(64);
        let w = tokio::spawn(async move { write_frame(&mut a, &bad, &payload).await });
        let mut r = FrameReader::new(b, Duration::from_secs(5));
        let got = r.header().await.unwrap().unwrap();
        assert!(matches!(
            r.payload(&got).await,
            Err(KvError::Checksum { transfer_id: 3, .. })
        ));
        w.await.unwrap().unwrap();
    }
}
