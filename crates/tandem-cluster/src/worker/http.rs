//! A worker's HTTP face: its routes (the control RPCs, `/health`, `/metrics`) and their handlers, each
//! RPC about a client request logged in a span carrying the ingress's request id.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use tracing::Instrument;

use super::{InFlight, WorkerService};
use crate::error::ClusterError;
use crate::protocol::{
    DecodeRequest, PrefillRequest, PrefillResponse, ReleaseRequest, Role, StreamEvent, WireToken,
    PATH_DECODE, PATH_HEALTH, PATH_INFO, PATH_LOAD, PATH_METRICS, PATH_PREFILL, PATH_RELEASE,
};

impl WorkerService {
    /// The worker's Prometheus text: the engine's gauges and counters (`tandem:num_requests_running`,
    /// `tandem:kv_blocks_used`, ... as a colocated server has them) and the worker's own: requests in
    /// flight, pinned KV blocks, KV bytes moved and failed transfers, draining.
    pub fn metrics_text(&self) -> Result<String, ClusterError> {
        let mut text = self
            .metrics
            .render_engine(&self.engine.stats())
            .map_err(|e| ClusterError::Protocol {
                url: String::new(),
                message: e.to_string(),
            })?;
        let load = self.load();
        let (bytes, failures) = match self.config.role {
            Role::Prefill => (load.kv.bytes_sent, load.kv.serve_errors),
            Role::Decode => (load.kv.bytes_received, load.kv.pulls_failed),
        };
        let role = self.config.role;
        for (name, kind, help, value) in [
            (
                "tandem:worker_requests_in_flight",
                "gauge",
                "Requests this worker is serving (prefills, decodes).",
                load.in_flight as u64,
            ),
            (
                "tandem:kv_pinned_blocks",
                "gauge",
                "KV blocks pinned for a decode worker to pull.",
                load.pinned_blocks as u64,
            ),
            (
                "tandem:kv_transfer_bytes_total",
                "counter",
                "KV bytes this worker sent (prefill) or received (decode).",
                bytes,
            ),
            (
                "tandem:kv_transfer_failures_total",
                "counter",
                "KV transfers that failed: served with an error (prefill), pulls that failed (decode).",
                failures,
            ),
            (
                "tandem:worker_draining",
                "gauge",
                "1 while the worker drains (SIGTERM): no new work.",
                u64::from(load.draining),
            ),
        ] {
            use std::fmt::Write;
            let _ = write!(
                text,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{role=\"{role}\"}} {value}\n"
            );
        }
        Ok(text)
    }

    /// The worker's HTTP routes: all but `/health` (and `/metrics`, unless `metrics_need_token`) need
    /// the cluster token when one is set.
    pub fn router(self: Arc<Self>) -> Router {
        let key = self.config.cluster_key.clone();
        let closed_metrics = self.config.metrics_need_token;
        let calls = Router::new()
            .route(
                PATH_INFO,
                get(|State(s): State<Arc<Self>>| async move { Json(s.info.clone()) }),
            )
            .route(
                PATH_LOAD,
                get(|State(s): State<Arc<Self>>| async move { Json(s.polled()) }),
            )
            .route(PATH_PREFILL, post(prefill))
            .route(PATH_DECODE, post(decode))
            .route(PATH_RELEASE, post(release));
        let (calls, open) = if closed_metrics {
            (calls.route(PATH_METRICS, get(metrics)), Router::new())
        } else {
            (calls, Router::new().route(PATH_METRICS, get(metrics)))
        };
        crate::auth::require_token(calls, key)
            .merge(open)
            .route(PATH_HEALTH, get(health))
            .with_state(self)
    }
}

/// Readiness: 200 while the worker takes work, 503 once it drains or its engine stopped (a lost device
/// or stage); the body says which worker answers (`{"status":"ok"|"draining"|"unavailable","role",
/// "worker","model"}`, `error` too when refusing, the shape the ingress reads refusals in).
async fn health(State(s): State<Arc<WorkerService>>) -> Response {
    let draining = s.is_draining();
    let engine = s.engine.health();
    let status = match (&engine, draining) {
        (Err(_), _) => "unavailable",
        (Ok(()), true) => "draining",
        (Ok(()), false) => "ok",
    };
    let mut body = serde_json::json!({
        "status": status,
        "role": s.config.role,
        "worker": s.info.worker_id,
        "model": s.info.peer.model_id,
    });
    if let Err(e) = engine {
        body["error"] = e.to_string().into();
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    } else if draining {
        body["error"] = "draining".into();
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    } else {
        (StatusCode::OK, Json(body)).into_response()
    }
}

/// `GET /metrics`: the worker's Prometheus text ([`WorkerService::metrics_text`]).
async fn metrics(State(s): State<Arc<WorkerService>>) -> Response {
    match s.metrics_text() {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The span of one RPC about a client request: the `X-Request-Id` the ingress sent (its own request
/// id), so the worker's lines about it carry the id the head's lines and the client's answer carry.
fn request_span(headers: &HeaderMap, rpc: &'static str) -> tracing::Span {
    let id = headers
        .get(tandem_telemetry::X_REQUEST_ID.as_str())
        .and_then(|v| v.to_str().ok())
        .filter(|id| tandem_telemetry::is_valid_request_id(id))
        .unwrap_or("");
    tracing::info_span!("request", rpc, request_id = %id)
}

async fn prefill(
    State(s): State<Arc<WorkerService>>,
    headers: HeaderMap,
    Json(req): Json<PrefillRequest>,
) -> Result<Json<PrefillResponse>, ClusterError> {
    let span = request_span(&headers, "prefill");
    let started = Instant::now();
    let prompt_tokens = req.prompt.len();
    let answer = s.prefill(req).instrument(span.clone()).await;
    span.in_scope(|| match &answer {
        Ok(_) => tracing::info!(
            prompt_tokens,
            ms = started.elapsed().as_millis() as u64,
            "prefilled"
        ),
        Err(e) => tracing::warn!(prompt_tokens, error = %e, "prefill failed"),
    });
    answer.map(Json)
}

async fn release(
    State(s): State<Arc<WorkerService>>,
    Json(req): Json<ReleaseRequest>,
) -> Json<bool> {
    Json(
        s.kv_server
            .as_ref()
            .is_some_and(|srv| srv.abort(req.transfer_id)),
    )
}

/// What a decode's last log line says: the tokens it streamed and how long since its RPC came.
struct DecodeLog {
    span: tracing::Span,
    started: Instant,
    tokens: usize,
}

fn ndjson(event: &StreamEvent) -> Bytes {
    let mut line =
        serde_json::to_vec(event).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}").into_bytes());
    line.push(b'\n');
    Bytes::from(line)
}

async fn decode(
    State(s): State<Arc<WorkerService>>,
    headers: HeaderMap,
    Json(req): Json<DecodeRequest>,
) -> Result<Response, ClusterError> {
    let span = request_span(&headers, "decode");
    let started = Instant::now();
    let busy = InFlight::new(&s.in_flight);
    let (first, stream) = match s.start_decode(req).instrument(span.clone()).await {
        Ok(started) => started,
        Err(e) => {
            span.in_scope(|| tracing::warn!(error = %e, "decode failed to start"));
            return Err(e);
        }
    };
    // The body owns the engine stream: when the ingress disconnects, the body is dropped and the
    // request aborted, which frees its blocks. Its end is logged in the request's span.
    let log = DecodeLog {
        span,
        started,
        tokens: 0,
    };
    let tokens = futures::stream::unfold(Some((stream, busy, log)), |state| async move {
        let (mut stream, busy, mut log) = state?;
        match stream.recv().await {
            Some(out) => {
                log.tokens += 1;
                let done = out.finish;
                let line = ndjson(&StreamEvent::Token(WireToken::from(out)));
                if let Some(finish) = done {
                    log.span.in_scope(|| {
                        tracing::info!(
                            tokens = log.tokens,
                            ?finish,
                            ms = log.started.elapsed().as_millis() as u64,
                            "decoded"
                        )
                    });
                    return Some((line, None));
                }
                Some((line, Some((stream, busy, log))))
            }
            None => {
                let err = stream.take_error().map_or_else(
                    || "the engine ended the request".to_owned(),
                    |e| e.to_string(),
                );
                log.span.in_scope(
                    || tracing::warn!(tokens = log.tokens, error = %err, "decode failed"),
                );
                Some((ndjson(&StreamEvent::Error(err)), None))
            }
        }
    });
    let body = futures::stream::iter(first.as_ref().map(ndjson))
        .chain(tokens)
        .map(Ok::<_, Infallible>);
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response())
}
