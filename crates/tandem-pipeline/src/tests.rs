use super::*;
use crate::backend::split;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use tandem_cpu::CpuBackend;
use tandem_engine::sampler::argmax;
use tandem_engine::{Backend, LayerBlocks};
use tandem_model::{CpuLlama, ForwardBatch, LoadedModel, LogitsWanted};
use tandem_testkit::model;

const BLOCK: usize = 4;
const BLOCKS: usize = 64;

fn budget(m: &LoadedModel) -> usize {
    let c = &m.config;
    BLOCKS * c.num_layers * 2 * c.num_kv_heads * BLOCK * c.head_dim * 4
}

/// A stage server's settings for the test pipelines: `io`, no secret, and exactly their KV budget.
fn serving(m: &LoadedModel, io: Duration) -> StageServing {
    StageServing {
        io,
        kv_cache_memory: budget(m),
        key: None,
        tls: None,
    }
}

/// Stage `stage` of `stages` of the test model on the CPU, one kernel thread.
fn cpu_stage(m: &LoadedModel, stage: usize, stages: usize) -> Box<dyn StageModel> {
    let part = tandem_model::Partition::stage(&m.config, stage, stages).unwrap();
    Box::new(CpuStage::new(&m.config, &m.weights, 1, part).unwrap())
}

fn servers(m: &LoadedModel, stages: usize) -> Vec<StageServer> {
    (1..stages)
        .map(|s| {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            serve_stage(
                cpu_stage(m, s, stages),
                &m.identity,
                s,
                stages,
                l,
                serving(m, Duration::from_secs(30)),
            )
            .unwrap()
        })
        .collect()
}

/// The first stage's configuration over `BLOCK`-token blocks and the test budget, with no cluster key.
fn config(m: &LoadedModel, micro_batches: usize, timeouts: StageTimeouts) -> PipelineConfig {
    PipelineConfig {
        micro_batches,
        min_micro_batch_tokens: 1,
        block_size: BLOCK,
        kv_cache_memory: budget(m),
        timeouts,
        cluster_key: None,
        tls: None,
        expert_counts_every: DEFAULT_EXPERT_COUNTS_EVERY,
    }
}

fn pipeline(m: &LoadedModel, servers: &[StageServer], micro_batches: usize) -> PipelineBackend {
    let addrs: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let timeouts = StageTimeouts {
        connect: Duration::from_secs(2),
        io: Duration::from_secs(30),
    };
    let cfg = config(m, micro_batches, timeouts);
    PipelineBackend::connect(cpu_stage(m, 0, addrs.len() + 1), &m.identity, &addrs, &cfg).unwrap()
}

fn reference(m: &LoadedModel) -> CpuBackend {
    CpuBackend::new(
        CpuLlama::new(m.config.clone(), m.weights.clone(), 1),
        BLOCK,
        budget(m),
    )
}

