//! Engine tests on the mock backend (whose logits depend on the KV read through block tables), through
//! the public API only.

use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;
use tandem_engine::bench::{run_engine_bench, BenchOptions};
use tandem_engine::sampler::logprobs_of;
use tandem_engine::*;
use tandem_model::{ForwardBatch, LogitsWanted};
use tandem_testkit::{MockBackend, MockCounts};

mod common;
use common::*;

fn cfg(block_size: usize) -> EngineConfig {
    EngineConfig {
        block_size,
        ..Default::default()
    }
}

fn start(block_size: usize, num_blocks: usize, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let mut c = cfg(block_size);
    f(&mut c);
    Engine::start(MockBackend::new(block_size, num_blocks), c).unwrap()
}

/// The tokens a request produces alone on a roomy engine without prefix caching or chunking.
fn alone(prompt: &[u32], params: &SamplingParams) -> Vec<u32> {
    let e = start(4, 512, |c| {
        c.enable_prefix_caching = false;
        c.enable_chunked_prefill = false;
        c.max_num_batched_tokens = 4096;
    });
    let mut s = submit(&e, 1, prompt.to_vec(), params.clone());
    let out = collect(&mut s).0;
    e.shutdown();
    out
}

fn assert_no_leak(e: &EngineHandle) -> EngineStats {
    let st = e.checked_stats().wait_blocking().unwrap();
    assert_eq!(st.kv_blocks_used, 0, "{st:?}");
    assert_eq!((st.running, st.waiting), (0, 0));
    st
}

#[test]
fn generates_until_max_tokens_and_frees_blocks() {
    let e = start(4, 64, |_| {});
    let mut s = submit(&e, 7, vec![1, 2, 3, 4, 5], SamplingParams::greedy(6));
    assert_eq!(s.id(), 7);
    let (toks, fin) = collect(&mut s);
    assert_eq!(toks.len(), 6);
    assert_eq!(fin, Some(FinishReason::Length));
    assert!(s.blocking_recv().is_none(), "nothing after the finish");
    assert_eq!(toks, alone(&[1, 2, 3, 4, 5], &SamplingParams::greedy(6)));
    let st = assert_no_leak(&e);
    assert_eq!(st.generation_tokens_total, 6);
    assert_eq!(st.prompt_tokens_total, 5);
    assert_eq!(st.requests_finished_total, 1);
    assert_eq!(st.prefill_tokens_computed, 5);
    assert!(st.kv_blocks_cached > 0, "freed full blocks stay cached");
    e.shutdown();
}

/// The engine times its own steps: every step's wall time, and the forward pass inside it, so that the
/// host work between them (what `tandem profile` writes as the per-step overhead) is measured, not guessed.
#[test]
fn steps_count_their_wall_time_and_their_forward_pass() {
    let e = start(4, 64, |_| {});
    let idle = e.checked_stats().wait_blocking().unwrap();
    assert_eq!(idle.host_seconds_per_step(&EngineStats::default()), None);
    collect(&mut submit(
        &e,
        1,
        vec![1, 2, 3, 4, 5],
        SamplingParams::greedy(6),
    ));
    let st = assert_no_leak(&e);
    assert_eq!(st.steps_total, 6);
    assert!(st.forward_seconds_total > 0.0, "{st:?}");
    assert!(st.step_seconds_total >= st.forward_seconds_total, "{st:?}");
    let host = st.host_seconds_per_step(&idle).unwrap();
    assert!(host >= 0.0 && host * 6.0 <= st.step_seconds_total, "{host}");
    e.shutdown();
}

