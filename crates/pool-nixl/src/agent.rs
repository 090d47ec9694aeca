//! Creating NIXL agents (UCX backend, thread-safe mode), describing raw memory to NIXL, and
//! turning nixl-sys errors into `PoolError`.

use kvferry_pool::PoolError;
use nixl_sys::{Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NixlError, ThreadSync};

use crate::BACKEND;

/// Which side of the transfers an agent is on; it decides who drives the UCX worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Posts every transfer and polls it to completion (the daemon's helper): no progress
    /// thread — polling a transfer's status progresses the worker. nixl-sys' default progress
    /// thread spins with no delay (`pthr_delay_us = 0`) and burned half a core per idle helper.
    Initiator,
    /// Only exposes memory (an engine): a progress thread answers the initiator's connection
    /// wire-up, woken every [`TARGET_PROGRESS_DELAY_US`] instead of spinning.
    Target,
}

/// How often a target's progress thread runs (only connection set-up waits on it; the data
/// path is one-sided).
pub(crate) const TARGET_PROGRESS_DELAY_US: u64 = 1_000;

/// Create an agent named `name` with a UCX backend.
///
/// The agent is configured with `ThreadSync::Strict`: backends are shared between tasks on a
/// multi-thread runtime, and NIXL's default (no locking) is only safe from one thread. Callers
/// must have called [`crate::ensure_nixl`] first.
pub(crate) fn new_agent(name: &str, role: Role) -> Result<Agent, PoolError> {
    let cfg = AgentConfig {
        thread_sync: ThreadSync::Strict,
        enable_prog_thread: role == Role::Target,
        pthr_delay_us: TARGET_PROGRESS_DELAY_US,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured(name, &cfg).map_err(|e| fatal(format!("create agent {name:?}"), e))?;
    let (_mems, params) = agent.get_plugin_params("UCX").map_err(|e| {
        fatal("UCX plugin not found (is NIXL_PLUGIN_DIR or the wheel's plugins/ directory intact?)", e)
    })?;
    agent.create_backend("UCX", &params).map_err(|e| fatal("create UCX backend", e))?;
    Ok(agent)
}

/// A NIXL error that retrying will not fix (bad parameters, setup failures).
pub(crate) fn fatal(op: impl std::fmt::Display, e: NixlError) -> PoolError {
    PoolError::Backend { backend: BACKEND, retryable: false, detail: format!("{op}: {e}") }
}

/// A NIXL error from posting or polling a transfer: a backend failure (connection loss, a
/// transient UCX error) may heal on retry; invalid parameters will not.
pub(crate) fn transfer_error(op: impl std::fmt::Display, e: NixlError) -> PoolError {
    let retryable = matches!(e, NixlError::BackendError);
    PoolError::Backend { backend: BACKEND, retryable, detail: format!("{op}: {e}") }
}

/// A raw memory range as NIXL sees it, for `Agent::register_memory`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawRegion {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) mem_type: MemType,
    pub(crate) dev: u64,
}

impl MemoryRegion for RawRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        // Only an address handed to NIXL; never dereferenced here.
        std::ptr::with_exposed_provenance(self.addr)
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for RawRegion {
    fn mem_type(&self) -> MemType {
        self.mem_type
    }

    fn device_id(&self) -> u64 {
        self.dev
    }
}