/// Three sequences: two prefill chunks each (the first wanting no logits, one wanting all rows), then
/// greedy decode steps; every step's logits of `b` must equal `a`'s bit for bit.
fn run_same(a: &mut dyn Backend, b: &mut dyn Backend, decode_steps: usize) {
    let prompts: [Vec<u32>; 3] = [
        (0..13).map(|i| 100 + i * 7).collect(),
        (0..5).map(|i| 2000 + i * 3).collect(),
        (0..9).map(|i| 500 + i * 11).collect(),
    ];
    let table = |s: usize| -> Vec<u32> { (0..16).map(|i| (s * 16 + i) as u32).collect() };
    let mut pos = [0usize; 3];
    let mut next = [0u32; 3];
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    let vocab = a.vocab_size();
    // Prefill in two chunks: the first three tokens, then the rest.
    for chunk in 0..2 {
        let mut batch = ForwardBatch::default();
        for (s, p) in prompts.iter().enumerate() {
            let r = if chunk == 0 { 0..3 } else { 3..p.len() };
            let logits = match (chunk, s) {
                (0, _) => LogitsWanted::None,
                (_, 1) => LogitsWanted::All,
                _ => LogitsWanted::Last,
            };
            batch.push(&p[r.clone()], pos[s], table(s), logits);
            pos[s] += r.len();
        }
        a.forward(&batch, &mut la).unwrap();
        b.forward(&batch, &mut lb).unwrap();
        assert_eq!(la.len(), batch.logits_rows() * vocab);
        assert!(la == lb, "prefill chunk {chunk}: logits differ");
        if chunk == 1 {
            let rows: Vec<&[f32]> = la.chunks(vocab).collect();
            next = [
                argmax(rows[0]),
                argmax(rows[rows.len() - 2]),
                argmax(rows[rows.len() - 1]),
            ];
        }
    }
    for step in 0..decode_steps {
        let mut batch = ForwardBatch::default();
        for s in 0..3 {
            batch.push(&[next[s]], pos[s], table(s), LogitsWanted::Last);
            pos[s] += 1;
        }
        a.forward(&batch, &mut la).unwrap();
        b.forward(&batch, &mut lb).unwrap();
        assert!(la == lb, "decode step {step}: logits differ");
        for (s, row) in la.chunks(vocab).enumerate() {
            next[s] = argmax(row);
        }
    }
}

#[test]
fn pipelined_logits_equal_the_whole_model_bit_for_bit() {
    let Some(m) = model() else { return };
    for (stages, micro_batches) in [(2, 0), (2, 1), (3, 3), (2, 5)] {
        let srv = servers(m, stages);
        let mut p = pipeline(m, &srv, micro_batches);
        assert_eq!(p.stages(), stages);
        let mut r = reference(m);
        assert_eq!(p.kv_layout(), r.kv_layout());
        run_same(&mut r, &mut p, 3);
    }
}

#[test]
fn splits_keep_order_and_balance_tokens() {
    let mut batch = ForwardBatch::default();
    for (i, n) in [10usize, 1, 1, 1, 9, 2].into_iter().enumerate() {
        batch.push(&vec![i as u32; n], 0, vec![0], LogitsWanted::Last);
    }
    let mut mbs = Vec::new();
    let m = split(&batch, 2, &mut mbs);
    assert_eq!(m, 2);
    let seqs: Vec<usize> = mbs[..m].iter().map(|b| b.seqs.len()).collect();
    assert_eq!(seqs, [3, 3]);
    let tokens: Vec<u32> = mbs[..m].iter().flat_map(|b| b.tokens.clone()).collect();
    assert_eq!(tokens, batch.tokens);
    // More micro-batches than sequences: one sequence each.
    assert_eq!(split(&batch, 9, &mut mbs), 6);
    assert!(mbs[..6].iter().all(|b| b.seqs.len() == 1));
}

