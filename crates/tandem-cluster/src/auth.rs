//! The cluster token on control calls: with a [`ClusterKey`] set, every worker route but `/health` and
//! the head's registration and listing (`/v1/cluster/workers`) require `Authorization: Bearer TOKEN`,
//! compared in constant time, and the ingress sends it on every call. A missing or wrong token gets 401
//! before any handler runs. Without a key the routes stay open, as before.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use tandem_kv::ClusterKey;

use crate::protocol::ErrorBody;

/// `router` with every route requiring the cluster token when `key` is set (unchanged otherwise).
pub fn require_token<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    key: Option<ClusterKey>,
) -> Router<S> {
    match key {
        Some(key) => router.route_layer(middleware::from_fn_with_state(key, check)),
        None => router,
    }
}

/// The headers every control call of a holder of `key` carries (none without a key).
pub fn token_headers(key: Option<&ClusterKey>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(key) = key {
        if let Ok(mut value) = HeaderValue::from_str(&format!("Bearer {}", key.token())) {
            value.set_sensitive(true);
            headers.insert(header::AUTHORIZATION, value);
        }
    }
    headers
}

async fn check(State(key): State<ClusterKey>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if key.matches_token(presented) {
        return next.run(req).await;
    }
    tracing::warn!(path = %req.uri().path(), "control call without the cluster token refused");
    (
        StatusCode::UNAUTHORIZED,
        Json(ErrorBody {
            error: "this call needs the cluster token (deployment.cluster_token)".into(),
        }),
    )
        .into_response()
}
