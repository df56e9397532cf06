//! KV tiers under the pool, on the mock backend (whose forward fails on any KV that is not what its own
//! steps wrote): a small pool evicts a prefix, the tiers take it, a later request restores it, and the
//! greedy output equals the same run with tiers off.

use std::path::{Path, PathBuf};

use tandem_engine::*;
use tandem_testkit::MockBackend;

mod common;
use common::*;

const BS: usize = 4;
/// Pool blocks: a 36-token prompt with its answer (10 blocks) evicts everything else.
const BLOCKS: usize = 10;

fn start(offload: KvOffloadConfig) -> EngineHandle {
    let config = EngineConfig {
        block_size: BS,
        kv_offload: offload,
        ..Default::default()
    };
    Engine::start(MockBackend::new(BS, BLOCKS), config).unwrap()
}

fn disk(path: &Path) -> Option<DiskOffloadConfig> {
    Some(DiskOffloadConfig {
        path: path.to_path_buf(),
        size: 1 << 20,
    })
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-engine-tiers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs 24-token prompt A, then B (which evicts all of A's blocks), then A again, one at a time: the outputs, the
/// prefill tokens the third request computed, and the stats at the end.
fn a_b_a(e: &EngineHandle) -> (Vec<Vec<u32>>, u64, EngineStats) {
    let a: Vec<u32> = (0..24).map(|i| i % 50 + 1).collect();
    let b: Vec<u32> = (0..36).map(|i| (i * 7) % 50 + 2).collect();
    let mut outs = Vec::new();
    let mut before = 0;
    for (id, p) in [(1, &a), (2, &b), (3, &a)] {
        before = e.stats().prefill_tokens_computed;
        let mut s = submit(e, id, p.clone(), SamplingParams::greedy(4));
        outs.push(collect(&mut s).0);
    }
    let st = e.checked_stats().wait_blocking().unwrap();
    assert_eq!(st.kv_blocks_used, 0);
    (outs, st.prefill_tokens_computed - before, st)
}

fn tier<'a>(st: &'a EngineStats, name: &str) -> &'a KvTierStats {
    st.kv_tiers.iter().find(|t| t.tier == name).unwrap()
}

