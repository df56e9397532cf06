//! The `nixl` transport against the real NIXL library (the `nixl-cu13` wheel, DRAM over loopback):
//! `TANDEM_TEST_NIXL_LIB` names the unpacked wheel or the directory of `libnixl_capi.so`
//! (`scripts/test.sh` fetches it); without it each test says why it skipped.
//!
//! The two-process test re-runs this test binary as the prefill side (`nixl_child_server`, ignored unless
//! `TANDEM_NIXL_CHILD` is set): the child serves a seeded random pool, so the parent rebuilds the same
//! bytes locally to compare against.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_kv::mem::{MemSink, MemSource};
use tandem_kv::{
    BlockSelection, KvClient, KvServer, KvServerConfig, NixlAgent, NixlConfig, NixlTransport,
    PeerInfo, PullSelection, TcpConfig, TransferHandle, WireDtype, WireLayout,
};

const N_BLOCKS: usize = 12;
const SEED: u64 = 11;

fn nixl_lib() -> Option<PathBuf> {
    match std::env::var_os("TANDEM_TEST_NIXL_LIB") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            // Straight to stderr, past libtest's capture, so the skip shows in a normal run.
            let _ = writeln!(
                std::io::stderr(),
                "skipped: TANDEM_TEST_NIXL_LIB is unset (scripts/test.sh sets it to the unpacked nixl-cu13 wheel)"
            );
            None
        }
    }
}

/// The agents' settings; the first call also sets the plugin directory they need in the environment,
/// as the `tandem` binary does at start (the library sets none).
fn config(lib: PathBuf) -> NixlConfig {
    let config = NixlConfig {
        library: Some(lib),
        pool_granule: 1 << 20,
        ..NixlConfig::default()
    };
    static ENV: std::sync::Once = std::sync::Once::new();
    ENV.call_once(|| {
        if let Some(dir) = tandem_kv::NixlEnv::for_config(&config).plugin_dir {
            std::env::set_var(tandem_kv::NixlEnv::PLUGIN_DIR, dir);
        }
    });
    config
}

fn info() -> PeerInfo {
    PeerInfo {
        model_id: "nixl-test".into(),
        layout: WireLayout {
            n_layers: 6,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            block_size: 8,
            dtype: WireDtype::F32,
        },
    }
}

fn server_config() -> KvServerConfig {
    KvServerConfig {
        pin_timeout: Duration::from_secs(60),
        ..KvServerConfig::default()
    }
}

fn client(lib: PathBuf) -> KvClient {
    let agent = NixlAgent::new("decode", &config(lib)).expect("client agent");
    KvClient::new(Arc::new(NixlTransport::new(
        info(),
        TcpConfig::default(),
        agent,
    )))
}

/// Every selected block of every layer arrived byte for byte.
fn assert_same(source: &MemSource, sink: &MemSink, handle: &TransferHandle, sel: &BlockSelection) {
    for l in 0..info().layout.n_layers {
        for i in sel.iter() {
            assert!(
                sink.block(l, i as usize) == source.block(l, handle.block_ids[i as usize]),
                "layer {l} block {i} differs"
            );
        }
    }
}

