//! `Mapping`: one `MAP_SHARED` mapping of a shared-memory file, and the memfd creation the
//! engine side uses. Owns the only `unsafe` of this crate besides the fd passing: mmap, munmap
//! and the bounded raw copies in and out of the mapping.
//!
//! Soundness rules: the mapping is never viewed as `&[u8]` or `&mut [u8]` (another process
//! writes it at any time); bytes move only with `ptr::copy_nonoverlapping` between the mapping
//! and private memory, after a bounds check. A mapping is only created when the file is at
//! least as long as the mapping *and* sealed against shrinking, so no access can hit a page
//! past the end of the file (which would raise SIGBUS).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use kvferry_pool::PoolError;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

fn io_err(what: &str, e: rustix::io::Errno) -> PoolError {
    if e == rustix::io::Errno::BADF {
        return PoolError::Closed;
    }
    PoolError::Backend { backend: "shm", retryable: false, detail: format!("{what}: {e}") }
}

/// Create a sealed memfd of `len` bytes (zeroed): `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`,
/// so no process can ever truncate it under a mapping.
pub fn create_memfd(name: &str, len: u64) -> Result<OwnedFd, PoolError> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| io_err("memfd_create", e))?;
    rustix::fs::ftruncate(&fd, len).map_err(|e| io_err("ftruncate", e))?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(|e| io_err("fcntl(F_ADD_SEALS)", e))?;
    Ok(fd)
}

/// A read-write `MAP_SHARED` mapping of the first `len` bytes of a file.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory owned by this value; every access goes through
// raw-pointer copies (never references), so sharing or sending the handle across threads adds
// no aliasing beyond what another process can already do.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only permits bounded raw copies.
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("fd", &self.fd)
            .finish()
    }
}

