//! The emulator's error type.

use std::io;

/// Everything that can go wrong while setting up, running or tearing down an emulated link.
#[derive(Debug, thiserror::Error)]
pub enum WanemError {
    /// The process lacks the privileges to create namespaces and TUN devices.
    #[error("the WAN emulator needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)")]
    NotRoot,
    /// `/dev/net/tun` is missing.
    #[error("/dev/net/tun is missing: the kernel has no TUN support here")]
    NoTun,
    /// An `ip` (iproute2) command failed or could not be started.
    #[error("`{cmd}` failed: {detail}")]
    Ip {
        /// The command line, for the report.
        cmd: String,
        /// Its stderr, or the reason it could not run.
        detail: String,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A link profile was malformed or unknown.
    #[error("bad link profile: {0}")]
    Profile(String),
    /// A thread inside a namespace panicked or could not be started.
    #[error("namespace thread failed: {0}")]
    Thread(String),
}

impl WanemError {
    /// Wraps the current `errno` as a [`WanemError::Sys`].
    pub(crate) fn last_os(what: &'static str) -> Self {
        Self::Sys { what, source: io::Error::last_os_error() }
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, WanemError>;