async fn wait_for(mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "condition never held"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_move_pinned_transfers_and_release_once() {
    let Some(lib) = nixl_lib() else { return };
    let source = Arc::new(MemSource::random(info().layout, N_BLOCKS, SEED));
    let server = KvServer::new(server_config(), info(), source.clone());
    server
        .enable_nixl(NixlAgent::new("prefill", &config(lib.clone())).expect("server agent"))
        .unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let client = client(lib);
    let layout = info().layout;

    // Reverse order (a gather), twice: the second pull reuses loaded metadata and pooled buffers.
    for _ in 0..2 {
        let h = server
            .register((0..N_BLOCKS as u32).rev().collect(), 96)
            .unwrap();
        assert!(h.nixl);
        let sink = Arc::new(MemSink::new(layout, N_BLOCKS));
        let stats = client.pull(&h, sink.clone()).await.expect("pull");
        assert_eq!(
            stats.bytes,
            (N_BLOCKS * layout.n_layers * layout.block_bytes()) as u64
        );
        assert_same(&source, &sink, &h, &BlockSelection::all(N_BLOCKS));
        assert_eq!(
            (sink.layers_complete(), sink.completes()),
            (layout.n_layers, 1)
        );
        wait_for(|| source.releases(h.transfer_id) == 1).await;
    }

    // Only some blocks (decode had the rest cached), and none at all.
    let h = server.register(vec![3, 1, 4, 7, 5, 9], 48).unwrap();
    let sel = BlockSelection::from_indices([1, 2, 4]);
    let sink = Arc::new(MemSink::new(layout, 6));
    client
        .pull_blocks(&h, &sel, sink.clone())
        .await
        .expect("partial pull");
    assert_same(&source, &sink, &h, &sel);
    wait_for(|| source.releases(h.transfer_id) == 1).await;

    // Per layer (sliding-window layers starting later, one past every block): each layer's blocks
    // arrive, the ones before its start never cross, and a layer of no block still completes.
    let h = server.register(vec![3, 1, 4, 7, 5, 9], 48).unwrap();
    let starts = (0..layout.n_layers as u32)
        .map(|l| [0, 4, 6][l as usize % 3])
        .collect();
    let cut = PullSelection::with_layer_from(BlockSelection::range(1..6), starts);
    let sink = Arc::new(MemSink::new(layout, 6));
    let stats = client
        .pull_selection(&h, &cut, sink.clone())
        .await
        .expect("per-layer pull");
    assert_eq!(
        stats.bytes,
        cut.bytes(layout.n_layers, layout.block_bytes())
    );
    for l in 0..layout.n_layers {
        for i in 0..6 {
            let got = sink.block(l, i);
            if cut.layer(l).iter().any(|s| s as usize == i) {
                assert!(
                    got == source.block(l, h.block_ids[i]),
                    "layer {l} block {i}"
                );
            } else {
                assert!(got.iter().all(|&b| b == 0), "layer {l} block {i} was sent");
            }
        }
    }
    assert_eq!(sink.layers_complete(), layout.n_layers);
    wait_for(|| source.releases(h.transfer_id) == 1).await;
    let h = server.register(vec![2], 8).unwrap();
    let sink = Arc::new(MemSink::new(layout, 1));
    let empty = BlockSelection::from_indices([]);
    client
        .pull_blocks(&h, &empty, sink)
        .await
        .expect("empty pull");
    wait_for(|| source.releases(h.transfer_id) == 1).await;

    // A client failing mid-way (its sink refuses layer 3) aborts: the pin is released exactly once.
    let h = server.register((0..N_BLOCKS as u32).collect(), 96).unwrap();
    let sink = Arc::new(MemSink::failing_at(layout, N_BLOCKS, 3));
    assert!(client.pull(&h, sink).await.is_err());
    wait_for(|| source.releases(h.transfer_id) == 1).await;
    assert_eq!(server.pinned(), 0);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(source.releases(h.transfer_id), 1, "released once");
    assert!(
        client
            .pull(&h, Arc::new(MemSink::new(layout, N_BLOCKS)))
            .await
            .is_err(),
        "a released transfer cannot be pulled again"
    );
    listener.shutdown();
}

/// A NIXL client pulling from a KV server without NIXL (a worker that could not load it) pulls over
/// TCP instead, byte for byte, and the pin is released once: workers that decided differently under
/// `transport: auto` still work together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nixl_client_pulls_over_tcp_from_a_server_without_nixl() {
    let Some(lib) = nixl_lib() else { return };
    let source = Arc::new(MemSource::random(info().layout, N_BLOCKS, SEED));
    let server = KvServer::new(server_config(), info(), source.clone());
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let client = client(lib);
    let layout = info().layout;
    let h = server
        .register((0..N_BLOCKS as u32).rev().collect(), 96)
        .unwrap();
    assert!(!h.nixl, "the handle says the server has no NIXL agent");
    let sink = Arc::new(MemSink::new(layout, N_BLOCKS));
    let stats = client.pull(&h, sink.clone()).await.expect("pull over TCP");
    assert_eq!(
        stats.bytes,
        (N_BLOCKS * layout.n_layers * layout.block_bytes()) as u64
    );
    assert_same(&source, &sink, &h, &BlockSelection::all(N_BLOCKS));
    wait_for(|| source.releases(h.transfer_id) == 1).await;
    listener.shutdown();
}