#[test]
fn blocks_of_a_remote_stage_export_import_and_copy() {
    let Some(m) = model() else { return };
    let srv = servers(m, 2);
    let mut p = pipeline(m, &srv, 2);
    let mut r = reference(m);
    run_same(&mut r, &mut p, 1);
    let bytes = p.kv_layout().block_bytes();
    let last = m.config.num_layers - 1;
    let (mut want, mut got) = (vec![0u8; bytes], vec![0u8; bytes]);
    // Sequence 0 wrote block 0 in every layer: layer 0 is local, the last layer is on stage 1.
    for layer in [0, last] {
        r.export_block(layer, 0, &mut want).unwrap();
        p.export_block(layer, 0, &mut got).unwrap();
        assert!(got == want, "layer {layer} exported differently");
        assert!(want.iter().any(|&b| b != 0));
    }
    // Import into a free block of the remote stage, read it back, then copy it.
    p.import_block(last, 40, &want).unwrap();
    p.export_block(last, 40, &mut got).unwrap();
    assert!(got == want);
    p.copy_block(40, 41).unwrap();
    p.export_block(last, 41, &mut got).unwrap();
    assert!(got == want);
    let e = p.export_block(last + 1, 0, &mut got).unwrap_err();
    assert!(e.message().contains("beyond the model"), "{e}");
    // Bulk: every layer of a run of blocks (one request per layer), as the unsplit model exports it,
    // and imported back into other blocks of both stages.
    let blocks = [0u32, 5, 0];
    let (we, ge) = (r.export_kv(&blocks).unwrap(), p.export_kv(&blocks).unwrap());
    assert_eq!(ge.num_layers(), m.config.num_layers);
    let moved = [50u32, 51, 52];
    for layer in 0..m.config.num_layers {
        assert!(
            ge.layer(layer).unwrap() == we.layer(layer).unwrap(),
            "layer {layer}"
        );
        let mut data = p.host_pool().take(blocks.len() * bytes).unwrap();
        data.as_mut_slice()
            .copy_from_slice(we.layer(layer).unwrap());
        p.import_kv(LayerBlocks::new(layer, &moved), data).unwrap();
    }
    let back = p.export_kv(&moved).unwrap();
    for layer in 0..m.config.num_layers {
        assert!(
            back.layer(layer).unwrap() == we.layer(layer).unwrap(),
            "layer {layer}"
        );
    }
    let e = p.import_kv(
        LayerBlocks::new(last, &[1]),
        p.host_pool().take(bytes + 1).unwrap(),
    );
    assert!(e.unwrap_err().message().contains("bytes for 1 blocks"));
}

#[test]
fn a_killed_stage_fails_the_step_within_a_bound() {
    let Some(m) = model() else { return };
    let mut srv = servers(m, 2);
    let mut p = pipeline(m, &srv, 2);
    let mut r = reference(m);
    run_same(&mut r, &mut p, 1);
    srv.pop().unwrap().shutdown();
    let mut batch = ForwardBatch::default();
    batch.push(&[1, 2, 3], 0, vec![0], LogitsWanted::Last);
    batch.push(&[4, 5], 0, vec![1], LogitsWanted::Last);
    let mut logits = Vec::new();
    let t = Instant::now();
    let e = p.forward(&batch, &mut logits).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(e.message().contains("pipeline stage 1"), "{e}");
    assert_eq!(e.kind(), tandem_engine::BackendErrorKind::WorkerLost, "{e}");
    // The link stays failed: the stage's KV went with it.
    let e = p.forward(&batch, &mut logits).unwrap_err();
    assert!(e.message().contains("failed earlier"), "{e}");
    let mut out = vec![0u8; p.kv_layout().block_bytes()];
    assert!(p
        .export_block(m.config.num_layers - 1, 0, &mut out)
        .is_err());
}