#[test]
fn stop_tokens_eos_and_context_length_end_requests() {
    let reference = alone(&[9, 9, 9], &SamplingParams::greedy(20));
    let e = start(4, 64, |c| c.max_model_len = Some(10));
    // A stop token id ends generation on its first occurrence, and is reported.
    let stop = reference[3];
    let first = reference.iter().position(|&t| t == stop).unwrap();
    let p = SamplingParams {
        stop_token_ids: vec![stop],
        ..SamplingParams::greedy(20)
    };
    let (toks, fin) = collect(&mut submit(&e, 1, vec![9, 9, 9], p));
    assert_eq!(
        (toks.as_slice(), fin),
        (&reference[..=first], Some(FinishReason::Stop))
    );
    // The context length (10) caps prompt + output.
    let (toks, fin) = collect(&mut submit(
        &e,
        2,
        vec![9, 9, 9],
        SamplingParams::greedy(20),
    ));
    assert_eq!((toks.len(), fin), (7, Some(FinishReason::Length)));
    assert_no_leak(&e);
    e.shutdown();

    // EOS (63 on the mock) stops unless ignore_eos: find a prompt whose greedy output contains it.
    let prompt = (0..200u32)
        .map(|i| vec![i % 60, i / 60 + 1])
        .find(|p| alone(p, &SamplingParams::greedy(30)).contains(&63))
        .expect("some prompt reaches EOS");
    let full = alone(&prompt, &SamplingParams::greedy(30));
    let e = start(4, 64, |_| {});
    let p = SamplingParams {
        ignore_eos: false,
        ..SamplingParams::greedy(30)
    };
    let (toks, fin) = collect(&mut submit(&e, 1, prompt, p));
    assert_eq!(fin, Some(FinishReason::Stop));
    assert_eq!(toks, full[..=full.iter().position(|&t| t == 63).unwrap()]);
    e.shutdown();
}

#[test]
fn submit_validates_synchronously() {
    let e = start(4, 8, |c| {
        c.max_waiting = 2;
        c.max_model_len = Some(20);
    });
    assert!(matches!(
        e.submit(EngineRequest::new(1, vec![], SamplingParams::greedy(1))),
        Err(EngineError::EmptyPrompt)
    ));
    assert!(matches!(
        e.submit(EngineRequest::new(
            1,
            vec![1; 20],
            SamplingParams::greedy(1)
        )),
        Err(EngineError::PromptTooLong {
            prompt: 20,
            max_tokens: 1,
            max_model_len: 20
        })
    ));
    assert!(matches!(
        e.submit(EngineRequest::new(1, vec![100], SamplingParams::greedy(1))),
        Err(EngineError::InvalidParams(_))
    ));
    assert!(matches!(
        e.submit(EngineRequest::new(
            1,
            vec![1],
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::greedy(1)
            }
        )),
        Err(EngineError::InvalidParams(_))
    ));
    // An engine started without a vocabulary refuses a guided request rather than answering freely.
    assert!(matches!(
        e.submit(EngineRequest::new(
            1,
            vec![1],
            SamplingParams {
                guidance: Some(Guidance::JsonObject),
                ..SamplingParams::greedy(1)
            }
        )),
        Err(EngineError::Guidance(_))
    ));
    let e2 = start(4, 2, |_| {});
    assert!(matches!(
        e2.submit(EngineRequest::new(1, vec![1; 9], SamplingParams::greedy(1))),
        Err(EngineError::KvCacheTooSmall { .. })
    ));
    e2.shutdown();
    let s1 = submit(&e, 1, vec![1], SamplingParams::greedy(1));
    assert!(matches!(
        e.submit(EngineRequest::new(1, vec![1], SamplingParams::greedy(1))),
        Err(EngineError::DuplicateId(1))
    ));
    drop(s1);
    e.shutdown();
    assert!(matches!(
        e.submit(EngineRequest::new(5, vec![1], SamplingParams::greedy(1))),
        Err(EngineError::Stopped)
    ));
}

#[test]
fn queue_full_when_too_many_wait() {
    // One sequence at a time on a slowed-down mock: the rest must queue.
    let slow = MockBackend::new(4, 1024).with_step_delay(Duration::from_millis(1));
    let e = Engine::start(
        slow,
        EngineConfig {
            max_waiting: 2,
            max_num_seqs: 1,
            ..cfg(4)
        },
    )
    .unwrap();
    let mut streams = Vec::new();
    let mut full = false;
    for id in 0..50 {
        match e.submit(EngineRequest::new(
            id,
            vec![1; 8],
            SamplingParams::greedy(200),
        )) {
            Ok(s) => streams.push(s),
            Err(EngineError::QueueFull { waiting }) => {
                assert!(waiting >= 2);
                full = true;
                break;
            }
            Err(other) => panic!("{other}"),
        }
    }
    assert!(full, "max_waiting must be enforced");
    drop(streams);
    assert_no_leak(&e);
    e.shutdown();
}

