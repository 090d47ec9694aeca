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
