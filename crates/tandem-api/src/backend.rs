//! The seam between the HTTP surface and whatever generates tokens: the local engine, or remote
//! prefill/decode workers behind the P/D router (`tandem_cluster::Ingress`).

use std::pin::Pin;

use futures::future::BoxFuture;
use futures::Stream;
use tandem_engine::{
    BackendErrorKind, EngineError, EngineHandle, EngineRequest, EngineStats, RequestId,
    SamplingParams, TokenOutput,
};

/// One generation as the API hands it to a [`GenerateBackend`]: which request, its prompt and how to
/// sample.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Unique among live requests; [`GenerateBackend::abort`] names it.
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
}

impl GenerateRequest {
    /// Request `id` of `prompt` under `params`.
    pub fn new(id: RequestId, prompt: Vec<u32>, params: SamplingParams) -> Self {
        GenerateRequest { id, prompt, params }
    }
}

/// Per-request token outputs; dropping the stream must abort the request and free its KV blocks.
pub type TokenStream = Pin<Box<dyn Stream<Item = Result<TokenOutput, BackendError>> + Send>>;

/// Why a backend refused a request, in terms the API maps onto HTTP statuses. (Not the engine's
/// `tandem_engine::BackendError`, the model backend's failure: this is the API's view of whatever
/// generates tokens, into which that one maps by its kind.)
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    /// Too many requests are waiting; the client should retry later (HTTP 503).
    #[error("the engine queue is full ({waiting} requests waiting)")]
    QueueFull {
        /// Requests waiting when this one was refused.
        waiting: usize,
    },
    /// Prompt plus requested tokens exceed the context (HTTP 400).
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {} tokens ({prompt} in the prompt, {max_tokens} in the completion). Please reduce the \
         length of the prompt or completion.",
        prompt + max_tokens
    )]
    PromptTooLong {
        /// Prompt length in tokens.
        prompt: usize,
        /// Requested completion length.
        max_tokens: usize,
        /// The context length the backend serves.
        max_model_len: usize,
    },
    /// The request itself is unacceptable (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// The backend cannot serve anything now (engine stopped, its device or a pipeline stage lost,
    /// worker unreachable; HTTP 503).
    #[error("{0}")]
    Unavailable(String),
    /// The model step kept failing for a passing reason (device memory) after the engine ran it
    /// again; the client should retry soon (HTTP 503 with Retry-After).
    #[error("{0}")]
    Transient(String),
    /// A started generation failed on the server's side (a backend fault, a failure the engine could
    /// not classify); the last item of a stream, so the client learns why its answer ended (HTTP 500
    /// or an error event).
    #[error("generation failed: {0}")]
    Failed(String),
}

/// What the API needs from a token generator; implemented by the local engine and the P/D router.
pub trait GenerateBackend: Send + Sync + 'static {
    /// Queues one generation from prompt token ids; validation errors come back synchronously.
    fn submit(&self, req: GenerateRequest) -> Result<TokenStream, BackendError>;
    /// Stops a request early (dropping its stream has the same effect).
    fn abort(&self, id: RequestId);
    /// A snapshot of counters and gauges for /metrics.
    fn stats(&self) -> EngineStats;
    /// Longest prompt + completion the backend accepts, in tokens.
    fn max_model_len(&self) -> usize;
    /// Resolves `Ok` when the backend can take requests now; /health answers 503 otherwise.
    fn health(&self) -> BoxFuture<'static, Result<(), BackendError>>;
    /// What this process is to `/health`'s readers: `colocated` (an engine here) or `head` (a P/D router).
    fn role(&self) -> &'static str {
        "colocated"
    }
    /// Extra Prometheus text appended to /metrics (a P/D router's transfer and per-role metrics).
    fn extra_metrics(&self) -> String {
        String::new()
    }
    /// The workers behind this backend for `GET /v1/cluster` (the model name is the API's to fill).
    fn cluster(&self) -> crate::ClusterView {
        crate::ClusterView::colocated(&self.stats())
    }
}