#[test]
fn abort_and_dropped_stream_free_blocks_at_once() {
    let slow = MockBackend::new(4, 64).with_step_delay(Duration::from_millis(5));
    let e = Engine::start(
        slow,
        EngineConfig {
            enable_prefix_caching: false,
            ..cfg(4)
        },
    )
    .unwrap();
    let mut s = submit(&e, 1, vec![1, 2, 3], SamplingParams::greedy(10_000));
    for _ in 0..3 {
        assert!(s.blocking_recv().unwrap().finish.is_none());
    }
    assert!(e.checked_stats().wait_blocking().unwrap().kv_blocks_used > 0);
    drop(s);
    let st = assert_no_leak(&e);
    assert_eq!(st.kv_blocks_cached, 0);
    let mut s = submit(&e, 2, vec![1, 2, 3], SamplingParams::greedy(10_000));
    s.blocking_recv().unwrap();
    e.abort(2);
    while s.blocking_recv().is_some() {}
    assert!(s.error().is_none(), "abort is not an error");
    assert_no_leak(&e);
    // The id is free again.
    let mut s = submit(&e, 2, vec![1], SamplingParams::greedy(2));
    assert_eq!(collect(&mut s).0.len(), 2);
    e.shutdown();
}

#[test]
fn backend_error_fails_the_step_and_engine_keeps_serving() {
    let e = Engine::start(MockBackend::new(4, 64).fail_at_step(2), cfg(4)).unwrap();
    let mut s = submit(&e, 1, vec![1, 2], SamplingParams::greedy(10));
    let (toks, fin) = collect(&mut s);
    assert_eq!((toks.len(), fin), (2, None));
    assert!(matches!(s.error(), Some(EngineError::Backend(_))));
    assert_no_leak(&e);
    let (toks, fin) = collect(&mut submit(&e, 2, vec![1, 2], SamplingParams::greedy(3)));
    assert_eq!((toks.len(), fin), (3, Some(FinishReason::Length)));
    e.shutdown();
}

#[test]
fn shutdown_closes_live_streams() {
    let e = Engine::start(
        MockBackend::new(4, 64).with_step_delay(Duration::from_millis(5)),
        cfg(4),
    )
    .unwrap();
    let mut s = submit(&e, 1, vec![1, 2], SamplingParams::greedy(1_000_000));
    s.blocking_recv().unwrap();
    e.shutdown();
    while s.blocking_recv().is_some() {}
    assert!(matches!(s.error(), Some(EngineError::Stopped)));
}

#[test]
fn prefix_cache_hits_are_counted_in_tokens_and_preserve_outputs() {
    let e = start(4, 64, |_| {});
    let prompt: Vec<u32> = (0..13).collect();
    let want = alone(&prompt, &SamplingParams::greedy(5));
    // The second request finds the first's full blocks cached.
    for id in 1..=2 {
        let mut s = submit(&e, id, prompt.clone(), SamplingParams::greedy(5));
        assert_eq!(collect(&mut s).0, want, "request {id}");
    }
    let st = assert_no_leak(&e);
    assert_eq!((st.prefix_cache_queries, st.prefix_cache_hits), (26, 12));
    assert_eq!(st.prefill_tokens_computed, 13 + 1);
    e.shutdown();
}

#[test]
fn seeded_sampling_is_reproducible_across_engines_and_preemption() {
    let p = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
        seed: Some(42),
        max_tokens: 30,
        ..Default::default()
    };
    let want = alone(&[3, 1, 4, 1, 5], &p);
    // Tiny pool: 3 concurrent sequences preempt one another.
    let e = start(2, 12, |_| {});
    let mut streams = submit_n(&e, 3, &[3, 1, 4, 1, 5], &p);
    for s in &mut streams {
        assert_eq!(collect(s).0, want);
    }
    let st = assert_no_leak(&e);
    assert!(st.preemptions_total > 0, "{st:?}");
    e.shutdown();
}

#[test]
fn logprobs_are_reported_when_asked() {
    let e = start(4, 64, |_| {});
    let p = SamplingParams {
        logprobs: Some(3),
        ..SamplingParams::greedy(2)
    };
    let mut s = submit(&e, 1, vec![1, 2], p);
    let o = s.blocking_recv().unwrap();
    let lp = o.logprobs.unwrap();
    assert_eq!(lp.top.len(), 3);
    assert_eq!(lp.top[0].0, o.token, "greedy picks the most likely token");
    assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6 && lp.logprob < 0.0);
    e.shutdown();
}

fn prefill_only(timeout: Duration) -> RequestMode {
    RequestMode::PrefillOnly {
        pin_timeout: timeout,
    }
}

