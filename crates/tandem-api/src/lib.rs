//! tandem's OpenAI-compatible HTTP API: request validation, chat templating, stop strings, SSE
//! streaming, Prometheus metrics (the registry is `tandem-telemetry`'s), all over a [`GenerateBackend`] so the same surface can front the
//! local engine or remote prefill/decode workers.

pub mod backend;
pub mod chat;
pub mod cluster;
pub mod codec;
pub mod completions;
pub mod console;
pub mod error;
pub mod generate;
pub mod guidance;
pub mod listen;
pub mod protocol;
pub mod reasoning;
pub mod request_log;
pub mod responses;
pub mod routes;
pub mod sse;
pub mod state;
pub mod stop;
pub mod tools;
pub mod validate;

#[cfg(test)]
mod api_tests;
#[cfg(test)]
mod reasoning_tests;
#[cfg(test)]
mod testing;

pub use backend::{BackendError, GenerateBackend, GenerateRequest, TokenStream};
pub use cluster::{ClusterSnapshot, ClusterView, RoutingCounts, WorkerView};
pub use codec::{CodecError, ModelCodec, StreamDecoder, TextCodec};
pub use error::ApiError;
pub use listen::{serve_router, serve_router_tls, ServeLimits};
pub use request_log::current_request_id;
pub use routes::router;
pub use state::{ApiConfig, AppState, DEFAULT_MAX_BODY_BYTES};

use std::future::Future;
use std::sync::Arc;

/// Serves the API on an already-bound listener under `limits` until `shutdown` resolves (in-flight
/// requests finish).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_router(listener, router(state), limits, shutdown).await
}
