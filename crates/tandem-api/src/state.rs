//! Shared state of the HTTP server: the generator, the codec, names, metrics, id counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tandem_engine::RequestId;

use crate::backend::GenerateBackend;
use crate::codec::TextCodec;
use crate::error::ApiError;
use tandem_telemetry::{Metrics, MetricsError};

/// Settings of the HTTP surface that do not belong to the engine.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Names clients may put in `model`; the first is reported in answers.
    pub served_model_names: Vec<String>,
    /// The underlying model (file stem or folder name), reported as `root` in /v1/models.
    pub model_root: String,
    /// When set, /v1 routes require `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// `system_fingerprint` of every answer: ties outputs to a server version and model identity.
    pub system_fingerprint: String,
    /// Largest request body read; a larger one is answered 413 before any of it is parsed.
    pub max_body_bytes: usize,
    /// With `api_key` set, /health and /metrics ask for it too (they are open by default, for probes
    /// and scrapers that carry no key).
    pub probes_need_key: bool,
    /// Split `<think>…</think>` off answers into `reasoning_content` / `reasoning` items (the binary
    /// resolves `--reasoning-parser auto` from the chat template).
    pub reasoning_parser: bool,
}

/// [`ApiConfig::max_body_bytes`] unless configured: room for a 128k-token prompt sent as token ids.
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;

/// Everything a handler needs, shared behind an `Arc`.
pub struct AppState {
    /// Where tokens come from (the local engine, or a P/D router).
    pub backend: Arc<dyn GenerateBackend>,
    /// Tokenizer and chat template.
    pub codec: Arc<dyn TextCodec>,
    /// Names, key and fingerprint.
    pub config: ApiConfig,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Unix seconds of server start, reported as the models' `created`.
    pub started_at: i64,
    next_request_id: AtomicU64,
}

impl AppState {
    /// Builds the state; fails only if the metrics registry rejects a metric.
    pub fn new(
        backend: Arc<dyn GenerateBackend>,
        codec: Arc<dyn TextCodec>,
        config: ApiConfig,
    ) -> Result<Self, MetricsError> {
        Ok(Self {
            backend,
            codec,
            config,
            metrics: Metrics::new()?,
            started_at: chrono::Utc::now().timestamp(),
            next_request_id: AtomicU64::new(1),
        })
    }

    /// A fresh engine request id (one per choice).
    pub fn next_request_id(&self) -> RequestId {
        self.next_request_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The name answers report.
    pub fn primary_model_name(&self) -> &str {
        self.config
            .served_model_names
            .first()
            .map(String::as_str)
            .unwrap_or("")
    }

    /// 404 unless `model` is one of the served names.
    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if self.config.served_model_names.iter().any(|n| n == model) {
            Ok(())
        } else {
            Err(ApiError::model_not_found(model))
        }
    }
}
