//! KV pool layouts (pure, no I/O): where every block's bytes live in an engine's pool, the
//! fingerprint two pools must share before blocks move between them, and the content keys
//! (chained SHA-256 block hashes) both regions compute alike.
//!
//! Codemap: `types` (dtype, kinds, planes), `layout` (`PoolLayout` + validation), `engines`
//! (vLLM / FlashInfer / SGLang / MLA constructors), `addressing` (blocks → extents),
//! `fingerprint`, `hash`, `error`. Must not depend on any backend or do I/O.

mod addressing;
mod engines;
mod error;
mod fingerprint;
mod hash;
mod layout;
mod types;

use serde::{Deserialize, Serialize};

pub use engines::MlaSpec;
pub use error::{FingerprintMismatch, LayoutError};
pub use fingerprint::LayoutFingerprint;
pub use hash::{BlockHash, block_hashes, hex};
pub use layout::PoolLayout;
pub use types::{AttnSpec, Dtype, LayoutKind, Plane, PlaneKind, StrideOrder};

/// A contiguous byte range inside one registered memory region of a pool.
///
/// Addressing produces extents in **staging order**: a staging buffer holds the extents'
/// bytes back to back, in the order of the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Extent {
    /// Index of the region in the pool's region table.
    pub region: u32,
    /// Byte offset from the start of the region.
    pub offset: u64,
    /// Length in bytes (> 0).
    pub len: u64,
}
