//! The backend as built without the `nixl` feature: the same public API, every constructor
//! answering a typed, non-retryable error, and the types that only a successful constructor
//! could produce uninhabited (so no code path can pretend to move bytes).
//!
//! This is what `cargo build` of the default members links: the demo and the daemon's shm and
//! CUDA paths need neither libclang (nixl-sys's bindgen) nor the NIXL wheel. An operator who
//! wants NIXL pools builds with `--features nixl` (see README).

use std::convert::Infallible;

use kvferry_pool::{BoxFut, Extent, MemoryBackend, PoolError, RegionInfo, Staging};

use crate::BACKEND;
use crate::descriptor::{NixlPoolDescriptor, NixlRegion};
use crate::options::NixlOptions;

/// Environment variable naming the directory that holds `libnixl_capi.so` (unused in this
/// build; kept so callers compile alike).
pub const LIB_DIR_ENV: &str = "KVFERRY_NIXL_LIB_DIR";

fn not_built() -> PoolError {
    PoolError::Backend {
        backend: BACKEND,
        retryable: false,
        detail: "this binary was built without NIXL support; rebuild with `--features nixl` \
                 (needs libclang at build time and the NIXL wheel at run time, see README)"
            .into(),
    }
}

/// Always the "built without NIXL" error.
pub fn ensure_nixl() -> Result<(), PoolError> {
    Err(not_built())
}

/// The helper process's entry point: in this build it only says NIXL is not built in.
pub fn helper_main() -> std::process::ExitCode {
    eprintln!("kvferry nixl-helper: {}", not_built());
    std::process::ExitCode::FAILURE
}

/// Cannot exist in this build: [`NixlBackend::attach_with`] always fails.
#[derive(Debug)]
pub struct NixlBackend {
    never: Infallible,
}

impl NixlBackend {
    /// Always the "built without NIXL" error.
    pub fn attach(desc: &NixlPoolDescriptor) -> Result<Self, PoolError> {
        Self::attach_with(desc, NixlOptions::default())
    }

    /// Validates the descriptor (so malformed input still gets its own error), then answers
    /// the "built without NIXL" error.
    pub fn attach_with(desc: &NixlPoolDescriptor, _opts: NixlOptions) -> Result<Self, PoolError> {
        desc.validate()?;
        Err(not_built())
    }

    /// Unreachable: no value of this type exists.
    pub fn peer(&self) -> &str {
        match self.never {}
    }

    /// Unreachable: no value of this type exists.
    pub fn agent_name(&self) -> String {
        match self.never {}
    }

    /// Unreachable: no value of this type exists.
    pub fn nixl_regions(&self) -> &[NixlRegion] {
        match self.never {}
    }
}

impl MemoryBackend for NixlBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn id(&self) -> u64 {
        match self.never {}
    }

    fn regions(&self) -> &[RegionInfo] {
        match self.never {}
    }

    fn staging(&self, _len: usize) -> Result<Staging, PoolError> {
        match self.never {}
    }

    fn read<'a>(&'a self, _e: &'a [Extent], _s: &'a mut Staging) -> BoxFut<'a, Result<(), PoolError>> {
        match self.never {}
    }

    fn write<'a>(&'a self, _e: &'a [Extent], _s: &'a Staging) -> BoxFut<'a, Result<(), PoolError>> {
        match self.never {}
    }
}

/// Cannot exist in this build: [`NixlPoolExport::new`] always fails.
#[derive(Debug)]
pub struct NixlPoolExport {
    never: Infallible,
}

impl NixlPoolExport {
    /// Always the "built without NIXL" error.
    pub fn new(_agent_name: &str) -> Result<Self, PoolError> {
        Err(not_built())
    }

    /// Unreachable: no value of this type exists.
    ///
    /// # Safety
    /// As the NIXL build's `register` (never callable here).
    pub unsafe fn register(&mut self, _region: NixlRegion) -> Result<u32, PoolError> {
        match self.never {}
    }

    /// Unreachable: no value of this type exists.
    pub fn descriptor(&self) -> Result<NixlPoolDescriptor, PoolError> {
        match self.never {}
    }

    /// Unreachable: no value of this type exists.
    pub fn agent_name(&self) -> &str {
        match self.never {}
    }

    /// Unreachable: no value of this type exists.
    pub fn regions(&self) -> &[NixlRegion] {
        match self.never {}
    }
}
