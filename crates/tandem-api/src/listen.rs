//! Serving a router on a listener with the limits `axum::serve` lacks, for every HTTP listener tandem runs
//! (the OpenAI API, the P/D head, the worker RPC): a deadline for a request's header, one for its body,
//! and a cap on open connections.
//!
//! With a rustls `ServerConfig` ([`serve_router_tls`]) every connection is TLS first.
//!
//! Built on hyper's HTTP/1.1 connection (the protocol `axum::serve` spoke here too: no client of tandem
//! uses HTTP/2, and hyper-util's `auto` builder would pull in `h2` for none).
//!
//! - **Header:** hyper's `header_read_timeout`: a connection whose next request head is not complete within
//!   [`ServeLimits::header_read_timeout`] of hyper starting to wait for it is closed. This also ends idle
//!   keep-alive connections after that long, which clients' pools handle (they retry a request that met a
//!   closed idle connection).
//! - **Body:** [`DeadlineBody`]: the whole body must arrive within [`ServeLimits::body_read_timeout`] of the
//!   head, or reading it fails (the API answers 408). A per-frame timeout would let a client trickle one
//!   byte per interval forever. Only the request is timed: a response (a long SSE stream) is not.
//! - **Connections:** a semaphore of [`ServeLimits::max_connections`] permits, one per open connection. A
//!   connection over the limit is refused at once with a 503 (`Retry-After: 1`, OpenAI's error shape)
//!   rather than left waiting: a waiting client cannot tell a full server from a hung one, a load balancer
//!   or an OpenAI SDK retries a 503 (elsewhere, or after backing off), and the refusal holds no slot.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::Request;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;
use tower::Service;
use tracing::{debug, warn};

use crate::ApiError;

/// Default of [`ServeLimits::header_read_timeout`]: a request head is a few hundred bytes.
pub const DEFAULT_HEADER_READ_TIMEOUT_SECS: f64 = 10.0;
/// Default of [`ServeLimits::body_read_timeout`]: room for a large prompt on a slow link.
pub const DEFAULT_BODY_READ_TIMEOUT_SECS: f64 = 30.0;
/// Default of [`ServeLimits::max_connections`]: far above the engine's running sequences.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// How long a refused connection is kept to let the client read its 503 before the socket closes
/// (closing with unread request bytes would reset the connection and lose the answer).
const REFUSE_LINGER: Duration = Duration::from_secs(1);

/// The per-listener limits that keep slow or numerous clients from holding the server.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ServeLimits {
    /// Time a connection has to deliver a complete request head (also the keep-alive idle limit).
    pub header_read_timeout: Duration,
    /// Time a request has, from its head, to deliver its whole body.
    pub body_read_timeout: Duration,
    /// Connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs_f64(DEFAULT_HEADER_READ_TIMEOUT_SECS),
            body_read_timeout: Duration::from_secs_f64(DEFAULT_BODY_READ_TIMEOUT_SECS),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// The error a request body yields when its deadline passes; the API maps it to 408.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyReadTimeout(pub Duration);

/// A request body that fails with [`BodyReadTimeout`] once its deadline passes before its end.
pub struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    limit: Duration,
}

