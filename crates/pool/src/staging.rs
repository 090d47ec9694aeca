//! `Staging`: page-aligned, zeroed host memory that blocks travel through on their way in and
//! out of a pool.
//!
//! Owns the allocation (via `std::alloc`, 4096-byte alignment) and an optional registration
//! guard (a NIXL registration, a CUDA host pin) that is dropped *before* the memory is freed.
//! It does not know about regions or extents; `check_batch` relates the two.
//!
//! Plain host allocations are recycled: a dropped buffer of at least [`RECYCLE_MIN_BYTES`]
//! goes to a process-wide free list (at most [`RECYCLE_MAX_BYTES`] held) and the next
//! [`Staging::new_host`] of the same page-rounded size takes it back, zeroed. A transfer
//! allocates one staging buffer per chunk; without the list each was fresh memory from the
//! allocator, which on this kind of host means page faults and the kernel clearing every page
//! (measured 2026-12-05: 19 % of a serving daemon's CPU at 100 Mbit/s, `clear_page_erms`),
//! where zeroing a recycled buffer costs a memset of memory already mapped.

use std::alloc::{self, Layout};
use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Mutex, PoisonError};

/// Alignment of every staging allocation (one host page).
pub const STAGING_ALIGN: usize = 4096;

/// Plain host allocations smaller than this are not recycled (the allocator serves them from
/// memory it keeps mapped anyway).
pub const RECYCLE_MIN_BYTES: usize = 64 << 10;

/// The most bytes the free list of recycled host allocations holds; a buffer dropped beyond
/// it is freed.
pub const RECYCLE_MAX_BYTES: usize = 128 << 20;

/// A free allocation of `STAGING_ALIGN` alignment; the key of its list is its size.
struct FreeAlloc(NonNull<u8>);

// SAFETY: a free allocation is owned by the list alone (nothing else holds its pointer) and is
// only handed out whole to one new `Staging`.
unsafe impl Send for FreeAlloc {}

struct Recycler {
    free: BTreeMap<usize, Vec<FreeAlloc>>,
    bytes: usize,
}

static RECYCLER: Mutex<Recycler> = Mutex::new(Recycler { free: BTreeMap::new(), bytes: 0 });

fn recycler() -> std::sync::MutexGuard<'static, Recycler> {
    RECYCLER.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A free allocation of exactly `cap` bytes, if the list holds one.
fn take_recycled(cap: usize) -> Option<NonNull<u8>> {
    if cap < RECYCLE_MIN_BYTES {
        return None;
    }
    let mut r = recycler();
    let list = r.free.get_mut(&cap)?;
    let a = list.pop()?;
    if list.is_empty() {
        r.free.remove(&cap);
    }
    r.bytes -= cap;
    Some(a.0)
}

/// Keeps `ptr` (an allocation of `cap` bytes) for reuse; gives it back when the list is full.
fn recycle(ptr: NonNull<u8>, cap: usize) -> Result<(), NonNull<u8>> {
    if cap < RECYCLE_MIN_BYTES {
        return Err(ptr);
    }
    let mut r = recycler();
    if r.bytes + cap > RECYCLE_MAX_BYTES {
        return Err(ptr);
    }
    r.bytes += cap;
    r.free.entry(cap).or_default().push(FreeAlloc(ptr));
    Ok(())
}

/// Bytes the free list of recycled host allocations holds now.
pub fn recycled_bytes() -> usize {
    recycler().bytes
}

/// Page-aligned host memory used to move blocks in and out of a pool.
///
/// Allocated by the backend ([`crate::MemoryBackend::staging`]) so that it can register it
/// (NIXL) or pin it (CUDA); the registration guard is dropped with the buffer, before the
/// memory is released. The allocation is zeroed and its capacity is rounded up to a whole
/// number of pages (so it can be pinned page by page); `len()` is the requested length.
pub struct Staging {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes actually allocated (multiple of `STAGING_ALIGN`); 0 when nothing was allocated.
    cap: usize,
    owner: u64,
    guard: Option<Box<dyn Any + Send + Sync>>,
    /// `None`: the allocation is ours (`std::alloc`). `Some`: memory owned elsewhere (a shared
    /// mapping), released by this callback after the guard.
    release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

// SAFETY: `Staging` uniquely owns its allocation (like `Vec<u8>`); shared access only hands out
// `&[u8]` / `*const u8` and mutation requires `&mut self`. The guard is itself `Send + Sync`.
unsafe impl Send for Staging {}
// SAFETY: as above: `&Staging` only permits reads of the buffer.
unsafe impl Sync for Staging {}

impl Staging {
    /// A plain zeroed host allocation of `len` bytes, aligned to 4096, owned by backend `owner`.
    ///
    /// # Panics
    /// If `len` rounded up to a page overflows `isize` (as `Vec` does), and aborts on
    /// allocation failure (`handle_alloc_error`).
    pub fn new_host(len: usize, owner: u64) -> Self {
        Self::host(len, owner, true)
    }

