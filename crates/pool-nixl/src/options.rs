//! [`NixlOptions`] and [`HelperCommand`]: how the daemon attaches to an engine's NIXL pool.
//! Plain data, the same with and without the `nixl` feature.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// The program that runs the NIXL side of one pool in its own process (see the `helper`
/// module): it is started with a Unix stream socket as stdin and speaks the `ipc` protocol.
/// `kvferry nixl-helper` and `kvferry-nixl-engine --nixl-helper` both are one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelperCommand {
    /// The executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl HelperCommand {
    /// This crate's `kvferry-nixl-engine` binary in helper mode.
    pub fn nixl_engine(path: impl Into<PathBuf>) -> Self {
        Self { program: path.into(), args: vec!["--nixl-helper".into()] }
    }
}

/// Options for `NixlBackend::attach_with`.
#[derive(Debug, Clone)]
pub struct NixlOptions {
    /// Name of the helper's NIXL agent (default `kvferry-daemon-<pid>-<backend id>`); must
    /// differ from the engine's.
    pub agent_name: Option<String>,
    /// How long one read or write may take before it fails with a retryable
    /// `PoolError::Backend` (default 30 s). A transfer never waits much longer than this.
    pub timeout: Duration,
    /// The helper program. Required: the engine's metadata is loaded only there, never in
    /// the calling process.
    pub helper: Option<HelperCommand>,
}

impl Default for NixlOptions {
    fn default() -> Self {
        Self { agent_name: None, timeout: Duration::from_secs(30), helper: None }
    }
}
