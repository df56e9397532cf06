//! Measures KV transfer throughput per transport: `cargo run --release -p tandem-kv --example kv_bench [iters]`.

use tandem_kv::bench::{run, BenchConfig, BenchTransport};

#[tokio::main]
async fn main() -> Result<(), tandem_kv::KvError> {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let cases = [
        (
            "default model, 1024 tokens (30 x 64 x 24 KiB = 45 MiB)",
            30,
            64,
            24_576,
        ),
        ("large (30 x 1456 x 24 KiB = 1.0 GiB)", 30, 1456, 24_576),
    ];
    let transports = [
        BenchTransport::InProc,
        BenchTransport::Tcp(1),
        BenchTransport::Tcp(4),
        BenchTransport::Tcp(8),
        BenchTransport::Shm,
    ];
    println!(
        "{:<58} {:<10} {:>12} {:>10} {:>8}",
        "case", "transport", "bytes/pull", "median ms", "GB/s"
    );
    for (name, n_layers, n_blocks, block_bytes) in cases {
        for transport in transports {
            let r = run(&BenchConfig {
                n_layers,
                n_blocks,
                block_bytes,
                transport,
                iters,
            })
            .await?;
            println!(
                "{:<58} {:<10} {:>12} {:>10.2} {:>8.2}",
                name,
                format!("{transport:?}"),
                r.bytes_per_pull,
                r.median_s * 1e3,
                r.gb_per_s
            );
        }
    }
    Ok(())
}
