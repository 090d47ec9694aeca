//! NIXL memory backend: the production path for moving KV blocks in and out of an engine's pool.
//!
//! Two sides, two processes:
//! - **Engine side** ([`NixlPoolExport`]): the engine registers its pool memory (DRAM here, VRAM
//!   on a GPU host) with its own NIXL agent and hands the daemon a [`NixlPoolDescriptor`]: the
//!   agent's name, its metadata blob and the region list. A Python engine (vLLM's
//!   NixlConnector, SGLang) builds the same descriptor from NIXL's Python API
//!   (`get_agent_metadata()`), so no Rust is needed on that side.
//! - **Daemon side** ([`NixlBackend`]): loads the metadata into the daemon's own agent and
//!   implements [`kvferry_pool::MemoryBackend`] with NIXL READ (gather into staging) and WRITE
//!   (scatter from staging). Staging buffers are registered with the daemon's agent.
//!
//! NIXL is reached through `nixl-sys` built with `stub-api`: `libnixl_capi.so` (from the PyPI
//! wheel `nixl-cu12`) is dlopened at run time. The stub aborts the process if the library is
//! missing, so every entry point first calls [`ensure_nixl`], which turns that into a typed
//! error. Every batch is validated with [`kvferry_pool::check_batch`] before anything is posted;
//! transfers are polled without blocking the executor and bounded by a deadline.

mod agent;
mod backend;
mod descriptor;
mod export;
mod isolate;
mod loader;
mod xfer;

pub use backend::{NixlBackend, NixlOptions};
pub use descriptor::{MemKind, NixlPoolDescriptor, NixlRegion, metadata_agent_name};
pub use export::NixlPoolExport;
pub use isolate::{CHECK_REFUSED_EXIT, load_metadata_here};
pub use loader::{LIB_DIR_ENV, ensure_nixl};

/// `MemoryBackend::name()` of this backend, and the `backend` field of its errors.
pub const BACKEND: &str = "nixl";

/// The line prefix an engine process (the `kvferry-nixl-engine` binary, or a Python engine)
/// prints before its descriptor's JSON on stdout.
pub const DESCRIPTOR_LINE_PREFIX: &str = "KVFERRY-NIXL-DESCRIPTOR ";
