//! What this region serves to peers, and where fetched chunks land.
//!
//! [`RegionCatalog`] answers a peer's fetch request: the tenant and layout fingerprint must
//! match, and the longest prefix of the requested blocks held in one place (one engine's pool,
//! or the landing zone) is served from there. [`LandingSink`] assembles a fetch's verified
//! chunks into per-block buffers that become visible only when the executor commits them.
//! [`EgressCaps`] paces what is served to each peer when `peers[].max_egress_gbps` is set.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// Per-peer egress caps.
    pub egress: EgressCaps,
    /// `Some(pool use)` when eviction hints are on (`policy.eviction_hints`).
    pub hint_threshold: Option<f64>,
}

/// Serves from an engine's pool and, once every chunk was read (the whole chain went to the
/// peer), hints the engine to evict those blocks if its pool is at least `pool_use` full.
struct HintWhenServed {
    inner: Arc<dyn ChunkSource>,
    engine: Arc<crate::registry::EngineEntry>,
    hashes: Vec<BlockHash>,
    total: u64,
    /// Distinct chunk ids read, and their bytes.
    read: Mutex<(std::collections::HashSet<u32>, u64)>,
    pool_use: f64,
    metrics: Arc<crate::metrics::Metrics>,
}

impl ChunkSource for HintWhenServed {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, String>> {
        Box::pin(async move {
            let out = self.inner.read(spec).await?;
            if let Ok(mut g) = self.read.lock()
                && g.0.insert(spec.id)
            {
                g.1 += spec.len;
            }
            Ok(out)
        })
    }
}

impl Drop for HintWhenServed {
    fn drop(&mut self) {
        let served = self.read.lock().map(|g| g.1).unwrap_or(0);
        if served < self.total || self.hashes.is_empty() {
            return;
        }
        let held = self.engine.blocks.lock().map(|b| b.len()).unwrap_or(0);
        let capacity = self.engine.layout.num_blocks().max(1) as usize;
        let pool_use = held as f64 / capacity as f64;
        if pool_use < self.pool_use {
            return;
        }
        let Some(tx) = self.engine.commands.lock().ok().and_then(|c| c.clone()) else { return };
        let cmd = kvferry_proto::v1::DaemonCommand {
            command: Some(kvferry_proto::v1::daemon_command::Command::Evict(
                kvferry_proto::v1::EvictionHint {
                    block_hashes: self.hashes.iter().map(|h| h.to_vec()).collect(),
                },
            )),
        };
        // Never block (this runs in a drop): a full command queue drops the hint.
        if tx.try_send(Ok(cmd)).is_ok() {
            self.metrics.eviction_hint_blocks.add(self.hashes.len() as u64);
            tracing::info!(engine = %self.engine.engine_id, blocks = self.hashes.len(), pool_use,
                "served a whole chain to a peer; eviction hint sent");
        }
    }
}

/// Per-peer egress pacing: one shared virtual clock per capped peer, so every transfer to that
/// peer together stays under its cap. A chunk read waits until the bytes before it have
/// "left" at the capped rate; the wait backpressures the owner's pipeline like a slow link.
#[derive(Debug, Default)]
pub struct EgressCaps {
    by_region: HashMap<String, Arc<Pacer>>,
}

impl EgressCaps {
    /// Caps from the peer list (peers with `max_egress_gbps = 0` are not paced).
    pub fn new(peers: &[crate::config::Peer]) -> Self {
        let by_region = peers
            .iter()
            .filter(|p| p.max_egress_gbps > 0.0)
            .map(|p| {
                let pacer = Pacer { bytes_per_s: p.max_egress_gbps * 1e9 / 8.0, next: Mutex::new(None) };
                (p.region.clone(), Arc::new(pacer))
            })
            .collect();
        Self { by_region }
    }

    fn wrap(&self, peer: &RegionId, source: Arc<dyn ChunkSource>) -> Arc<dyn ChunkSource> {
        match self.by_region.get(&peer.region) {
            Some(p) => Arc::new(Paced { pacer: p.clone(), inner: source }),
            None => source,
        }
    }
}

/// A virtual clock: when the link (at the capped rate) is next free.
#[derive(Debug)]
struct Pacer {
    bytes_per_s: f64,
    next: Mutex<Option<Instant>>,
}

impl Pacer {
    /// When `len` bytes may start; books their transmission time.
    fn book(&self, len: u64) -> Instant {
        let now = Instant::now();
        let mut g = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let start = g.map_or(now, |t| t.max(now));
        *g = Some(start + Duration::from_secs_f64(len as f64 / self.bytes_per_s));
        start
    }
}

struct Paced {
    pacer: Arc<Pacer>,
    inner: Arc<dyn ChunkSource>,
}

impl ChunkSource for Paced {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, String>> {
        Box::pin(async move {
            tokio::time::sleep_until(self.pacer.book(spec.len).into()).await;
            self.inner.read(spec).await
        })
    }
}

impl BlockCatalog for RegionCatalog {
    fn open(&self, peer: &RegionId, req: &FetchRequest) -> Result<Served, (RefusalCode, String)> {
        let mut served = self.open_unpaced(peer, req)?;
        served.source = self.egress.wrap(peer, served.source);
        Ok(served)
    }
}

impl RegionCatalog {
    fn open_unpaced(&self, peer: &RegionId, req: &FetchRequest) -> Result<Served, (RefusalCode, String)> {
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
                let pool: Arc<dyn ChunkSource> =
                    Arc::new(PoolChunks::new(e.layout.clone(), e.backend.clone(), held.clone()));
                let source = match self.hint_threshold {
                    Some(pool_use) => Arc::new(HintWhenServed {
                        inner: pool,
                        engine: e.clone(),
                        hashes: req.block_hashes[..held.len()].to_vec(),
                        total: shape.block_bytes() * held.len() as u64,
                        read: Mutex::new((std::collections::HashSet::new(), 0)),
                        pool_use,
                        metrics: self.metrics.clone(),
                    }) as Arc<dyn ChunkSource>,
                    None => pool,
                };
                return Ok(Served {
                    blocks_held: held.len() as u32,
                    layers: shape.layers(),
                    bytes_per_block_layer: shape.layer_bytes(0),
                    source,
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
