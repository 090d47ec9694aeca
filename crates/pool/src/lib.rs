//! The memory-backend boundary: the one trait every KV pool backend (shm, NIXL, CUDA)
//! implements, the staging buffers blocks travel through, the batch validation every backend
//! runs before a byte moves, and (feature `conformance`) the shared conformance suite.
//!
//! This crate must not depend on any backend's FFI (no cudarc, no nixl-sys, no libc mapping
//! code): backends depend on it, never the other way. The contract is written down in
//! `crates/pool/TRAIT.md`; keep the two in sync.
//!
//! Architecture invariant: every batch is validated in full by [`check_batch`] before the first
//! byte moves, so a refused batch writes nothing (neither into the pool nor into staging).

mod check;
mod staging;
pub mod sync;

#[cfg(feature = "conformance")]
pub mod conformance;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

pub use check::check_batch;
pub use kvferry_layout::Extent;
pub use staging::{RECYCLE_MAX_BYTES, RECYCLE_MIN_BYTES, STAGING_ALIGN, Staging, recycled_bytes};

/// Where an error came from and whether retrying can help.
///
/// The variants marked "nothing written" are raised by [`check_batch`] before any byte moves.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// An extent reaches past the end of its region (or `offset + len` overflows). Nothing written.
    #[error(
        "extent out of bounds: region {region} offset {offset} len {len} exceeds region length {region_len}"
    )]
    OutOfBounds {
        /// Region index of the offending extent.
        region: u32,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// An extent names a region the pool does not have. Nothing written.
    #[error("unknown region {region}: the pool has {regions} region(s)")]
    UnknownRegion {
        /// Region index of the offending extent.
        region: u32,
        /// Number of regions in the pool.
        regions: u32,
    },
    /// The staging buffer is smaller than the batch. Nothing written.
    #[error("staging buffer too small: batch needs {needed} bytes, staging has {got}")]
    StagingSize {
        /// Sum of the extents' lengths.
        needed: u64,
        /// Staging buffer length.
        got: u64,
    },
    /// A staging buffer this backend did not allocate/register. Nothing written.
    #[error("staging buffer was not allocated by this backend instance (foreign staging)")]
    ForeignStaging,
    /// The pool's memory is gone (engine exited, fd closed, file truncated).
    #[error("pool closed: the pool's memory is gone (engine exited, fd closed or file truncated)")]
    Closed,
    /// Truncated or foreign NIXL metadata, bad IPC handle, bad fd message, ...
    #[error("bad metadata: {0}")]
    BadMetadata(String),
    /// Any other failure inside a backend.
    #[error("{backend} backend error (retryable: {retryable}): {detail}")]
    Backend {
        /// `MemoryBackend::name()` of the backend.
        backend: &'static str,
        /// Whether trying the same batch again can succeed.
        retryable: bool,
        /// What happened.
        detail: String,
    },
}

impl PoolError {
    /// Whether retrying the same call can help. Validation errors, a closed pool and bad
    /// metadata never heal by themselves; a backend error says so itself.
    pub fn is_retryable(&self) -> bool {
        matches!(self, PoolError::Backend { retryable: true, .. })
    }
}

/// One registered memory region of a pool, as the backend sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Length of the region in bytes.
    pub len: u64,
}

/// A boxed, `Send` future (the trait must stay object safe).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A view of an engine's KV pool that can gather blocks into staging and scatter them back.
///
/// Contract (see `TRAIT.md`):
/// - every batch is validated in full ([`check_batch`]) before the first byte moves; a refused
///   batch writes nothing;
/// - an empty extent list is a successful no-op;
/// - concurrent calls on disjoint extents are allowed; the backend must be safe under them
///   (overlapping concurrent writes give unspecified bytes, never UB).
pub trait MemoryBackend: Send + Sync {
    /// "shm", "nixl", "cuda".
    fn name(&self) -> &'static str;
    /// Unique id of this backend instance (`Staging::owner` must match it); see
    /// [`next_backend_id`].
    fn id(&self) -> u64;
    /// The pool's regions, index = `Extent::region`.
    fn regions(&self) -> &[RegionInfo];
    /// A staging buffer of `len` bytes usable with this backend.
    fn staging(&self, len: usize) -> Result<Staging, PoolError>;
    /// A staging buffer of `len` bytes for a caller that overwrites all of `[0, len)` before
    /// it reads any of it (a gather into it, a payload copied over it): its contents may be
    /// what an earlier buffer held instead of zeros. By default [`MemoryBackend::staging`].
    fn staging_to_fill(&self, len: usize) -> Result<Staging, PoolError> {
        self.staging(len)
    }
    /// Gather: copy `extents` (in order, back to back) into `staging[0..sum(len)]`.
    fn read<'a>(
        &'a self,
        extents: &'a [Extent],
        staging: &'a mut Staging,
    ) -> BoxFut<'a, Result<(), PoolError>>;
    /// Scatter: copy `staging[0..sum(len)]` into `extents` (in order).
    fn write<'a>(&'a self, extents: &'a [Extent], staging: &'a Staging) -> BoxFut<'a, Result<(), PoolError>>;
    /// Whether [`MemoryBackend::write_host`] copies straight from host memory (a pool this
    /// process maps, as shm's). False by default.
    fn writes_host(&self) -> bool {
        false
    }
    /// Scatter `bytes[0..sum(len)]` into `extents` (in order) straight from host memory, under
    /// `write`'s contract (validated in full before the first byte moves, `bytes` standing for
    /// the staging buffer; a refused batch writes nothing), without a staging buffer: one copy
    /// instead of two, and no buffer to allocate. Only where [`MemoryBackend::writes_host`];
    /// elsewhere it refuses with nothing written, and the caller copies into a staging buffer
    /// and calls `write`.
    fn write_host(&self, extents: &[Extent], bytes: &[u8]) -> Result<(), PoolError> {
        let _ = (extents, bytes);
        Err(PoolError::Backend {
            backend: self.name(),
            retryable: false,
            detail: "no writes from host memory: write through a staging buffer".into(),
        })
    }
}

static NEXT_BACKEND_ID: AtomicU64 = AtomicU64::new(1);

/// A process-unique id for a new backend instance (never 0, never repeats).
pub fn next_backend_id() -> u64 {
    NEXT_BACKEND_ID.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_ids_are_unique_and_nonzero() {
        let a = next_backend_id();
        let b = next_backend_id();
        assert_ne!(a, 0);
        assert_ne!(a, b);
    }

    #[test]
    fn messages_name_region_offset_and_bound() {
        let e = PoolError::OutOfBounds { region: 3, offset: 4096, len: 100, region_len: 4100 };
        let s = e.to_string();
        for needle in ["region 3", "offset 4096", "len 100", "4100"] {
            assert!(s.contains(needle), "{s:?} lacks {needle:?}");
        }
        assert!(PoolError::UnknownRegion { region: 9, regions: 2 }.to_string().contains("region 9"));
        assert!(PoolError::StagingSize { needed: 10, got: 5 }.to_string().contains("needs 10"));
        assert!(!PoolError::Closed.is_retryable());
        assert!(PoolError::Backend { backend: "shm", retryable: true, detail: String::new() }.is_retryable());
    }

    #[test]
    fn trait_is_object_safe() {
        fn _takes(_: &dyn MemoryBackend) {}
    }
}
