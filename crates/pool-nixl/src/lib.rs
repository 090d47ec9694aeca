//! NIXL memory backend: the production path for moving KV blocks in and out of an engine's pool.
//!
//! Two sides, two processes:
//! - **Engine side** ([`NixlPoolExport`]): the engine registers its pool memory (DRAM here, VRAM
//!   on a GPU host) with its own NIXL agent and hands the daemon a [`NixlPoolDescriptor`]: the
//!   agent's name, its metadata blob and the region list. A Python engine (vLLM's
//!   NixlConnector, SGLang) builds the same descriptor from NIXL's Python API
//!   (`get_agent_metadata()`), so no Rust is needed on that side.
//! - **Daemon side** ([`NixlBackend`]): implements [`kvferry_pool::MemoryBackend`] with NIXL
//!   READ (gather into staging) and WRITE (scatter from staging), carried out by a **helper
//!   process** per pool (`kvferry nixl-helper`, [`helper_main`]) that alone loads the engine's
//!   untrusted metadata into its NIXL agent; staging buffers are memfds both processes map
//!   (see the `proxy` module for why, and the `ipc` module for the protocol).
//!
//! Cargo feature `nixl` (default on for this crate; dependents take it with
//! `default-features = false` and pass it through) links nixl-sys; without it the same API
//! exists and answers a typed error (`disabled` module).
//!
//! NIXL is reached through `nixl-sys` built with `stub-api`: `libnixl_capi.so` (from the PyPI
//! wheel `nixl-cu12`) is dlopened at run time. The stub aborts the process if the library is
//! missing, so every entry point first calls [`ensure_nixl`], which turns that into a typed
//! error. Every batch is validated with [`kvferry_pool::check_batch`] before anything is posted;
//! transfers are polled without blocking the executor and bounded by a deadline.

#[cfg(feature = "nixl")]
mod agent;
mod descriptor;
#[cfg(feature = "nixl")]
mod direct;
#[cfg(not(feature = "nixl"))]
mod disabled;
#[cfg(feature = "nixl")]
mod export;
#[cfg(feature = "nixl")]
mod helper;
#[cfg(feature = "nixl")]
mod ipc;
#[cfg(feature = "nixl")]
mod loader;
mod options;
#[cfg(feature = "nixl")]
mod proxy;
#[cfg(feature = "nixl")]
mod xfer;

pub use descriptor::{MemKind, NixlPoolDescriptor, NixlRegion, metadata_agent_name};
#[cfg(not(feature = "nixl"))]
pub use disabled::{LIB_DIR_ENV, NixlBackend, NixlPoolExport, ensure_nixl, helper_main};
#[cfg(feature = "nixl")]
pub use export::NixlPoolExport;
#[cfg(feature = "nixl")]
pub use helper::helper_main;
#[cfg(feature = "nixl")]
pub use loader::{LIB_DIR_ENV, ensure_nixl};
pub use options::{HelperCommand, NixlOptions};
#[cfg(feature = "nixl")]
pub use proxy::NixlBackend;

/// Whether this build can use NIXL at all (cargo feature `nixl`). Without it every
/// constructor answers a typed "built without NIXL" error and nothing links nixl-sys.
pub const COMPILED: bool = cfg!(feature = "nixl");

/// `MemoryBackend::name()` of this backend, and the `backend` field of its errors.
pub const BACKEND: &str = "nixl";

/// The line prefix an engine process (the `kvferry-nixl-engine` binary, or a Python engine)
/// prints before its descriptor's JSON on stdout.
pub const DESCRIPTOR_LINE_PREFIX: &str = "KVFERRY-NIXL-DESCRIPTOR ";
