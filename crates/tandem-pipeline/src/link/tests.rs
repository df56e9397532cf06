//! The stage link against a toy handler: round trips, the handshake's checks, the cluster secret,
//! and failures that must be errors, not hangs.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

use tandem_engine::{LayerBlocks, StageInput, StageOutput};

use super::*;

fn bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn floats(b: &[u8]) -> Vec<f32> {
    let mut v = Vec::new();
    crate::model::extend_f32(&mut v, b);
    v
}

fn hello() -> StageHello {
    StageHello {
        model_id: "m".into(),
        stage: 1,
        stages: 3,
        layer_start: 2,
        layer_end: 4,
        hidden_size: 3,
        vocab_size: 5,
        activations: Activations::F32,
        block_size: 4,
        num_blocks: 8,
        samples: false,
        version: STAGE_LINK_VERSION,
    }
}

/// Doubles the hidden states; KV is one byte vector per (layer, block) of 4 bytes.
struct Doubler {
    sized: bool,
    kv: Vec<u8>,
    /// How long each forward stalls, to play a frozen stage.
    stall: Duration,
    /// The link version its hello states (0 plays a server from before expert counts).
    version: u32,
}

/// The expert counts a `Doubler` reports: its two layers of 3 experts.
fn doubler_counts() -> Vec<LayerExpertTokens> {
    vec![
        LayerExpertTokens {
            layer: 2,
            tokens: vec![1, 0, u64::MAX],
        },
        LayerExpertTokens {
            layer: 3,
            tokens: vec![4, 5, 6],
        },
    ]
}

/// The test handler's failures.
#[derive(Debug, thiserror::Error)]
enum DoublerError {
    #[error("bad hidden")]
    BadHidden,
    #[error("no such layer")]
    NoSuchLayer,
    #[error("layer {0} is not on this stage")]
    NotOnStage(usize),
}

impl Doubler {
    fn export_block(&self, layer: usize, block: u32, out: &mut [u8]) -> Result<(), DoublerError> {
        let at = ((layer - 2) * 8 + block as usize) * 4;
        out.copy_from_slice(self.kv.get(at..at + 4).ok_or(DoublerError::NoSuchLayer)?);
        Ok(())
    }
    fn import_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), DoublerError> {
        if !(2..4).contains(&layer) {
            return Err(DoublerError::NotOnStage(layer));
        }
        let at = ((layer - 2) * 8 + block as usize) * 4;
        self.kv[at..at + 4].copy_from_slice(data);
        Ok(())
    }
}

impl StageHandler for Doubler {
    type Error = DoublerError;

    fn hello(&self) -> StageHello {
        let mut h = hello();
        if !self.sized {
            h.block_size = 0;
            h.num_blocks = 0;
        }
        h.version = self.version;
        h
    }
    fn size_pool(&mut self, _: usize, num_blocks: usize) -> Result<(), DoublerError> {
        self.sized = true;
        self.kv = vec![0; 2 * num_blocks * 4];
        Ok(())
    }
    /// Doubles the hidden states (after the stall), or "draws" each row's first hidden value plus its
    /// row's seed.
    fn forward(&mut self, input: StageInput, output: StageOutput) -> Result<(), DoublerError> {
        let b = input.batch;
        let x = floats(input.hidden.unwrap_or_default());
        if x.len() != b.tokens.len() * 3 {
            return Err(DoublerError::BadHidden);
        }
        match output {
            StageOutput::Hidden(out) => {
                std::thread::sleep(self.stall);
                *out = bytes(&x.iter().map(|v| v * 2.0).collect::<Vec<_>>());
            }
            StageOutput::Tokens { rows, out } => {
                if rows.len() != b.logits_rows() {
                    return Err(DoublerError::BadHidden);
                }
                out.clear();
                out.extend(
                    x.chunks(3)
                        .zip(rows)
                        .map(|(r, s)| r[0] as u32 + s.seed as u32),
                );
            }
        }
        Ok(())
    }
    fn block_bytes(&self) -> usize {
        4
    }
    fn export_blocks(&mut self, at: LayerBlocks, out: &mut [u8]) -> Result<(), DoublerError> {
        at.zip_mut(out, 4)
            .try_for_each(|(b, o)| self.export_block(at.layer, b, o))
    }
    fn import_blocks(&mut self, at: LayerBlocks, data: &[u8]) -> Result<(), DoublerError> {
        at.zip(data, 4)
            .try_for_each(|(b, d)| self.import_block(at.layer, b, d))
    }
    fn expert_tokens(&self, out: &mut Vec<LayerExpertTokens>) {
        *out = doubler_counts();
    }
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), DoublerError> {
        for l in 2..4 {
            let mut b = [0u8; 4];
            self.export_block(l, src, &mut b)?;
            self.import_block(l, dst, &b)?;
        }
        Ok(())
    }
}

