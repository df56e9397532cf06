//! Errors of the CUDA backend, typed so that callers can tell a bad batch from a broken device.

/// What went wrong in the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver, NVRTC or cuBLAS library could not be loaded (no GPU stack on this machine).
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// cuBLAS failed.
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// NVRTC could not compile the kernels; the log says where.
    #[error("NVRTC compile failed: {0}")]
    Compile(String),
    /// The model cannot run on this backend (shape, dtype or size).
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A step's batch is inconsistent or exceeds the preallocated buffers.
    #[error("invalid batch: {0}")]
    Batch(String),
    /// Reading or writing a file of the check and bench tools failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Loading the model from disk failed.
    #[error(transparent)]
    Model(#[from] tandem_model::ModelError),
}
