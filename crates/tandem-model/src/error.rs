//! The crate's error type: every failure names the file, tensor or key at fault.

use std::path::PathBuf;

use crate::gguf::GgufError;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be opened, mapped or read.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A GGUF file is malformed or uses something we do not read.
    #[error("GGUF file {path}: {source}")]
    Gguf {
        /// The file involved.
        path: PathBuf,
        /// What is wrong with it.
        source: GgufError,
    },
    /// A safetensors file or its index is malformed.
    #[error("safetensors {path}: {message}")]
    Safetensors {
        /// The file involved.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A tensor is stored in an element type the CPU kernels cannot use.
    #[error("tensor {tensor} has unsupported dtype {dtype}")]
    UnsupportedDtype {
        /// The tensor's name in the file.
        tensor: String,
        /// The dtype as the file names it.
        dtype: String,
    },
    /// A tensor the architecture needs is not in the file.
    #[error("missing tensor {0}")]
    MissingTensor(String),
    /// A tensor's shape disagrees with the model configuration.
    #[error("tensor {tensor} has shape {actual:?}, expected {expected:?}")]
    Shape {
        /// The tensor's name in the file.
        tensor: String,
        /// The shape the configuration implies (rows, cols) or (len).
        expected: Vec<usize>,
        /// The shape found in the file.
        actual: Vec<usize>,
    },
    /// The model configuration is missing a value or is inconsistent.
    #[error("model config: {0}")]
    Config(String),
    /// The tokenizer could not be built, or failed to encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// A forward batch is inconsistent with the model or the KV cache.
    #[error("invalid batch: {0}")]
    Batch(String),
    /// A tensor- or pipeline-parallel split does not fit the model (names the size and the dimension).
    #[error("parallel split: {0}")]
    Partition(String),
    /// An expert-parallel placement does not place every expert exactly once on the group's ranks.
    #[error("expert placement: {0}")]
    ExpertMap(#[from] crate::expert_map::ExpertMapError),
    /// A kernel rejected its inputs (for example a weight whose byte size does not match its shape).
    #[error("kernel: {0}")]
    Kernel(#[from] tandem_kernels::KernelError),
}

impl ModelError {
    /// Wraps an i/o error with the path it happened on.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}