/// The prefill process of `two_processes_move_a_transfer`: prints its endpoint, then answers stdin lines
/// `register` (a handle as JSON) and `releases ID` (how often the pin was released) until EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by two_processes_move_a_transfer as its child"]
async fn nixl_child_server() {
    if std::env::var_os("TANDEM_NIXL_CHILD").is_none() {
        return;
    }
    let lib = nixl_lib().expect("the parent passes TANDEM_TEST_NIXL_LIB");
    let source = Arc::new(MemSource::random(info().layout, N_BLOCKS, SEED));
    let server = KvServer::new(server_config(), info(), source.clone());
    server
        .enable_nixl(NixlAgent::new("prefill", &config(lib)).expect("server agent"))
        .unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    println!("ENDPOINT {}", listener.local_addr());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    while let Some(line) = rx.recv().await {
        let mut out = std::io::stdout().lock();
        if line == "register" {
            let h = server
                .register((0..N_BLOCKS as u32).rev().collect(), 96)
                .unwrap();
            writeln!(out, "HANDLE {}", serde_json::to_string(&h).unwrap()).unwrap();
        } else if let Some(id) = line.strip_prefix("releases ") {
            let id: u64 = id.parse().unwrap();
            writeln!(out, "RELEASES {}", source.releases(id)).unwrap();
        }
        out.flush().unwrap();
    }
    listener.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_move_a_transfer() {
    let Some(lib) = nixl_lib() else { return };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "nixl_child_server",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TANDEM_NIXL_CHILD", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("re-running the test binary");
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut answer = |prefix: &str| -> String {
        loop {
            let line = lines.next().expect("child output").expect("child output");
            // libtest may print its own text in front of the child's on the same line.
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].trim().to_string();
            }
        }
    };
    let endpoint = answer("ENDPOINT ");
    let client = client(lib);
    let layout = info().layout;
    let source = MemSource::random(layout, N_BLOCKS, SEED);
    let mut ask = |cmd: String, prefix: &str| {
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        answer(prefix)
    };

    let h: TransferHandle = serde_json::from_str(&ask("register".into(), "HANDLE ")).unwrap();
    assert_eq!(h.endpoint, endpoint);
    let sink = Arc::new(MemSink::new(layout, N_BLOCKS));
    client
        .pull(&h, sink.clone())
        .await
        .expect("cross-process pull");
    assert_same(&source, &sink, &h, &BlockSelection::all(N_BLOCKS));
    let t = Instant::now();
    while ask(format!("releases {}", h.transfer_id), "RELEASES ") != "1" {
        assert!(t.elapsed() < Duration::from_secs(10), "pin never released");
        std::thread::sleep(Duration::from_millis(10));
    }

    // The failing client, across processes.
    let h: TransferHandle = serde_json::from_str(&ask("register".into(), "HANDLE ")).unwrap();
    assert!(client
        .pull(&h, Arc::new(MemSink::failing_at(layout, N_BLOCKS, 2)))
        .await
        .is_err());
    let t = Instant::now();
    while ask(format!("releases {}", h.transfer_id), "RELEASES ") != "1" {
        assert!(t.elapsed() < Duration::from_secs(10), "pin never released");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(ask(format!("releases {}", h.transfer_id), "RELEASES "), "1");
    drop(stdin);
    assert!(child.wait().unwrap().success());
}