impl From<EngineError> for BackendError {
    fn from(err: EngineError) -> Self {
        match err {
            EngineError::QueueFull { waiting } => BackendError::QueueFull { waiting },
            EngineError::PromptTooLong {
                prompt,
                max_tokens,
                max_model_len,
            } => BackendError::PromptTooLong {
                prompt,
                max_tokens,
                max_model_len,
            },
            EngineError::EmptyPrompt => BackendError::Invalid("the prompt is empty".to_owned()),
            e @ (EngineError::KvCacheTooSmall { .. }
            | EngineError::InvalidParams(_)
            | EngineError::Guidance(_)) => BackendError::Invalid(e.to_string()),
            EngineError::Stopped => BackendError::Unavailable("the engine has stopped".to_owned()),
            EngineError::Backend(e) => backend_failure(e.kind(), e.to_string()),
            other => BackendError::Unavailable(other.to_string()),
        }
    }
}

/// The API's view of a model backend failure of `kind`: the request's fault is the client's error, a
/// lost worker or a shortage that outlasted the engine's retries is a 503 to retry (elsewhere), and a
/// fault is the server's error.
fn backend_failure(kind: BackendErrorKind, message: String) -> BackendError {
    match kind {
        BackendErrorKind::Request => BackendError::Invalid(message),
        BackendErrorKind::WorkerLost => BackendError::Unavailable(message),
        BackendErrorKind::Retryable => BackendError::Transient(message),
        BackendErrorKind::Fatal => BackendError::Failed(message),
    }
}

/// Why a started generation ended without a finish: a backend failure by its kind, anything else
/// (a constraint that failed mid-answer, the engine stopping) as a failure of the server.
fn stream_failure(err: EngineError) -> BackendError {
    match err {
        EngineError::Backend(e) => backend_failure(e.kind(), e.to_string()),
        other => BackendError::Failed(other.to_string()),
    }
}

impl GenerateBackend for EngineHandle {
    fn submit(&self, req: GenerateRequest) -> Result<TokenStream, BackendError> {
        let stream =
            EngineHandle::submit(self, EngineRequest::new(req.id, req.prompt, req.params))?;
        // The RequestStream lives inside the unfold state, so dropping the HTTP body drops it and aborts.
        Ok(Box::pin(futures::stream::unfold(
            Some(stream),
            |s| async move {
                let mut s = s?;
                match s.recv().await {
                    Some(out) => Some((Ok(out), Some(s))),
                    None => {
                        let err = s.take_error()?;
                        tracing::warn!(request = s.id(), error = %err, "engine failed a request");
                        Some((Err(stream_failure(err)), None))
                    }
                }
            },
        )))
    }

    fn abort(&self, id: RequestId) {
        EngineHandle::abort(self, id)
    }

    fn stats(&self) -> EngineStats {
        EngineHandle::stats(self)
    }

    fn max_model_len(&self) -> usize {
        EngineHandle::max_model_len(self)
    }