fn server() -> StageServer {
    keyed_server(Duration::ZERO, None)
}

fn stalling_server(stall: Duration) -> StageServer {
    keyed_server(stall, None)
}

fn keyed_server(stall: Duration, key: Option<ClusterKey>) -> StageServer {
    versioned_server(stall, key, STAGE_LINK_VERSION)
}

fn versioned_server(stall: Duration, key: Option<ClusterKey>, version: u32) -> StageServer {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    StageServer::start(
        l,
        Doubler {
            sized: false,
            kv: Vec::new(),
            stall,
            version,
        },
        Duration::from_secs(5),
        key,
    )
    .unwrap()
}

#[test]
fn only_clients_with_the_cluster_secret_get_a_stage_and_they_need_it_asked() {
    let key = ClusterKey::new("cluster-secret");
    let s = keyed_server(Duration::ZERO, key.clone());
    let to = StageTimeouts::default();
    let e = StageClient::connect(s.addr(), &hello(), to, None)
        .err()
        .unwrap();
    assert!(e.to_string().contains("requires the cluster token"), "{e}");
    let wrong = ClusterKey::new("guess");
    let e = StageClient::connect(s.addr(), &hello(), to, wrong.as_ref())
        .err()
        .unwrap();
    assert!(e.to_string().contains("cluster token challenge"), "{e}");
    let mut c = StageClient::connect(s.addr(), &hello(), to, key.as_ref()).unwrap();
    c.import_block(3, 5, &[9, 8, 7, 6]).unwrap();
    let mut out = [0u8; 4];
    c.export_block(3, 5, &mut out).unwrap();
    assert_eq!(out, [9, 8, 7, 6]);
    drop(c);
    s.shutdown();
    let open = server();
    let e = StageClient::connect(open.addr(), &hello(), to, key.as_ref())
        .err()
        .unwrap();
    assert!(matches!(e, KvError::Auth(_)), "{e}");
    open.shutdown();
}

fn cluster_tls(ca: &std::path::Path, cert: &std::path::Path, key: &std::path::Path) -> ClusterTls {
    ClusterTls::load(&tandem_kv::ClusterTlsPaths {
        ca: ca.to_owned(),
        cert: cert.to_owned(),
        key: key.to_owned(),
        server_name: None,
    })
    .unwrap()
}

