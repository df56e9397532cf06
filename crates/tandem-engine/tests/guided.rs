//! Guided decoding on the mock backend, whose logits are pseudo-random: whatever the model "wants",
//! the output must satisfy the constraint, through preemption, P/D hand-over and resume.

use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tandem_engine::*;
use tandem_testkit::{mock_guide, mock_text, MockBackend, MockCounts};

mod common;
use common::{import, submit, submit_n};

fn start(block_size: usize, num_blocks: usize) -> EngineHandle {
    let c = EngineConfig {
        block_size,
        ..Default::default()
    };
    Engine::start_guided(
        MockBackend::new(block_size, num_blocks),
        c,
        Some(mock_guide()),
    )
    .unwrap()
}

/// The stream's tokens through its finish, which it must have.
fn collect(s: &mut RequestStream) -> (Vec<u32>, Option<FinishReason>) {
    let (toks, finish) = common::collect(s);
    assert!(
        finish.is_some(),
        "stream ended without a finish: {:?}",
        s.error()
    );
    (toks, finish)
}

fn guided(guidance: Guidance, temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        max_tokens: 120,
        guidance: Some(guidance),
        ..Default::default()
    }
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "ab", "x"]}, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    })
}

/// Panics unless `text` is a JSON document valid under [`schema`].
fn assert_valid(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = v.as_object().unwrap_or_else(|| panic!("{text:?}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["age", "name", "tags"], "{text:?}");
    assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text:?}");
    let age = o["age"].as_i64().unwrap_or_else(|| panic!("{text:?}"));
    assert!((0..=120).contains(&age), "{text:?}");
    let tags = o["tags"].as_array().unwrap();
    assert!(tags.len() <= 3, "{text:?}");
    for t in tags {
        assert!(["a", "ab", "x"].contains(&t.as_str().unwrap()), "{text:?}");
    }
}

fn run(e: &EngineHandle, id: u64, prompt: &[u32], p: &SamplingParams) -> Vec<u32> {
    let (toks, fin) = collect(&mut submit(e, id, prompt.to_vec(), p.clone()));
    assert_eq!(fin, Some(FinishReason::Stop), "{:?}", mock_text(&toks));
    toks
}

#[test]
fn guided_output_satisfies_a_json_schema_greedy_and_sampled() {
    let e = start(4, 256);
    for (i, prompt) in [[1u32, 2, 3], [9, 9, 9], [40, 2, 17]].iter().enumerate() {
        let toks = run(
            &e,
            i as u64,
            prompt,
            &guided(Guidance::JsonSchema(schema()), 0.0, 0),
        );
        assert_valid(&mock_text(&toks));
        for seed in 0..4 {
            let id = 100 + i as u64 * 10 + seed;
            let toks = run(
                &e,
                id,
                prompt,
                &guided(Guidance::JsonSchema(schema()), 1.0, seed),
            );
            assert_valid(&mock_text(&toks));
        }
    }
    e.shutdown();
}

#[test]
fn guided_output_matches_a_regex_and_a_lark_grammar() {
    let e = start(4, 256);
    for seed in 0..6 {
        let p = guided(Guidance::Regex("[a-z]{2,4}-[0-9]{3}".into()), 1.0, seed);
        let text = mock_text(&run(&e, seed, &[7, 8], &p));
        let (word, num) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!((2..=4).contains(&word.len()), "{text:?}");
        assert!(word.bytes().all(|b| b.is_ascii_lowercase()), "{text:?}");
        assert!(
            num.len() == 3 && num.bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
        let p = guided(
            Guidance::Lark(r#"start: "yes" | "no" | "maybe""#.into()),
            1.0,
            seed,
        );
        let text = mock_text(&run(&e, 100 + seed, &[7, 8], &p));
        assert!(["yes", "no", "maybe"].contains(&text.as_str()), "{text:?}");
    }
    e.shutdown();
}

#[test]
fn constraints_that_do_not_compile_are_refused_at_submit() {
    let e = start(4, 64);
    let bad = [
        Guidance::Regex("(ab".into()),
        Guidance::Lark("start: missing_rule".into()),
        Guidance::JsonSchema(json!({"type": "frobnicate"})),
    ];
    for g in bad {
        let p = guided(g.clone(), 0.0, 0);
        match e.submit(EngineRequest::new(1, vec![1], p)) {
            Err(EngineError::Guidance(msg)) => assert!(!msg.is_empty()),
            Err(other) => panic!("{g:?}: {other}"),
            Ok(_) => panic!("{g:?} was accepted"),
        }
    }
    // The refusals left nothing behind: the same id runs.
    run(&e, 1, &[1], &guided(Guidance::JsonObject, 0.0, 0));
    e.shutdown();
    // An engine without a vocabulary refuses guided requests rather than answering them freely.
    let plain = Engine::start(
        MockBackend::new(4, 64),
        EngineConfig {
            block_size: 4,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(matches!(
        plain.submit(EngineRequest::new(
            1,
            vec![1],
            guided(Guidance::JsonObject, 0.0, 0)
        )),
        Err(EngineError::Guidance(_))
    ));
    plain.shutdown();
}

#[test]
fn guided_requests_survive_preemption() {
    let p = guided(Guidance::JsonSchema(schema()), 1.0, 11);
    let want = run(&start(4, 256), 1, &[3, 1, 4, 1, 5], &p);
    // A tiny pool: three concurrent guided requests preempt one another and recompute. Steps are slow
    // enough that all three are queued before the first finishes, however the threads are scheduled.
    let e = Engine::start_guided(
        MockBackend::new(2, 24).with_step_delay(std::time::Duration::from_millis(10)),
        EngineConfig {
            block_size: 2,
            ..Default::default()
        },
        Some(mock_guide()),
    )
    .unwrap();
    let mut streams = submit_n(&e, 3, &[3, 1, 4, 1, 5], &p);
    for s in &mut streams {
        let (toks, _) = collect(s);
        assert_eq!(toks, want);
        assert_valid(&mock_text(&toks));
    }
    let st = e.checked_stats().wait_blocking().unwrap();
    assert!(st.preemptions_total > 0, "{st:?}");
    e.shutdown();
}

#[test]
fn guided_requests_hand_over_from_prefill_to_decode_and_resume_elsewhere() {
    let prompt: Vec<u32> = (0..11).map(|i| (i * 7) % 60).collect();
    let p = guided(Guidance::JsonSchema(schema()), 1.0, 5);
    let want = run(&start(4, 256), 1, &prompt, &p);
    assert_valid(&mock_text(&want));

    // Prefill on a (its first token is guided too), decode on b.
    let (a, b) = (start(4, 64), start(4, 64));
    let req = EngineRequest {
        id: 2,
        prompt: prompt.clone(),
        params: p.clone(),
        mode: RequestMode::PrefillOnly {
            pin_timeout: Duration::from_secs(60),
        },
    };
    let (first, _) = collect(&mut a.submit(req).unwrap());
    assert_eq!(first, want[..1]);
    let kv = a.export_blocks(2).wait_blocking().unwrap();
    let (mut stream, plan) = import(&b, 2, prompt.clone(), p.clone(), first[0]);
    let plan = plan.wait_blocking().unwrap();
    for layer in 0..kv.layout.n_layers {
        for blk in plan.needed() {
            b.import_block(2, layer, blk, kv.block(layer, blk).unwrap().to_vec())
                .wait_blocking()
                .unwrap();
        }
    }
    b.start_decoding(2).wait_blocking().unwrap();
    a.release_pin(2);
    assert_eq!(collect(&mut stream).0, want);

    // Resumed on c after half the output was delivered: the matcher is fed that half first.
    let c = start(4, 64);
    let half = want.len() / 2;
    let req = EngineRequest {
        id: 3,
        prompt: prompt.clone(),
        params: p.clone(),
        mode: RequestMode::Resume {
            output: want[..half].to_vec(),
        },
    };
    assert_eq!(collect(&mut c.submit(req).unwrap()).0, want[half..]);

    // Delivered tokens the constraint could not have produced are refused, not continued.
    let req = EngineRequest {
        id: 4,
        prompt,
        params: p,
        mode: RequestMode::Resume { output: vec![1] },
    };
    assert!(matches!(c.submit(req), Err(EngineError::Guidance(_))));
    for e in [a, b, c] {
        e.shutdown();
    }
}

/// A guided engine on the mock with its own sampler, as the CUDA backend has: it draws only tokens the
/// engine's packed masks allow, or with `honour_masks` off stands for a faulty device that ignores them.
fn start_masking(honour_masks: bool) -> (EngineHandle, Arc<MockCounts>) {
    let backend = MockBackend::new(4, 256);
    let backend = if honour_masks {
        backend.with_device_sampling()
    } else {
        backend.with_device_sampling_ignoring_masks()
    };
    let counts = backend.counts();
    let c = EngineConfig {
        block_size: 4,
        ..Default::default()
    };
    let e = Engine::start_guided(backend, c, Some(mock_guide())).unwrap();
    (e, counts)
}

#[test]
fn guided_rows_are_masked_by_a_device_sampler_and_never_reach_the_host() {
    let (e, counts) = start_masking(true);
    // Concurrent guided and unguided requests share steps.
    let mut streams = Vec::new();
    for seed in 0..4u64 {
        for (k, t) in [0.0, 1.0].into_iter().enumerate() {
            let id = seed * 10 + k as u64;
            let p = guided(Guidance::JsonSchema(schema()), t, seed);
            streams.push((true, submit(&e, id, vec![1, 2, 3], p)));
        }
        let free = SamplingParams {
            max_tokens: 20,
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        };
        let s = submit(&e, 100 + seed, vec![5, 6], free);
        streams.push((false, s));
    }
    for (is_guided, s) in &mut streams {
        let (toks, fin) = collect(s);
        if *is_guided {
            assert_eq!(fin, Some(FinishReason::Stop));
            assert_valid(&mock_text(&toks));
        }
    }
    let p = guided(Guidance::Regex("[a-z]{2,4}-[0-9]{3}".into()), 1.0, 3);
    let text = mock_text(&run(&e, 200, &[7, 8], &p));
    assert!(text.contains('-'), "{text:?}");
    e.shutdown();
    assert_eq!(
        counts.host_steps.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "no step went to the host sampler"
    );
    assert!(
        counts
            .device_guided_rows
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
}

#[test]
fn a_device_draw_outside_the_constraint_fails_the_request_instead_of_leaving_it() {
    let (e, _) = start_masking(false);
    for seed in 0..4u64 {
        let p = guided(Guidance::JsonSchema(schema()), 1.0, seed);
        let mut s = submit(&e, seed, vec![1, 2, 3], p);
        let mut toks = Vec::new();
        while let Some(o) = s.blocking_recv() {
            toks.push(o.token);
        }
        match s.error() {
            Some(EngineError::Guidance(msg)) => {
                assert!(msg.contains("does not allow"), "{msg}")
            }
            other => panic!("{:?} ended with {other:?}", mock_text(&toks)),
        }
        // What was delivered before the fault is still inside the constraint: a prefix of JSON.
        assert!(mock_text(&toks).is_empty() || mock_text(&toks).starts_with('{'));
    }
    e.shutdown();
}

#[test]
fn packed_masks_allow_exactly_the_tokens_the_host_mask_leaves_finite() {
    let env = mock_guide();
    let mut guide = env.compile(&Guidance::JsonSchema(schema())).unwrap();
    let eos = [63u32];
    for (step, stop) in [(0, vec![]), (1, vec![5u32, 70]), (2, vec![9])] {
        if step > 0 {
            // Advance along a valid document: the first allowed token each time.
            let m = guide.mask().unwrap();
            let t = (0..64).find(|&t| m.allows(t)).unwrap();
            guide.consume(&[t]).unwrap();
        }
        let mask = guide.mask().unwrap();
        for width in [64usize, 70, 96] {
            let mut logits = vec![0.0f32; width];
            mask.apply(&mut logits, &stop, &eos);
            let mut bits = vec![0u32; width.div_ceil(32)];
            mask.pack(&mut bits, &stop, &eos);
            for (t, l) in logits.iter().enumerate() {
                let packed = bits[t / 32] >> (t % 32) & 1 == 1;
                assert_eq!(
                    packed,
                    l.is_finite(),
                    "token {t} of {width}, stops {stop:?}"
                );
            }
        }
    }
    // Once the grammar can end, stop tokens are allowed alongside EOS.
    let mut done = env.compile(&Guidance::Regex("a".into())).unwrap();
    let a = (0..64).find(|&t| mock_text(&[t]) == "a").unwrap();
    done.consume(&[a]).unwrap();
    let mask = done.mask().unwrap();
    let mut bits = vec![0u32; 2];
    mask.pack(&mut bits, &[7], &eos);
    assert_eq!(bits[0] >> 7 & 1, 1);
    assert_eq!(bits[1] >> 31 & 1, 1, "EOS");
}

/// The mock's stand-ins for a thinking model's `<think>` and `</think>`: single tokens no JSON spells.
const OPEN: u32 = 61;
const CLOSE: u32 = 62;

/// A gated guide: the model may open the block as its first token (else the answer starts, constrained);
/// inside, anything but EOS; after the close, the grammar; the grammar's end only counts in the answer.
#[test]
fn a_reasoning_gate_frees_the_thinking_block_and_constrains_the_answer() {
    let env = mock_guide();
    let a = (0..64).find(|&t| mock_text(&[t]) == "a").unwrap();
    let gate = ReasoningGate {
        open: Some(OPEN),
        close: CLOSE,
    };
    let mut g = env
        .compile_gated(&Guidance::Regex("a".into()), Some(gate))
        .unwrap();
    let m = g.mask().unwrap();
    let allowed: Vec<u32> = (0..64).filter(|&t| m.allows(t)).collect();
    assert_eq!(
        allowed,
        [a, OPEN],
        "the grammar's first tokens, or the block"
    );
    g.consume(&[OPEN, 5, 9]).unwrap();
    assert!(!g.mask().unwrap().allows(63), "no end inside the block");
    g.consume(&[CLOSE]).unwrap();
    let m = g.mask().unwrap();
    assert!(!g.is_stopped());
    let allowed: Vec<u32> = (0..64).filter(|&t| m.allows(t)).collect();
    assert_eq!(allowed, [a], "after the close: only the grammar");
    g.consume(&[a]).unwrap();
    assert!(g.is_stopped());
    // Inside the block every token but EOS; a first token other than the open tag starts the answer.
    let mut inside = env
        .compile_gated(
            &Guidance::Regex("a".into()),
            Some(ReasoningGate {
                open: None,
                close: CLOSE,
            }),
        )
        .unwrap();
    let m = inside.mask().unwrap();
    assert_eq!((0..64).filter(|&t| m.allows(t)).count(), 63);
    assert!(!m.allows(63), "the block cannot end the output");
    inside.consume(&[3, 4, CLOSE, a]).unwrap();
    assert!(inside.is_stopped());
    let mut skipped = env
        .compile_gated(&Guidance::Regex("a".into()), Some(gate))
        .unwrap();
    assert!(
        skipped.consume(&[OPEN - 1]).is_err(),
        "not the grammar's token"
    );
    let mut skipped = env
        .compile_gated(&Guidance::Regex("a".into()), Some(gate))
        .unwrap();
    skipped.consume(&[a]).unwrap();
    assert!(skipped.is_stopped());
    assert!(env
        .compile_gated(
            &Guidance::JsonObject,
            Some(ReasoningGate {
                open: None,
                close: 64
            })
        )
        .is_err());
}

/// Through the engine: whatever the mock "thinks", the output never ends inside the block, and what
/// follows the close is a document of the schema (or the output ran out of tokens).
#[test]
fn guided_reasoning_requests_think_freely_then_answer_in_the_schema() {
    let e = start(4, 512);
    let mut answered = 0;
    for seed in 0..8 {
        let mut params = guided(Guidance::JsonSchema(schema()), 1.0, seed);
        params.max_tokens = 200;
        params.reasoning_gate = Some(ReasoningGate {
            open: None,
            close: CLOSE,
        });
        let (toks, finish) = collect(&mut submit(&e, seed, vec![1, 2, 3], params));
        match toks.iter().position(|&t| t == CLOSE) {
            Some(at) => {
                let answer = &toks[at + 1..];
                if finish == Some(FinishReason::Stop) {
                    assert_valid(&mock_text(answer));
                    answered += 1;
                } else {
                    assert_eq!(finish, Some(FinishReason::Length));
                }
            }
            None => assert_eq!(finish, Some(FinishReason::Length), "ended inside the block"),
        }
    }
    assert!(answered > 0, "no seed closed its block and answered");
    e.shutdown();
}
