//! The reference-engine process behind `kvferry engine`: the `kvferry-engine` compute core
//! over a shared-memory KV pool, registered with the region's daemon, serving the
//! `kvferry.v1.ReferenceEngine` control API on its own Unix socket.
//!
//! Codemap:
//! - [`config`]: `NodeConfig`, the clap `EngineArgs` the CLI mounts, the default model.
//! - [`memory`]: the canonical pool layout, its byte-for-byte check against the core's, and
//!   `ShmKvMemory` (the core's `KvMemory` over the shm mapping, optionally exported through
//!   NIXL with `--pool nixl`; the crate's only `unsafe`).
//! - [`cache`]: the engine-wide prefix cache (hash → block, refcounts, LRU).
//! - [`daemon`]: Unix-socket gRPC channel, pool fd hand-over, RegisterPool (shm or NIXL),
//!   Attach events.
//! - [`worker`]: the single thread that owns the core and runs Generate / Recompute jobs.
//! - `service`: the ReferenceEngine gRPC service.
//! - [`node`]: `EngineNode` (start, supervise, shut down) and the `run` entry point.
//! - [`error`]: `NodeError` and its one mapping to gRPC statuses.

pub mod cache;
pub mod config;
pub mod daemon;
pub mod error;
pub mod memory;
pub mod node;
pub mod prompt;
mod service;
pub mod worker;

pub use cache::PrefixCache;
pub use config::{EngineArgs, KvDtypeArg, NodeConfig, PoolAccess, ReconnectPolicy, default_model};
pub use error::NodeError;
pub use memory::ShmKvMemory;
pub use node::{EngineNode, NodeInfo, build_engine, nixl_agent_name, run};
pub use prompt::prompt;
pub use service::ControlService;