#[test]
fn a_tls_link_round_trips_and_refuses_strangers() {
    let dir = tempfile::tempdir().unwrap();
    let pki = tandem_testkit::TestPki::generate(dir.path());
    let good = cluster_tls(&pki.ca, &pki.cert, &pki.key);
    let s = StageServer::start_tls(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        Doubler {
            sized: false,
            kv: Vec::new(),
            stall: Duration::ZERO,
            version: STAGE_LINK_VERSION,
        },
        Duration::from_secs(5),
        None,
        Some(Arc::new(good.clone())),
    )
    .unwrap();
    let to = StageTimeouts::default();
    let strangers = [
        (
            "wrong CA",
            Some(cluster_tls(&pki.wrong_ca, &pki.wrong_cert, &pki.wrong_key)),
        ),
        (
            "wrong cert",
            Some(cluster_tls(&pki.ca, &pki.wrong_cert, &pki.wrong_key)),
        ),
        ("plain TCP", None),
    ];
    for (who, tls) in &strangers {
        let r = StageClient::connect_tls(s.addr(), &hello(), to, None, tls.as_ref());
        assert!(r.is_err(), "{who} got a stage link");
    }
    let mut c = StageClient::connect_tls(s.addr(), &hello(), to, None, Some(&good)).unwrap();
    c.import_block(3, 5, &[9, 8, 7, 6]).unwrap();
    let mut out = [0u8; 4];
    c.export_block(3, 5, &mut out).unwrap();
    assert_eq!(out, [9, 8, 7, 6]);
    let mut b = ForwardBatch::default();
    b.push(&[1, 2], 0, vec![0], tandem_model::LogitsWanted::Last);
    let mut buf = bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
    c.forward(&b, &mut buf).unwrap();
    assert_eq!(floats(&buf), [2.0, 4.0, 6.0, 8.0, 10.0, 13.0]);
    drop(c);
    s.shutdown();
}