#[test]
fn a_mismatched_stage_is_refused_naming_the_field() {
    let Some(m) = model() else { return };
    // A server for stage 1 of 3 behind a worker that expects stage 1 of 2.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let srv = serve_stage(
        cpu_stage(m, 1, 3),
        &m.identity,
        1,
        3,
        l,
        serving(m, Duration::from_secs(5)),
    )
    .unwrap();
    let cfg = config(m, 0, StageTimeouts::default());
    let e = PipelineBackend::connect(
        cpu_stage(m, 0, 2),
        &m.identity,
        &[srv.addr().to_string()],
        &cfg,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`stages`"), "{e}");
    let other = ModelIdentity("another-model".into());
    let e = PipelineBackend::connect(cpu_stage(m, 0, 2), &other, &[srv.addr().to_string()], &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`model_id`"), "{e}");
}

/// The stage server sizes its KV pool from the first worker's hello, so that hello must not ask for
/// more than the stage's own budget (`StageServing::kv_cache_memory`, the whole model's KV as the
/// worker's): a bigger pool (one block more than the budget, 1,000 times it, and one whose byte count
/// overflows usize) is refused with an `Error` frame naming the budget before anything is allocated, and
/// the server stays unsized for a worker that fits. The old server allocated whatever the first client
/// asked for.
#[test]
fn a_pool_beyond_the_stage_budget_is_refused_before_it_is_allocated() {
    let Some(m) = model() else { return };
    let srv = servers(m, 2).pop().unwrap();
    let part = tandem_model::Partition::stage(&m.config, 1, 2).unwrap();
    let stage1 = cpu_stage(m, 1, 2);
    let asking = |blocks: usize, block_size: usize| {
        let h = hello(&*stage1, &m.identity, &part, (1, 2), (block_size, blocks));
        link::StageClient::connect(srv.addr(), &h, StageTimeouts::default(), None)
    };
    for (blocks, block_size) in [
        (BLOCKS + 1, BLOCK),
        (BLOCKS * 1000, BLOCK),
        (usize::MAX / 2, usize::MAX / 2),
    ] {
        let e = asking(blocks, block_size).err().unwrap().to_string();
        assert!(
            e.contains(&format!("more than this stage's budget of {}", budget(m))),
            "{e}"
        );
    }
    // Exactly the budget fits (the worker's own sizing of it), and sizes the pool.
    let addrs = [srv.addr().to_string()];
    let cfg = config(m, 0, StageTimeouts::default());
    drop(PipelineBackend::connect(cpu_stage(m, 0, 2), &m.identity, &addrs, &cfg).unwrap());
    let sized = asking(BLOCKS, BLOCK).unwrap();
    assert_eq!(sized.remote().num_blocks, BLOCKS);
}

/// The `Backend` contract (tandem_testkit::conformance) on a pipeline of three CPU stages, two of them
/// stage servers: bit-exact like the whole model, so at tolerance 0. Each backend gets stage servers
/// of its own (a server's KV pool belongs to the worker connected to it).
#[test]
fn a_cpu_pipeline_conforms() {
    let Some(m) = model() else { return };
    let mut kept = Vec::new();
    tandem_testkit::conformance::run(
        || {
            let srv = servers(m, 3);
            let p = pipeline(m, &srv, 2);
            kept.push(srv);
            p
        },
        0.0,
    );
}

/// A tiny mixture-of-experts fixture from `tests/fixtures/hf`.
fn moe_fixture(name: &str) -> LoadedModel {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name);
    tandem_model::load(&dir, &tandem_model::LoadOptions::default()).unwrap()
}

/// A pipeline of `stages` CPU stages over `m` whose later stages' expert counts are fetched at most
/// every `every`.
fn moe_pipeline(m: &LoadedModel, srv: &[StageServer], every: Duration) -> PipelineBackend {
    let addrs: Vec<String> = srv.iter().map(|s| s.addr().to_string()).collect();
    let mut cfg = config(m, 2, StageTimeouts::default());
    cfg.expert_counts_every = every;
    PipelineBackend::connect(cpu_stage(m, 0, addrs.len() + 1), &m.identity, &addrs, &cfg).unwrap()
}

/// Three prompts prefilled in one step (cut into micro-batches), then two greedy decode steps, on
/// both backends with the same logits; returns the token rows computed.
fn moe_steps(a: &mut dyn Backend, b: &mut dyn Backend) -> u64 {
    let prompts: [Vec<u32>; 3] = [
        (0..11).map(|i| (i * 37 + 5) % 512).collect(),
        (0..4).map(|i| 300 + i * 3).collect(),
        (0..7).map(|i| 40 + i * 61).collect(),
    ];
    let table = |s: usize| -> Vec<u32> { (0..8).map(|i| (s * 8 + i) as u32).collect() };
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    let mut batch = ForwardBatch::default();
    for (s, p) in prompts.iter().enumerate() {
        batch.push(p, 0, table(s), LogitsWanted::Last);
    }
    let mut rows = batch.tokens.len() as u64;
    a.forward(&batch, &mut la).unwrap();
    b.forward(&batch, &mut lb).unwrap();
    assert!(la == lb, "prefill logits differ");
    let vocab = a.vocab_size();
    let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
    for step in 0..2 {
        let next: Vec<u32> = la.chunks(vocab).map(argmax).collect();
        let mut batch = ForwardBatch::default();
        for s in 0..3 {
            batch.push(&[next[s]], pos[s], table(s), LogitsWanted::Last);
            pos[s] += 1;
        }
        rows += 3;
        a.forward(&batch, &mut la).unwrap();
        b.forward(&batch, &mut lb).unwrap();
        assert!(la == lb, "decode step {step}: logits differ");
    }
    rows
}

