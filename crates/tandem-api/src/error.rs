//! API errors in OpenAI's wire shape, so that official clients raise the exception they expect.

use axum::extract::rejection::JsonRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Every failure a handler can answer with: an HTTP status plus OpenAI's `{"error": {...}}` body.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status of the answer.
    pub status: StatusCode,
    /// Human-readable explanation, shown by clients.
    pub message: String,
    /// OpenAI's error `type` (e.g. `invalid_request_error`).
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (e.g. `model_not_found`).
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (sent as `Retry-After` on 503).
    pub retry_after: Option<u32>,
}

/// The inner object of the error body.
#[derive(Serialize)]
struct ErrorObject<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

/// The whole error body, `{"error": {...}}`.
#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

impl ApiError {
    /// A 400 for a request that is malformed or out of range; `param` names the offending field.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
            retry_after: None,
        }
    }

    /// A 404 for a model name this server does not serve.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model".to_owned()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// A 413 for a request body over the server's limit (`server.max_body_bytes`).
    pub fn too_large() -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: "The request body is larger than this server accepts (server.max_body_bytes)."
                .to_owned(),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
        }
    }

    /// A 408 for a request body that did not arrive within `server.body_read_timeout_secs`.
    pub fn body_timeout() -> Self {
        Self {
            status: StatusCode::REQUEST_TIMEOUT,
            message: "The request body did not arrive in time (server.body_read_timeout_secs)."
                .to_owned(),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
            retry_after: None,
        }
    }

    /// A 401 for a missing or wrong bearer token.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key.".to_owned(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// A 503 telling the client that the engine queue is full and when to retry.
    pub fn overloaded(message: impl Into<String>, retry_after: u32) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_overloaded",
            param: None,
            code: Some("queue_full"),
            retry_after: Some(retry_after),
        }
    }

    /// A 500 for failures on the server's side (engine gone, tokenizer failure on our own output).
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// A 404 for a path that no route serves, in the same JSON shape as every other error.
    pub fn route_not_found(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("No route for {path}."),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
            retry_after: None,
        }
    }

    /// The JSON body alone; streaming answers send it as an SSE event after headers went out.
    pub fn body_json(&self) -> String {
        let body = ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| String::from("{\"error\":{}}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            self.body_json(),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl From<JsonRejection> for ApiError {
    /// Axum answers malformed bodies with 415/422 and plain text; OpenAI clients expect a 400 JSON error.
    fn from(rejection: JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::too_large();
        }
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&rejection);
        while let Some(e) = cause {
            if e.is::<crate::listen::BodyReadTimeout>() {
                return ApiError::body_timeout();
            }
            cause = e.source();
        }
        ApiError::invalid(rejection.body_text(), None)
    }
}

impl From<crate::backend::BackendError> for ApiError {
    fn from(err: crate::backend::BackendError) -> Self {
        use crate::backend::BackendError;
        match &err {
            BackendError::QueueFull { .. } => ApiError::overloaded(err.to_string(), 1),
            BackendError::PromptTooLong { .. } => {
                ApiError::invalid(err.to_string(), Some("max_tokens"))
            }
            BackendError::Invalid(_) => ApiError::invalid(err.to_string(), None),
            BackendError::Unavailable(_) => {
                let mut e = ApiError::overloaded(err.to_string(), 5);
                e.code = Some("backend_unavailable");
                e
            }
            BackendError::Transient(_) => {
                let mut e = ApiError::overloaded(err.to_string(), 1);
                e.code = Some("backend_retry");
                e
            }
            BackendError::Failed(_) => ApiError::internal(err.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::to_bytes;

    #[tokio::test]
    async fn error_body_has_openai_shape_and_retry_after() {
        let response = ApiError::overloaded("queue full", 3).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
        let body = to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["message"], "queue full");
        assert_eq!(v["error"]["type"], "server_overloaded");
        assert!(v["error"]["param"].is_null());
        assert_eq!(v["error"]["code"], "queue_full");
    }

    #[test]
    fn backend_failures_map_to_their_statuses() {
        use crate::backend::BackendError;
        let status = |e: BackendError| {
            let a = ApiError::from(e);
            (a.status, a.retry_after)
        };
        assert_eq!(
            status(BackendError::Invalid("bad input".into())),
            (StatusCode::BAD_REQUEST, None)
        );
        assert_eq!(
            status(BackendError::Unavailable("stage lost".into())),
            (StatusCode::SERVICE_UNAVAILABLE, Some(5))
        );
        assert_eq!(
            status(BackendError::Transient("out of memory".into())),
            (StatusCode::SERVICE_UNAVAILABLE, Some(1))
        );
        assert_eq!(
            status(BackendError::Failed("fault".into())),
            (StatusCode::INTERNAL_SERVER_ERROR, None)
        );
    }

    #[test]
    fn invalid_names_the_param() {
        let e = ApiError::invalid("bad", Some("temperature"));
        let v: serde_json::Value = serde_json::from_str(&e.body_json()).unwrap();
        assert_eq!(v["error"]["param"], "temperature");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }
}