#[test]
fn forward_and_blocks_round_trip() {
    let s = server();
    let mut c = StageClient::connect(s.addr(), &hello(), StageTimeouts::default(), None).unwrap();
    let mut b = ForwardBatch::default();
    b.push(&[1, 2], 0, vec![0], tandem_model::LogitsWanted::Last);
    let mut buf = bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
    c.forward(&b, &mut buf).unwrap();
    assert_eq!(floats(&buf), [2.0, 4.0, 6.0, 8.0, 10.0, 13.0]);
    let mut all = ForwardBatch::default();
    all.push(&[1, 2], 0, vec![0], tandem_model::LogitsWanted::All);
    let row = |seed| DeviceSampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
    };
    let mut ids = Vec::new();
    c.forward_sampled(
        &all,
        &[row(10), row(20)],
        &bytes(&[7.0, 0.0, 0.0, 9.0, 0.0, 0.0]),
        &mut ids,
    )
    .unwrap();
    assert_eq!(ids, [17, 29]);
    // Plain forwards still carry hidden states after a sampled one.
    c.forward(&b, &mut buf).unwrap();
    assert_eq!(floats(&buf), [4.0, 8.0, 12.0, 16.0, 20.0, 26.0]);
    // Runs of blocks of one layer move in one request each way.
    c.import_blocks(2, &[1, 7, 3], &[1, 1, 1, 1, 7, 7, 7, 7, 3, 3, 3, 3])
        .unwrap();
    let mut three = [0u8; 12];
    c.export_blocks(2, &[3, 1, 7], &mut three).unwrap();
    assert_eq!(three, [3, 3, 3, 3, 1, 1, 1, 1, 7, 7, 7, 7]);
    c.import_block(3, 5, &[9, 8, 7, 6]).unwrap();
    c.copy_block(5, 6).unwrap();
    let mut out = [0u8; 4];
    c.export_block(3, 6, &mut out).unwrap();
    assert_eq!(out, [9, 8, 7, 6]);
    let e = c.import_block(0, 1, &[0; 4]).unwrap_err().to_string();
    assert!(e.contains("layer 0 is not on this stage"), "{e}");
    // The failure poisons the link.
    assert!(c.copy_block(1, 2).is_err());
    // A second client of the now sized server must agree on the pool size.
    let mut other = hello();
    other.num_blocks = 9;
    match StageClient::connect(s.addr(), &other, StageTimeouts::default(), None) {
        Err(KvError::Remote(m)) => assert!(m.contains("`num_blocks`"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("mismatch accepted"),
    }
    // A GPU stage's bf16 hidden states are not a CPU stage's f32 ones.
    other = hello();
    other.activations = Activations::Bf16;
    let e = StageClient::connect(s.addr(), &other, StageTimeouts::default(), None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("`activations`"), "{e}");
    other = hello();
    other.layer_start = 1;
    let e = StageClient::connect(s.addr(), &other, StageTimeouts::default(), None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("`layer_start`"), "{e}");
    s.shutdown();
}

#[test]
fn a_dead_or_silent_server_is_an_error_not_a_hang() {
    let s = server();
    let mut c = StageClient::connect(s.addr(), &hello(), StageTimeouts::default(), None).unwrap();
    s.shutdown();
    let mut b = ForwardBatch::default();
    b.push(&[1], 0, vec![0], tandem_model::LogitsWanted::Last);
    let t = std::time::Instant::now();
    assert!(c.forward(&b, &mut bytes(&[0.0; 3])).is_err());
    assert!(t.elapsed() < Duration::from_secs(5));
    // A peer that accepts but never answers: the handshake times out.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let hold = std::thread::spawn(move || l.accept().map(|(s, _)| s));
    let to = StageTimeouts {
        connect: Duration::from_secs(1),
        io: Duration::from_millis(300),
    };
    let e = StageClient::connect(addr, &hello(), to, None)
        .err()
        .unwrap();
    assert!(matches!(e, KvError::Timeout { .. }), "{e}");
    drop(hold.join());
    // A stage that handshakes but then stalls in a forward: the forward times out.
    let s = stalling_server(Duration::from_secs(2));
    let mut c = StageClient::connect(s.addr(), &hello(), to, None).unwrap();
    let t = std::time::Instant::now();
    let e = c.forward(&b, &mut bytes(&[0.0; 3])).unwrap_err();
    assert!(matches!(e, KvError::Timeout { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

/// A peer that claims more bytes than any batch of the pool could need (hidden states for a tiny batch,
/// more blocks than the pool) is refused from the header, before the server sizes a buffer for it: the
/// lengths come from the wire and must not become an allocation of any size.
#[test]
fn lengths_beyond_the_batch_or_the_pool_are_refused_before_any_allocation() {
    use std::io::{Read, Write};
    let s = server();
    // Size the pool (8 blocks of 4) with a well-behaved client first.
    drop(StageClient::connect(s.addr(), &hello(), StageTimeouts::default(), None).unwrap());
    let mut b = ForwardBatch::default();
    b.push(&[1, 2], 0, vec![0], tandem_model::LogitsWanted::Last);
    let meta = serde_json::to_vec(&b).unwrap();
    let mut forward = FrameHeader::control(FrameKind::StageForward, 1, 0);
    forward.layer = meta.len() as u32;
    forward.payload_len = meta.len() as u64 + (1 << 28);
    let mut export = FrameHeader::control(FrameKind::StageExport, 1, 0);
    export.layer = 2;
    export.n_blocks = 9;
    export.payload_len = 9 * 4;
    for (frame, body, says) in [
        (forward, meta.clone(), "hidden states for 2 tokens"),
        (export, vec![0u8; 9 * 4], "of 9 blocks (the pool has 8)"),
    ] {
        let mut raw = TcpStream::connect(s.addr()).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let hello = serde_json::to_vec(&hello()).unwrap();
        raw.write_all(&FrameHeader::control(FrameKind::StageHello, 0, hello.len()).encode())
            .unwrap();
        raw.write_all(&hello).unwrap();
        raw.write_all(&frame.encode()).unwrap();
        raw.write_all(&body).unwrap();
        let mut answer = Vec::new();
        let _ = raw.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer);
        assert!(text.contains(says), "{says:?} not in the answer {text:?}");
    }
    // The server still serves.
    let mut c = StageClient::connect(s.addr(), &hello(), StageTimeouts::default(), None).unwrap();
    let mut buf = bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    c.forward(&b, &mut buf).unwrap();
    s.shutdown();
}

/// A server that handshakes (echoing the client's hello) and answers each connection's one request
/// with a header stating the next of `lengths` as its payload length, then closes: a faulty or hostile
/// stage server, authenticated or not.
fn lying_server(lengths: Vec<u64>) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        for stated in lengths {
            let (s, _) = l.accept().unwrap();
            let mut c = Conn::new(s, Duration::from_secs(5), None).unwrap();
            let h = c.expect(FrameKind::StageHello).unwrap();
            let hello: StageHello = c.json(&h).unwrap();
            c.send_json(FrameKind::StageHelloReply, &hello).unwrap();
            let Ok(Some(h)) = c.header() else { continue };
            let kind = match h.kind {
                FrameKind::StageExport => FrameKind::StageBlock,
                FrameKind::StageExpertTokens => FrameKind::StageExpertTokensReply,
                _ => FrameKind::StageReply,
            };
            let mut reply = FrameHeader::control(kind, h.transfer_id, 0);
            reply.payload_len = stated;
            // Only the header: a client that believed it would wait for bytes that never come.
            let _ = c.stream.write_all(&reply.encode());
            let mut rest = Vec::new();
            let _ = c.stream.read_to_end(&mut rest);
        }
    });
    (addr, t)
}

/// A stage client knows the length of every reply from its request (tokens × hidden × element size
/// from a middle stage, logits rows × vocab × 4 from the last, one u32 per sampling row, the blocks it
/// exported), so a reply stating another length is refused from its header with an error naming the
/// server, before any buffer is sized from it: the old client resized its buffer to whatever the
/// header said (up to 1 TiB here) and then waited for the bytes.
#[test]
fn replies_of_another_length_than_asked_are_refused_before_any_allocation() {
    let mut two = ForwardBatch::default();
    two.push(&[1, 2], 0, vec![0], tandem_model::LogitsWanted::Last);
    let row = DeviceSampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
    };
    let mut last = hello();
    last.stage = 2;
    // Each case: the hello, the request, the length the client expects, the length the server states.
    type Request = Box<dyn Fn(&mut StageClient) -> Result<(), KvError>>;
    let forward =
        |b: ForwardBatch| -> Request { Box::new(move |c| c.forward(&b, &mut bytes(&[0.0; 6]))) };
    let cases: Vec<(StageHello, Request, &str, u64, u64)> = vec![
        // A middle stage: 2 tokens × 3 wide × 4 bytes.
        (hello(), forward(two.clone()), "forward reply", 24, 28),
        (hello(), forward(two.clone()), "forward reply", 24, 1 << 40),
        // The last stage: 1 logits row × 5 vocab × 4 bytes.
        (last.clone(), forward(two.clone()), "forward reply", 20, 24),
        (
            last.clone(),
            forward(two.clone()),
            "forward reply",
            20,
            1 << 40,
        ),
        (
            last.clone(),
            Box::new(move |c| c.forward_sampled(&two, &[row], &bytes(&[0.0; 6]), &mut Vec::new())),
            "sampled reply",
            4,
            1 << 40,
        ),
        (
            hello(),
            Box::new(|c| c.export_blocks(2, &[1, 2], &mut [0u8; 8])),
            "block export",
            8,
            1 << 40,
        ),
        // At most 2 layers × (8 bytes + 3 experts × 8 bytes).
        (
            hello(),
            Box::new(|c| c.expert_tokens(3, &mut Vec::new())),
            "expert token counts",
            64,
            1 << 40,
        ),
    ];
    let (addr, server) = lying_server(cases.iter().map(|c| c.4).collect());
    for (h, request, what, expected, stated) in cases {
        // Short deadlines, so the old client fails this test in seconds (it waited for the bytes).
        let to = StageTimeouts {
            connect: Duration::from_secs(2),
            io: Duration::from_secs(3),
        };
        let mut c = StageClient::connect(addr, &h, to, None).unwrap();
        let t = std::time::Instant::now();
        let r = request(&mut c);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        match r {
            Err(KvError::ReplyLength {
                peer,
                what: w,
                stated: s,
                expected: e,
            }) => assert_eq!((peer, w, s, e), (addr, what, stated, expected)),
            Err(e) => panic!("{what} stating {stated} bytes: {e}"),
            Ok(()) => panic!("{what} stating {stated} bytes accepted"),
        }
    }
    server.join().unwrap();
}

