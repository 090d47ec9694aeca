//! `ShmBackend`: the daemon's `MemoryBackend` over a mapped shared-memory pool. Validates every
//! batch with `check_batch`, then does bounded raw copies between the mapping and staging.
//!
//! Copies run inline on the polling task, in a single poll: a batch is either refused before
//! any byte moves or copied completely before the future returns, so dropping the future never
//! leaves a half-written batch. (Measured: bench/results/pool-shm.md; at memcpy speed a 128 MiB
//! batch holds the task for tens of milliseconds, so callers with latency-sensitive tasks on
//! the same runtime should call it from `spawn_blocking` or a dedicated runtime.)

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvferry_pool::{
    BoxFut, Extent, MemoryBackend, PoolError, RegionInfo, Staging, check_batch, next_backend_id,
};

use crate::{Mapping, RegionTable};

/// A pool in shared memory, seen from the daemon.
#[derive(Debug)]
pub struct ShmBackend {
    id: u64,
    mapping: Mapping,
    table: RegionTable,
    infos: Vec<RegionInfo>,
    closed: Arc<AtomicBool>,
}

/// Marks a backend closed from elsewhere (e.g. the task that sees the engine's socket close);
/// every later call then fails with [`PoolError::Closed`].
#[derive(Debug, Clone)]
pub struct CloseHandle(Arc<AtomicBool>);

impl CloseHandle {
    /// Close the pool: later reads and writes fail with `Closed`. In-flight calls finish.
    pub fn close(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl ShmBackend {
    /// Map `fd` (a sealed shared-memory file) with the regions of `table`.
    ///
    /// Refuses a closed fd, a file shorter than `table.file_len()`, and a file not sealed
    /// against shrinking (see [`Mapping::map`]).
    pub fn new(fd: std::os::fd::OwnedFd, table: RegionTable) -> Result<Self, PoolError> {
        let mapping = Mapping::map(fd, table.file_len())?;
        let infos = table.regions().iter().map(|r| RegionInfo { len: r.len }).collect();
        Ok(Self { id: next_backend_id(), mapping, table, infos, closed: Arc::new(AtomicBool::new(false)) })
    }

    /// The region table.
    pub fn table(&self) -> &RegionTable {
        &self.table
    }

    /// A handle that closes this backend.
    pub fn close_handle(&self) -> CloseHandle {
        CloseHandle(self.closed.clone())
    }

    /// Close this backend (see [`CloseHandle::close`]).
    pub fn close(&self) {
        self.close_handle().close();
    }

    /// Checks a batch against a buffer of `len` bytes owned by backend `owner` (a staging
    /// buffer's, or this backend's own id for host memory passed to `write_host`).
    fn validate(&self, extents: &[Extent], len: usize, owner: u64) -> Result<u64, PoolError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(PoolError::Closed);
        }
        check_batch(&self.infos, extents, len, owner, self.id)
    }

    /// File offset of an extent that passed `check_batch` (in bounds of its region, whose
    /// table entry lies inside the mapping).
    fn file_offset(&self, e: &Extent) -> usize {
        (self.table.regions()[e.region as usize].offset + e.offset) as usize
    }

    fn read_now(&self, extents: &[Extent], staging: &mut Staging) -> Result<(), PoolError> {
        self.validate(extents, staging.len(), staging.owner())?;
        let dst = staging.as_mut_ptr();
        let mut at = 0usize;
        for e in extents {
            let n = e.len as usize;
            // SAFETY: `check_batch` proved `e` lies inside its region and the table (validated
            // at construction) puts the region inside the mapping, so the source range is in
            // bounds; it also proved sum(len) <= staging.len(), so `dst + at .. + n` is inside
            // the staging buffer, which we borrow mutably and which is private memory.
            unsafe { self.mapping.copy_out(self.file_offset(e), dst.add(at), n) };
            at += n;
        }
        Ok(())
    }

    fn write_now(&self, extents: &[Extent], staging: &Staging) -> Result<(), PoolError> {
        self.validate(extents, staging.len(), staging.owner())?;
        self.scatter_from(extents, staging.as_slice());
        Ok(())
    }

    /// Copies `src[0..sum(len)]` into `extents`, which passed `check_batch` against
    /// `src.len()`.
    fn scatter_from(&self, extents: &[Extent], src: &[u8]) {
        let src = src.as_ptr();
        let mut at = 0usize;
        for e in extents {
            let n = e.len as usize;
            // SAFETY: as in `read_now`: `check_batch` proved the destination in bounds of the
            // mapping and sum(len) <= the source's length, so `src + at .. + n` lies inside the
            // borrowed source slice, which is private memory, not the mapping.
            unsafe { self.mapping.copy_in(self.file_offset(e), src.add(at), n) };
            at += n;
        }
    }
}

impl MemoryBackend for ShmBackend {
    fn name(&self) -> &'static str {
        "shm"
    }
    fn id(&self) -> u64 {
        self.id
    }
    fn regions(&self) -> &[RegionInfo] {
        &self.infos
    }
    fn staging(&self, len: usize) -> Result<Staging, PoolError> {
        Ok(Staging::new_host(len, self.id))
    }
    fn staging_to_fill(&self, len: usize) -> Result<Staging, PoolError> {
        Ok(Staging::new_host_to_fill(len, self.id))
    }
    fn read<'a>(
        &'a self,
        extents: &'a [Extent],
        staging: &'a mut Staging,
    ) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(async move { self.read_now(extents, staging) })
    }
    fn write<'a>(&'a self, extents: &'a [Extent], staging: &'a Staging) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(async move { self.write_now(extents, staging) })
    }
    fn writes_host(&self) -> bool {
        true
    }
    fn write_host(&self, extents: &[Extent], bytes: &[u8]) -> Result<(), PoolError> {
        self.validate(extents, bytes.len(), self.id)?;
        self.scatter_from(extents, bytes);
        Ok(())
    }
}