/// Prefills on engine `a`, moves the KV b does not already cache to engine `b` and decodes there;
/// returns b's tokens and its import plan.
fn transfer_planned(
    a: &EngineHandle,
    b: &EngineHandle,
    id: u64,
    prompt: &[u32],
    params: &SamplingParams,
) -> (Vec<u32>, ImportPlan) {
    let req = EngineRequest {
        id,
        prompt: prompt.to_vec(),
        params: params.clone(),
        mode: prefill_only(Duration::from_secs(60)),
    };
    let (first, fin) = collect(&mut a.submit(req).unwrap());
    assert_eq!((first.len(), fin), (1, Some(FinishReason::Length)));
    let kv = a.export_blocks(id).wait_blocking().unwrap();
    assert_eq!(kv.first_token, first[0]);
    assert_eq!(kv.num_tokens, prompt.len());
    let (mut stream, plan) = import(b, id, prompt.to_vec(), params.clone(), first[0]);
    let plan = plan.wait_blocking().unwrap();
    assert_eq!(plan.num_blocks, kv.num_blocks);
    for layer in 0..kv.layout.n_layers {
        for blk in plan.needed() {
            b.import_block(id, layer, blk, kv.block(layer, blk).unwrap().to_vec())
                .wait_blocking()
                .unwrap();
        }
    }
    b.start_decoding(id).wait_blocking().unwrap();
    a.release_pin(id);
    (collect(&mut stream).0, plan)
}

/// [`transfer_planned`] without the plan.
fn transfer(
    a: &EngineHandle,
    b: &EngineHandle,
    id: u64,
    prompt: &[u32],
    params: &SamplingParams,
) -> Vec<u32> {
    transfer_planned(a, b, id, prompt, params).0
}

#[test]
fn imports_share_the_decode_side_prefix_cache_and_import_only_the_rest() {
    let a = start(4, 64, |_| {});
    let b = start(4, 64, |_| {});
    let head: Vec<u32> = (0..12).map(|i| (i * 11 + 2) % 60).collect();
    let p1: Vec<u32> = head.iter().copied().chain([5, 6]).collect();
    let p2: Vec<u32> = head
        .iter()
        .copied()
        .chain([7, 8, 9, 10, 11, 12, 13])
        .collect();
    // Nothing cached yet: all 4 blocks (3 full + 1 partial) are imported.
    let (out, plan) = transfer_planned(&a, &b, 1, &p1, &SamplingParams::greedy(6));
    assert_eq!(out, alone(&p1, &SamplingParams::greedy(6)));
    assert_eq!(
        plan,
        ImportPlan {
            num_blocks: 4,
            cached: 0,
            layer_from: vec![0; 2],
        }
    );
    assert_no_leak(&b);
    // The shared 12-token head is 3 full blocks in b's cache: only blocks 3 and 4 are imported.
    let (out, plan) = transfer_planned(&a, &b, 2, &p2, &SamplingParams::greedy(6));
    assert_eq!(out, alone(&p2, &SamplingParams::greedy(6)));
    assert_eq!(
        plan,
        ImportPlan {
            num_blocks: 5,
            cached: 3,
            layer_from: vec![3; 2],
        }
    );
    assert_eq!(plan.needed(), 3..5);
    // A prompt of exactly the cached head: every block is cached, nothing is imported.
    let (out, plan) = transfer_planned(&a, &b, 3, &head, &SamplingParams::greedy(6));
    assert_eq!(out, alone(&head, &SamplingParams::greedy(6)));
    assert_eq!(
        plan,
        ImportPlan {
            num_blocks: 3,
            cached: 3,
            layer_from: vec![3; 2],
        }
    );
    assert!(plan.needed().is_empty());
    let st = assert_no_leak(&b);
    assert_eq!(st.prefill_tokens_computed, 0, "b never prefills");
    assert_eq!(
        (st.import_blocks_cached, st.import_blocks_needed),
        (3 + 3, 4 + 2)
    );
    assert_eq!(st.prefix_cache_hits, 2 * 12);
    assert_no_leak(&a);

    // While an import holds shared blocks, the accounting explains them and they cannot be overwritten.
    let (s, plan) = import(&b, 9, p2.clone(), SamplingParams::greedy(3), 1);
    let plan = plan.wait_blocking().unwrap();
    assert_eq!(
        plan.cached, 4,
        "p2's 4th block was named when its first import finished"
    );
    let st = b.checked_stats().wait_blocking().unwrap();
    assert_eq!(st.kv_blocks_used, 5);
    let bb = b.kv_layout().block_bytes();
    assert!(b
        .import_block(9, 0, 0, vec![0; bb])
        .wait_blocking()
        .is_err());
    b.import_block(9, 0, 4, vec![0; bb])
        .wait_blocking()
        .unwrap();
    drop(s);
    assert_no_leak(&b);
    a.shutdown();
    b.shutdown();
}