/// The counts' payload decodes to what was encoded, and anything but a stage's own layers in order, each
/// of the model's expert count, in exactly the stated bytes, is refused.
#[test]
fn expert_token_counts_round_trip_and_malformed_ones_are_refused() {
    let counts = doubler_counts();
    let mut bytes = Vec::new();
    encode_expert_tokens(&counts, &mut bytes);
    assert_eq!(bytes.len() as u64, expert_tokens_len(2, 3));
    let mut out = vec![LayerExpertTokens::default()];
    decode_expert_tokens(&bytes, 2..4, 3, &mut out).unwrap();
    assert_eq!(out, counts);
    // A stage that counts nothing (dense layers) answers nothing.
    encode_expert_tokens(&[], &mut bytes);
    assert!(bytes.is_empty());
    decode_expert_tokens(&bytes, 2..4, 3, &mut out).unwrap();
    assert!(out.is_empty());
    let refused = |layers: &[LayerExpertTokens], range: std::ops::Range<usize>, cut: usize| {
        let mut bytes = Vec::new();
        encode_expert_tokens(layers, &mut bytes);
        bytes.truncate(bytes.len() - cut);
        decode_expert_tokens(&bytes, range, 3, &mut Vec::new())
            .unwrap_err()
            .to_string()
    };
    let e = refused(&counts, 3..4, 0);
    assert!(e.contains("layer 2 out of order or outside"), "{e}");
    let e = refused(&counts, 2..3, 0);
    assert!(e.contains("layer 3 out of order or outside"), "{e}");
    let (a, b) = (counts[0].clone(), counts[1].clone());
    let e = refused(&[b.clone(), a.clone()], 2..4, 0);
    assert!(e.contains("layer 2 out of order"), "{e}");
    let e = refused(&[a.clone(), a.clone()], 2..4, 0);
    assert!(e.contains("layer 2 out of order"), "{e}");
    let four = LayerExpertTokens {
        layer: 2,
        tokens: vec![0; 4],
    };
    let e = refused(&[four], 2..4, 0);
    assert!(e.contains("layer 2 has 4 experts, the model 3"), "{e}");
    for cut in [1, 8, 30] {
        let e = refused(&counts, 2..4, cut);
        assert!(e.contains("cut short"), "cut {cut}: {e}");
    }
}

