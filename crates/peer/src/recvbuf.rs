//! Receive buffers for chunk payloads, recycled: a chunk read off a data channel needs a buffer
//! of its length (4 MiB by default), and a fresh one per chunk is an allocation, a memset of
//! the whole length and, for memory the allocator had given back, page faults with the kernel
//! clearing every page. [`RecvBuf::take`] reuses a buffer a landed chunk gave back (a bounded,
//! process-wide free list) and zero-fills only what it grows by; its old bytes are overwritten
//! by the read that fills it, and a buffer whose read fails is never handed on.
//!
//! Owns no socket; the staging budget ([`crate::budget`]) still bounds how many are in use.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

use kvferry_pool::sync::LockExt;

/// Buffers kept for reuse, at most.
pub const MAX_FREE_BUFFERS: usize = 32;
/// A buffer larger than this is not kept (the wire's chunks are at most 64 MiB; the default
/// is 4 MiB).
pub const MAX_KEPT_BYTES: usize = 16 << 20;

static FREE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// A chunk payload's buffer; goes back to the free list when dropped.
#[derive(Debug, Default)]
pub struct RecvBuf(Vec<u8>);

impl RecvBuf {
    /// A buffer of exactly `len` bytes: a recycled one when the free list has one (holding
    /// earlier bytes up to its old length, zeros beyond), else a new zeroed one. The caller
    /// overwrites it whole before reading it.
    pub fn take(len: usize) -> Self {
        let reused = if len <= MAX_KEPT_BYTES { FREE.locked().pop() } else { None };
        let mut v = reused.unwrap_or_default();
        if v.len() > len {
            v.truncate(len);
        } else {
            v.resize(len, 0);
        }
        RecvBuf(v)
    }
}

impl Deref for RecvBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for RecvBuf {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl DerefMut for RecvBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl Drop for RecvBuf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() == 0 || v.capacity() > MAX_KEPT_BYTES {
            return;
        }
        let mut free = FREE.locked();
        if free.len() < MAX_FREE_BUFFERS {
            free.push(v);
        }
    }
}

/// Buffers on the free list now.
#[cfg(test)]
fn free_buffers() -> usize {
    FREE.locked().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_have_the_asked_length_and_come_back_for_reuse() {
        for len in [0usize, 1, 4096, 3 << 20, 4 << 20, 5] {
            let mut b = RecvBuf::take(len);
            assert_eq!(b.len(), len);
            b.fill(0x5A);
        }
        // A shorter take after a longer one is cut to length; a longer one is zero-extended.
        let b = RecvBuf::take(10);
        assert_eq!(b.len(), 10);
        drop(b);
        let b = RecvBuf::take(20_000);
        assert_eq!(b.len(), 20_000);
        drop(b);
        assert!(free_buffers() <= MAX_FREE_BUFFERS);
        // Oversized buffers are never kept.
        let big = RecvBuf::take(MAX_KEPT_BYTES + 1);
        assert_eq!(big.len(), MAX_KEPT_BYTES + 1);
        drop(big);
        assert!(FREE.locked().iter().all(|v| v.capacity() <= MAX_KEPT_BYTES));
    }

    #[test]
    fn the_free_list_is_bounded() {
        let many: Vec<RecvBuf> = (0..MAX_FREE_BUFFERS + 8).map(|_| RecvBuf::take(1000)).collect();
        drop(many);
        assert!(free_buffers() <= MAX_FREE_BUFFERS);
    }
}
