//! What an engine links to share its KV pool with the kvferry daemon.
//!
//! - [`ShmPool::create`]: allocate the pool for a [`PoolLayout`] in a sealed memfd and map it;
//!   the engine builds its KV tensors over [`ShmPool::region_ptr`].
//! - [`ShmPool::share`] / [`ShmPool::connect_and_share`]: send the fd and the layout over a
//!   Unix stream socket; the daemon side is `kvferry_pool_shm::accept_pool`.
//! - [`block_hashes`]: the content keys both regions compute alike (re-exported from
//!   `kvferry-layout`).
//!
//! This crate owns no copying policy and no protocol of its own: the frame format lives in
//! `kvferry-pool-shm::transport`, the layout rules in `kvferry-layout`.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

pub use kvferry_layout::{
    AttnSpec, BlockHash, Dtype, Extent, LayoutError, LayoutFingerprint, LayoutKind, MlaSpec, PoolLayout,
    StrideOrder, block_hashes, hex,
};
pub use kvferry_pool::PoolError;
pub use kvferry_pool_shm::{Offer, RegionTable};

use kvferry_pool_shm::{Mapping, create_memfd, send_offer};

/// Why an engine-side call failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The layout or the addressed blocks are invalid.
    #[error("layout: {0}")]
    Layout(#[from] LayoutError),
    /// Shared memory or the socket failed.
    #[error("pool: {0}")]
    Pool(#[from] PoolError),
    /// Connecting to the daemon failed.
    #[error("connect to daemon at {path}: {source}")]
    Connect {
        /// Socket path.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A buffer of the wrong size was passed.
    #[error("buffer is {got} bytes, the blocks need {needed}")]
    BufferSize {
        /// Bytes the blocks occupy.
        needed: u64,
        /// Bytes given.
        got: u64,
    },
}

/// An engine's KV pool in shared memory, laid out by a [`PoolLayout`].
#[derive(Debug)]
pub struct ShmPool {
    layout: PoolLayout,
    table: RegionTable,
    mapping: Mapping,
}

impl ShmPool {
    /// Allocate (zeroed) and map a pool for `layout`: one sealed memfd holding every region,
    /// each page-aligned.
    pub fn create(layout: PoolLayout) -> Result<Self, EngineError> {
        let table = RegionTable::packed(layout.region_lens())?;
        let fd = create_memfd("kvferry-pool", table.file_len())?;
        let mapping = Mapping::map(fd, table.file_len())?;
        Ok(Self { layout, table, mapping })
    }

    /// Allocates every page of the pool now ([`Mapping::allocate`]), as an engine that
    /// allocates its KV cache zeroed does at start.
    pub fn allocate_pages(&self) -> Result<(), EngineError> {
        Ok(self.mapping.allocate()?)
    }

    /// The layout.
    pub fn layout(&self) -> &PoolLayout {
        &self.layout
    }

    /// Where each region sits in the shared file.
    pub fn table(&self) -> &RegionTable {
        &self.table
    }

    /// Start of region `region` in this process (for building the engine's tensors over it),
    /// `None` for an unknown region. The region is `layout().region_lens()[region]` bytes.
    pub fn region_ptr(&self, region: u32) -> Option<*mut u8> {
        let r = self.table.regions().get(region as usize)?;
        // wrapping_add: pointer arithmetic without dereference; in bounds since the table lies
        // inside the mapping.
        Some(self.mapping.as_ptr().wrapping_add(r.offset as usize))
    }

    /// Copy the bytes of `blocks` over `layers` (in staging order, see
    /// `PoolLayout::extents`) out of the pool into `out`, which must be exactly that long.
    pub fn read_blocks(
        &self,
        blocks: &[u32],
        layers: std::ops::Range<u32>,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        let extents = self.extents_for(blocks, layers, out.len())?;
        let mut at = 0usize;
        for e in extents {
            let n = e.len as usize;
            self.mapping
                .read_at(self.table.regions()[e.region as usize].offset + e.offset, &mut out[at..at + n])?;
            at += n;
        }
        Ok(())
    }

    /// Copy `data` (staging order) into the bytes of `blocks` over `layers`.
    pub fn write_blocks(
        &self,
        blocks: &[u32],
        layers: std::ops::Range<u32>,
        data: &[u8],
    ) -> Result<(), EngineError> {
        let extents = self.extents_for(blocks, layers, data.len())?;
        let mut at = 0usize;
        for e in extents {
            let n = e.len as usize;
            self.mapping
                .write_at(self.table.regions()[e.region as usize].offset + e.offset, &data[at..at + n])?;
            at += n;
        }
        Ok(())
    }

    fn extents_for(
        &self,
        blocks: &[u32],
        layers: std::ops::Range<u32>,
        got: usize,
    ) -> Result<Vec<Extent>, EngineError> {
        let extents = self.layout.extents(blocks, layers)?;
        let needed: u64 = extents.iter().map(|e| e.len).sum();
        if needed != got as u64 {
            return Err(EngineError::BufferSize { needed, got: got as u64 });
        }
        Ok(extents)
    }

    /// Send this pool (fd, table, layout, `model_id`) to the daemon over `stream`.
    pub fn share(&self, stream: &UnixStream, model_id: &str) -> Result<(), EngineError> {
        send_offer(stream, &offer(&self.layout, &self.table, model_id), self.mapping.fd())?;
        Ok(())
    }

    /// What sharing this pool needs, detached from the pool: its layout, its table and a
    /// duplicate of its fd. Any thread can share the pool with it (an engine registering again
    /// with a restarted daemon need not ask the thread that owns the pool).
    pub fn share_handle(&self) -> Result<PoolShare, EngineError> {
        let fd = self.mapping.fd().try_clone_to_owned().map_err(|e| PoolError::Backend {
            backend: "shm",
            retryable: true,
            detail: format!("duplicate the pool's fd: {e}"),
        })?;
        Ok(PoolShare { layout: self.layout.clone(), table: self.table.clone(), fd })
    }

    /// Connect to the daemon's socket at `path` and share this pool; keep the returned stream
    /// open for as long as the daemon may use the pool (closing it tells the daemon the engine
    /// is gone).
    pub fn connect_and_share(
        &self,
        path: impl AsRef<Path>,
        model_id: &str,
    ) -> Result<UnixStream, EngineError> {
        let path = path.as_ref();
        let stream = UnixStream::connect(path)
            .map_err(|source| EngineError::Connect { path: path.display().to_string(), source })?;
        self.share(&stream, model_id)?;
        Ok(stream)
    }

    /// This pool's layout fingerprint for `model_id`.
    pub fn fingerprint(&self, model_id: &str) -> LayoutFingerprint {
        self.layout.fingerprint(model_id)
    }
}

/// A pool's offer without its mapping ([`ShmPool::share_handle`]): it keeps the pool's memfd
/// open (a duplicate), not mapped.
#[derive(Debug)]
pub struct PoolShare {
    layout: PoolLayout,
    table: RegionTable,
    fd: OwnedFd,
}

impl PoolShare {
    /// Send the pool (fd, table, layout, `model_id`) to the daemon over `stream`, as
    /// [`ShmPool::share`] does.
    pub fn share(&self, stream: &UnixStream, model_id: &str) -> Result<(), EngineError> {
        send_offer(stream, &offer(&self.layout, &self.table, model_id), self.fd.as_fd())?;
        Ok(())
    }
}

fn offer(layout: &PoolLayout, table: &RegionTable, model_id: &str) -> Offer {
    Offer { model_id: model_id.to_owned(), layout: Some(layout.clone()), table: table.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> PoolLayout {
        let spec = AttnSpec { layers: 2, kv_heads: 2, head_dim: 8, block_size: 4, dtype: Dtype::Bf16 };
        PoolLayout::flashinfer(spec, 16, StrideOrder::Hnd).unwrap()
    }

    #[test]
    fn blocks_round_trip_and_land_where_the_layout_says() {
        let pool = ShmPool::create(layout()).unwrap();
        let bb = 4 * 2 * 8 * 2u64;
        let data: Vec<u8> = (0..2 * 2 * bb).map(|i| i as u8).collect();
        pool.write_blocks(&[5, 9], 1..2, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        pool.read_blocks(&[5, 9], 1..2, &mut back).unwrap();
        assert_eq!(back, data);
        // FlashInfer: block 5's K in layer 1 starts at 2*5*bb of region 1.
        let p = pool.region_ptr(1).unwrap();
        // SAFETY: region 1 is 16*2*bb bytes long and mapped for the pool's lifetime; no other
        // thread writes it during this test.
        let first = unsafe { p.add((10 * bb) as usize).read() };
        assert_eq!(first, data[0]);
        assert!(pool.region_ptr(2).is_none());
    }

    #[test]
    fn wrong_buffer_and_bad_blocks_are_typed_errors() {
        let pool = ShmPool::create(layout()).unwrap();
        assert!(matches!(
            pool.write_blocks(&[1], 0..1, &[0; 3]),
            Err(EngineError::BufferSize { got: 3, .. })
        ));
        assert!(matches!(
            pool.read_blocks(&[16], 0..1, &mut []),
            Err(EngineError::Layout(LayoutError::BlockOutOfRange { block: 16, .. }))
        ));
    }

    #[test]
    fn a_share_handle_offers_the_pools_memory_from_another_thread() {
        let pool = ShmPool::create(layout()).unwrap();
        let data: Vec<u8> = (0..2 * 2 * 4 * 2 * 8 * 2).map(|i| (i * 7) as u8).collect();
        pool.write_blocks(&[3], 0..2, &data).unwrap();
        let handle = pool.share_handle().unwrap();
        // Shared from another thread than the pool's.
        let (a, b) = UnixStream::pair().unwrap();
        std::thread::spawn(move || handle.share(&a, "m").map(|()| a)).join().unwrap().unwrap();
        let (offer, fd) = kvferry_pool_shm::recv_offer(&b).unwrap();
        assert_eq!((offer.model_id.as_str(), offer.layout.as_ref()), ("m", Some(pool.layout())));
        assert_eq!(offer.table, *pool.table());
        // The received fd maps the pool's memory: block 3's bytes are there.
        let seen = kvferry_pool_shm::Mapping::map(fd, offer.table.file_len()).unwrap();
        let ext = pool.layout().extents(&[3], 0..2).unwrap();
        let mut got = Vec::new();
        for e in ext {
            let mut buf = vec![0u8; e.len as usize];
            seen.read_at(offer.table.regions()[e.region as usize].offset + e.offset, &mut buf).unwrap();
            got.extend(buf);
        }
        assert_eq!(got, data);
    }
}
