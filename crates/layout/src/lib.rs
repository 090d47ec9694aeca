//! KV pool layouts (pure): where every block's bytes live in an engine's pool.
//!
//! (Skeleton: the layout constructors, fingerprints, addressing and block hashes land with the
//! pools issue.)

use serde::{Deserialize, Serialize};

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
