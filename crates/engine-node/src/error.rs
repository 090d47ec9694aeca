//! Typed errors of the engine process and their one mapping to gRPC statuses
//! ([`NodeError::to_status`]). Nothing here does I/O.

use kvferry_engine::{EngineError, OutOfBlocks};
use thiserror::Error;

/// Why the engine process (or one of its requests) failed.
#[derive(Debug, Error)]
pub enum NodeError {
    /// Flags or configuration that cannot describe an engine.
    #[error("config: {0}")]
    Config(String),
    /// The compute core refused or failed an operation.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The pool has no block left, even after evicting every unused cached block.
    #[error("{0}")]
    OutOfBlocks(#[from] OutOfBlocks),
    /// A malformed request (empty prompt, token outside the vocabulary, too many tokens).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The shared-memory pool could not be created or shared.
    #[error("pool: {0}")]
    Pool(String),
    /// The engine's pool layout disagrees with the canonical layout crate (a bug: refusing to
    /// serve blocks another engine could misread).
    #[error("layout mismatch: {0}")]
    Layout(String),
    /// Registration with the daemon failed (socket, pool token, RegisterPool, Attach).
    #[error("register with the daemon at {run_dir}: {detail}")]
    Register {
        /// The daemon's run directory.
        run_dir: String,
        /// What failed.
        detail: String,
    },
    /// The daemon closed the Attach stream or stopped answering: the lease is gone.
    #[error("the daemon went away ({0}); the engine's lease is gone, shutting down")]
    DaemonGone(String),
    /// Serving the control socket failed.
    #[error("control socket {path}: {detail}")]
    Control {
        /// The socket path.
        path: String,
        /// What failed.
        detail: String,
    },
    /// The engine worker stopped (shutting down or crashed).
    #[error("the engine worker is not running ({0})")]
    WorkerGone(String),
}

impl NodeError {
    /// The gRPC status a client sees for this error (the only such mapping).
    pub fn to_status(&self) -> tonic::Status {
        use tonic::Status;
        let msg = self.to_string();
        match self {
            NodeError::InvalidRequest(_) | NodeError::Config(_) => Status::invalid_argument(msg),
            NodeError::Engine(e) => match e {
                EngineError::EmptyPrompt | EngineError::TokenOutOfRange { .. } => {
                    Status::invalid_argument(msg)
                }
                EngineError::OutOfBlocks(_) => Status::resource_exhausted(msg),
                EngineError::Refused(_) => Status::failed_precondition(msg),
                EngineError::Config(_) => Status::invalid_argument(msg),
                EngineError::Pool(_) | EngineError::Range(_) => Status::internal(msg),
            },
            NodeError::OutOfBlocks(_) => Status::resource_exhausted(msg),
            NodeError::Layout(_) => Status::failed_precondition(msg),
            NodeError::DaemonGone(_) | NodeError::WorkerGone(_) => Status::unavailable(msg),
            NodeError::Pool(_) | NodeError::Register { .. } | NodeError::Control { .. } => {
                Status::internal(msg)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn statuses_follow_the_api_conventions() {
        let code = |e: NodeError| e.to_status().code();
        assert_eq!(code(NodeError::Engine(EngineError::EmptyPrompt)), Code::InvalidArgument);
        assert_eq!(
            code(NodeError::Engine(EngineError::TokenOutOfRange { token: 9, position: 0, vocab: 4 })),
            Code::InvalidArgument
        );
        assert_eq!(code(NodeError::OutOfBlocks(OutOfBlocks { wanted: 3, free: 1 })), Code::ResourceExhausted);
        assert_eq!(code(NodeError::DaemonGone("eof".into())), Code::Unavailable);
        assert_eq!(code(NodeError::InvalidRequest("x".into())), Code::InvalidArgument);
    }
}