/// With PP=2 and PP=3 over the tiny Qwen3-MoE (layer 1 dense) and Qwen2-MoE (shared expert) fixtures,
/// the pipeline's expert counts are the unsplit model's for the same steps: every MoE layer, the
/// remote stages' included (the old backend reported stage 0's only), each once, in layer order,
/// with every computed row routed to top-k experts of each layer.
#[test]
fn remote_stages_report_expert_counts_equal_to_the_whole_model_s() {
    for name in ["tiny-qwen3-moe", "tiny-qwen2-moe"] {
        let m = moe_fixture(name);
        let moe = m.config.moe.clone().unwrap();
        let moe_layers: Vec<usize> = (0..m.config.num_layers)
            .filter(|&l| matches!(m.config.layer(l).mlp, tandem_model::MlpKind::Moe))
            .collect();
        for stages in [2, 3] {
            let srv = servers(&m, stages);
            let mut p = moe_pipeline(&m, &srv, Duration::ZERO);
            let mut r = reference(&m);
            let (mut want, mut got) = (Vec::new(), Vec::new());
            p.moe_expert_tokens(&mut got);
            let layers: Vec<usize> = got.iter().map(|l| l.layer).collect();
            assert_eq!(layers, moe_layers, "{name} PP={stages}: before any step");
            assert!(got.iter().all(|l| l.tokens == vec![0; moe.num_experts]));
            let rows = moe_steps(&mut r, &mut p);
            r.moe_expert_tokens(&mut want);
            p.moe_expert_tokens(&mut got);
            assert_eq!(got, want, "{name} PP={stages}");
            let layers: Vec<usize> = got.iter().map(|l| l.layer).collect();
            assert_eq!(layers, moe_layers, "{name} PP={stages}");
            for l in &got {
                let routed: u64 = l.tokens.iter().sum();
                assert_eq!(routed, rows * moe.top_k as u64, "{name} layer {}", l.layer);
            }
        }
    }
}

/// The engine asks for counts after every step; the later stages' are fetched then only once
/// `expert_counts_every` has passed, and again whenever it asks twice with no step between (its
/// publish before idling), so the counts a resting engine shows are exact.
#[test]
fn remote_expert_counts_are_fetched_off_the_step_path_and_exact_at_rest() {
    let m = moe_fixture("tiny-qwen2-moe");
    let srv = servers(&m, 2);
    let mut p = moe_pipeline(&m, &srv, Duration::from_secs(3600));
    let mut r = reference(&m);
    let (mut want, mut got) = (Vec::new(), Vec::new());
    p.moe_expert_tokens(&mut got);
    moe_steps(&mut r, &mut p);
    r.moe_expert_tokens(&mut want);
    let remote = p.links[0].layers.clone();
    // Asked right after steps, within the interval: stage 0's counts are fresh, stage 1's as fetched.
    p.moe_expert_tokens(&mut got);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        if remote.contains(&g.layer) {
            assert!(g.tokens.iter().all(|&n| n == 0), "layer {}", g.layer);
        } else {
            assert_eq!(g, w);
        }
    }
    // Asked again with no step between: fetched, exact.
    p.moe_expert_tokens(&mut got);
    assert_eq!(got, want);
}