    /// [`Staging::new_host`] for a caller that overwrites all of `[0, len)` before anything
    /// reads it (a pool read into it, a payload copied over it): a recycled allocation comes
    /// back as it was dropped instead of zeroed — initialized bytes, possibly an earlier
    /// transfer's, which the caller's write replaces. Zeroing it again was a memset of every
    /// byte a serving daemon moves (6 % of its CPU at 1 Gbit/s, 2026-12-06). A fresh
    /// allocation is zeroed as before.
    pub fn new_host_to_fill(len: usize, owner: u64) -> Self {
        Self::host(len, owner, false)
    }

    fn host(len: usize, owner: u64, zero_recycled: bool) -> Self {
        if len == 0 {
            return Self { ptr: dangling_aligned(), len: 0, cap: 0, owner, guard: None, release: None };
        }
        let cap = len.checked_next_multiple_of(STAGING_ALIGN).expect("staging length overflows usize");
        let layout = Layout::from_size_align(cap, STAGING_ALIGN).expect("staging length overflows isize");
        if let Some(ptr) = take_recycled(cap) {
            if zero_recycled {
                // SAFETY: a recycled allocation has exactly this layout and nothing else refers
                // to it (it left the free list whole); zeroing its `cap` bytes stays inside it.
                unsafe { ptr.as_ptr().write_bytes(0, cap) };
            }
            // Unzeroed, its bytes are still initialized: every byte was zeroed when it was
            // first allocated and only ever written since.
            return Self { ptr, len, cap, owner, guard: None, release: None };
        }
        // SAFETY: `layout` has a non-zero size (len > 0, so cap >= 4096).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        Self { ptr, len, cap, owner, guard: None, release: None }
    }

    /// A staging buffer over memory this value does not allocate (for example a `MAP_SHARED`
    /// mapping of a memfd that a backend's helper process maps too). `release` runs once, on
    /// drop, after the guard.
    ///
    /// # Safety
    /// `ptr` must be 4096-aligned and valid for reads and writes of `cap` initialized bytes
    /// until `release` has run; `len <= cap` and `cap` a multiple of 4096. Nothing else in this
    /// process may create references to that memory meanwhile; other parties (a helper process,
    /// a DMA engine) may touch it only inside a backend's `read`/`write` of this buffer, as a
    /// registered buffer is touched.
    pub unsafe fn from_external(
        ptr: NonNull<u8>,
        len: usize,
        cap: usize,
        owner: u64,
        release: Box<dyn FnOnce() + Send + Sync>,
    ) -> Self {
        debug_assert!(
            len <= cap
                && cap.is_multiple_of(STAGING_ALIGN)
                && (ptr.as_ptr() as usize).is_multiple_of(STAGING_ALIGN)
        );
        Self { ptr, len, cap, owner, guard: None, release: Some(release) }
    }

    /// Attach a registration guard, dropped before the memory is freed.
    #[must_use]
    pub fn with_guard(mut self, guard: Box<dyn Any + Send + Sync>) -> Self {
        self.guard = Some(guard);
        self
    }

    /// The guard attached with [`Staging::with_guard`], if any.
    pub fn guard(&self) -> Option<&(dyn Any + Send + Sync)> {
        self.guard.as_deref()
    }

    /// The buffer as bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialized (zeroed at allocation) bytes for the
        // lifetime of `self`, or dangling-but-aligned with len 0; `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer as mutable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Start of the buffer (4096-aligned when `len() > 0`).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the buffer, for writing (requires `&mut self`).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Requested length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when `len() == 0`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes actually allocated (the length rounded up to whole pages; 0 for an empty buffer).
    /// Backends that pin or register memory may register this many bytes.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Id of the backend instance that allocated (and possibly registered) this buffer.
    pub fn owner(&self) -> u64 {
        self.owner
    }
}

fn dangling_aligned() -> NonNull<u8> {
    // A non-null, 4096-aligned address with no provenance; never dereferenced for len > 0.
    NonNull::new(std::ptr::without_provenance_mut(STAGING_ALIGN)).expect("4096 is non-zero")
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The registration (if any) must go before the memory it covers.
        drop(self.guard.take());
        if let Some(release) = self.release.take() {
            release();
        } else if self.cap > 0 {
            let Err(ptr) = recycle(self.ptr, self.cap) else { return };
            let layout = Layout::from_size_align(self.cap, STAGING_ALIGN).expect("checked at allocation");
            // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this layout (directly,
            // or through the free list, which keeps allocations whole) and has not been freed
            // (Drop runs once, and a recycled pointer is no longer ours).
            unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
        }
    }
}

