//! The daemon's errors and their one mapping to gRPC statuses. Every handler returns
//! [`DaemonError`]; nothing else builds a `tonic::Status`.

use thiserror::Error;

/// Where a request failed, typed.
#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("precondition failed: {0}")]
    Precondition(String),
    #[error("deadline exceeded: {0}")]
    Deadline(String),
    #[error("resource exhausted: {0}")]
    Exhausted(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    #[error("internal: {0}")]
    Internal(String),
}

impl From<DaemonError> for tonic::Status {
    fn from(e: DaemonError) -> Self {
        use tonic::Code;
        let code = match &e {
            DaemonError::Invalid(_) => Code::InvalidArgument,
            DaemonError::NotFound(_) => Code::NotFound,
            DaemonError::Precondition(_) => Code::FailedPrecondition,
            DaemonError::Deadline(_) => Code::DeadlineExceeded,
            DaemonError::Exhausted(_) => Code::ResourceExhausted,
            DaemonError::Unavailable(_) => Code::Unavailable,
            DaemonError::Unauthenticated(_) => Code::Unauthenticated,
            DaemonError::Internal(_) => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}

impl From<kvferry_pool::PoolError> for DaemonError {
    fn from(e: kvferry_pool::PoolError) -> Self {
        match e {
            kvferry_pool::PoolError::OutOfBounds { .. } | kvferry_pool::PoolError::UnknownRegion { .. } => {
                DaemonError::Invalid(e.to_string())
            }
            kvferry_pool::PoolError::Closed => DaemonError::Unavailable(e.to_string()),
            other => DaemonError::Internal(other.to_string()),
        }
    }
}

impl From<kvferry_pool_cuda::CudaError> for DaemonError {
    /// Errors opening an engine's CUDA IPC pool. The descriptor's shape was checked before
    /// (INVALID_ARGUMENT); what is left is about this host: no driver, a handle that does not
    /// open here (foreign, stale, wrong device), a region past its allocation, a failed driver
    /// call. All of these are preconditions the engine or operator must fix, except a deadline
    /// (retryable) and pool-contract errors (mapped as above).
    fn from(e: kvferry_pool_cuda::CudaError) -> Self {
        use kvferry_pool_cuda::CudaError;
        match e {
            CudaError::Pool(p) => p.into(),
            CudaError::Deadline(_) => DaemonError::Unavailable(format!("CUDA IPC pool: {e}")),
            CudaError::Unavailable(_)
            | CudaError::Descriptor(_)
            | CudaError::Driver { .. }
            | CudaError::Kernel(_) => {
                DaemonError::Precondition(format!("cannot open the CUDA IPC pool: {e}"))
            }
        }
    }
}
