//! Errors of the peer protocol, each saying where it came from and whether a retry can help.

use std::sync::Arc;

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
    /// A failure on this side, typed by cause (never the peer's fault).
    #[error("local: {0}")]
    Local(LocalError),
}

impl From<LocalError> for WireError {
    fn from(e: LocalError) -> Self {
        WireError::Local(e)
    }
}

impl WireError {
    /// Whether trying again (a new connection, later) can help. A [`WireError::Local`] never:
    /// a new connection to the peer does not heal this side's memory, setup or budget.
    pub fn retryable(&self) -> bool {
        match self {
            WireError::Refused { code, .. } => code.retryable(),
            WireError::Connection(_) => true,
            _ => false,
        }
    }
}

/// Why this side of a transfer failed, by cause.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LocalError {
    /// The owner read a chunk of another size than planned (a layout mismatch or a bug).
    #[error("chunk {chunk} read {got} bytes, planned {planned}")]
    ChunkSize { chunk: u32, got: u64, planned: u64 },
    /// A chunk served again (after a refetch) no longer has the bytes first served: the
    /// source changed under the owner.
    #[error("chunk {chunk} changed while being served")]
    SourceChanged { chunk: u32 },
    /// A chunk's [`crate::Summed`] was computed for another transfer or chunk (a driver bug).
    #[error("chunk {chunk} was hashed as another chunk or transfer")]
    MisboundSum { chunk: u32 },
    /// This side's chunk memory (a pool, the landing zone) failed; the typed error is kept.
    #[error("{0}")]
    Memory(Cause),
    /// The staging budget was closed (the node is shutting down).
    #[error("staging closed")]
    StagingClosed,
    /// The endpoint could not be set up (TLS configuration, socket bind).
    #[error("endpoint setup: {0}")]
    Setup(String),
}

/// A typed error from a crate this sans-IO core does not depend on (a chunk source's or sink's
/// error, carrying the pool's `PoolError`), kept whole: [`Cause::downcast_ref`] gives it back.
/// Two causes are equal when they say the same thing.
#[derive(Debug, Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    /// Keeps `e`.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(e))
    }

    /// The kept error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref::<E>()
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for Cause {}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Error, PartialEq)]
    #[error("pool closed")]
    struct Closed;

    #[test]
    fn a_local_cause_keeps_its_type_and_is_never_retryable() {
        let e = WireError::from(LocalError::Memory(Cause::new(Closed)));
        let WireError::Local(LocalError::Memory(c)) = &e else { panic!("{e:?}") };
        assert_eq!(c.downcast_ref::<Closed>(), Some(&Closed));
        assert_eq!(e.to_string(), "local: pool closed");
        assert!(!e.retryable());
        assert!(!WireError::from(LocalError::StagingClosed).retryable());
        assert!(WireError::Connection("lost".into()).retryable());
    }
}
