//! End-to-end tests of every transport against a real server: data integrity, refusal, release accounting.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use crate::mem::{MemSink, MemSource};
use crate::peer::tests::smollm_info;
use crate::wire::{self, FrameKind, FrameReader, PullRequest};
use crate::*;

const NUM_BLOCKS: usize = 64;

struct Fixture {
    server: KvServer,
    source: Arc<MemSource>,
    listener: KvListener,
    info: PeerInfo,
    /// Private shared-memory directory, so parallel tests can check for leftover files.
    shm_dir: tempfile::TempDir,
}

async fn fixture(pin_timeout: Duration) -> Fixture {
    fixture_with(
        pin_timeout,
        |s| s,
        KvServerConfig::default().shm_copy_threads,
    )
    .await
}

/// A fixture whose server reads through `wrap(source)` and copies shared-memory pulls on `shm_copy_threads`.
async fn fixture_with(
    pin_timeout: Duration,
    wrap: impl FnOnce(Arc<MemSource>) -> Arc<dyn KvSource>,
    shm_copy_threads: usize,
) -> Fixture {
    let info = smollm_info();
    let source = Arc::new(MemSource::random(info.layout, NUM_BLOCKS, 42));
    let shm_dir = tempfile::Builder::new()
        .prefix("kvtest")
        .tempdir_in(default_shm_dir())
        .unwrap();
    let config = KvServerConfig {
        pin_timeout,
        io_timeout: Duration::from_secs(5),
        max_frame_bytes: 5 * info.layout.block_bytes(),
        shm_dir: shm_dir.path().to_path_buf(),
        shm_copy_threads,
        ..Default::default()
    };
    let server = KvServer::new(config, info.clone(), wrap(source.clone()));
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    Fixture {
        server,
        source,
        listener,
        info,
        shm_dir,
    }
}

fn tcp_config(streams: usize, checksum: bool) -> TcpConfig {
    TcpConfig {
        streams,
        checksum,
        io_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        cluster_key: None,
        tls: None,
    }
}
/// Connects to the handle's server as `f`'s decode side and sends one raw request frame, for tests that
/// drive the protocol by hand; returns the connection to read the answer from.
async fn send_request<T: serde::Serialize>(
    f: &Fixture,
    handle: &TransferHandle,
    kind: FrameKind,
    req: &T,
) -> FrameReader<crate::tls::MaybeTls> {
    let cfg = tcp_config(1, false);
    let mut c = crate::transport::tcp::connect(&handle.endpoint, &f.info, &cfg)
        .await
        .unwrap();
    wire::send_json(c.get_mut(), kind, handle.transfer_id, req, cfg.io_timeout)
        .await
        .unwrap();
    c
}

fn transports(f: &Fixture) -> Vec<Arc<dyn KvTransport>> {
    vec![
        Arc::new(InProcTransport::new(f.server.clone(), f.info.clone())),
        Arc::new(TcpTransport::new(f.info.clone(), tcp_config(1, false))),
        Arc::new(TcpTransport::new(f.info.clone(), tcp_config(3, true))),
        Arc::new(TcpTransport::new(f.info.clone(), tcp_config(64, false))),
        Arc::new(ShmTransport::new(
            f.info.clone(),
            tcp_config(1, false),
            f.shm_dir.path().to_path_buf(),
        )),
    ]
}

/// A scattered, out-of-order block list, as a real block table would be.
fn scattered_blocks(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + 11) % NUM_BLOCKS as u32)
        .collect()
}

fn assert_same(f: &Fixture, sink: &MemSink, blocks: &[u32]) {
    for layer in 0..f.info.layout.n_layers {
        for (i, &b) in blocks.iter().enumerate() {
            assert!(
                sink.block(layer, i) == f.source.block(layer, b),
                "layer {layer} block {i} differs"
            );
        }
    }
}

