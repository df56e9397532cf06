//! The engine's error type.

use std::sync::Arc;

use crate::backend::{BackendError, BackendErrorKind};
use crate::types::RequestId;

/// Why the engine refused or failed a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Too many requests are queued; retry later.
    #[error("engine queue full ({waiting} waiting)")]
    QueueFull {
        /// Requests queued when this one was refused.
        waiting: usize,
    },
    /// The prompt leaves no room for a generated token.
    #[error("prompt of {prompt} tokens (+{max_tokens} to generate) exceeds the model's {max_model_len}-token context")]
    PromptTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested max_tokens.
        max_tokens: usize,
        /// The engine's context length.
        max_model_len: usize,
    },
    /// The prompt needs more KV blocks than the whole pool has.
    #[error("prompt of {prompt} tokens needs more KV cache than the pool's {capacity} tokens")]
    KvCacheTooSmall {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens the whole pool holds.
        capacity: usize,
    },
    /// A request must have at least one prompt token.
    #[error("empty prompt")]
    EmptyPrompt,
    /// A live request already uses this id.
    #[error("duplicate request id {0}")]
    DuplicateId(RequestId),
    /// The request (or its pin) is not known to the engine.
    #[error("unknown request id {0}")]
    UnknownRequest(RequestId),
    /// The request is in the wrong state for this command (e.g. export of an unpinned request).
    #[error("request {id}: {reason}")]
    InvalidState {
        /// The request.
        id: RequestId,
        /// What was wrong.
        reason: String,
    },
    /// The KV cache has no free blocks for an import right now (running sequences hold them); the
    /// caller may wait and retry, as an admission waits in the queue.
    #[error("request {id}: no room in the KV cache for its import yet: {reason}")]
    KvBusy {
        /// The request.
        id: RequestId,
        /// The pool's shortfall.
        reason: String,
    },
    /// Sampling parameters out of range.
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(String),
    /// The request's output constraint cannot be honoured (a grammar that does not compile, or an
    /// engine without guided decoding).
    #[error("response format: {0}")]
    Guidance(String),
    /// Configuration does not fit the backend.
    #[error("invalid engine config: {0}")]
    Config(String),
    /// The engine thread has stopped.
    #[error("engine stopped")]
    Stopped,
    /// The backend failed while running this request, or failed the engine as a whole (then every
    /// request gets the same error, hence shared). Its kind says whether the request, the moment or the
    /// worker is to blame ([`EngineError::backend_kind`]).
    #[error(transparent)]
    Backend(Arc<BackendError>),
}

impl From<BackendError> for EngineError {
    fn from(e: BackendError) -> Self {
        EngineError::Backend(Arc::new(e))
    }
}

impl EngineError {
    /// The kind of the backend failure behind this error, if it is one.
    pub fn backend_kind(&self) -> Option<BackendErrorKind> {
        match self {
            EngineError::Backend(e) => Some(e.kind()),
            _ => None,
        }
    }
}