/// A sliding-window layer's import starts at the block of the first position the first decoded token
/// sees; the blocks before it are refused for that layer only, and a sequence imported so never names
/// its blocks in the prefix cache (some of their layers hold no KV).
#[test]
fn windowed_layers_import_only_their_window_and_stay_out_of_the_prefix_cache() {
    let windowed = || Engine::start(MockBackend::new(4, 64).with_window(6), cfg(4)).unwrap();
    let (a, b) = (windowed(), windowed());
    let prompt: Vec<u32> = (0..14).map(|i| (i * 5 + 1) % 60).collect();
    let params = SamplingParams::greedy(5);
    let req = EngineRequest {
        id: 1,
        prompt: prompt.clone(),
        params: params.clone(),
        mode: prefill_only(Duration::from_secs(60)),
    };
    let (first, _) = collect(&mut a.submit(req).unwrap());
    let kv = a.export_blocks(1).wait_blocking().unwrap();
    let (mut s, plan) = import(&b, 1, prompt.clone(), params.clone(), first[0]);
    let plan = plan.wait_blocking().unwrap();
    // Position 14 sees 9..=14: layer 0 from block 2, layer 1 (global) everything.
    assert_eq!(
        plan,
        ImportPlan {
            num_blocks: 4,
            cached: 0,
            layer_from: vec![2, 0],
        }
    );
    assert_eq!((plan.layer_needed(0), plan.layer_needed(1)), (2..4, 0..4));
    let bb = b.kv_layout().block_bytes();
    let refused = b.import_block(1, 0, 1, vec![0; bb]).wait_blocking();
    assert!(refused.is_err(), "block 1 of the windowed layer");
    for layer in 0..2 {
        for blk in plan.layer_needed(layer) {
            b.import_block(1, layer, blk, kv.block(layer, blk).unwrap().to_vec())
                .wait_blocking()
                .unwrap();
        }
    }
    b.start_decoding(1).wait_blocking().unwrap();
    a.release_pin(1);
    // Decoding reads only what was imported (the mock checks every position it reads).
    let got: Vec<u32> = collect(&mut s).0;
    let mut want = collect(&mut submit(&a, 2, prompt.clone(), params.clone())).0;
    want.truncate(got.len());
    assert_eq!(got, want);
    // The same prompt again finds nothing cached: the first import's blocks were never named.
    let (s2, plan) = import(&b, 3, prompt, params, 3);
    assert_eq!(plan.wait_blocking().unwrap().cached, 0);
    drop(s2);
    assert_no_leak(&a);
    assert_no_leak(&b);
    a.shutdown();
    b.shutdown();
}

#[test]
fn prefill_export_import_decode_matches_colocated_run() {
    let a = start(4, 64, |c| c.max_num_batched_tokens = 5);
    let b = start(4, 64, |_| {});
    let prompt: Vec<u32> = (0..11).map(|i| (i * 7) % 60).collect();
    let want = alone(&prompt, &SamplingParams::greedy(12));
    assert_eq!(
        transfer(&a, &b, 1, &prompt, &SamplingParams::greedy(12)),
        want
    );
    let sb = assert_no_leak(&b);
    assert_eq!(
        sb.prefill_tokens_computed, 0,
        "decode worker must not prefill"
    );
    assert_eq!(sb.generation_tokens_total, 12);
    assert_no_leak(&a);
    // Seeded sampling continues identically too (the RNG is seeded on both sides).
    let p = SamplingParams {
        temperature: 1.0,
        seed: Some(5),
        ..SamplingParams::greedy(8)
    };
    let want = alone(&prompt, &p);
    assert_eq!(transfer(&a, &b, 2, &prompt, &p), want);
    a.shutdown();
    b.shutdown();
}

