//! Errors of the peer protocol, each saying where it came from and whether a retry can help.

use thiserror::Error;

use crate::frame::{DecodeError, RefusalCode};
use crate::state::IllegalTransition;

/// A transfer failure.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    /// The owner refused before sending any KV byte.
    #[error("peer refused: {code:?}: {detail}")]
    Refused { code: RefusalCode, detail: String },
    /// The peer sent bytes that are not a frame.
    #[error("malformed frame from peer: {0}")]
    Decode(#[from] DecodeError),
    /// The peer broke the protocol (wrong transfer id, frame out of place, inconsistent manifest).
    #[error("protocol violation by peer: {0}")]
    Protocol(String),
    /// The manifest describes a different layout than ours.
    #[error("manifest {field} is {theirs}, expected {ours}")]
    LayoutMismatch { field: &'static str, ours: u64, theirs: u64 },
    /// A state machine refused an event.
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
    /// The transfer's deadline passed; nothing it touched is valid.
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// A chunk failed verification more often than allowed.
    #[error("chunk {chunk} failed verification {attempts} times")]
    TooManyRetries { chunk: u32, attempts: u32 },
    /// Both sides' transfer digests differ.
    #[error("transfer digest mismatch")]
    DigestMismatch,
    /// The transfer was cancelled.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// The connection failed (driver level).
    #[error("connection: {0}")]
    Connection(String),
    /// The peer's identity was rejected (driver level).
    #[error("peer not authorised: {0}")]
    NotAuthorised(String),
    /// Local pool or landing failure (driver level).
    #[error("local: {0}")]
    Local(String),
}

impl WireError {
    /// Whether trying again (a new connection, later) can help.
    pub fn retryable(&self) -> bool {
        match self {
            WireError::Refused { code, .. } => code.retryable(),
            WireError::Connection(_) => true,
            _ => false,
        }
    }
}
