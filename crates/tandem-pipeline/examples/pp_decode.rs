//! Decode and prefill throughput of the default model unsplit (one backend, T threads) against a 2-stage pipeline
//! (stage 1 served on loopback from this process, T/2 threads per stage) for a batch of
//! sequences.
//!
//! `cargo run --release -p tandem-pipeline --example pp_decode -- [THREADS] [SEQS] [STEPS] [MICRO_BATCHES] [MIN_MICRO_BATCH_TOKENS]`

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tandem_cpu::CpuBackend;
use tandem_engine::{Backend, StageModel};
use tandem_model::{CpuLlama, ForwardBatch, LogitsWanted, Partition};
use tandem_pipeline::{
    serve_stage, CpuStage, PipelineBackend, PipelineConfig, StageServing, StageTimeouts,
};

const BLOCK: usize = 16;

/// Prefills `seqs` prompts of 32 tokens, then times `steps` decode steps of all sequences at once.
fn decode_tok_s(b: &mut dyn Backend, seqs: usize, steps: usize) -> f64 {
    let table = |s: usize| -> Vec<u32> { (0..8).map(|i| (s * 8 + i) as u32).collect() };
    let mut logits = Vec::new();
    let mut batch = ForwardBatch::default();
    for s in 0..seqs {
        let prompt: Vec<u32> = (0..32).map(|i| (100 + s * 37 + i * 11) as u32).collect();
        batch.push(&prompt, 0, table(s), LogitsWanted::Last);
    }
    b.forward(&batch, &mut logits).unwrap();
    let t = Instant::now();
    for step in 0..steps {
        batch.clear();
        for s in 0..seqs {
            batch.push(
                &[(7 + s + step) as u32],
                32 + step,
                table(s),
                LogitsWanted::Last,
            );
        }
        b.forward(&batch, &mut logits).unwrap();
    }
    (seqs * steps) as f64 / t.elapsed().as_secs_f64()
}

/// Times `reps` prefill steps of `seqs` fresh 64-token prompts each (rewriting the same blocks).
fn prefill_tok_s(b: &mut dyn Backend, seqs: usize, reps: usize) -> f64 {
    let table = |s: usize| -> Vec<u32> { (0..8).map(|i| (s * 8 + i) as u32).collect() };
    let mut logits = Vec::new();
    let mut batch = ForwardBatch::default();
    for s in 0..seqs {
        let prompt: Vec<u32> = (0..64).map(|i| (100 + s * 37 + i * 11) as u32).collect();
        batch.push(&prompt, 0, table(s), LogitsWanted::Last);
    }
    b.forward(&batch, &mut logits).unwrap();
    let t = Instant::now();
    for _ in 0..reps {
        b.forward(&batch, &mut logits).unwrap();
    }
    (seqs * 64 * reps) as f64 / t.elapsed().as_secs_f64()
}

fn main() {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .map_or(d, |v| v.parse().expect("a number"))
    };
    let (threads, seqs, steps, mbs) = (arg(1, 2), arg(2, 8), arg(3, 32), arg(4, 2));
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let m = tandem_model::load(&path, &Default::default()).expect("the default model");
    let c = &m.config;
    let budget = 64 * c.num_layers * 2 * c.num_kv_heads * BLOCK * c.head_dim * 4;

    let mut whole = CpuBackend::new(
        CpuLlama::new(c.clone(), m.weights.clone(), threads),
        BLOCK,
        budget,
    );
    let pp1 = decode_tok_s(&mut whole, seqs, steps);
    let pre1 = prefill_tok_s(&mut whole, seqs, 3);
    drop(whole);

    let per_stage = (threads / 2).max(1);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let stage = |i| -> Box<dyn StageModel> {
        let part = Partition::stage(c, i, 2).unwrap();
        Box::new(CpuStage::new(c, &m.weights, per_stage, part).unwrap())
    };
    let server = serve_stage(
        stage(1),
        &m.identity,
        1,
        2,
        l,
        StageServing {
            io: Duration::from_secs(60),
            kv_cache_memory: budget,
            key: None,
            tls: None,
        },
    )
    .unwrap();
    let cfg = PipelineConfig {
        micro_batches: mbs,
        min_micro_batch_tokens: arg(5, 1),
        block_size: BLOCK,
        kv_cache_memory: budget,
        timeouts: StageTimeouts::default(),
        cluster_key: None,
        tls: None,
        expert_counts_every: tandem_pipeline::DEFAULT_EXPERT_COUNTS_EVERY,
    };
    let mut pp =
        PipelineBackend::connect(stage(0), &m.identity, &[server.addr().to_string()], &cfg)
            .unwrap();
    let pp2 = decode_tok_s(&mut pp, seqs, steps);
    let pre2 = prefill_tok_s(&mut pp, seqs, 3);
    println!(
        "threads {threads}, {seqs} sequences: decode ({steps} steps) PP=1 {pp1:.1} tok/s, PP=2 {pp2:.1} tok/s; \
         prefill (64-token prompts) PP=1 {pre1:.1} tok/s, PP=2 {pre2:.1} tok/s \
         (PP=2: {per_stage} threads per stage, {mbs} micro-batches)"
    );
}