#[test]
fn pins_expire_and_bad_imports_are_refused() {
    let a = start(4, 64, |_| {});
    let req = EngineRequest {
        id: 1,
        prompt: vec![1; 9],
        params: SamplingParams::greedy(4),
        mode: prefill_only(Duration::from_millis(50)),
    };
    collect(&mut a.submit(req).unwrap());
    assert_eq!(a.checked_stats().wait_blocking().unwrap().kv_blocks_used, 3);
    assert!(matches!(
        a.submit(EngineRequest::new(1, vec![1], SamplingParams::greedy(1))),
        Err(EngineError::DuplicateId(1))
    ));
    std::thread::sleep(Duration::from_millis(120));
    assert_no_leak(&a);
    assert!(matches!(
        a.export_blocks(1).wait_blocking(),
        Err(EngineError::UnknownRequest(1))
    ));

    let (s, plan) = import(&a, 2, vec![1; 9], SamplingParams::greedy(4), 3);
    assert_eq!(plan.wait_blocking().unwrap().num_blocks, 3);
    assert!(a
        .import_block(2, 0, 3, vec![0; a.kv_layout().block_bytes()])
        .wait_blocking()
        .is_err());
    assert!(a.import_block(2, 0, 0, vec![0; 3]).wait_blocking().is_err());
    assert!(a
        .import_block(9, 0, 0, vec![0; a.kv_layout().block_bytes()])
        .wait_blocking()
        .is_err());
    drop(s);
    assert_no_leak(&a);
    a.shutdown();
}

#[derive(Clone, Debug)]
struct Case {
    prompt: Vec<u32>,
    max_tokens: usize,
}

