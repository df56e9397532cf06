//! The benchmark library's error type.

use std::path::PathBuf;

/// Everything that can stop a benchmark before or between runs (per-request failures are recorded in the
/// results instead, because a benchmark must count them, not abort on them).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Loading the tokenizer of the served model failed.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] tandem_model::ModelError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A JSONL prompt file has a bad line.
    #[error("{path}:{line}: {message}")]
    Jsonl {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// A result file is not valid JSON of the expected shape.
    #[error("{path}: {source}")]
    ResultFile {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The benchmark was configured inconsistently.
    #[error("invalid benchmark configuration: {0}")]
    Config(String),
    /// A prompt could not be made to round-trip to an exact token count.
    #[error("cannot build a token-exact text prompt: {0}")]
    Prompt(String),
    /// The endpoint could not be reached or described itself unexpectedly (before any timed request).
    #[error("endpoint {url}: {message}")]
    Endpoint {
        /// The endpoint's base URL.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// Nothing answers at the endpoint (refused, unresolvable): the server is not running there.
    #[error("endpoint {url}: nothing answers")]
    Unreachable {
        /// The endpoint's base URL.
        url: String,
        /// The connection error (kept as the source, so the command can say what to do about it).
        source: reqwest::Error,
    },
    /// Drawing a chart failed.
    #[error("plot {path}: {message}")]
    Plot {
        /// The PNG being drawn.
        path: PathBuf,
        /// The drawing backend's message.
        message: String,
    },
}

impl BenchError {
    /// An [`BenchError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> BenchError {
        BenchError::Io {
            path: path.into(),
            source,
        }
    }
}
