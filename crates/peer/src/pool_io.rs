//! Chunk sources and sinks over a KV pool: a chunk's (blocks, layers) become the layout's
//! extents for the given block ids, and the bytes move through the pool's `MemoryBackend`
//! (shared memory, NIXL, CUDA) in the layout's staging order. Both regions' layouts have the
//! same fingerprint (checked before a transfer starts), so the same staging order means the
//! same bytes even when the block ids differ.
//!
//! [`FlatChunks`]: a transfer's bytes in one flat buffer in staging order, for benchmarks that
//! measure the link rather than a pool.

use std::sync::Arc;

use kvferry_layout::PoolLayout;
use kvferry_pool::{MemoryBackend, Staging};
use kvferry_wire::ChunkSpec;

use kvferry_wire::frame::{FetchRequest, RefusalCode};

use crate::io::{BoxFut, ChunkBytes, ChunkError, ChunkSink, ChunkSource};
use crate::node::{BlockCatalog, Served};
use crate::tls::RegionId;

/// A transfer's view of one pool: which block ids hold the transfer's blocks, in order.
pub struct PoolChunks {
    layout: PoolLayout,
    backend: Arc<dyn MemoryBackend>,
    block_ids: Vec<u32>,
}

impl std::fmt::Debug for PoolChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolChunks")
            .field("backend", &self.backend.name())
            .field("blocks", &self.block_ids.len())
            .finish()
    }
}

impl PoolChunks {
    /// The transfer's i-th block lives at `block_ids[i]` of the pool.
    pub fn new(layout: PoolLayout, backend: Arc<dyn MemoryBackend>, block_ids: Vec<u32>) -> Self {
        Self { layout, backend, block_ids }
    }

    /// Bytes of one block in one layer (the wire's unit), if the layout is uniform.
    pub fn bytes_per_block_layer(&self) -> Option<u64> {
        let first = self.layout.bytes_per_block(0..1).ok()?;
        (0..self.layout.num_layers())
            .all(|l| self.layout.bytes_per_block(l..l + 1).ok() == Some(first))
            .then_some(first)
    }

    fn staging_for(&self, spec: &ChunkSpec) -> Result<(Vec<kvferry_layout::Extent>, Staging), ChunkError> {
        let mismatch = |detail: String| ChunkError::Mismatch { chunk: spec.id, detail };
        let ids = self
            .block_ids
            .get(spec.blocks.0 as usize..spec.blocks.1 as usize)
            .ok_or_else(|| mismatch("names blocks past the transfer".into()))?;
        let extents =
            self.layout.extents(ids, spec.layers.0..spec.layers.1).map_err(|e| mismatch(e.to_string()))?;
        let len: u64 = extents.iter().map(|e| e.len).sum();
        if len != spec.len {
            return Err(mismatch(format!("{len} bytes in this layout, {} on the wire", spec.len)));
        }
        // Every caller overwrites all `len` bytes: a gather of these extents (their lengths
        // add up to `len`, checked above) or a payload of exactly `len` bytes.
        let staging = self.backend.staging_to_fill(len as usize)?;
        Ok((extents, staging))
    }
}

struct StagingBytes {
    staging: Staging,
    len: usize,
}

impl AsRef<[u8]> for StagingBytes {
    fn as_ref(&self) -> &[u8] {
        &self.staging.as_slice()[..self.len]
    }
}

impl ChunkSource for PoolChunks {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        Box::pin(async move {
            let (extents, mut staging) = self.staging_for(&spec)?;
            self.backend.read(&extents, &mut staging).await?;
            Ok(Box::new(StagingBytes { staging, len: spec.len as usize }) as ChunkBytes)
        })
    }
}

impl ChunkSink for PoolChunks {
    fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>> {
        Box::pin(async move {
            if payload.len() as u64 != spec.len {
                let detail = format!("a payload of {} bytes for a chunk of {}", payload.len(), spec.len);
                return Err(ChunkError::Mismatch { chunk: spec.id, detail });
            }
            let (extents, mut staging) = self.staging_for(&spec)?;
            staging.as_mut_slice()[..payload.len()].copy_from_slice(payload);
            Ok(self.backend.write(&extents, &staging).await?)
        })
    }
}

/// Where chunk `spec` lies in a flat buffer of a transfer of `blocks` blocks in staging order
/// (layer-major: chunks are whole layers of every block, or a run of blocks of one layer).
pub fn flat_span(spec: &ChunkSpec, blocks: u32, bytes_per_block_layer: u64) -> std::ops::Range<usize> {
    let layers = u64::from(spec.layers.1.saturating_sub(spec.layers.0));
    let at = (u64::from(spec.layers.0) * u64::from(blocks) + u64::from(spec.blocks.0) * layers)
        * bytes_per_block_layer;
    at as usize..(at + spec.len) as usize
}

/// A transfer's bytes in one flat buffer (staging order); reads are zero-copy slices of it.
/// As a [`BlockCatalog`] it serves its blocks to every request, whatever the tenant and
/// fingerprint: for benchmarks of the link, never for a region's real blocks.
#[derive(Debug, Clone)]
pub struct FlatChunks {
    buf: Arc<Vec<u8>>,
    blocks: u32,
    layers: u32,
    bytes_per_block_layer: u64,
}

impl FlatChunks {
    /// `buf` holds `blocks` blocks of `layers` layers of `bytes_per_block_layer` bytes.
    pub fn new(buf: Arc<Vec<u8>>, blocks: u32, layers: u32, bytes_per_block_layer: u64) -> Self {
        Self { buf, blocks, layers, bytes_per_block_layer }
    }

    /// Blocks held.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Chunk `spec`'s bytes, if the buffer holds them.
    pub fn get(&self, spec: &ChunkSpec) -> Option<&[u8]> {
        self.buf.get(flat_span(spec, self.blocks, self.bytes_per_block_layer))
    }
}

struct FlatSlice(Arc<Vec<u8>>, std::ops::Range<usize>);

impl AsRef<[u8]> for FlatSlice {
    fn as_ref(&self) -> &[u8] {
        &self.0[self.1.clone()]
    }
}

impl ChunkSource for FlatChunks {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        let span = flat_span(&spec, self.blocks, self.bytes_per_block_layer);
        let out = if span.end <= self.buf.len() {
            Ok(Box::new(FlatSlice(self.buf.clone(), span)) as ChunkBytes)
        } else {
            Err(ChunkError::Mismatch { chunk: spec.id, detail: "beyond the buffer".into() })
        };
        Box::pin(async move { out })
    }
}

impl BlockCatalog for FlatChunks {
    fn open(&self, _peer: &RegionId, req: &FetchRequest) -> Result<Served, (RefusalCode, String)> {
        Ok(Served {
            blocks_held: (req.block_hashes.len() as u32).min(self.blocks),
            layers: self.layers,
            bytes_per_block_layer: self.bytes_per_block_layer,
            source: Arc::new(self.clone()),
            egress_cap_bps: 0,
        })
    }
}
