//! Chunk sources and sinks over a KV pool: a chunk's (blocks, layers) become the layout's
//! extents for the given block ids, and the bytes move through the pool's `MemoryBackend`
//! (shared memory, NIXL, CUDA) in the layout's staging order. Both regions' layouts have the
//! same fingerprint (checked before a transfer starts), so the same staging order means the
//! same bytes even when the block ids differ.

use std::sync::Arc;

use kvferry_layout::PoolLayout;
use kvferry_pool::{MemoryBackend, Staging};
use kvferry_wire::ChunkSpec;

use crate::io::{BoxFut, ChunkBytes, ChunkError, ChunkSink, ChunkSource};

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
        let staging = self.backend.staging(len as usize)?;
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
            let (extents, mut staging) = self.staging_for(&spec)?;
            staging.as_mut_slice()[..payload.len()].copy_from_slice(payload);
            Ok(self.backend.write(&extents, &staging).await?)
        })
    }
}
