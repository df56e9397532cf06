//! Errors of the CUDA backend, typed so that callers can tell a bad batch from a broken device, and
//! their classification for the engine ([`CudaError::kind`]).

use cudarc::cublas::sys::cublasStatus_t;
use cudarc::driver::sys::CUresult;
use tandem_engine::{BackendError, BackendErrorKind};

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

impl CudaError {
    /// What the engine must do about this error when a step raised it: device memory that ran out is
    /// a passing shortage; a sticky fault (the context is unusable after it) or a missing GPU stack
    /// loses the worker; everything else (a batch or shape the kernels refuse, a failed compile) is a
    /// disagreement between engine and backend, a bug.
    pub fn kind(&self) -> BackendErrorKind {
        match self {
            CudaError::Driver(e) => driver_kind(e.0),
            CudaError::Blas(e) => match e.0 {
                cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED => BackendErrorKind::Retryable,
                cublasStatus_t::CUBLAS_STATUS_EXECUTION_FAILED => BackendErrorKind::WorkerLost,
                _ => BackendErrorKind::Fatal,
            },
            CudaError::Unavailable(_) => BackendErrorKind::WorkerLost,
            CudaError::Compile(_)
            | CudaError::Unsupported(_)
            | CudaError::Batch(_)
            | CudaError::Io { .. }
            | CudaError::Model(_) => BackendErrorKind::Fatal,
        }
    }

    /// [`Self::kind`] for a KV transfer of one request (an export or import): a shape the transfer
    /// buffers cannot take is that request's fault, not the engine's, and the engine serves on.
    pub fn transfer_kind(&self) -> BackendErrorKind {
        match self {
            CudaError::Batch(_) => BackendErrorKind::Request,
            e => e.kind(),
        }
    }

    /// This error as the engine's, under `context` (what was being done), classified by [`Self::kind`].
    pub fn into_backend(self, context: impl std::fmt::Display) -> BackendError {
        BackendError::caused(self.kind(), context, self)
    }

    /// This error of a KV transfer as the engine's, classified by [`Self::transfer_kind`].
    pub fn into_transfer(self, context: impl std::fmt::Display) -> BackendError {
        BackendError::caused(self.transfer_kind(), context, self)
    }
}

/// The driver's result codes after which the context cannot run anything again (CUDA's "sticky"
/// errors) or the device is gone; the process must be restarted to use the GPU.
fn driver_kind(code: CUresult) -> BackendErrorKind {
    match code {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => BackendErrorKind::Retryable,
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
        | CUresult::CUDA_ERROR_LAUNCH_FAILED
        | CUresult::CUDA_ERROR_LAUNCH_TIMEOUT
        | CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR
        | CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION
        | CUresult::CUDA_ERROR_MISALIGNED_ADDRESS
        | CUresult::CUDA_ERROR_INVALID_PC
        | CUresult::CUDA_ERROR_ASSERT
        | CUresult::CUDA_ERROR_ECC_UNCORRECTABLE
        | CUresult::CUDA_ERROR_NVLINK_UNCORRECTABLE
        | CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
        | CUresult::CUDA_ERROR_DEINITIALIZED
        | CUresult::CUDA_ERROR_NOT_INITIALIZED
        | CUresult::CUDA_ERROR_NO_DEVICE => BackendErrorKind::WorkerLost,
        _ => BackendErrorKind::Fatal,
    }
}

impl From<CudaError> for BackendError {
    /// A CUDA failure classified by [`CudaError::kind`], its text as the message.
    fn from(e: CudaError) -> Self {
        BackendError::caused(e.kind(), "CUDA", e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::cublas::result::CublasError;
    use cudarc::driver::DriverError;

    #[test]
    fn out_of_memory_is_retryable_and_a_sticky_fault_loses_the_worker() {
        let oom = CudaError::Driver(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(oom.kind(), BackendErrorKind::Retryable);
        let blas_oom = CudaError::Blas(CublasError(cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED));
        assert_eq!(blas_oom.kind(), BackendErrorKind::Retryable);
        let sticky = CudaError::Driver(DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
        assert_eq!(sticky.kind(), BackendErrorKind::WorkerLost);
        let invalid = CudaError::Driver(DriverError(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(invalid.kind(), BackendErrorKind::Fatal);
        assert_eq!(
            CudaError::Unavailable("no driver".into()).kind(),
            BackendErrorKind::WorkerLost
        );
    }

    #[test]
    fn a_bad_batch_is_a_fault_in_a_step_and_the_request_s_in_a_transfer() {
        let e = CudaError::Batch("too many blocks".into());
        assert_eq!(e.kind(), BackendErrorKind::Fatal);
        assert_eq!(e.transfer_kind(), BackendErrorKind::Request);
        let e = CudaError::Driver(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(e.transfer_kind(), BackendErrorKind::Retryable);
        // (A driver error's text asks the driver, absent on a machine without a GPU.)
        let b = BackendError::from(CudaError::Batch("too many blocks".into()));
        assert_eq!(b.kind(), BackendErrorKind::Fatal);
        let source = std::error::Error::source(&b).expect("the CUDA error is kept");
        assert!(matches!(
            source.downcast_ref::<CudaError>(),
            Some(CudaError::Batch(_))
        ));
    }
}