/// A server of this version answers its expert counts over the link (between forwards, which still
/// work after); a server from before them (version 0) is never asked: the client refuses the call
/// without sending the frame the old server would close the link over, and the link stays usable.
#[test]
fn expert_counts_cross_the_link_and_an_older_server_is_not_asked() {
    let s = server();
    let mut c = StageClient::connect(s.addr(), &hello(), StageTimeouts::default(), None).unwrap();
    assert!(c.answers_expert_tokens());
    let mut b = ForwardBatch::default();
    b.push(&[1], 0, vec![0], tandem_model::LogitsWanted::Last);
    let mut buf = bytes(&[1.0, 2.0, 3.0]);
    c.forward(&b, &mut buf).unwrap();
    let mut counts = Vec::new();
    c.expert_tokens(3, &mut counts).unwrap();
    assert_eq!(counts, doubler_counts());
    c.forward(&b, &mut buf).unwrap();
    assert_eq!(floats(&buf), [4.0, 8.0, 12.0]);
    // The model has 4 experts a layer where the server counts 3: refused, naming both.
    let e = c.expert_tokens(4, &mut counts).unwrap_err().to_string();
    assert!(e.contains("3 experts, the model 4"), "{e}");
    s.shutdown();

    let old = versioned_server(Duration::ZERO, None, 0);
    let mut c = StageClient::connect(old.addr(), &hello(), StageTimeouts::default(), None).unwrap();
    assert!(!c.answers_expert_tokens());
    let e = c.expert_tokens(3, &mut counts).unwrap_err().to_string();
    assert!(e.contains("link version 0"), "{e}");
    let mut buf = bytes(&[1.0, 2.0, 3.0]);
    c.forward(&b, &mut buf).unwrap();
    assert_eq!(floats(&buf), [2.0, 4.0, 6.0]);
    old.shutdown();
}
