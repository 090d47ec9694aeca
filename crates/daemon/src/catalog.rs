//! What this region serves to peers, and where fetched chunks land.
//!
//! [`RegionCatalog`] answers a peer's fetch request: the tenant and layout fingerprint must
//! match, and the longest prefix of the requested blocks held in one place (one engine's pool,
//! or the landing zone) is served from there. [`LandingSink`] assembles a fetch's verified
//! chunks into per-block buffers that become visible only when the executor commits them.

use std::sync::{Arc, Mutex};

use kvferry_layout::BlockHash;
use kvferry_peer::{BlockCatalog, BoxFut, ChunkBytes, ChunkSink, ChunkSource, PoolChunks, RegionId, Served};
use kvferry_wire::ChunkSpec;
use kvferry_wire::frame::{FetchRequest, RefusalCode};

use crate::blockbuf::BlockShape;
use crate::landing::{Landed, LandingZone};
use crate::registry::Registry;

/// Serves peers from the engines' pools and the landing zone.
#[derive(Debug)]
pub struct RegionCatalog {
    pub registry: Arc<Registry>,
    pub landing: Arc<LandingZone>,
    pub metrics: Arc<crate::metrics::Metrics>,
}

impl BlockCatalog for RegionCatalog {
    fn open(&self, peer: &RegionId, req: &FetchRequest) -> Result<Served, (RefusalCode, String)> {
        let engines: Vec<_> =
            self.registry.all().into_iter().filter(|e| e.digest == req.fingerprint).collect();
        let any_engine = !self.registry.all().is_empty();
        if engines.is_empty() && any_engine {
            return Err((
                RefusalCode::FingerprintMismatch,
                "no pool here has the requested layout fingerprint".into(),
            ));
        }
        let first =
            req.block_hashes.first().ok_or((RefusalCode::BadRequest, "no blocks requested".into()))?;
        // The first block decides the tenant: hashes are salted with it, so a tenant that does
        // not own the first block owns none of the chain.
        for e in &engines {
            let held: Vec<u32> = req.block_hashes.iter().map_while(|h| e.block_of(&req.tenant, h)).collect();
            if !held.is_empty() {
                let shape = BlockShape::of(&e.layout).map_err(|m| (RefusalCode::Internal, m))?;
                self.metrics.served_requests.inc();
                tracing::debug!(peer = %peer, blocks = held.len(), engine = %e.engine_id, "serving from engine pool");
                return Ok(Served {
                    blocks_held: held.len() as u32,
                    layers: shape.layers(),
                    bytes_per_block_layer: shape.layer_bytes(0),
                    source: Arc::new(PoolChunks::new(e.layout.clone(), e.backend.clone(), held)),
                });
            }
            if e.blocks.lock().map(|b| b.get(first).is_some_and(|(_, t)| *t != req.tenant)).unwrap_or(false) {
                return Err((RefusalCode::TenantMismatch, "the blocks belong to another tenant".into()));
            }
        }
        let landed: Vec<Landed> = req
            .block_hashes
            .iter()
            .map_while(|h| self.landing.get(&req.tenant, h).filter(|l| l.fingerprint == req.fingerprint))
            .collect();
        if let Some(e) = engines.first().filter(|_| !landed.is_empty()) {
            let shape = BlockShape::of(&e.layout).map_err(|m| (RefusalCode::Internal, m))?;
            self.metrics.served_requests.inc();
            return Ok(Served {
                blocks_held: landed.len() as u32,
                layers: shape.layers(),
                bytes_per_block_layer: shape.layer_bytes(0),
                source: Arc::new(LandedSource { shape, blocks: landed }),
            });
        }
        if self.landing.owner_of(first).is_some_and(|t| t != req.tenant) {
            return Err((RefusalCode::TenantMismatch, "the blocks belong to another tenant".into()));
        }
        Err((RefusalCode::UnknownBlocks, "none of the requested blocks are held in this region".into()))
    }
}

/// Serves chunks out of landing-zone block buffers.
struct LandedSource {
    shape: BlockShape,
    blocks: Vec<Landed>,
}

impl ChunkSource for LandedSource {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, String>> {
        Box::pin(async move {
            let refs: Vec<&[u8]> = self.blocks.iter().map(|b| b.bytes.as_slice()).collect();
            Ok(Box::new(self.shape.gather(&spec, &refs)?) as ChunkBytes)
        })
    }
}

/// Assembles a fetch's verified chunks into block buffers (invisible until committed).
#[derive(Debug)]
pub struct LandingSink {
    shape: BlockShape,
    blocks: Mutex<Vec<Vec<u8>>>,
    pub landed_bytes: Arc<std::sync::atomic::AtomicU64>,
}

impl LandingSink {
    /// Buffers for `n` blocks of `shape`.
    pub fn new(shape: BlockShape, n: usize) -> Self {
        let bytes = shape.block_bytes() as usize;
        Self { shape, blocks: Mutex::new(vec![vec![0u8; bytes]; n]), landed_bytes: Default::default() }
    }

    /// The assembled blocks (call only after the fetch returned `Ok`).
    pub fn into_blocks(self) -> Vec<Vec<u8>> {
        self.blocks.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

impl ChunkSink for LandingSink {
    fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), String>> {
        Box::pin(async move {
            let mut blocks = self.blocks.lock().map_err(|_| "landing buffers poisoned".to_owned())?;
            self.shape.scatter(&spec, payload, &mut blocks)?;
            self.landed_bytes.fetch_add(payload.len() as u64, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        })
    }
}

/// The blocks to commit after a verified fetch.
pub fn landed_blocks(
    tenant: &str,
    fingerprint: [u8; 32],
    hashes: &[BlockHash],
    blocks: Vec<Vec<u8>>,
) -> Vec<(BlockHash, Landed)> {
    hashes
        .iter()
        .zip(blocks)
        .map(|(h, b)| (*h, Landed { tenant: tenant.to_owned(), fingerprint, bytes: Arc::new(b) }))
        .collect()
}