fn case() -> impl Strategy<Value = Case> {
    // Prompts share prefixes often (small alphabet, common head) so the prefix cache is exercised.
    (
        0..3usize,
        proptest::collection::vec(0..4u32, 1..14),
        1..12usize,
    )
        .prop_map(|(head, tail, max_tokens)| {
            let mut prompt: Vec<u32> = (0..head * 4).map(|i| i as u32 % 5).collect();
            prompt.extend(tail);
            Case { prompt, max_tokens }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn concurrent_requests_match_running_alone(
        cases in proptest::collection::vec(case(), 1..7),
        block_size in prop_oneof![Just(2usize), Just(4)],
        num_blocks in 17..40usize,
        budget in 3..20usize,
        max_num_seqs in 1..5usize,
        caching: bool,
    ) {
        let e = start(block_size, num_blocks, |c| {
            c.max_num_batched_tokens = budget;
            c.max_num_seqs = max_num_seqs;
            c.enable_prefix_caching = caching;
        });
        let mut streams: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(i, c)| submit(&e, i as u64, c.prompt.clone(), SamplingParams::greedy(c.max_tokens)))
            .collect();
        for (c, s) in cases.iter().zip(&mut streams) {
            let (toks, fin) = collect(s);
            prop_assert_eq!(fin, Some(FinishReason::Length), "{:?}", s.error());
            prop_assert_eq!(toks, alone(&c.prompt, &SamplingParams::greedy(c.max_tokens)));
        }
        assert_no_leak(&e);
        e.shutdown();
    }
}

#[test]
fn prompt_logprobs_score_every_prompt_token_chunked_and_past_the_prefix_cache() {
    let prompt: Vec<u32> = (0..23).map(|i| (i * 5 + 3) % 60).collect();
    // Reference: one unchunked pass over the whole prompt returning every row.
    let mut mock = MockBackend::new(4, 64);
    let mut batch = ForwardBatch::default();
    batch.push(&prompt, 0, (0..6).collect(), LogitsWanted::All);
    let mut logits = Vec::new();
    mock.forward(&batch, &mut logits).unwrap();
    let vocab = mock.vocab_size();
    let expected: Vec<Option<TokenLogprobs>> = (0..prompt.len())
        .map(|p| (p > 0).then(|| logprobs_of(&logits[(p - 1) * vocab..p * vocab], prompt[p], 2)))
        .collect();

    let e = start(4, 64, |c| c.max_num_batched_tokens = 8);
    let params = SamplingParams {
        prompt_logprobs: Some(2),
        ..SamplingParams::greedy(3)
    };
    // The second request finds the whole prompt cached and must still score every position.
    for id in 1..=2 {
        let mut s = submit(&e, id, prompt.clone(), params.clone());
        let first = s.blocking_recv().unwrap();
        assert_eq!(first.prompt_logprobs.as_deref(), Some(&expected[..]));
        let mut toks = vec![first.token];
        while let Some(o) = s.blocking_recv() {
            assert!(o.prompt_logprobs.is_none(), "only the first output scores");
            toks.push(o.token);
        }
        assert_eq!(toks, alone(&prompt, &SamplingParams::greedy(3)));
    }
    let st = assert_no_leak(&e);
    assert_eq!(st.prefill_tokens_computed, 2 * prompt.len() as u64);
}

#[test]
fn a_resumed_request_continues_exactly_where_the_lost_one_stopped() {
    let prompt: Vec<u32> = (0..10).map(|i| (i * 7 + 1) % 60).collect();
    let seeded = SamplingParams {
        temperature: 0.9,
        seed: Some(11),
        frequency_penalty: 0.5,
        ..SamplingParams::greedy(14)
    };
    let e = start(4, 64, |c| c.max_num_batched_tokens = 6);
    for (id, params) in [(1, SamplingParams::greedy(14)), (2, seeded)] {
        let full = alone(&prompt, &params);
        assert_eq!(full.len(), 14);
        // Another worker delivered the first 5 tokens, then died: only the remaining 9 come out, the
        // same ones (same RNG stream position, same penalties over the output).
        let req = EngineRequest {
            id,
            prompt: prompt.clone(),
            params: params.clone(),
            mode: RequestMode::Resume {
                output: full[..5].to_vec(),
            },
        };
        let (toks, fin) = collect(&mut e.submit(req).unwrap());
        assert_eq!(
            (toks.as_slice(), fin),
            (&full[5..], Some(FinishReason::Length))
        );
    }
    // Nothing left to generate, or too long together with the prompt: refused up front.
    let resume = |output: Vec<u32>, max_tokens| EngineRequest {
        id: 9,
        prompt: prompt.clone(),
        params: SamplingParams::greedy(max_tokens),
        mode: RequestMode::Resume { output },
    };
    assert!(matches!(
        e.submit(resume(vec![1; 3], 3)),
        Err(EngineError::InvalidParams(_))
    ));
    assert!(matches!(
        e.submit(resume(vec![1; 5000], 6000)),
        Err(EngineError::PromptTooLong { prompt: 5010, .. })
    ));
    assert!(matches!(
        e.import_prefilled(resume(vec![1], 3), 1),
        Err(EngineError::InvalidParams(_))
    ));
    assert_no_leak(&e);
    e.shutdown();
}

/// An engine on the mock with its own sampler (greedy rows by argmax of its logits, other rows by a pure
/// function of the draw's seed), and the mock's counts of which path each step took.
fn start_device(block_size: usize, num_blocks: usize) -> (EngineHandle, Arc<MockCounts>) {
    let backend = MockBackend::new(block_size, num_blocks).with_device_sampling();
    let counts = backend.counts();
    (Engine::start(backend, cfg(block_size)).unwrap(), counts)
}

#[test]
fn a_backend_sampler_draws_plain_rows_and_the_host_keeps_penalties_and_logprobs() {
    use std::sync::atomic::Ordering::Relaxed;
    let prompt = [3, 1, 4, 1, 5];
    // Greedy through the backend's sampler gives the host sampler's tokens.
    let want = alone(&prompt, &SamplingParams::greedy(6));
    let (e, counts) = start_device(4, 64);
    let (device, host) = (&counts.device_steps, &counts.host_steps);
    let mut s = submit(&e, 1, prompt.to_vec(), SamplingParams::greedy(6));
    assert_eq!(collect(&mut s).0, want);
    assert_eq!(host.load(Relaxed), 0);
    assert!(device.load(Relaxed) >= 6);
    // Logprobs and penalties need the whole row: those steps run `forward` and the host sampler.
    for (id, p) in [
        SamplingParams {
            logprobs: Some(2),
            ..SamplingParams::greedy(3)
        },
        SamplingParams {
            repetition_penalty: 1.3,
            ..SamplingParams::greedy(3)
        },
        SamplingParams {
            frequency_penalty: 0.5,
            ..SamplingParams::greedy(3)
        },
    ]
    .into_iter()
    .enumerate()
    {
        // A fresh id each time: the previous request may still be in the engine's books.
        let before = (device.load(Relaxed), host.load(Relaxed));
        let mut s = submit(&e, 2 + id as u64, prompt.to_vec(), p.clone());
        let first = s.blocking_recv().unwrap();
        assert_eq!(first.logprobs.is_some(), p.logprobs.is_some());
        collect(&mut s);
        assert_eq!(
            device.load(Relaxed),
            before.0,
            "{p:?} must not reach the device sampler"
        );
        assert!(host.load(Relaxed) >= before.1 + 3);
    }
    assert_no_leak(&e);
    e.shutdown();
}

#[test]
fn backend_draws_are_seeded_per_request_and_output_index() {
    let p = SamplingParams {
        temperature: 0.9,
        top_p: 0.8,
        seed: Some(7),
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    };
    let run = |p: &SamplingParams| {
        let (e, counts) = start_device(4, 64);
        let mut s = submit(&e, 1, vec![2, 7], p.clone());
        let toks = collect(&mut s).0;
        assert!(
            counts
                .device_steps
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 12
        );
        e.shutdown();
        toks
    };
    let a = run(&p);
    assert_eq!(a.len(), 12);
    assert_eq!(a, run(&p), "the same seed repeats on the same backend");
    let distinct: std::collections::HashSet<_> = a.iter().collect();
    assert!(
        distinct.len() > 3,
        "each output index draws with its own seed: {a:?}"
    );
    assert_ne!(
        a,
        run(&SamplingParams {
            seed: Some(8),
            ..p.clone()
        })
    );
}

#[test]
fn bench_reports_positive_figures_on_the_mock() {
    let cfg = EngineConfig {
        block_size: 4,
        ..Default::default()
    };
    let engine = Engine::start(MockBackend::new(4, 1024), cfg).unwrap();
    let opts = BenchOptions {
        decode_tokens: 8,
        prefill_len: 40,
        concurrency: 3,
        concurrent_tokens: 5,
        prompt_len: 4,
        seed: 1,
    };
    let r = run_engine_bench(&engine, &opts).unwrap();
    assert!(
        r.single_stream_decode_tok_s > 0.0
            && r.prefill_tok_s > 0.0
            && r.concurrent_decode_tok_s > 0.0
    );
    let st = engine.checked_stats().wait_blocking().unwrap();
    assert_eq!(st.generation_tokens_total, 8 + 1 + 3 * 5);
    assert_eq!(st.prompt_tokens_total, 4 + 40 + 3 * 4);
    engine.shutdown();
}

/// An engine of 8 blocks of 4 tokens whose steps take 50 ms, so that requests still run while a test
/// imports beside them.
fn slow_engine() -> EngineHandle {
    let slow = MockBackend::new(4, 8).with_step_delay(Duration::from_millis(50));
    Engine::start(slow, cfg(4)).unwrap()
}

/// Why the import of request `id` was refused as `KvBusy`; panics on any other outcome.
fn busy_reason(plan: Pending<ImportPlan>, id: RequestId) -> String {
    match plan.wait_blocking() {
        Err(EngineError::KvBusy { id: got, reason }) if got == id => reason,
        other => panic!("expected KvBusy for {id}, got {other:?}"),
    }
}

/// An import that finds every block held by running sequences is refused as `KvBusy` (retryable:
/// the decode worker waits and tries again) and leaves the pool as it was; once the blocks free, the
/// same import succeeds.
#[test]
fn import_into_a_full_cache_is_busy_not_failed() {
    let e = slow_engine();
    // A 29-token prompt holds all 8 blocks of 4 tokens from its first token on.
    let mut busy = submit(&e, 1, vec![1; 29], SamplingParams::greedy(3));
    busy.blocking_recv().unwrap();
    let (_s, plan) = import(&e, 2, vec![2; 12], SamplingParams::greedy(2), 3);
    busy_reason(plan, 2);
    while busy.blocking_recv().is_some() {}
    let (_s, plan) = import(&e, 3, vec![2; 12], SamplingParams::greedy(2), 3);
    assert_eq!(plan.wait_blocking().unwrap().num_blocks, 3);
    e.shutdown();
}

/// An import queues behind a request already waiting to run: even with blocks free for the import
/// itself, it is `KvBusy` until the waiting request runs, so imports cannot starve what waits (a
/// preempted sequence, or an earlier admission).
#[test]
fn an_import_does_not_jump_ahead_of_a_waiting_request() {
    let e = slow_engine();
    // 6 of the 8 blocks run; the second request (also 6 blocks) waits for them.
    let mut running = submit(&e, 1, vec![1; 21], SamplingParams::greedy(3));
    running.blocking_recv().unwrap();
    let mut waiting = submit(&e, 2, vec![2; 21], SamplingParams::greedy(2));
    // Two blocks are free, enough for a 5-token import, yet request 2 is ahead of it.
    let (_s, plan) = import(&e, 3, vec![3; 5], SamplingParams::greedy(2), 3);
    let reason = busy_reason(plan, 3);
    assert!(reason.contains("ahead"), "{reason}");
    while running.blocking_recv().is_some() {}
    waiting.blocking_recv().unwrap();
    let (_s, plan) = import(&e, 4, vec![3; 5], SamplingParams::greedy(2), 3);
    assert_eq!(plan.wait_blocking().unwrap().num_blocks, 2);
    while waiting.blocking_recv().is_some() {}
    e.shutdown();
}