impl Mapping {
    /// Map the first `len` bytes of `fd` read-write, shared.
    ///
    /// Refuses (typed, nothing mapped): a closed fd ([`PoolError::Closed`]); a file shorter
    /// than `len`, or one not sealed against shrinking ([`PoolError::BadMetadata`]): either
    /// could make an access fault with SIGBUS.
    pub fn map(fd: OwnedFd, len: u64) -> Result<Self, PoolError> {
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err("fstat", e))?;
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if size < len {
            return Err(PoolError::BadMetadata(format!(
                "shared-memory file is {size} bytes, the pool needs {len}: truncated or wrong file"
            )));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            PoolError::BadMetadata(format!("cannot read the file's seals ({e}): not a sealable memfd"))
        })?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(PoolError::BadMetadata(
                "shared-memory file is not sealed against shrinking (F_SEAL_SHRINK): refusing a mapping it could truncate"
                    .into(),
            ));
        }
        let len =
            usize::try_from(len).map_err(|_| PoolError::BadMetadata(format!("length {len} too large")))?;
        if len == 0 {
            return Ok(Self { ptr: NonNull::dangling(), len: 0, fd });
        }
        // SAFETY: a fresh mapping chosen by the kernel (null hint), of a file checked above to
        // be at least `len` bytes and sealed so it cannot shrink; nothing else refers to it yet.
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| io_err("mmap", e))?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| io_err("mmap", rustix::io::Errno::INVAL))?;
        Ok(Self { ptr, len, fd })
    }

    /// Mapped bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// True when nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Allocates the file's pages now (`fallocate`: zeroed, in the page cache), so the first
    /// write to each page later maps it instead of allocating and clearing it. What an engine
    /// that allocates its KV cache zeroed pays at start (vLLM's `torch.zeros`), rather than
    /// during its first loads: on this project's VM a page touched for the first time costs
    /// ~10 CPU s per GiB, ten times a copy into it.
    pub fn allocate(&self) -> Result<(), PoolError> {
        if self.len == 0 {
            return Ok(());
        }
        rustix::fs::fallocate(&self.fd, rustix::fs::FallocateFlags::empty(), 0, self.len as u64)
            .map_err(|e| io_err("fallocate", e))
    }

    /// The file (to pass it on, e.g. over SCM_RIGHTS).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Start of the mapping, for engines that build tensors over it. Writing through it is the
    /// caller's responsibility; this type never dereferences it outside bounded copies.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, PoolError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len as u64 => Ok(offset as usize),
            _ => Err(PoolError::OutOfBounds {
                region: 0,
                offset,
                len: len as u64,
                region_len: self.len as u64,
            }),
        }
    }

    /// Copy `out.len()` bytes at `offset` out of the mapping. Bounds-checked.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), PoolError> {
        let at = self.check(offset, out.len())?;
        // SAFETY: `at + out.len() <= self.len` (checked), so the source lies in our live mapping;
        // `out` is private memory that cannot overlap a shared mapping we own.
        unsafe { self.copy_out(at, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copy `data` into the mapping at `offset`. Bounds-checked.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), PoolError> {
        let at = self.check(offset, data.len())?;
        // SAFETY: as in `read_at`, with the roles of source and destination swapped.
        unsafe { self.copy_in(at, data.as_ptr(), data.len()) };
        Ok(())
    }

    /// Copy `len` bytes from mapping offset `at` to `dst`.
    ///
    /// # Safety
    /// `at + len <= self.len()`, and `dst` valid for `len` bytes of writes, not inside this mapping.
    pub(crate) unsafe fn copy_out(&self, at: usize, dst: *mut u8, len: usize) {
        // SAFETY: guaranteed by the caller; raw copy, no reference to shared bytes is formed.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(at), dst, len) }
    }

    /// Copy `len` bytes from `src` to mapping offset `at`.
    ///
    /// # Safety
    /// `at + len <= self.len()`, and `src` valid for `len` bytes of reads, not inside this mapping.
    pub(crate) unsafe fn copy_in(&self, at: usize, src: *const u8, len: usize) {
        // SAFETY: guaranteed by the caller; raw copy, no reference to shared bytes is formed.
        unsafe { std::ptr::copy_nonoverlapping(src, self.ptr.as_ptr().add(at), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: exactly the range returned by `mmap` in `map`, unmapped once; no copies can
            // be in flight because they all borrow `self`.
            let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_share_bytes() {
        let fd = create_memfd("t", 10_000).unwrap();
        let dup = fd.try_clone().unwrap();
        let a = Mapping::map(fd, 10_000).unwrap();
        let b = Mapping::map(dup, 10_000).unwrap();
        a.write_at(9_990, b"0123456789").unwrap();
        let mut out = [0u8; 10];
        b.read_at(9_990, &mut out).unwrap();
        assert_eq!(&out, b"0123456789");
        assert!(matches!(b.read_at(9_991, &mut out), Err(PoolError::OutOfBounds { offset: 9_991, .. })));
        assert!(matches!(a.write_at(u64::MAX, b"x"), Err(PoolError::OutOfBounds { .. })));
    }

    #[test]
    fn refuses_mapping_past_the_file() {
        let fd = create_memfd("t", 4096).unwrap();
        assert!(matches!(Mapping::map(fd, 8192), Err(PoolError::BadMetadata(m)) if m.contains("4096 bytes")));
    }

    #[test]
    fn refuses_unsealed_files() {
        let fd = rustix::fs::memfd_create("u", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        assert!(matches!(Mapping::map(fd, 4096), Err(PoolError::BadMetadata(m)) if m.contains("seal")));
    }

    #[test]
    fn sealed_files_cannot_shrink() {
        let fd = create_memfd("t", 4096).unwrap();
        assert!(rustix::fs::ftruncate(&fd, 0).is_err());
    }

    #[test]
    fn empty_mapping() {
        let m = Mapping::map(create_memfd("e", 0).unwrap(), 0).unwrap();
        assert!(m.is_empty());
        m.read_at(0, &mut []).unwrap();
        assert!(m.read_at(0, &mut [0]).is_err());
    }
}
