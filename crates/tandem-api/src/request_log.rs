//! One request, followed: its id (the client's `X-Request-Id` when acceptable, else minted), echoed on
//! every response and carried by the request's span into every log line that touches it, and its access
//! line, written when the response body ends (a stream's real duration and token counts, not the moment
//! its headers went out).
//!
//! The id and the token tally reach code that cannot see the HTTP request (a backend's `submit`, the
//! choice runs in `generate`) through a task-local set around the handler: the P/D ingress reads the id
//! there to hand it to the workers in its RPCs, so the `GenerateBackend` trait stays as it is. What an
//! acceptable id is, and minting one, are `tandem_telemetry::request_id`'s (the workers check ids too).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tandem_telemetry::{request_id_from, X_REQUEST_ID};
use tracing::{Instrument, Level, Span};

/// Token counts of one HTTP request, summed over its choices, for its access line.
#[derive(Debug, Default)]
pub struct Tally {
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
}

impl Tally {
    /// Counts one prompt's tokens (once per prompt, however many choices it has, as `usage` does).
    pub fn prompt(&self, tokens: usize) {
        self.prompt_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// Counts one generated token.
    pub fn token(&self) {
        self.completion_tokens.fetch_add(1, Ordering::Relaxed);
    }

    fn counts(&self) -> (u64, u64) {
        (
            self.prompt_tokens.load(Ordering::Relaxed),
            self.completion_tokens.load(Ordering::Relaxed),
        )
    }
}

/// What the handler's task knows about the request it serves.
#[derive(Clone)]
struct RequestContext {
    id: Arc<str>,
    tally: Arc<Tally>,
}

tokio::task_local! {
    static CURRENT: RequestContext;
}

/// The id of the request whose handler runs on this task, if any (the P/D ingress sends it on).
pub fn current_request_id() -> Option<String> {
    CURRENT.try_with(|c| c.id.to_string()).ok()
}

/// The token tally of the request whose handler runs on this task, if any.
pub fn current_tally() -> Option<Arc<Tally>> {
    CURRENT.try_with(|c| Arc::clone(&c.tally)).ok()
}

/// Middleware: gives the request its id (echoed on the response, whatever its status), runs the handler
/// in a `request` span carrying it, and writes the access line at `level` once the body has ended.
pub async fn access_log(State(level): State<Level>, mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = request_id_from(req.headers().get(&X_REQUEST_ID));
    let header = HeaderValue::from_str(&id).expect("a valid request id is a valid header value");
    req.headers_mut()
        .insert(X_REQUEST_ID.clone(), header.clone());
    let span = tracing::info_span!(
        "request",
        method = %req.method(),
        path = %req.uri().path(),
        request_id = %id
    );
    let context = RequestContext {
        id: id.into(),
        tally: Arc::default(),
    };
    let tally = Arc::clone(&context.tally);
    let mut response = CURRENT
        .scope(context, next.run(req))
        .instrument(span.clone())
        .await;
    response.headers_mut().insert(X_REQUEST_ID.clone(), header);
    let status = response.status();
    response.map(|body| {
        Body::new(LoggedBody {
            inner: body,
            line: Some(AccessLine {
                span,
                level,
                status,
                started,
                tally,
            }),
        })
    })
}

/// The access line of one request, written once when its body ends or is dropped.
struct AccessLine {
    span: Span,
    level: Level,
    status: StatusCode,
    started: Instant,
    tally: Arc<Tally>,
}

impl AccessLine {
    fn write(self, complete: bool) {
        let _in = self.span.enter();
        let ms = self.started.elapsed().as_millis() as u64;
        let status = self.status.as_u16();
        let (prompt_tokens, completion_tokens) = self.tally.counts();
        // `tracing` macros need a level known at compile time.
        macro_rules! line {
            ($lvl:expr) => {
                tracing::event!(
                    $lvl,
                    status,
                    ms,
                    prompt_tokens,
                    completion_tokens,
                    complete,
                    "finished processing request"
                )
            };
        }
        match self.level {
            Level::ERROR => line!(Level::ERROR),
            Level::WARN => line!(Level::WARN),
            Level::INFO => line!(Level::INFO),
            Level::DEBUG => line!(Level::DEBUG),
            _ => line!(Level::TRACE),
        }
    }
}

/// A response body that writes the request's access line when it ends: after its last frame, or, when
/// the client leaves first, when it is dropped (`complete=false`). Polled inside the request's span, so
/// lines logged while streaming (a choice's `generation finished`) carry the request id.
struct LoggedBody {
    inner: Body,
    line: Option<AccessLine>,
}

impl HttpBody for LoggedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = match &this.line {
            Some(line) => {
                let _in = line.span.enter();
                Pin::new(&mut this.inner).poll_frame(cx)
            }
            None => Pin::new(&mut this.inner).poll_frame(cx),
        };
        if matches!(polled, Poll::Ready(None)) || this.inner.is_end_stream() {
            if let Some(line) = this.line.take() {
                line.write(true);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        if let Some(line) = self.line.take() {
            // A body hyper never polled (HEAD, or a response it knows to be empty) is complete too.
            let complete = self.inner.is_end_stream();
            line.write(complete);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `req` to `app`: the answer's status, `x-request-id` and body.
    async fn send(app: &axum::Router, req: Request) -> (u16, String, String) {
        use tower::ServiceExt;
        let response = app.clone().oneshot(req).await.unwrap();
        let status = response.status().as_u16();
        let id = response.headers()[&X_REQUEST_ID]
            .to_str()
            .unwrap()
            .to_owned();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, id, String::from_utf8(body.to_vec()).unwrap())
    }

    fn get(uri: &str, id: Option<&str>) -> Request {
        let mut req = Request::builder().uri(uri);
        if let Some(id) = id {
            req = req.header(&X_REQUEST_ID, id);
        }
        req.body(Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn the_handler_sees_the_id_the_answer_carries() {
        let app = axum::Router::new()
            .route(
                "/id",
                axum::routing::get(|| async { current_request_id().unwrap_or_default() }),
            )
            .layer(axum::middleware::from_fn_with_state(
                Level::INFO,
                access_log,
            ));
        let (status, id, body) = send(&app, get("/id", Some("abc-1"))).await;
        assert_eq!(
            (status, id.as_str(), body.as_str()),
            (200, "abc-1", "abc-1")
        );
        let (_, id, body) = send(&app, get("/id", Some("not valid"))).await;
        assert!(id.starts_with("req-"), "{id}");
        assert_eq!(body, id, "the handler sees the id the client is told");
        let (status, id, _) = send(&app, get("/missing", None)).await;
        assert_eq!(status, 404);
        assert!(id.starts_with("req-"), "errors carry an id too: {id}");
    }

    #[tokio::test]
    async fn health_says_what_answers_and_every_route_has_an_id() {
        use crate::testing::{fake_state, FakeBackend};
        let backend = Arc::new(FakeBackend::new("hi"));
        let app = crate::router(fake_state(Arc::clone(&backend), None));
        let (status, id, body) = send(&app, get("/health", Some("probe-1"))).await;
        assert_eq!((status, id.as_str()), (200, "probe-1"));
        let health: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            health,
            serde_json::json!({"status": "ok", "role": "colocated", "model": "fake"})
        );
        let (status, id, _) = send(&app, get("/v1/nothing", Some("x"))).await;
        assert_eq!((status, id.as_str()), (404, "x"));
        backend.stopped.store(true, Ordering::SeqCst);
        let (status, id, body) = send(&app, get("/health", None)).await;
        assert_eq!(status, 503, "unhealthy keeps its status");
        assert!(id.starts_with("req-"));
        let health: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(health["status"], "unavailable", "{health}");
        assert_eq!(health["role"], "colocated", "{health}");
        assert_eq!(health["model"], "fake", "{health}");
        assert!(
            health["error"].as_str().is_some_and(|e| !e.is_empty()),
            "the body says why: {health}"
        );
        assert_eq!(
            health.as_object().map(|o| o.len()),
            Some(4),
            "not the OpenAI error shape: {health}"
        );
    }

    #[tokio::test]
    async fn the_context_is_seen_only_inside_the_handler_task() {
        assert_eq!(current_request_id(), None);
        let context = RequestContext {
            id: "abc".into(),
            tally: Arc::default(),
        };
        let (id, tally) = CURRENT
            .scope(context, async {
                let tally = current_tally().expect("inside the scope");
                tally.prompt(5);
                tally.token();
                tally.token();
                (current_request_id(), tally)
            })
            .await;
        assert_eq!(id.as_deref(), Some("abc"));
        assert_eq!(tally.counts(), (5, 2));
        assert!(current_tally().is_none());
    }
}
