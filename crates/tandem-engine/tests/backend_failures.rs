//! The engine's reaction to each kind of backend failure (ARCHITECTURE.md, "What the engine does with a
//! backend failure"), on the mock backend failing chosen steps with a chosen kind.

use std::time::Duration;
use tandem_engine::*;
use tandem_testkit::MockBackend;

fn cfg() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        ..Default::default()
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams::greedy(max_tokens)
}

/// The tokens and the error a stream ended with.
fn drain(s: &mut RequestStream) -> (Vec<u32>, Option<FinishReason>, Option<EngineError>) {
    let mut toks = Vec::new();
    let mut finish = None;
    while let Some(o) = s.blocking_recv() {
        toks.push(o.token);
        finish = o.finish;
    }
    (toks, finish, s.take_error())
}

/// What `prompt` generates on a mock that never fails.
fn clean(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let e = Engine::start(MockBackend::new(4, 64), cfg()).unwrap();
    let out = drain(
        &mut e
            .submit(EngineRequest::new(1, prompt.to_vec(), greedy(max_tokens)))
            .unwrap(),
    );
    e.shutdown();
    assert_eq!(out.1, Some(FinishReason::Length));
    out.0
}

fn kind_of(e: &Option<EngineError>) -> Option<BackendErrorKind> {
    e.as_ref().and_then(EngineError::backend_kind)
}

fn assert_no_leak(e: &EngineHandle) {
    let st = e.checked_stats().wait_blocking().unwrap();
    assert_eq!(st.kv_blocks_used, 0, "{st:?}");
    assert_eq!((st.running, st.waiting), (0, 0));
}

#[test]
fn a_passing_failure_reruns_the_step_and_the_answer_is_unchanged() {
    // Steps 2, 3 and 4 fail: three reruns, as many as the engine allows in a row.
    let mock = MockBackend::new(4, 64).fail_steps(2..5, BackendErrorKind::Retryable);
    let e = Engine::start(mock, cfg()).unwrap();
    let (toks, finish, err) = drain(
        &mut e
            .submit(EngineRequest::new(1, vec![1, 2, 3], greedy(8)))
            .unwrap(),
    );
    assert!(err.is_none(), "{err:?}");
    assert_eq!(finish, Some(FinishReason::Length));
    assert_eq!(toks, clean(&[1, 2, 3], 8));
    assert_no_leak(&e);
    e.shutdown();
}

#[test]
fn a_failure_that_does_not_pass_fails_the_request_after_the_reruns_and_the_engine_serves_on() {
    // Steps 2..6 fail: the first try and three reruns, then the request fails.
    let mock = MockBackend::new(4, 64).fail_steps(2..6, BackendErrorKind::Retryable);
    let e = Engine::start(mock, cfg()).unwrap();
    let (toks, finish, err) = drain(
        &mut e
            .submit(EngineRequest::new(1, vec![1, 2, 3], greedy(8)))
            .unwrap(),
    );
    assert_eq!((toks.len(), finish), (2, None));
    assert_eq!(kind_of(&err), Some(BackendErrorKind::Retryable), "{err:?}");
    assert!(e.health().is_ok());
    assert_no_leak(&e);
    let (toks, _, err) = drain(
        &mut e
            .submit(EngineRequest::new(2, vec![1, 2, 3], greedy(8)))
            .unwrap(),
    );
    assert!(err.is_none(), "{err:?}");
    assert_eq!(toks, clean(&[1, 2, 3], 8));
    e.shutdown();
}

#[test]
fn a_request_at_fault_fails_alone_and_its_neighbours_run_again() {
    // Both requests are in step 4; the mock names the step's first sequence as the one at fault.
    let mock = MockBackend::new(4, 64)
        .with_step_delay(Duration::from_millis(2))
        .fail_steps(4..5, BackendErrorKind::Request);
    let e = Engine::start(mock, cfg()).unwrap();
    let mut a = e
        .submit(EngineRequest::new(1, vec![1, 2, 3], greedy(10)))
        .unwrap();
    let mut b = e
        .submit(EngineRequest::new(2, vec![4, 5], greedy(10)))
        .unwrap();
    let (a, b) = (drain(&mut a), drain(&mut b));
    let (failed, served, served_prompt) = match (&a.2, &b.2) {
        (Some(_), None) => (a, b, [4, 5].as_slice()),
        (None, Some(_)) => (b, a, [1, 2, 3].as_slice()),
        other => panic!("exactly one request fails: {other:?}"),
    };
    assert_eq!(kind_of(&failed.2), Some(BackendErrorKind::Request));
    assert_eq!(failed.1, None);
    assert_eq!(served.1, Some(FinishReason::Length));
    assert_eq!(
        served.0,
        clean(served_prompt, 10),
        "the rerun step draws the same tokens"
    );
    assert!(e.health().is_ok());
    assert_no_leak(&e);
    e.shutdown();
}

#[test]
fn a_lost_worker_fails_every_request_refuses_new_ones_and_reports_unhealthy() {
    let mock = MockBackend::new(4, 64)
        .with_step_delay(Duration::from_millis(2))
        .fail_steps(3.., BackendErrorKind::WorkerLost);
    let mut config = cfg();
    // One runs, the other waits: both fail with the loss.
    config.max_num_seqs = 1;
    let e = Engine::start(mock, config).unwrap();
    let mut a = e
        .submit(EngineRequest::new(1, vec![1, 2, 3], greedy(50)))
        .unwrap();
    let mut b = e
        .submit(EngineRequest::new(2, vec![4, 5], greedy(50)))
        .unwrap();
    let (a, b) = (drain(&mut a), drain(&mut b));
    assert_eq!(
        kind_of(&a.2),
        Some(BackendErrorKind::WorkerLost),
        "{:?}",
        a.2
    );
    assert_eq!(
        kind_of(&b.2),
        Some(BackendErrorKind::WorkerLost),
        "{:?}",
        b.2
    );
    assert_eq!(
        e.health()
            .err()
            .as_ref()
            .and_then(EngineError::backend_kind),
        Some(BackendErrorKind::WorkerLost)
    );
    let refused = e.submit(EngineRequest::new(3, vec![1], greedy(1))).err();
    assert_eq!(
        kind_of(&refused),
        Some(BackendErrorKind::WorkerLost),
        "{refused:?}"
    );
    assert!(
        e.checked_stats().wait_blocking().is_err(),
        "the engine thread is gone"
    );
    e.shutdown();
}

#[test]
fn a_fault_fails_the_step_s_requests_and_stops_the_engine() {
    let mock = MockBackend::new(4, 64).fail_steps(2..3, BackendErrorKind::Fatal);
    let e = Engine::start(mock, cfg()).unwrap();
    let (toks, _, err) = drain(
        &mut e
            .submit(EngineRequest::new(1, vec![1, 2], greedy(10)))
            .unwrap(),
    );
    assert_eq!(toks.len(), 2);
    assert_eq!(kind_of(&err), Some(BackendErrorKind::Fatal), "{err:?}");
    // The backend's own error reaches the request, not one rebuilt from its text.
    match err {
        Some(EngineError::Backend(b)) => {
            assert!(matches!(*b, BackendError::Fatal { .. }));
            assert_eq!(b.message(), "injected failure at step 2");
        }
        other => panic!("{other:?}"),
    }
    assert!(e.health().is_err());
    assert!(e.submit(EngineRequest::new(2, vec![1], greedy(1))).is_err());
    e.shutdown();
}