/// Polls until the source saw a release of `tid`, since servers release asynchronously after the client returns.
/// The bound is generous (10 s) because a loaded 2-core CI machine can delay the server task by seconds.
async fn wait_released(f: &Fixture, tid: u64) {
    for _ in 0..1000 {
        if f.source.releases(tid) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        f.source.releases(tid),
        1,
        "transfer {tid} must be released exactly once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_over_every_transport() {
    let f = fixture(Duration::from_secs(30)).await;
    for (ti, t) in transports(&f).into_iter().enumerate() {
        let blocks = scattered_blocks(13 + ti);
        let handle = f
            .server
            .register(blocks.clone(), blocks.len() * 16 - 3)
            .unwrap();
        assert_eq!(handle.endpoint, f.listener.local_addr().to_string());
        let sink = Arc::new(MemSink::new(f.info.layout, blocks.len()));
        let client = KvClient::new(t.clone());
        let stats = client
            .pull(&handle, sink.clone())
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", t.name()));
        assert_eq!(stats.bytes, handle.total_bytes(), "{}", t.name());
        assert_same(&f, &sink, &blocks);
        assert_eq!(
            sink.layers_complete(),
            f.info.layout.n_layers,
            "{}",
            t.name()
        );
        assert_eq!(sink.completes(), 1);
        wait_released(&f, handle.transfer_id).await;
        assert_eq!(client.metrics().snapshot().pulls_ok, 1);
        assert_eq!(client.metrics().snapshot().bytes_received, stats.bytes);
        // The pin is gone, so the handle cannot be pulled again.
        let again = client
            .pull(&handle, Arc::new(MemSink::new(f.info.layout, blocks.len())))
            .await;
        assert!(
            matches!(again, Err(KvError::UnknownTransfer(t)) if t == handle.transfer_id),
            "{}: {again:?}",
            t.name()
        );
    }
    let m = f.server.metrics().snapshot();
    assert_eq!(m.released_ack, 5);
    assert_eq!(f.server.pinned(), 0);
    // Sequential shared-memory pulls reuse one pooled segment instead of leaving a file per transfer.
    let shm = KvClient::new(Arc::new(ShmTransport::new(
        f.info.clone(),
        tcp_config(1, false),
        f.shm_dir.path().to_path_buf(),
    )));
    for n in [3, 20] {
        let blocks = scattered_blocks(n);
        let handle = f.server.register(blocks.clone(), n * 16).unwrap();
        let sink = Arc::new(MemSink::new(f.info.layout, n));
        shm.pull(&handle, sink.clone()).await.unwrap();
        assert_same(&f, &sink, &blocks);
        wait_released(&f, handle.transfer_id).await;
    }
    let files = std::fs::read_dir(f.shm_dir.path()).unwrap().count();
    assert_eq!(files, 1, "one pooled shared-memory segment");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_pulls_deliver_exactly_the_requested_blocks() {
    let f = fixture(Duration::from_secs(30)).await;
    let n = 17;
    let bb = f.info.layout.block_bytes();
    let zero = vec![0u8; bb];
    let n_layers = f.info.layout.n_layers;
    // A cached-prefix suffix (the decode worker's case), scattered runs longer than a frame (5 blocks),
    // a single block, nothing at all (everything cached: the pull only acks), and per-layer starts
    // (sliding-window layers: one mid-run, one past every selected block, one inside a gap).
    let starts: Vec<u32> = (0..n_layers as u32)
        .map(|l| [0, 14, 17, 8][l as usize % 4])
        .collect();
    let selections = [
        PullSelection::uniform(BlockSelection::range(11..17)),
        PullSelection::uniform(BlockSelection::from_indices([
            0, 1, 2, 3, 4, 5, 6, 9, 13, 14, 16,
        ])),
        PullSelection::uniform(BlockSelection::range(16..17)),
        PullSelection::uniform(BlockSelection::range(0..0)),
        PullSelection::with_layer_from(BlockSelection::range(2..17), starts.clone()),
        PullSelection::with_layer_from(
            BlockSelection::from_indices([0, 1, 2, 6, 7, 9, 10, 11, 15]),
            starts,
        ),
    ];
    assert!(
        n_layers >= 3,
        "the windowed selections need three kinds of layer"
    );
    let mut released_ack = 0;
    for t in transports(&f) {
        for sel in &selections {
            let blocks = scattered_blocks(n);
            let handle = f.server.register(blocks.clone(), n * 16 - 5).unwrap();
            let sink = Arc::new(MemSink::new(f.info.layout, n));
            let client = KvClient::new(t.clone());
            let stats = client
                .pull_selection(&handle, sel, sink.clone())
                .await
                .unwrap_or_else(|e| panic!("{} {sel:?}: {e}", t.name()));
            let what = format!("{} {sel:?}", t.name());
            assert_eq!(stats.bytes, sel.bytes(n_layers, bb), "{what}");
            let per_layer: usize = (0..n_layers).map(|l| sel.layer(l).len()).sum();
            assert_eq!(stats.bytes, (per_layer * bb) as u64, "{what}");
            if sel.layer_from.is_empty() {
                assert_eq!(stats.bytes, handle.bytes_for(&sel.blocks), "{what}");
            }
            for layer in 0..n_layers {
                let wanted = sel.layer(layer);
                for (i, &b) in blocks.iter().enumerate() {
                    let want = if wanted.iter().any(|s| s as usize == i) {
                        f.source.block(layer, b)
                    } else {
                        &zero[..]
                    };
                    assert!(
                        sink.block(layer, i) == want,
                        "{what}: layer {layer} block {i}"
                    );
                }
            }
            assert_eq!(sink.layers_complete(), n_layers, "{what}");
            assert_eq!(sink.completes(), 1, "{what}");
            wait_released(&f, handle.transfer_id).await;
            released_ack += 1;
            let m = client.metrics().snapshot();
            let pulled = sel.blocks.len();
            assert_eq!(
                (m.blocks_pulled, m.blocks_skipped),
                (pulled as u64, (n - pulled) as u64),
                "{what}"
            );
            assert_eq!(m.bytes_received, stats.bytes);
        }
    }
    assert_eq!(f.server.metrics().snapshot().released_ack, released_ack);
    assert_eq!(f.server.pinned(), 0);

    // Past the end of the transfer: refused before connecting, and by the server itself.
    let handle = f.server.register(scattered_blocks(4), 64).unwrap();
    let client = KvClient::new(Arc::new(TcpTransport::new(
        f.info.clone(),
        tcp_config(1, false),
    )));
    let r = client
        .pull_blocks(
            &handle,
            &BlockSelection::range(2..5),
            Arc::new(MemSink::new(f.info.layout, 5)),
        )
        .await;
    assert!(matches!(r, Err(KvError::Protocol(_))), "{r:?}");
    let req = PullRequest {
        layers: vec![0],
        selection: PullSelection::uniform(BlockSelection::range(3..5)),
        control: false,
        checksum: false,
    };
    let mut c = send_request(&f, &handle, FrameKind::Pull, &req).await;
    assert!(matches!(c.expect_frame().await, Err(KvError::Remote(_))));
    // The refused request did not consume the pin: a valid pull still works.
    let sink = Arc::new(MemSink::new(f.info.layout, 4));
    client
        .pull_blocks(&handle, &BlockSelection::range(1..4), sink.clone())
        .await
        .unwrap();
    wait_released(&f, handle.transfer_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_refuses_each_mismatched_field() {
    let f = fixture(Duration::from_secs(30)).await;
    let handle = f.server.register(scattered_blocks(4), 64).unwrap();
    let cases = crate::peer::tests::mismatch_cases();
    for (field, mutate) in cases {
        let mut local = f.info.clone();
        mutate(&mut local);
        let transports: Vec<Arc<dyn KvTransport>> = vec![
            Arc::new(TcpTransport::new(local.clone(), tcp_config(2, false))),
            Arc::new(ShmTransport::new(
                local.clone(),
                tcp_config(1, false),
                f.shm_dir.path().to_path_buf(),
            )),
            Arc::new(InProcTransport::new(f.server.clone(), local.clone())),
        ];
        for t in transports {
            // Straight to the transport, past the client's pre-check, so the wire handshake itself is tested.
            let sink = Arc::new(MemSink::new(f.info.layout, 4));
            let all = PullSelection::uniform(BlockSelection::all(4));
            match t.pull(&handle, &all, sink.clone()).await {
                Err(KvError::Mismatch {
                    field: got,
                    local: l,
                    remote: r,
                }) => {
                    assert_eq!(got, field, "{}", t.name());
                    assert_ne!(l, r);
                }
                other => panic!("{} {field}: expected a mismatch, got {other:?}", t.name()),
            }
            assert_eq!(sink.completes(), 0);
        }
        if field != "model_id" {
            // The layout travels in the handle, so the client refuses before connecting.
            let client = KvClient::new(Arc::new(TcpTransport::new(local, tcp_config(1, false))));
            let r = client
                .pull(&handle, Arc::new(MemSink::new(f.info.layout, 4)))
                .await;
            assert!(matches!(r, Err(KvError::Mismatch { field: got, .. }) if got == field));
        }
    }
    // A refused peer does not release the pin: a compatible worker can still pull it.
    assert_eq!(f.source.releases(handle.transfer_id), 0);
    let sink = Arc::new(MemSink::new(f.info.layout, 4));
    KvClient::new(Arc::new(TcpTransport::new(
        f.info.clone(),
        tcp_config(2, false),
    )))
    .pull(&handle, sink)
    .await
    .unwrap();
    wait_released(&f, handle.transfer_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_failure_aborts_and_releases_once() {
    let f = fixture(Duration::from_secs(30)).await;
    for t in transports(&f) {
        let blocks = scattered_blocks(9);
        let handle = f.server.register(blocks.clone(), 9 * 16).unwrap();
        let sink = Arc::new(MemSink::failing_at(f.info.layout, blocks.len(), 7));
        let client = KvClient::new(t.clone());
        let r = client.pull(&handle, sink.clone()).await;
        assert!(matches!(r, Err(KvError::Sink(_))), "{}: {r:?}", t.name());
        assert_eq!(sink.completes(), 0);
        wait_released(&f, handle.transfer_id).await;
        assert_eq!(client.metrics().snapshot().pulls_failed, 1);
    }
    let m = f.server.metrics().snapshot();
    assert_eq!(m.released_ack, 0);
    assert_eq!(m.released_abort + m.released_disconnect, 5);
    assert_eq!(f.server.pinned(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_pins_time_out_and_cannot_be_pulled() {
    let f = fixture(Duration::from_millis(50)).await;
    let handle = f.server.register(scattered_blocks(3), 40).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(f.source.releases(handle.transfer_id), 1);
    assert_eq!(f.server.metrics().snapshot().released_timeout, 1);
    let client = KvClient::new(Arc::new(TcpTransport::new(
        f.info.clone(),
        tcp_config(2, false),
    )));
    let r = client
        .pull(&handle, Arc::new(MemSink::new(f.info.layout, 3)))
        .await;
    assert!(matches!(r, Err(KvError::UnknownTransfer(_))), "{r:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        f.source.releases(handle.transfer_id),
        1,
        "no second release after the timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_side_abort_releases_once() {
    let f = fixture(Duration::from_secs(30)).await;
    let handle = f.server.register(scattered_blocks(3), 40).unwrap();
    assert!(f.server.abort(handle.transfer_id));
    assert!(!f.server.abort(handle.transfer_id));
    assert_eq!(f.source.releases(handle.transfer_id), 1);
    assert!(matches!(
        f.server.register(Vec::new(), 0),
        Err(KvError::EmptyTransfer)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_control_connection_releases() {
    let f = fixture(Duration::from_secs(30)).await;
    let handle = f
        .server
        .register(scattered_blocks(NUM_BLOCKS), 1000)
        .unwrap();
    let req = PullRequest {
        layers: (0..30).collect(),
        selection: PullSelection::uniform(BlockSelection::all(NUM_BLOCKS)),
        control: true,
        checksum: false,
    };
    let mut c = send_request(&f, &handle, FrameKind::Pull, &req).await;
    // Read one frame to be sure the server is mid-transfer, then vanish.
    let h = c.expect_frame().await.unwrap();
    assert_eq!(h.kind, FrameKind::Data);
    drop(c);
    wait_released(&f, handle.transfer_id).await;
    assert_eq!(f.server.metrics().snapshot().released_disconnect, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_unknown_transfers_are_refused() {
    let f = fixture(Duration::from_secs(30)).await;
    let mut s = tokio::net::TcpStream::connect(f.listener.local_addr())
        .await
        .unwrap();
    s.write_all(&[0xAB; 64]).await.unwrap();
    let mut r = FrameReader::new(s, Duration::from_secs(2));
    let end = r.header().await;
    assert!(
        matches!(end, Ok(None) | Ok(Some(_)) | Err(KvError::Io { .. })),
        "{end:?}"
    );
    let mut bogus = f.server.register(scattered_blocks(2), 20).unwrap();
    bogus.transfer_id ^= 0xdead_beef;
    for t in transports(&f) {
        let r = t
            .pull(
                &bogus,
                &PullSelection::uniform(BlockSelection::all(2)),
                Arc::new(MemSink::new(f.info.layout, 2)),
            )
            .await;
        assert!(
            matches!(r, Err(KvError::UnknownTransfer(_))),
            "{}: {r:?}",
            t.name()
        );
    }
    assert!(f.server.metrics().snapshot().serve_errors >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pulls_each_release_once() {
    let f = Arc::new(fixture(Duration::from_secs(30)).await);
    let tcp: Arc<dyn KvTransport> =
        Arc::new(TcpTransport::new(f.info.clone(), tcp_config(3, false)));
    let shm: Arc<dyn KvTransport> = Arc::new(ShmTransport::new(
        f.info.clone(),
        tcp_config(1, false),
        f.shm_dir.path().to_path_buf(),
    ));
    let mut tasks = Vec::new();
    for i in 0..12usize {
        let f = Arc::clone(&f);
        let client = KvClient::new(if i % 3 == 0 { shm.clone() } else { tcp.clone() });
        tasks.push(tokio::spawn(async move {
            let blocks: Vec<u32> = (0..(5 + i as u32))
                .map(|b| (b * 7 + i as u32) % NUM_BLOCKS as u32)
                .collect();
            let handle = f
                .server
                .register(blocks.clone(), blocks.len() * 16)
                .unwrap();
            let sink = Arc::new(MemSink::new(f.info.layout, blocks.len()));
            client.pull(&handle, sink.clone()).await.unwrap();
            assert_same(&f, &sink, &blocks);
            handle.transfer_id
        }));
    }
    for t in tasks {
        let tid = t.await.unwrap();
        wait_released(&f, tid).await;
    }
    assert_eq!(f.server.pinned(), 0);
    assert_eq!(f.server.metrics().snapshot().released_ack, 12);
}

/// Counts calls in flight and the most seen at once; each call sleeps `delay` so that calls overlap.
#[derive(Default)]
struct Probe {
    delay: Duration,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    calls: AtomicUsize,
    finished: AtomicUsize,
}

impl Probe {
    fn with_delay(delay: Duration) -> Self {
        Probe {
            delay,
            ..Probe::default()
        }
    }

    fn call<T>(&self, f: impl FnOnce() -> T) -> T {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        let r = f();
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.finished.fetch_add(1, Ordering::SeqCst);
        r
    }

    fn max(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }
}

/// A source that is slow (so copies overlap and a transfer can be interrupted) and can fail at one layer.
struct ProbedSource {
    inner: Arc<MemSource>,
    probe: Arc<Probe>,
    fail_at_layer: Option<usize>,
}

impl KvSource for ProbedSource {
    fn copy_blocks(
        &self,
        tid: u64,
        layer: usize,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<(), KvError> {
        self.probe.call(|| {
            if self.fail_at_layer == Some(layer) {
                return Err(KvError::Source(format!(
                    "injected failure at layer {layer}"
                )));
            }
            self.inner.copy_blocks(tid, layer, blocks, out)
        })
    }

    fn release(&self, tid: u64, blocks: &[u32]) {
        self.inner.release(tid, blocks)
    }
}

/// A slow sink in front of a `MemSink`, recording how many writes overlapped.
struct ProbedSink {
    inner: MemSink,
    probe: Arc<Probe>,
}

impl KvSink for ProbedSink {
    fn write(&self, layer: usize, first_block: usize, data: &[u8]) -> Result<(), KvError> {
        self.probe
            .call(|| self.inner.write(layer, first_block, data))
    }

    fn layer_complete(&self, layer: usize) -> Result<(), KvError> {
        self.inner.layer_complete(layer)
    }

    fn complete(&self) -> Result<(), KvError> {
        self.inner.complete()
    }
}

fn probed_fixture_source(
    probe: &Arc<Probe>,
    fail_at_layer: Option<usize>,
) -> impl FnOnce(Arc<MemSource>) -> Arc<dyn KvSource> {
    let probe = Arc::clone(probe);
    move |inner| {
        Arc::new(ProbedSource {
            inner,
            probe,
            fail_at_layer,
        })
    }
}

fn shm_files(f: &Fixture) -> usize {
    std::fs::read_dir(f.shm_dir.path()).unwrap().count()
}

fn shm_transport(f: &Fixture, copy_threads: usize) -> Arc<dyn KvTransport> {
    Arc::new(
        ShmTransport::new(
            f.info.clone(),
            tcp_config(1, false),
            f.shm_dir.path().to_path_buf(),
        )
        .with_copy_threads(copy_threads),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_copies_layers_in_parallel_on_both_sides() {
    let src_probe = Arc::new(Probe::with_delay(Duration::from_millis(3)));
    let f = fixture_with(
        Duration::from_secs(30),
        probed_fixture_source(&src_probe, None),
        4,
    )
    .await;
    let n_layers = f.info.layout.n_layers;
    let client = KvClient::new(shm_transport(&f, 3));
    let blocks = scattered_blocks(17);
    let selections = [
        BlockSelection::all(17),
        BlockSelection::from_indices([0, 1, 2, 5, 6, 9, 13, 14, 16]),
    ];
    for sel in &selections {
        let handle = f.server.register(blocks.clone(), 17 * 16).unwrap();
        let sink_probe = Arc::new(Probe::with_delay(Duration::from_millis(3)));
        let sink = Arc::new(ProbedSink {
            inner: MemSink::new(f.info.layout, blocks.len()),
            probe: Arc::clone(&sink_probe),
        });
        let stats = client
            .pull_blocks(&handle, sel, sink.clone())
            .await
            .unwrap();
        assert_eq!(stats.bytes, handle.bytes_for(sel));
        for layer in 0..n_layers {
            for (i, &b) in blocks.iter().enumerate() {
                let got = sink.inner.block(layer, i);
                if sel.iter().any(|s| s as usize == i) {
                    assert!(got == f.source.block(layer, b), "layer {layer} block {i}");
                } else {
                    assert!(got.iter().all(|&x| x == 0), "layer {layer} block {i}");
                }
            }
        }
        assert_eq!(sink.inner.layers_complete(), n_layers);
        assert_eq!(sink.inner.completes(), 1);
        assert_eq!(sink_probe.calls(), n_layers * sel.runs().len());
        assert!(
            (2..=3).contains(&sink_probe.max()),
            "client copies at once: {}",
            sink_probe.max()
        );
        wait_released(&f, handle.transfer_id).await;
    }
    assert_eq!(src_probe.calls(), 2 * n_layers);
    assert!(
        (2..=4).contains(&src_probe.max()),
        "server copies at once: {}",
        src_probe.max()
    );
    assert_eq!(f.server.pinned(), 0);
    assert_eq!(f.server.metrics().snapshot().released_ack, 2);
    assert_eq!(shm_files(&f), 1, "one pooled segment, reused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_shm_failures_release_once_and_leak_no_segment() {
    let src_probe = Arc::new(Probe::with_delay(Duration::from_millis(2)));
    let f = fixture_with(
        Duration::from_secs(30),
        probed_fixture_source(&src_probe, Some(17)),
        4,
    )
    .await;
    let n_layers = f.info.layout.n_layers;
    let blocks = scattered_blocks(9);

    // The decode side's sink fails mid-transfer while other layers are being copied.
    let handle = f.server.register(blocks[..5].to_vec(), 80).unwrap();
    let sink_probe = Arc::new(Probe::with_delay(Duration::from_millis(2)));
    let sink = Arc::new(ProbedSink {
        inner: MemSink::failing_at(f.info.layout, 5, 7),
        probe: Arc::clone(&sink_probe),
    });
    let r = KvClient::new(shm_transport(&f, 4))
        .pull(&handle, sink.clone())
        .await;
    assert!(matches!(r, Err(KvError::Sink(_))), "{r:?}");
    assert_eq!(sink.inner.completes(), 0);
    let writes = sink_probe.finished();
    assert_eq!(
        writes,
        sink_probe.calls(),
        "every write that began ended before the pull returned"
    );
    assert!(writes < n_layers, "copies stop after the failure: {writes}");
    wait_released(&f, handle.transfer_id).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        sink_probe.calls(),
        writes,
        "no sink write after the pull ended"
    );

    // The prefill side's source fails at layer 17: the copy threads stop and the pull fails.
    let handle = f.server.register(blocks.clone(), 9 * 16).unwrap();
    let before = src_probe.calls();
    let sink = Arc::new(MemSink::new(f.info.layout, 9));
    let r = KvClient::new(shm_transport(&f, 4))
        .pull(&handle, sink.clone())
        .await;
    assert!(matches!(r, Err(KvError::Remote(_))), "{r:?}");
    assert_eq!(sink.completes(), 0);
    wait_released(&f, handle.transfer_id).await;
    let copied = src_probe.calls() - before;
    assert!(copied < n_layers, "copies stop after the failure: {copied}");

    // The decode side vanishes after the first announced layer while the server is still copying.
    let handle = f.server.register(blocks.clone(), 9 * 16).unwrap();
    let req = crate::wire::ShmPullRequest {
        selection: PullSelection::uniform(BlockSelection::all(blocks.len())),
    };
    let mut c = send_request(&f, &handle, FrameKind::ShmPull, &req).await;
    assert_eq!(c.expect_frame().await.unwrap().kind, FrameKind::ShmOpen);
    drop(c);
    wait_released(&f, handle.transfer_id).await;

    // A pull dropped by its caller mid-transfer: the connection's loss releases the pin, and copies that
    // had not started never write into the sink afterwards.
    let handle = f.server.register(blocks[..5].to_vec(), 80).unwrap();
    let sink_probe = Arc::new(Probe::with_delay(Duration::from_millis(20)));
    let sink = Arc::new(ProbedSink {
        inner: MemSink::new(f.info.layout, 5),
        probe: Arc::clone(&sink_probe),
    });
    let client = KvClient::new(shm_transport(&f, 2));
    let r = tokio::time::timeout(
        Duration::from_millis(60),
        client.pull(&handle, sink.clone()),
    )
    .await;
    assert!(r.is_err(), "the pull must still be running: {r:?}");
    let at_drop = sink_probe.calls();
    wait_released(&f, handle.transfer_id).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        sink_probe.calls() <= at_drop + 2,
        "only copies already running may finish: {} after {at_drop}",
        sink_probe.calls()
    );
    assert_eq!(sink.inner.completes(), 0);

    assert_eq!(f.server.pinned(), 0);
    let m = f.server.metrics().snapshot();
    assert_eq!(m.released_ack, 0);
    assert_eq!(m.released_abort + m.released_disconnect, 4);
    // Every failed transfer's segment went back to the pool: at most one file per concurrent transfer.
    assert!(shm_files(&f) <= 1, "{} shared-memory files", shm_files(&f));
    // And the pooled one is unlinked with the server.
    let Fixture {
        server,
        listener,
        shm_dir,
        ..
    } = f;
    listener.shutdown();
    drop(server);
    for _ in 0..500 {
        if std::fs::read_dir(shm_dir.path()).unwrap().count() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(std::fs::read_dir(shm_dir.path()).unwrap().count(), 0);
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
        #[test]
        fn inproc_round_trip_any_block_table(blocks in proptest::collection::vec(0u32..NUM_BLOCKS as u32, 1..40), kv_heads in 1usize..4, bs in 1usize..9) {
            let info = PeerInfo { model_id: "p".into(), layout: WireLayout { n_layers: 3, n_heads: 4, n_kv_heads: kv_heads, head_dim: 8, block_size: bs, dtype: WireDtype::Bf16 } };
            let source = Arc::new(MemSource::random(info.layout, NUM_BLOCKS, 9));
            let server = KvServer::new(KvServerConfig::default(), info.clone(), source.clone());
            let handle = server.register(blocks.clone(), 1).unwrap();
            let sink = Arc::new(MemSink::new(info.layout, blocks.len()));
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(KvClient::new(Arc::new(InProcTransport::new(server.clone(), info.clone()))).pull(&handle, sink.clone())).unwrap();
            for l in 0..3 {
                for (i, &b) in blocks.iter().enumerate() {
                    prop_assert_eq!(sink.block(l, i), source.block(l, b).to_vec());
                }
            }
            prop_assert_eq!(source.releases(handle.transfer_id), 1);
        }
    }
}