    fn health(&self) -> BoxFuture<'static, Result<(), BackendError>> {
        // A lost device or stage says so at once; else a round trip through the engine thread proves
        // it is alive and its block accounting sound.
        if let Err(e) = EngineHandle::health(self) {
            return Box::pin(std::future::ready(Err(BackendError::from(e))));
        }
        let pending = self.checked_stats();
        Box::pin(async move { pending.wait().await.map(|_| ()).map_err(BackendError::from) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use tandem_engine::{Engine, EngineConfig, FinishReason};
    use tandem_testkit::MockBackend;

    /// Submits a greedy request of `max_tokens` through the API's seam.
    fn greedy(
        e: &EngineHandle,
        id: RequestId,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> Result<TokenStream, BackendError> {
        GenerateBackend::submit(
            e,
            GenerateRequest::new(id, prompt, SamplingParams::greedy(max_tokens)),
        )
    }

    fn engine() -> EngineHandle {
        let config = EngineConfig {
            block_size: 16,
            max_num_seqs: 8,
            ..EngineConfig::default()
        };
        Engine::start(MockBackend::new(16, 64), config).expect("engine starts")
    }

    /// Waits until the engine thread has processed everything sent so far and reports no live request.
    async fn drained(e: &EngineHandle) -> EngineStats {
        for _ in 0..200 {
            let stats = e.checked_stats().wait().await.expect("engine alive");
            if stats.running == 0 && stats.waiting == 0 && stats.kv_blocks_used == 0 {
                return stats;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("engine did not drain: {:?}", e.stats());
    }

    #[tokio::test]
    async fn engine_handle_streams_to_the_finish() {
        let e = engine();
        GenerateBackend::health(&e).await.expect("healthy");
        let outs: Vec<TokenOutput> = greedy(&e, 1, vec![1, 2, 3], 5)
            .unwrap()
            .map(|o| o.expect("no failure"))
            .collect()
            .await;
        assert_eq!(outs.len(), 5);
        assert!(outs[..4].iter().all(|o| o.finish.is_none()));
        assert_eq!(outs[4].finish, Some(FinishReason::Length));
        drained(&e).await;
        e.shutdown();
        assert!(
            GenerateBackend::health(&e).await.is_err(),
            "a stopped engine is unhealthy"
        );
    }

    #[tokio::test]
    async fn dropping_the_stream_aborts_and_frees_blocks() {
        let e = engine();
        let mut stream = greedy(&e, 7, (1..40).collect(), 3000).unwrap();
        assert!(stream.next().await.is_some());
        drop(stream);
        let stats = drained(&e).await;
        assert!(stats.generation_tokens_total < 3000);
        e.shutdown();
    }

    #[tokio::test]
    async fn a_failed_step_ends_the_stream_with_its_error() {
        let config = EngineConfig {
            block_size: 16,
            ..EngineConfig::default()
        };
        let e =
            Engine::start(MockBackend::new(16, 64).fail_at_step(2), config).expect("engine starts");
        let outs: Vec<Result<TokenOutput, BackendError>> =
            greedy(&e, 1, vec![1, 2, 3], 5).unwrap().collect().await;
        let last = outs.last().expect("at least the error");
        // The mock's failure is the request's fault: the client's error.
        match last {
            Err(BackendError::Invalid(m)) => {
                assert!(m.contains("injected failure at step 2"), "{m}")
            }
            other => panic!("expected the step's error last, got {other:?}"),
        }
        assert!(outs[..outs.len() - 1].iter().all(Result::is_ok));
        e.shutdown();
    }

    /// The last item of a stream whose steps fail from the third on with `kind`, and the engine.
    async fn failed_with(
        kind: BackendErrorKind,
    ) -> (Result<TokenOutput, BackendError>, EngineHandle) {
        let config = EngineConfig {
            block_size: 16,
            ..EngineConfig::default()
        };
        let mock = MockBackend::new(16, 64).fail_steps(2.., kind);
        let e = Engine::start(mock, config).expect("engine starts");
        let outs: Vec<Result<TokenOutput, BackendError>> =
            greedy(&e, 1, vec![1, 2, 3], 5).unwrap().collect().await;
        (outs.into_iter().last().expect("at least the error"), e)
    }

    #[tokio::test]
    async fn each_kind_of_backend_failure_reaches_the_api_as_its_own_error() {
        let (last, e) = failed_with(BackendErrorKind::Retryable).await;
        assert!(matches!(last, Err(BackendError::Transient(_))), "{last:?}");
        GenerateBackend::health(&e)
            .await
            .expect("a shortage leaves the engine healthy");
        e.shutdown();

        let (last, e) = failed_with(BackendErrorKind::WorkerLost).await;
        assert!(
            matches!(last, Err(BackendError::Unavailable(_))),
            "{last:?}"
        );
        let health = GenerateBackend::health(&e).await;
        assert!(
            matches!(health, Err(BackendError::Unavailable(_))),
            "{health:?}"
        );
        let refused = greedy(&e, 2, vec![1], 1).err();
        assert!(
            matches!(refused, Some(BackendError::Unavailable(_))),
            "{refused:?}"
        );
        e.shutdown();

        let (last, e) = failed_with(BackendErrorKind::Fatal).await;
        assert!(matches!(last, Err(BackendError::Failed(_))), "{last:?}");
        assert!(GenerateBackend::health(&e).await.is_err());
        e.shutdown();
    }

    #[tokio::test]
    async fn engine_errors_map_to_backend_errors() {
        let config = EngineConfig {
            block_size: 16,
            ..EngineConfig::default()
        };
        let e = Engine::start(MockBackend::new(16, 64).with_max_len(100), config)
            .expect("engine starts");
        let too_long = greedy(&e, 2, vec![1; 200], 1).err();
        assert!(
            matches!(too_long, Some(BackendError::PromptTooLong { .. })),
            "{too_long:?}"
        );
        let empty = greedy(&e, 3, Vec::new(), 1).err();
        assert!(matches!(empty, Some(BackendError::Invalid(_))), "{empty:?}");
        e.shutdown();
    }
}
