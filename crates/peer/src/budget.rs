//! The staging budget: chunk bytes held in memory per direction (serving, fetching), bounded in
//! bytes whatever the session size, as KiB permits on a semaphore, with a high-water mark. A
//! chunk is read only once its bytes are leased, so a stalled consumer backpressures the
//! producer (and, through QUIC flow control, the peer). Owns no socket.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvferry_wire::{LocalError, WireError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::io::ChunkBytes;

/// Staging budget in KiB permits, with a high-water mark.
pub(crate) struct Budget {
    pub(crate) sem: Arc<Semaphore>,
    pub(crate) total_kib: u32,
    pub(crate) in_use_kib: AtomicU64,
    pub(crate) high_water_kib: AtomicU64,
}

pub(crate) struct Lease {
    _permit: OwnedSemaphorePermit,
    kib: u32,
    budget: Arc<Budget>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.in_use_kib.fetch_sub(u64::from(self.kib), Ordering::Relaxed);
    }
}

impl Budget {
    pub(crate) fn new(bytes: usize) -> Arc<Self> {
        let kib = (bytes / 1024).clamp(1, u32::MAX as usize / 2) as u32;
        Arc::new(Self {
            sem: Arc::new(Semaphore::new(kib as usize)),
            total_kib: kib,
            in_use_kib: AtomicU64::new(0),
            high_water_kib: AtomicU64::new(0),
        })
    }

    pub(crate) async fn lease(self: &Arc<Self>, bytes: u64) -> Result<Lease, WireError> {
        let kib = (bytes.div_ceil(1024) as u32).clamp(1, self.total_kib);
        let permit = self.sem.clone().acquire_many_owned(kib).await.map_err(|_| LocalError::StagingClosed)?;
        let now = self.in_use_kib.fetch_add(u64::from(kib), Ordering::Relaxed) + u64::from(kib);
        self.high_water_kib.fetch_max(now, Ordering::Relaxed);
        Ok(Lease { _permit: permit, kib, budget: self.clone() })
    }
}

/// Chunk bytes kept alive (with their staging lease) until quinn no longer needs them.
pub(crate) struct Leased {
    pub(crate) bytes: ChunkBytes,
    pub(crate) _lease: Lease,
}

impl AsRef<[u8]> for Leased {
    fn as_ref(&self) -> &[u8] {
        (*self.bytes).as_ref()
    }
}
