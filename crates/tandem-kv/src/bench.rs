//! Throughput measurement of the transports on synthetic KV, for `examples/kv_bench.rs` and CI smoke runs.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::mem::{MemSink, MemSource};
use crate::{
    ClusterTls, ClusterTlsPaths, InProcTransport, KvClient, KvError, KvServer, KvServerConfig,
    KvTransport, NixlAgent, NixlConfig, NixlTransport, PeerInfo, ShmTransport, TcpConfig,
    TcpTransport, WireDtype, WireLayout,
};

/// Which transport a benchmark run exercises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum BenchTransport {
    /// Direct calls.
    InProc,
    /// Loopback TCP with this many connections.
    Tcp(usize),
    /// Loopback TCP under mutual TLS ([`BenchConfig::tls`]) with this many connections.
    TcpTls(usize),
    /// Shared memory, with this many copy threads on each side (server and client).
    Shm(usize),
    /// NIXL READs between two agents of this process (UCX backend); needs [`BenchConfig::nixl`].
    Nixl,
}

impl std::fmt::Display for BenchTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BenchTransport::InProc => f.write_str("in-proc"),
            BenchTransport::Tcp(s) => write!(f, "tcp x{s}"),
            BenchTransport::TcpTls(s) => write!(f, "tls x{s}"),
            BenchTransport::Shm(t) => write!(f, "shm {t}thr"),
            BenchTransport::Nixl => f.write_str("nixl"),
        }
    }
}

/// One benchmark case.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Layers in the model.
    pub n_layers: usize,
    /// Blocks per transfer.
    pub n_blocks: usize,
    /// Bytes per (layer, block); rounded down to a whole f32 layout.
    pub block_bytes: usize,
    /// Transport under test.
    pub transport: BenchTransport,
    /// Timed pulls (after one warm-up pull).
    pub iters: usize,
    /// Settings of the two NIXL agents, for [`BenchTransport::Nixl`].
    pub nixl: Option<NixlConfig>,
    /// The certificates both sides use, for [`BenchTransport::TcpTls`].
    pub tls: Option<ClusterTlsPaths>,
}

/// Measured throughput of one case.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Transport measured.
    pub transport: BenchTransport,
    /// Bytes per pull.
    pub bytes_per_pull: u64,
    /// Timed pulls.
    pub iters: usize,
    /// Median pull time in seconds.
    pub median_s: f64,
    /// Throughput of the median pull in GB/s (10^9 bytes).
    pub gb_per_s: f64,
}

/// Runs `cfg` against a local server (random data, checked once after the warm-up) and reports GB/s.
pub async fn run(cfg: &BenchConfig) -> Result<BenchReport, KvError> {
    // block_bytes = 2 * n_kv_heads * block_size * head_dim * 4 with n_kv_heads = block_size = 1.
    let layout = WireLayout {
        n_layers: cfg.n_layers,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: (cfg.block_bytes / 8).max(1),
        block_size: 1,
        dtype: WireDtype::F32,
    };
    let info = PeerInfo {
        model_id: "bench".into(),
        layout,
    };
    let source = Arc::new(MemSource::random(layout, cfg.n_blocks, 7));
    let shm_threads = match cfg.transport {
        BenchTransport::Shm(t) => t.max(1),
        _ => KvServerConfig::default().shm_copy_threads,
    };
    let tls = match cfg.transport {
        BenchTransport::TcpTls(_) => {
            let paths = cfg
                .tls
                .as_ref()
                .ok_or_else(|| KvError::Protocol("the TLS benchmark needs certificates".into()))?;
            Some(Arc::new(ClusterTls::load(paths)?))
        }
        _ => None,
    };
    let server = KvServer::new(
        KvServerConfig {
            pin_timeout: Duration::from_secs(120),
            io_timeout: Duration::from_secs(60),
            shm_copy_threads: shm_threads,
            tls: tls.clone(),
            ..KvServerConfig::default()
        },
        info.clone(),
        source.clone(),
    );
    let listener = server.listen("127.0.0.1:0").await?;
    let tcp = |streams| TcpConfig {
        streams,
        io_timeout: Duration::from_secs(60),
        tls: tls.clone(),
        ..TcpConfig::default()
    };
    let transport: Arc<dyn KvTransport> = match cfg.transport {
        BenchTransport::InProc => Arc::new(InProcTransport::new(server.clone(), info.clone())),
        BenchTransport::Tcp(s) | BenchTransport::TcpTls(s) => {
            Arc::new(TcpTransport::new(info.clone(), tcp(s)))
        }
        BenchTransport::Shm(_) => Arc::new(
            ShmTransport::new(info.clone(), tcp(1), crate::default_shm_dir())
                .with_copy_threads(shm_threads),
        ),
        BenchTransport::Nixl => {
            let nixl = cfg.nixl.clone().ok_or_else(|| {
                KvError::Protocol("the nixl benchmark needs NIXL settings".into())
            })?;
            server.enable_nixl(NixlAgent::new("bench-prefill", &nixl)?)?;
            Arc::new(NixlTransport::new(
                info.clone(),
                tcp(1),
                NixlAgent::new("bench-decode", &nixl)?,
            ))
        }
    };
    let client = KvClient::new(transport);
    // Blocks in reverse order, so the source gathers rather than copying one contiguous run.
    let blocks: Vec<u32> = (0..cfg.n_blocks as u32).rev().collect();
    let sink = Arc::new(MemSink::new(layout, cfg.n_blocks));
    let mut times = Vec::with_capacity(cfg.iters);
    let mut bytes = 0;
    for i in 0..=cfg.iters {
        let handle = server.register(blocks.clone(), cfg.n_blocks)?;
        let stats = client.pull(&handle, sink.clone()).await?;
        bytes = stats.bytes;
        if i == 0 {
            for l in [0, cfg.n_layers - 1] {
                for (i, &b) in blocks.iter().enumerate() {
                    if sink.block(l, i) != source.block(l, b) {
                        return Err(KvError::Sink(format!(
                            "benchmark data mismatch at layer {l} block {i}"
                        )));
                    }
                }
            }
        } else {
            times.push(stats.elapsed.as_secs_f64());
        }
    }
    listener.shutdown();
    times.sort_by(f64::total_cmp);
    let median_s = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    Ok(BenchReport {
        transport: cfg.transport,
        bytes_per_pull: bytes,
        iters: cfg.iters,
        median_s,
        gb_per_s: bytes as f64 / median_s / 1e9,
    })
}
