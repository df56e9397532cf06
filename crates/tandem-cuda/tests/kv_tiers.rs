//! The KV tiers on the CUDA backend: blocks evicted from the GPU's pool go down to the host tier
//! through the bulk export (a device gather and a DMA into the page-locked pool), and come back up
//! through the bulk import when their prefix returns; the greedy output equals the same run with
//! tiers off, where the prefix is computed again. It needs an NVIDIA GPU (skips with a message
//! elsewhere); on the GPU machine `scripts/gpu/tiers_bench.sh test` runs it (built here with
//! `cargo test --release -p tandem-cuda --test kv_tiers --no-run`).

mod common;

use tandem_cuda::{CudaBackend, CudaLlama, CudaOptions, WeightSource};
use tandem_engine::{
    Engine, EngineConfig, EngineHandle, EngineRequest, EngineStats, KvOffloadConfig, SamplingParams,
};

const BLOCK: usize = 16;
/// Pool blocks: prompt B with its answer takes most of them, so A's blocks are evicted.
const BLOCKS: usize = 24;

fn start(offload: KvOffloadConfig) -> EngineHandle {
    let opts = CudaOptions {
        block_size: BLOCK,
        num_blocks: Some(BLOCKS),
        max_tokens: 512,
        max_seqs: 4,
        max_model_len: Some(512),
        ..CudaOptions::default()
    };
    let model = CudaLlama::new(
        common::small_llama(),
        WeightSource::Random { seed: 11 },
        opts,
    )
    .expect("the CUDA model loads");
    let config = EngineConfig {
        block_size: BLOCK,
        kv_offload: offload,
        ..Default::default()
    };
    Engine::start(CudaBackend::new(model), config).expect("the engine starts")
}

/// Prompt A (200 tokens), then B (300, which evicts A's blocks), then A again, one at a time: the
/// outputs, the prompt tokens the third request computed, and the stats at the end.
fn a_b_a(e: &EngineHandle) -> (Vec<Vec<u32>>, u64, EngineStats) {
    let a: Vec<u32> = (0..200).map(|i| (i * 37 % 4000) + 10).collect();
    let b: Vec<u32> = (0..300).map(|i| (i * 53 % 4000) + 20).collect();
    let mut outs = Vec::new();
    let mut before = 0;
    for (id, p) in [(1, &a), (2, &b), (3, &a)] {
        before = e.stats().prefill_tokens_computed;
        let mut s = e
            .submit(EngineRequest::new(id, p.clone(), SamplingParams::greedy(8)))
            .unwrap();
        let mut toks = Vec::new();
        while let Some(o) = s.blocking_recv() {
            toks.push(o.token);
            if o.finish.is_some() {
                break;
            }
        }
        outs.push(toks);
    }
    let st = e.checked_stats().wait_blocking().unwrap();
    (outs, st.prefill_tokens_computed - before, st)
}

#[test]
fn evicted_gpu_blocks_come_back_from_the_host_tier() {
    if !common::gpu_or_skip() {
        return;
    }
    let e = start(KvOffloadConfig::default());
    let (reference, recomputed_off, _) = a_b_a(&e);
    e.shutdown();
    assert!(
        recomputed_off > 100,
        "tiers off: most of A is computed again ({recomputed_off} tokens)"
    );

    let e = start(KvOffloadConfig {
        host: Some(64 << 20),
        ..Default::default()
    });
    let (outs, recomputed_on, st) = a_b_a(&e);
    e.shutdown();
    assert_eq!(outs, reference, "greedy output identical with tiers on");
    assert!(
        recomputed_on < BLOCK as u64,
        "A's full blocks come back from the host tier ({recomputed_on} tokens computed)"
    );
    let host = st.kv_tiers.iter().find(|t| t.tier == "host").unwrap();
    assert!(
        host.hits > 0 && host.bytes_up > 0 && host.bytes_down > 0,
        "{host:?}"
    );
    assert!(st.kv_restore_seconds.count >= 1);
}
