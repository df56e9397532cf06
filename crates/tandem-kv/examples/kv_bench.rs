//! Measures KV transfer throughput per transport:
//! `cargo run --release -p tandem-kv --example kv_bench [iters] [shm copy threads ...]`.
//!
//! Without thread counts, shared memory runs with 1 copy thread per side (the serial path) and with the
//! default (`KvServerConfig::default().shm_copy_threads`, half the cores, at most 8). With
//! `TANDEM_NIXL_LIB` naming the unpacked nixl-cu13 wheel (or the directory of libnixl_capi.so), NIXL
//! READs between two agents of the process are measured too. TCP runs in plain and under mutual TLS
//! (`tls xN`, certificates made at start), in the same run, for what TLS costs a pull.

use tandem_kv::bench::{run, BenchConfig, BenchTransport};
use tandem_kv::{ClusterTlsPaths, KvServerConfig, NixlConfig};

#[tokio::main]
async fn main() -> Result<(), tandem_kv::KvError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(5);
    let mut shm_threads: Vec<usize> = args.iter().skip(1).filter_map(|s| s.parse().ok()).collect();
    if shm_threads.is_empty() {
        shm_threads = vec![1, KvServerConfig::default().shm_copy_threads];
        shm_threads.dedup();
    }
    let cases = [
        (
            "default model, 1024 tokens (30 x 64 x 24 KiB = 45 MiB)",
            30,
            64,
            24_576,
        ),
        ("large (30 x 1456 x 24 KiB = 1.0 GiB)", 30, 1456, 24_576),
    ];
    let pki_dir = tempfile::tempdir().map_err(|e| tandem_kv::KvError::Io {
        context: "making the certificates' directory",
        source: e,
    })?;
    let pki = tandem_testkit::TestPki::generate(pki_dir.path());
    let tls = ClusterTlsPaths {
        ca: pki.ca,
        cert: pki.cert,
        key: pki.key,
        server_name: None,
    };
    let transports = [
        BenchTransport::InProc,
        BenchTransport::Tcp(1),
        BenchTransport::TcpTls(1),
        BenchTransport::Tcp(4),
        BenchTransport::TcpTls(4),
        BenchTransport::Tcp(8),
        BenchTransport::TcpTls(8),
    ]
    .into_iter()
    .chain(shm_threads.into_iter().map(BenchTransport::Shm));
    let nixl = std::env::var_os("TANDEM_NIXL_LIB").map(|lib| NixlConfig {
        library: Some(lib.into()),
        ..NixlConfig::default()
    });
    if let Some(dir) = nixl
        .as_ref()
        .and_then(|c| tandem_kv::NixlEnv::for_config(c).plugin_dir)
    {
        // The library sets no environment; this program is its binary. No runtime thread reads it.
        std::env::set_var(tandem_kv::NixlEnv::PLUGIN_DIR, dir);
    }
    let transports = transports.chain(nixl.is_some().then_some(BenchTransport::Nixl));
    println!(
        "{:<58} {:<10} {:>12} {:>10} {:>8}",
        "case", "transport", "bytes/pull", "median ms", "GB/s"
    );
    for (name, n_layers, n_blocks, block_bytes) in cases {
        for transport in transports.clone() {
            let r = run(&BenchConfig {
                n_layers,
                n_blocks,
                block_bytes,
                transport,
                iters,
                nixl: nixl.clone(),
                tls: Some(tls.clone()),
            })
            .await?;
            println!(
                "{:<58} {:<10} {:>12} {:>10.2} {:>8.2}",
                name,
                transport.to_string(),
                r.bytes_per_pull,
                r.median_s * 1e3,
                r.gb_per_s
            );
        }
    }
    Ok(())
}
