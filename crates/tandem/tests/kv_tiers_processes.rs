//! KV tiers in a real `tandem serve` (colocated, default model): with `engine.kv_offload` a prefix the
//! small pool evicted goes to the disk tier, and after a restart over the same directory the first
//! request of that prefix is served from disk (read from `/metrics`) with the same greedy answer.

use std::path::Path;

use tandem_testkit::{default_model, model_path, text, Server};

/// The `tandem` binary cargo built for these tests.
const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// A server whose pool holds ~11 blocks of 16 tokens (8 MiB of the default model's KV), over the disk
/// tier in `dir`.
fn serve(dir: &Path) -> Server {
    let yaml = format!(
        "model: {}\nengine:\n  block_size: 16\n  kv_cache_memory: 8MiB\n  threads: 2\n  \
         kv_offload: {{disk: {{path: {}, size: 256MiB}}}}\n",
        default_model().display(),
        dir.display()
    );
    Server::with_config(BIN, &yaml)
}

/// The value of the series `name` in a Prometheus text page (0 when absent).
fn series(page: &str, name: &str) -> f64 {
    page.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_tier_survives_a_restart() {
    if model_path().is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tandem-kv-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let a: Vec<u32> = (0..100).map(|i| 1000 + (i * 37) % 900).collect();
    let b: Vec<u32> = (0..165).map(|i| 3000 + (i * 53) % 700).collect();
    let hits = "tandem:kv_tier_hits_total{tier=\"disk\"}";

    let server = serve(&dir);
    let first = text(&server.complete_ids(&a, 8).await);
    // B needs almost the whole pool: A's cached blocks are evicted, down to disk.
    server.complete_ids(&b, 8).await;
    let page = server.metrics().await;
    assert!(
        series(&page, "tandem:kv_tier_blocks{tier=\"disk\"}") >= 6.0,
        "A's six full blocks on disk:\n{page}"
    );
    assert_eq!(series(&page, hits), 0.0);
    drop(server);

    let server = serve(&dir);
    let page = server.metrics().await;
    assert!(
        series(&page, "tandem:kv_tier_blocks{tier=\"disk\"}") >= 6.0,
        "re-indexed at start:\n{page}"
    );
    let again = text(&server.complete_ids(&a, 8).await);
    assert_eq!(again, first, "greedy answer from restored KV");
    let page = server.metrics().await;
    assert!(series(&page, hits) >= 6.0, "served from disk:\n{page}");
    assert!(
        series(&page, "tandem:prefix_cache_hits_total") >= 96.0,
        "{page}"
    );
    assert!(series(&page, "tandem:kv_tier_restore_seconds_count") >= 1.0);
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