#[test]
fn evicted_prefix_comes_back_from_host_and_disk_tiers() {
    let e = start(KvOffloadConfig::default());
    let (reference, recomputed, st) = a_b_a(&e);
    e.shutdown();
    assert!(st.kv_tiers.is_empty());
    assert_eq!(
        recomputed, 24,
        "tiers off: the evicted prefix is computed again"
    );

    // Host tier: the third request computes only the prompt's last (partial) block.
    let e = start(KvOffloadConfig {
        host: Some(1 << 20),
        ..Default::default()
    });
    let (outs, recomputed, st) = a_b_a(&e);
    e.shutdown();
    assert_eq!(outs, reference, "greedy output identical with tiers on");
    assert_eq!(
        recomputed, 4,
        "20 of 24 prompt tokens restored from the host tier"
    );
    let host = tier(&st, "host");
    assert!(
        host.hits >= 5 && host.bytes_up > 0 && host.bytes_down > 0,
        "{host:?}"
    );
    assert!(st.kv_restore_seconds.count >= 1);

    // Disk tier alone, then across a restart (a new engine over the same directory).
    let dir = tmpdir("disk");
    let offload = KvOffloadConfig {
        disk: disk(&dir),
        model_identity: "mock-model".into(),
        ..Default::default()
    };
    let e = start(offload.clone());
    let (outs, recomputed, st) = a_b_a(&e);
    e.shutdown();
    assert_eq!(outs, reference);
    assert_eq!(recomputed, 4);
    assert!(tier(&st, "disk").hits >= 5);

    let e = start(offload.clone());
    assert!(
        tier(&e.checked_stats().wait_blocking().unwrap(), "disk").blocks > 0,
        "the disk tier survived the restart"
    );
    let a: Vec<u32> = (0..24).map(|i| i % 50 + 1).collect();
    let mut s = submit(&e, 9, a.clone(), SamplingParams::greedy(4));
    assert_eq!(collect(&mut s).0, reference[0]);
    let st = e.checked_stats().wait_blocking().unwrap();
    e.shutdown();
    assert_eq!(
        st.prefill_tokens_computed, 4,
        "the first request after a restart hits the disk"
    );
    assert_eq!(st.prefix_cache_hits, 20);

    // Another model over the same directory: the tier is cleared, nothing is served from it.
    let e = start(KvOffloadConfig {
        model_identity: "another-model".into(),
        ..offload.clone()
    });
    assert_eq!(
        tier(&e.checked_stats().wait_blocking().unwrap(), "disk").blocks,
        0
    );
    e.shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn host_tier_evicts_into_disk_and_a_corrupt_file_is_recomputed() {
    let dir = tmpdir("both");
    // The host tier holds two blocks: the rest of A's prefix goes on down to disk.
    let block = 2 * 2 * BS * 2 * 4; // layers × K/V × slots × head_dim × f32, as MockBackend lays it out
    let offload = KvOffloadConfig {
        host: Some(2 * block),
        disk: disk(&dir),
        model_identity: "mock-model".into(),
    };
    let e = start(KvOffloadConfig::default());
    let (reference, _, _) = a_b_a(&e);
    e.shutdown();

    let e = start(offload.clone());
    let (outs, recomputed, st) = a_b_a(&e);
    e.shutdown();
    assert_eq!(outs, reference);
    assert_eq!(recomputed, 4);
    assert!(tier(&st, "disk").hits > 0, "{:?}", st.kv_tiers);

    // Damage every block file: a restart finds them (header intact), a restore refuses them.
    for f in std::fs::read_dir(&dir).unwrap() {
        let p = f.unwrap().path();
        let mut bytes = std::fs::read(&p).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 0x55;
        std::fs::write(&p, bytes).unwrap();
    }
    let e = start(offload);
    let a: Vec<u32> = (0..24).map(|i| i % 50 + 1).collect();
    let mut s = submit(&e, 9, a, SamplingParams::greedy(4));
    assert_eq!(collect(&mut s).0, reference[0], "recomputed, never served");
    let st = e.checked_stats().wait_blocking().unwrap();
    e.shutdown();
    assert_eq!(st.prefill_tokens_computed, 24);
    assert!(tier(&st, "disk").corrupt >= 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A request that waits behind a running one gets its disk blocks read ahead while the other's steps
/// run: its restore takes them from memory (read-ahead hits), and its output is the same.
#[test]
fn a_waiting_request_reads_its_disk_blocks_ahead() {
    let dir = tmpdir("ahead");
    let config = EngineConfig {
        block_size: BS,
        max_num_seqs: 1,
        kv_offload: KvOffloadConfig {
            disk: disk(&dir),
            model_identity: "mock-model".into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let backend =
        MockBackend::new(BS, BLOCKS).with_step_delay(std::time::Duration::from_millis(10));
    let e = Engine::start(backend, config).unwrap();
    let a: Vec<u32> = (0..24).map(|i| i % 50 + 1).collect();
    let b: Vec<u32> = (0..36).map(|i| (i * 7) % 50 + 2).collect();
    let mut first = submit(&e, 1, a.clone(), SamplingParams::greedy(4));
    let reference = collect(&mut first).0;
    let mut s = submit(&e, 2, b, SamplingParams::greedy(4));
    collect(&mut s);
    // C decodes for 20 steps (200 ms) while A waits for the one sequence slot.
    let mut c = submit(&e, 3, vec![3, 1, 4, 1], SamplingParams::greedy(20));
    let mut again = submit(&e, 4, a, SamplingParams::greedy(4));
    collect(&mut c);
    assert_eq!(collect(&mut again).0, reference);
    let st = e.checked_stats().wait_blocking().unwrap();
    e.shutdown();
    let disk = tier(&st, "disk");
    assert!(
        disk.read_ahead >= 5,
        "A's 5 full blocks read ahead: {disk:?}"
    );
    assert!(disk.hits >= disk.read_ahead);
    std::fs::remove_dir_all(&dir).unwrap();
}