impl fmt::Debug for Staging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Staging")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .field("owner", &self.owner)
            .field("guarded", &self.guard.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn aligned_zeroed_and_sized() {
        for len in [1usize, 100, 4096, 4097, 3 << 20] {
            let s = Staging::new_host(len, 7);
            assert_eq!(s.as_ptr() as usize % STAGING_ALIGN, 0, "len {len}");
            assert_eq!(s.len(), len);
            assert_eq!(s.capacity() % STAGING_ALIGN, 0);
            assert!(s.capacity() >= len);
            assert_eq!(s.owner(), 7);
            assert!(s.as_slice().iter().all(|&b| b == 0), "len {len} not zeroed");
        }
    }

    #[test]
    fn a_buffer_to_fill_is_recycled_unzeroed_and_a_plain_one_after_it_zeroed() {
        // A size no other test allocates, so the free list's entry for it is this test's.
        let len = RECYCLE_MIN_BYTES + 41 * STAGING_ALIGN + 3;
        let fresh = Staging::new_host_to_fill(len, 1);
        assert!(fresh.as_slice().iter().all(|&b| b == 0), "a fresh allocation is zeroed");
        let first = fresh.as_ptr();
        let mut s = fresh;
        s.as_mut_slice().fill(0xCD);
        drop(s);
        let mut to_fill = Staging::new_host_to_fill(len, 3);
        assert_eq!((to_fill.as_ptr(), to_fill.len(), to_fill.owner()), (first, len, 3));
        assert!(to_fill.as_slice().iter().all(|&b| b == 0xCD), "taken back as it was dropped");
        to_fill.as_mut_slice()[..10].fill(1);
        drop(to_fill);
        let plain = Staging::new_host(len, 4);
        assert_eq!(plain.as_ptr(), first);
        assert!(plain.as_slice().iter().all(|&b| b == 0), "new_host zeroes what to_fill left");
    }

    #[test]
    fn a_recycled_buffer_comes_back_zeroed_and_the_list_stays_bounded() {
        // A size no other test allocates, so the free list's entry for it is this test's.
        let len = RECYCLE_MIN_BYTES + 37 * STAGING_ALIGN + 5;
        let mut s = Staging::new_host(len, 1);
        s.as_mut_slice().fill(0xAB);
        let first = s.as_ptr();
        drop(s);
        let again = Staging::new_host(len, 2);
        assert_eq!(again.as_ptr(), first, "the dropped allocation is taken back");
        assert_eq!(again.owner(), 2);
        assert!(again.as_slice().iter().all(|&b| b == 0), "a recycled buffer is zeroed");
        // Small buffers are not kept; the list never holds more than its bound.
        let small = Staging::new_host(4096, 1);
        drop(small);
        let many: Vec<Staging> = (0..40).map(|_| Staging::new_host(4 << 20, 1)).collect();
        drop(many);
        assert!(recycled_bytes() <= RECYCLE_MAX_BYTES);
    }

    #[test]
    fn empty_is_valid() {
        let mut s = Staging::new_host(0, 1);
        assert!(s.is_empty());
        assert!(s.as_slice().is_empty());
        assert!(s.as_mut_slice().is_empty());
        assert_eq!(s.capacity(), 0);
    }

    #[test]
    fn writes_stick() {
        let mut s = Staging::new_host(10_000, 1);
        s.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        assert!(s.as_slice().iter().enumerate().all(|(i, &b)| b == i as u8));
    }

    #[test]
    fn guard_dropped_before_free_and_exactly_once() {
        struct G(Arc<AtomicBool>);
        impl Drop for G {
            fn drop(&mut self) {
                assert!(!self.0.swap(true, Ordering::SeqCst), "guard dropped twice");
            }
        }
        let flag = Arc::new(AtomicBool::new(false));
        let s = Staging::new_host(4096, 3).with_guard(Box::new(G(flag.clone())));
        assert!(s.guard().is_some_and(|g| g.is::<G>()));
        assert!(!flag.load(Ordering::SeqCst));
        drop(s);
        assert!(flag.load(Ordering::SeqCst));
    }

    #[test]
    fn is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Staging>();
    }
}
