//! The router: routes, API-key and access-log middleware (`request_log`), and the small endpoints
//! (models, tokenize, detokenize, health, metrics, cluster; the console's page in `console.rs`).

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tracing::Level;

use crate::cluster::ClusterSnapshot;
use crate::error::ApiError;
use crate::protocol::{
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
};
use crate::state::AppState;
use crate::{chat, completions, responses};

/// JSON body extractor whose rejections are OpenAI-shaped 400s instead of axum's plain-text 415/422.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    Json<T>: FromRequest<S, Rejection = axum::extract::rejection::JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Json(value) = Json::<T>::from_request(req, state).await?;
        Ok(Self(value))
    }
}

/// Builds the whole HTTP surface over one state.
pub fn router(state: Arc<AppState>) -> Router {
    let keyed = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::create_response))
        .route(
            "/v1/responses/{id}",
            get(responses::stored_response).delete(responses::stored_response),
        )
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let api = Router::new()
        .merge(keyed)
        .merge(crate::console::routes())
        .fallback(fallback);
    // The console polls this every two seconds per open page: DEBUG like the probes, but always keyed.
    let polled = Router::new()
        .route("/v1/cluster", get(cluster))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    // Scrapers and probes call these every few seconds: their lines are DEBUG, so INFO shows requests.
    let mut probes = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics));
    if state.config.probes_need_key {
        probes = probes.route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    }
    traced(api, Level::INFO)
        .merge(traced(polled, Level::DEBUG))
        .merge(traced(probes, Level::DEBUG))
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

/// `router` with a request id, a span per request and an access line at `level` when its body ends.
fn traced<S: Clone + Send + Sync + 'static>(router: Router<S>, level: Level) -> Router<S> {
    router.layer(middleware::from_fn_with_state(
        level,
        crate::request_log::access_log,
    ))
}

/// Rejects API requests (/v1, /tokenize, /detokenize) without the configured bearer token.
async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !presented.is_some_and(|p| same_secret(p, key)) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Whether a presented key is the configured one, in time that depends on neither: both are hashed to
/// fixed-length digests first and the digests compared without an early exit.
fn same_secret(presented: &str, key: &str) -> bool {
    use sha2::{Digest, Sha256};
    let (a, b) = (Sha256::digest(presented), Sha256::digest(key));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

async fn fallback(req: Request) -> ApiError {
    ApiError::route_not_found(req.uri().path())
}

fn model_card(state: &AppState, name: &str) -> ModelCard {
    ModelCard {
        id: name.to_owned(),
        object: "model",
        created: state.started_at,
        owned_by: "tandem",
        root: state.config.model_root.clone(),
        max_model_len: state.backend.max_model_len(),
    }
}

async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    let data = state
        .config
        .served_model_names
        .iter()
        .map(|n| model_card(&state, n))
        .collect();
    Json(ModelList {
        object: "list",
        data,
    })
}

async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    state.check_model(&id)?;
    Ok(Json(model_card(&state, &id)))
}

/// The deployment's workers, routing, KV traffic and latency (`GET /v1/cluster`).
async fn cluster(State(state): State<Arc<AppState>>) -> Json<ClusterSnapshot> {
    let mut deployment = state.backend.cluster();
    deployment.model = state.primary_model_name().to_owned();
    Json(ClusterSnapshot {
        deployment,
        latency: state.metrics.latency(),
    })
}

fn check_optional_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    model.map_or(Ok(()), |m| state.check_model(m))
}

async fn tokenize(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    check_optional_model(&state, req.model.as_deref())?;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => state
            .codec
            .encode(prompt, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?,
        (None, Some(messages)) => {
            chat::render_and_encode(
                &state,
                messages,
                req.add_generation_prompt.unwrap_or(true),
                None,
                req.chat_template_kwargs.as_ref(),
            )?
            .ids
        }
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of `prompt` or `messages`",
                Some("prompt"),
            ))
        }
    };
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.backend.max_model_len(),
        tokens,
    }))
}

/// 400 unless every id is in the vocabulary.
pub(crate) fn check_token_ids(state: &AppState, ids: &[u32], param: &str) -> Result<(), ApiError> {
    let vocab = state.codec.vocab_size();
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(ApiError::invalid(
            format!("token id {t} is out of vocabulary (size {vocab})"),
            Some(param),
        )),
        None => Ok(()),
    }
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    check_optional_model(&state, req.model.as_deref())?;
    check_token_ids(&state, &req.tokens, "tokens")?;
    let prompt = state
        .codec
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("tokens")))?;
    Ok(Json(DetokenizeResponse { prompt }))
}

/// How long /health waits for the backend before declaring it unhealthy.
const HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `GET /health`'s answer, ready or not: enough for a person or a probe to see what answers and, when it
/// is not ready, why (the same small shape as a P/D worker's `/health`).
#[derive(serde::Serialize)]
struct Health<'a> {
    status: &'static str,
    role: &'static str,
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// 200 only while the backend can take requests (load balancers and the test fixture poll it); otherwise
/// the error's status (503 while not ready) with `status: "unavailable"` and the reason in `error`.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let not_ready = match tokio::time::timeout(HEALTH_TIMEOUT, state.backend.health()).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(ApiError::from(e)),
        Err(_) => Some(ApiError::overloaded(
            "the engine did not answer the health check in time",
            5,
        )),
    };
    let mut body = Health {
        status: "ok",
        role: state.backend.role(),
        model: state.primary_model_name(),
        error: None,
    };
    let Some(e) = not_ready else {
        return Json(body).into_response();
    };
    body.status = "unavailable";
    body.error = Some(e.message);
    let mut response = (e.status, Json(body)).into_response();
    if let Some(secs) = e.retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(secs));
    }
    response
}

async fn metrics(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let mut text = state
        .metrics
        .render(&state.backend.stats())
        .map_err(|e| ApiError::internal(e.to_string()))?;
    text.push_str(&state.backend.extra_metrics());
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}
