//! The crate's typed errors and their HTTP mapping on the worker side.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tandem_engine::{BackendErrorKind, EngineError};
use tandem_kv::KvError;

use crate::protocol::ErrorBody;

/// Everything that can fail in the cluster layer; callers match on it to retry, fall back or refuse.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The local engine refused or failed the request.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Moving KV failed (or the peers' layouts differ).
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A worker was refused at registration: its KV would not be interchangeable (the error names the field).
    #[error("worker {url} refused: {source}")]
    Refused {
        /// The worker's base URL.
        url: String,
        /// Why, naming the differing handshake field.
        #[source]
        source: KvError,
    },
    /// A worker's role cannot serve the RPC it received (e.g. prefill sent to a decode worker).
    #[error("this {role} worker does not serve {what}")]
    WrongRole {
        /// The worker's role.
        role: crate::protocol::Role,
        /// The RPC it refused.
        what: &'static str,
    },
    /// An RPC to another process failed at the transport level (connection refused, reset, timeout).
    #[error("RPC to {url} failed: {source}")]
    Rpc {
        /// The worker's base URL.
        url: String,
        /// The HTTP client's error.
        #[source]
        source: reqwest::Error,
    },
    /// A worker answered with an error status.
    #[error("worker {url} answered {status}: {message}")]
    Remote {
        /// The worker's base URL.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The worker's error message.
        message: String,
    },
    /// A cluster setting is invalid (the error names the key, relative to its section).
    #[error("{key}: {message}")]
    BadConfig {
        /// The key, e.g. `discovery.decode`.
        key: &'static str,
        /// What is wrong with its value.
        message: String,
    },
    /// The decode workers have no room for the request now (the head's admission queue is full or its
    /// wait ran out): a 503 the client retries later.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// A worker answered something that does not follow the protocol.
    #[error("bad answer from {url}: {message}")]
    Protocol {
        /// The worker's base URL.
        url: String,
        /// What was wrong.
        message: String,
    },
}

impl ClusterError {
    /// Whether this is an overload a client should retry later (503 here or from a worker): a full
    /// queue or KV cache, not a failure.
    pub fn is_busy(&self) -> bool {
        match self {
            ClusterError::Remote { status, .. } => *status == 503,
            _ => self.status() == StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Whether the request never reached the worker (its connection was refused: it stopped, or was
    /// never there), so nothing of it started there and another worker can take it unchanged.
    pub fn never_arrived(&self) -> bool {
        matches!(self, ClusterError::Rpc { source, .. } if source.is_connect())
    }

    /// The HTTP status a worker answers this error with.
    pub fn status(&self) -> StatusCode {
        match self {
            ClusterError::Engine(EngineError::QueueFull { .. } | EngineError::KvBusy { .. })
            | ClusterError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ClusterError::Engine(
                EngineError::PromptTooLong { .. }
                | EngineError::KvCacheTooSmall { .. }
                | EngineError::EmptyPrompt
                | EngineError::InvalidParams(_)
                | EngineError::Guidance(_),
            ) => StatusCode::BAD_REQUEST,
            // A model backend failure by its kind: the request's fault, a lost device or stage or a
            // shortage that outlasted the engine's retries (retry elsewhere), or a fault.
            ClusterError::Engine(EngineError::Backend(e)) => match e.kind() {
                BackendErrorKind::Request => StatusCode::BAD_REQUEST,
                BackendErrorKind::WorkerLost | BackendErrorKind::Retryable => {
                    StatusCode::SERVICE_UNAVAILABLE
                }
                BackendErrorKind::Fatal => StatusCode::INTERNAL_SERVER_ERROR,
            },
            ClusterError::WrongRole { .. } => StatusCode::NOT_FOUND,
            ClusterError::Refused { .. } => StatusCode::CONFLICT,
            ClusterError::Kv(_)
            | ClusterError::Rpc { .. }
            | ClusterError::Remote { .. }
            | ClusterError::Protocol { .. } => StatusCode::BAD_GATEWAY,
            ClusterError::Engine(_) | ClusterError::BadConfig { .. } => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }
}

impl IntoResponse for ClusterError {
    fn into_response(self) -> Response {
        (
            self.status(),
            Json(ErrorBody {
                error: self.to_string(),
            }),
        )
            .into_response()
    }
}