impl DeadlineBody {
    /// Wraps `inner`, which must end within `limit` from now.
    pub fn new(inner: Incoming, limit: Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep_until(Instant::now() + limit)),
            limit,
        }
    }
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match this.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(BodyReadTimeout(this.limit).into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `router` on `listener` under `limits` until `shutdown` resolves; then stops accepting and
/// waits for the open connections' requests to finish (each connection closes after its current one).
pub async fn serve_router(
    listener: TcpListener,
    router: axum::Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_router_tls(listener, router, limits, None, shutdown).await
}

/// [`serve_router`] over TLS when `tls` is given (`server.tls`, or the cluster's mutual TLS on a
/// worker's port): each connection's handshake must finish within the header deadline, and one that
/// fails (plain HTTP, an untrusted client certificate) is closed before any request is read. Without
/// `tls` the sockets are served as they are.
pub async fn serve_router_tls(
    listener: TcpListener,
    router: axum::Router,
    limits: ServeLimits,
    tls: Option<Arc<ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let acceptor = tls.map(TlsAcceptor::from);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            debug!(%peer, limit = limits.max_connections, "connection refused: too many open");
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                match acceptor {
                    None => refuse(stream).await,
                    Some(a) => {
                        if let Ok(Ok(s)) =
                            tokio::time::timeout(REFUSE_LINGER, a.accept(stream)).await
                        {
                            refuse(s).await;
                        }
                    }
                }
            });
            continue;
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let body_limit = limits.body_read_timeout;
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let req = req.map(|body| Body::new(DeadlineBody::new(body, body_limit)));
            router.clone().call(req)
        });
        let watcher = graceful.watcher();
        let http = http.clone();
        let acceptor = acceptor.clone();
        let handshake_limit = limits.header_read_timeout;
        tokio::spawn(async move {
            let served = match acceptor {
                None => {
                    watcher
                        .watch(http.serve_connection(TokioIo::new(stream), service))
                        .await
                }
                Some(a) => match tokio::time::timeout(handshake_limit, a.accept(stream)).await {
                    Ok(Ok(tls)) => {
                        watcher
                            .watch(http.serve_connection(TokioIo::new(tls), service))
                            .await
                    }
                    Ok(Err(e)) => {
                        debug!(%peer, error = %e, "TLS handshake refused");
                        Ok(())
                    }
                    Err(_) => {
                        debug!(%peer, "TLS handshake timed out");
                        Ok(())
                    }
                },
            };
            if let Err(e) = served {
                debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Waits after a failed `accept`: at once for errors of one connection, a second for the rest (out
/// of file descriptors: retrying at once would spin).
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    warn!(error = %e, "accepting a connection failed; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// Answers a connection over the limit with a 503 in OpenAI's error shape and closes it. It waits (at
/// most [`REFUSE_LINGER`]) for the request head first, since HTTP clients drop an answer that comes
/// before their request went out, and afterwards reads (and drops) what else comes for as long again,
/// so the close does not reset the connection before the client read the answer.
async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) {
    let mut error = ApiError::overloaded("Too many open connections; retry shortly.", 1);
    error.code = Some("too_many_connections");
    let body = error.body_json();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    let _ = tokio::time::timeout(REFUSE_LINGER, async {
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") && seen.len() < 16 * 1024 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let _ = tokio::time::timeout(REFUSE_LINGER, async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        while stream.read(&mut buf).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use futures::StreamExt;
    use std::net::SocketAddr;
    use tokio::net::TcpStream;

    /// A router with a body-reading echo and a plain GET, served under `limits` on a loopback port.
    async fn start(limits: ServeLimits) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let router = axum::Router::new()
            .route("/ok", get(|| async { "ok" }))
            .route(
                "/echo",
                post(|body: Bytes| async move { body.len().to_string() }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve_router(listener, router, limits, async move {
            let _ = stopped.await;
        }));
        (addr, stop)
    }

    /// Writes `request` and reads until the server closes (or `wait` passes): what came back.
    async fn exchange(addr: SocketAddr, request: &[u8], wait: Duration) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(wait, s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn a_slow_header_is_cut_and_a_slow_body_fails_while_others_are_served() {
        let limits = ServeLimits {
            header_read_timeout: Duration::from_millis(300),
            body_read_timeout: Duration::from_millis(300),
            max_connections: 8,
        };
        let (addr, _stop) = start(limits).await;
        let started = std::time::Instant::now();
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /ok HTTP/1.1\r\n").await.unwrap();
        let ok = exchange(
            addr,
            b"GET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            Duration::from_secs(5),
        )
        .await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        let mut rest = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut rest))
            .await
            .expect("the slow header's connection is closed");
        assert!(n.is_ok());
        assert!(started.elapsed() < Duration::from_secs(3));

        let partial =
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\nconnection: close\r\n\r\nabc";
        let answer = exchange(addr, partial, Duration::from_secs(5)).await;
        assert!(answer.starts_with("HTTP/1.1 4"), "{answer}");
        let whole =
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc";
        let answer = exchange(addr, whole, Duration::from_secs(5)).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with('3'),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn a_response_streaming_longer_than_both_timeouts_is_not_cut() {
        let limits = ServeLimits {
            header_read_timeout: Duration::from_millis(200),
            body_read_timeout: Duration::from_millis(200),
            max_connections: 4,
        };
        let router = axum::Router::new().route(
            "/stream",
            post(|body: Bytes| async move {
                let len = body.len();
                let ticks = futures::stream::iter(0..8).then(move |i| async move {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Ok::<_, std::io::Error>(format!("tick {i} of {len}\n"))
                });
                Body::from_stream(ticks)
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_router(
            listener,
            router,
            limits,
            std::future::pending(),
        ));
        let started = std::time::Instant::now();
        let request =
            b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi";
        let answer = exchange(addr, request, Duration::from_secs(5)).await;
        assert!(started.elapsed() >= Duration::from_millis(800));
        assert!(answer.contains("tick 7 of 2"), "{answer}");
    }

    #[tokio::test]
    async fn a_connection_over_the_limit_gets_503_and_a_freed_slot_serves_again() {
        let limits = ServeLimits {
            header_read_timeout: Duration::from_secs(60),
            body_read_timeout: Duration::from_secs(60),
            max_connections: 2,
        };
        let (addr, _stop) = start(limits).await;
        let held: Vec<TcpStream> = futures::future::join_all((0..2).map(|_| async {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /ok HTTP/1.1\r\n").await.unwrap();
            s
        }))
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let request = b"GET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
        let refused = exchange(addr, request, Duration::from_secs(5)).await;
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        assert!(refused.contains("too_many_connections"), "{refused}");
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let served = exchange(addr, request, Duration::from_secs(5)).await;
        assert!(served.starts_with("HTTP/1.1 200"), "{served}");
    }
}
