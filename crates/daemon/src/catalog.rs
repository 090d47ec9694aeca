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
use kvferry_peer::{
    BlockCatalog, BoxFut, ChunkBytes, ChunkError, ChunkSink, ChunkSource, PoolChunks, RegionId, Served,
};
use kvferry_wire::ChunkSpec;
use kvferry_wire::frame::{FetchRequest, RefusalCode};

use crate::blockbuf::BlockShape;
use crate::landing::{Landed, LandingZone};
use crate::registry::{Held, Registry};
use kvferry_pool::sync::LockExt;

/// Serves peers from the engines' pools and the landing zone.
#[derive(Debug)]
pub struct RegionCatalog {
    pub registry: Arc<Registry>,
    pub landing: Arc<LandingZone>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Per-peer egress caps.
    pub egress: EgressCaps,
    /// Per-peer tenant allow-lists (`peers[].tenants`): checked first, before any index or
    /// KV byte is looked at.
    pub scopes: TenantScopes,
    /// `Some(pool use)` when eviction hints are on (`policy.eviction_hints`).
    pub hint_threshold: Option<f64>,
    /// Test builds' injected faults (`[faults]`; empty unless feature `fault-injection`).
    pub faults: InjectedFaults,
}

/// Chunks still to corrupt per tenant (`[faults] corrupt`), shared by that tenant's transfers.
#[derive(Debug, Default)]
pub struct InjectedFaults {
    corrupt: HashMap<String, Arc<std::sync::atomic::AtomicU64>>,
}

impl InjectedFaults {
    /// From the config (validation refuses entries in builds without the feature).
    pub fn new(cfg: &crate::config::Faults) -> Self {
        let corrupt = cfg
            .corrupt
            .iter()
            .map(|f| (f.tenant.clone(), Arc::new(std::sync::atomic::AtomicU64::new(f.chunks))))
            .collect();
        Self { corrupt }
    }

    #[cfg(feature = "fault-injection")]
    fn wrap(&self, tenant: &str, source: Arc<dyn ChunkSource>) -> Arc<dyn ChunkSource> {
        match self.corrupt.get(tenant) {
            Some(left) => Arc::new(Corrupting { inner: source, left: left.clone() }),
            None => source,
        }
    }

    #[cfg(not(feature = "fault-injection"))]
    fn wrap(&self, _tenant: &str, source: Arc<dyn ChunkSource>) -> Arc<dyn ChunkSource> {
        debug_assert!(self.corrupt.is_empty(), "config validation refuses faults without the feature");
        source
    }
}

/// Asks the owner to corrupt each chunk after its checksum while the tenant's budget lasts.
#[cfg(feature = "fault-injection")]
struct Corrupting {
    inner: Arc<dyn ChunkSource>,
    left: Arc<std::sync::atomic::AtomicU64>,
}

#[cfg(feature = "fault-injection")]
impl ChunkSource for Corrupting {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        self.inner.read(spec)
    }

    fn corrupt_after_checksum(&self, _spec: &ChunkSpec) -> bool {
        use std::sync::atomic::Ordering;
        self.left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok()
    }
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
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        Box::pin(async move {
            let out = self.inner.read(spec).await?;
            let mut g = self.read.locked();
            if g.0.insert(spec.id) {
                g.1 += spec.len;
            }
            drop(g);
            Ok(out)
        })
    }
}

impl Drop for HintWhenServed {
    fn drop(&mut self) {
        let served = self.read.locked().1;
        if served < self.total || self.hashes.is_empty() {
            return;
        }
        let held = self.engine.blocks.locked().len();
        let capacity = self.engine.layout.num_blocks().max(1) as usize;
        let pool_use = held as f64 / capacity as f64;
        if pool_use < self.pool_use {
            return;
        }
        let Some(tx) = self.engine.commands.locked().clone() else { return };
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
            tracing::info!(engine = ?self.engine.engine_id, blocks = self.hashes.len(), pool_use,
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

    /// The cap toward `peer`, bits/s (0: none).
    fn cap_bps(&self, peer: &RegionId) -> u64 {
        self.by_region.get(&peer.region).map_or(0, |p| (p.bytes_per_s * 8.0) as u64)
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
        let mut g = self.next.locked();
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
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        Box::pin(async move {
            tokio::time::sleep_until(self.pacer.book(spec.len).into()).await;
            self.inner.read(spec).await
        })
    }
}

/// Every peer's tenant allow-list (`peers[].tenants`), by region, for the serving side.
#[derive(Debug, Clone, Default)]
pub struct TenantScopes {
    by_region: std::collections::HashMap<String, Option<std::collections::HashSet<String>>>,
}

impl TenantScopes {
    /// From the peer list.
    pub fn new(peers: &[crate::config::Peer]) -> Self {
        let by_region = peers
            .iter()
            .map(|p| (p.region.clone(), p.tenants.as_ref().map(|t| t.iter().cloned().collect())))
            .collect();
        Self { by_region }
    }

    /// Whether this region may exchange `tenant`'s blocks with `region`: a configured peer
    /// whose allow-list (if any) names the tenant. A region that is not a configured peer is
    /// allowed nothing (the handshake refuses it before this is asked).
    pub fn allows(&self, region: &str, tenant: &str) -> bool {
        match self.by_region.get(region) {
            Some(None) => true,
            Some(Some(set)) => set.contains(tenant),
            None => false,
        }
    }
}

/// Counts the KV bytes read for peers (`kvferry_served_bytes_total`).
struct CountServed {
    inner: Arc<dyn ChunkSource>,
    metrics: Arc<crate::metrics::Metrics>,
}

impl ChunkSource for CountServed {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        Box::pin(async move {
            let out = self.inner.read(spec).await?;
            self.metrics.served_bytes.add(spec.len);
            Ok(out)
        })
    }
}

/// The refusal of a peer's request for a tenant its allow-list does not name.
pub fn tenant_refusal(region: &str) -> (RefusalCode, String) {
    (
        RefusalCode::NotAuthorized,
        format!("this region does not exchange that tenant's blocks with {region} (peers[].tenants)"),
    )
}

impl BlockCatalog for RegionCatalog {
    fn open(&self, peer: &RegionId, req: &FetchRequest) -> Result<Served, (RefusalCode, String)> {
        if !self.scopes.allows(&peer.region, &req.tenant) {
            self.metrics.tenant_denied_serve.inc();
            tracing::warn!(peer = %peer, tenant = %req.tenant.escape_debug(), "refused: tenant not allowed for this peer");
            return Err(tenant_refusal(&peer.region));
        }
        let mut served = self.open_unpaced(peer, req)?;
        let counted = Arc::new(CountServed { inner: served.source, metrics: self.metrics.clone() });
        served.source = self.faults.wrap(&req.tenant, self.egress.wrap(peer, counted));
        served.egress_cap_bps = self.egress.cap_bps(peer);
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
            let entries: Vec<Held> = req.block_hashes.iter().map_while(|h| e.held(&req.tenant, h)).collect();
            let held: Vec<u32> = entries.iter().map(|h| h.id).collect();
            if !held.is_empty() {
                let shape = BlockShape::of(&e.layout).map_err(|m| (RefusalCode::Internal, m))?;
                self.metrics.served_requests.inc();
                tracing::debug!(peer = %peer, blocks = held.len(), engine = ?e.engine_id, "serving from engine pool");
                let pool: Arc<dyn ChunkSource> = Arc::new(Revalidated {
                    inner: Arc::new(PoolChunks::new(e.layout.clone(), e.backend.clone(), held.clone())),
                    engine: e.clone(),
                    blocks: req
                        .block_hashes
                        .iter()
                        .zip(&entries)
                        .map(|(h, x)| (*h, x.id, x.generation))
                        .collect(),
                    metrics: self.metrics.clone(),
                });
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
                    egress_cap_bps: 0,
                });
            }
            if e.blocks.locked().get(first).is_some_and(|h| h.tenant != req.tenant) {
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
                egress_cap_bps: 0,
            });
        }
        if self.landing.owner_of(first).is_some_and(|t| t != req.tenant) {
            return Err((RefusalCode::TenantMismatch, "the blocks belong to another tenant".into()));
        }
        Err((RefusalCode::UnknownBlocks, "none of the requested blocks are held in this region".into()))
    }
}

/// Serves from an engine's pool, then re-validates: after a chunk's blocks were read into
/// staging and before they are checksummed and sent, every one of them must still be indexed
/// with the same (hash, block id, generation). An engine withdraws a block (acknowledged
/// `Publish`) *before* it overwrites it, so a read that passes the re-check finished before
/// the overwrite began: the bytes are the published ones. A read that fails it ends the
/// transfer (the requester sees the owner's Cancel and falls back to recompute).
pub(crate) struct Revalidated {
    pub(crate) inner: Arc<dyn ChunkSource>,
    pub(crate) engine: Arc<crate::registry::EngineEntry>,
    /// The transfer's blocks in order: (hash, block id, generation) as indexed at open.
    pub(crate) blocks: Vec<(BlockHash, u32, u64)>,
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
}

/// The detail a transfer ends with when an engine reused a block during the read.
pub const BLOCKS_REUSED: &str = "blocks reused by the engine during the read";

impl ChunkSource for Revalidated {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        Box::pin(async move {
            let out = self.inner.read(spec).await?;
            let range = self.blocks.get(spec.blocks.0 as usize..spec.blocks.1 as usize).ok_or_else(|| {
                ChunkError::Mismatch { chunk: spec.id, detail: "names blocks past the transfer".into() }
            })?;
            let ix = self.engine.blocks.locked();
            if let Some((h, id, _)) = range.iter().find(|(h, id, g)| !ix.still_holds(h, *id, *g)) {
                drop(ix);
                self.metrics.served_reused.inc();
                tracing::warn!(engine = ?self.engine.engine_id, block = id, hash = %hex::encode(h),
                    "a served block was withdrawn during the read; ending the transfer");
                return Err(ChunkError::Withdrawn(format!("{BLOCKS_REUSED} (block id {id})")));
            }
            Ok(out)
        })
    }
}

/// Serves chunks out of landing-zone block buffers.
struct LandedSource {
    shape: BlockShape,
    blocks: Vec<Landed>,
}

impl ChunkSource for LandedSource {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        Box::pin(async move {
            let refs: Vec<&[u8]> = self.blocks.iter().map(|b| b.bytes.as_slice()).collect();
            let bytes = self
                .shape
                .gather(&spec, &refs)
                .map_err(|detail| ChunkError::Mismatch { chunk: spec.id, detail })?;
            Ok(Box::new(bytes) as ChunkBytes)
        })
    }
}

/// Assembles a fetch's verified chunks into block buffers (invisible until committed).
/// Buffers come from the landing zone (a spare if it has one, *not* zeroed: it may hold an
/// earlier block's bytes); a sink dropped without [`LandingSink::into_blocks`] (the fetch
/// failed or was cancelled) gives them back. The sink records which (block, layer) each
/// landed chunk wrote in full, and `into_blocks` zeroes every layer of a block no landed
/// chunk wrote, so nothing of an earlier block can show through a committed one.
#[derive(Debug)]
pub struct LandingSink {
    shape: BlockShape,
    zone: Arc<LandingZone>,
    blocks: Mutex<SinkBlocks>,
    pub landed_bytes: Arc<std::sync::atomic::AtomicU64>,
}

/// A sink's block buffers and, per block and layer (`block * layers + layer`), whether a
/// landed chunk wrote it whole.
#[derive(Debug, Default)]
struct SinkBlocks {
    bufs: Vec<Vec<u8>>,
    written: Vec<bool>,
}

impl LandingSink {
    /// Room for `n` blocks of `shape`. A block's buffer is taken when the first chunk that
    /// covers it lands, not here: zero-filling (and faulting in) a whole fetch's buffers
    /// before its request went out cost 161 ms for 256 MiB on this host — three round trips
    /// at 50 ms before a byte moved, and ~1.3 s at 2 GiB. Taken as it lands, the cost is
    /// spread over the transfer, beside the network.
    pub fn new(shape: BlockShape, zone: Arc<LandingZone>, n: usize) -> Self {
        let written = vec![false; n * shape.layers() as usize];
        let blocks = Mutex::new(SinkBlocks { bufs: vec![Vec::new(); n], written });
        Self { shape, zone, blocks, landed_bytes: Default::default() }
    }

    /// The assembled blocks (call only after the fetch returned `Ok`, when every block was
    /// landed). A layer of a block no landed chunk wrote comes back zeroed, never short and
    /// never with a spare's earlier bytes.
    pub fn into_blocks(self) -> Vec<Vec<u8>> {
        let SinkBlocks { mut bufs, written } = std::mem::take(&mut *self.blocks.locked());
        let layers = self.shape.layers() as usize;
        for (b, buf) in bufs.iter_mut().enumerate() {
            if buf.is_empty() {
                *buf = self.zone.buffer(self.shape.block_bytes() as usize);
                continue;
            }
            for l in 0..layers {
                if !written[b * layers + l] {
                    buf[self.shape.layer_range(l as u32)].fill(0);
                }
            }
        }
        bufs
    }
}

impl Drop for LandingSink {
    fn drop(&mut self) {
        for b in std::mem::take(&mut self.blocks.locked().bufs) {
            self.zone.give_back(b);
        }
    }
}

impl ChunkSink for LandingSink {
    fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>> {
        Box::pin(async move {
            let mut g = self.blocks.locked();
            let range = spec.blocks.0 as usize..spec.blocks.1 as usize;
            allocate(&self.zone, &mut g.bufs, range.clone(), self.shape.block_bytes() as usize);
            self.shape
                .scatter(&spec, payload, &mut g.bufs)
                .map_err(|detail| ChunkError::Mismatch { chunk: spec.id, detail })?;
            // `scatter` checked the ranges against this transfer and wrote every byte of
            // these layers of these blocks.
            let layers = self.shape.layers() as usize;
            for b in range {
                for l in spec.layers.0 as usize..spec.layers.1 as usize {
                    g.written[b * layers + l] = true;
                }
            }
            self.landed_bytes.fetch_add(payload.len() as u64, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        })
    }
}

/// Gives each block of `range` (clamped to `blocks`) without a buffer one to fill.
fn allocate(zone: &LandingZone, blocks: &mut [Vec<u8>], range: std::ops::Range<usize>, bytes: usize) {
    let end = range.end.min(blocks.len());
    for b in blocks.iter_mut().take(end).skip(range.start) {
        if b.is_empty() {
            *b = zone.buffer_to_fill(bytes);
        }
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

#[cfg(test)]
mod tests {
    //! The owner-side re-validation, deterministically: a block withdrawn before, during or
    //! after a chunk's read, and re-published at the same id.
    use super::*;
    use crate::registry::{EngineEntry, EngineLoad, Profile};
    use kvferry_layout::{AttnSpec, Dtype, PoolLayout};
    use kvferry_pool::MemoryBackend;
    use kvferry_pool_shm::{RegionTable, ShmBackend, create_memfd};
    use std::sync::atomic::{AtomicBool, Ordering};

    const TENANT: &str = "t";

    fn engine() -> Arc<EngineEntry> {
        let spec = AttnSpec { layers: 2, kv_heads: 2, head_dim: 32, block_size: 32, dtype: Dtype::F32 };
        let layout = PoolLayout::vllm_cpu(spec, 8).unwrap();
        let lens = layout.region_lens().to_vec();
        let table = RegionTable::packed(&lens).unwrap();
        let fd = create_memfd("revalidate", table.file_len()).unwrap();
        let backend: Arc<dyn MemoryBackend> = Arc::new(ShmBackend::new(fd, table).unwrap());
        let fingerprint = layout.fingerprint("m");
        let digest = fingerprint.digest_bytes();
        Arc::new(EngineEntry {
            engine_id: "e".into(),
            model_id: "m".into(),
            lease_id: "l".into(),
            layout,
            fingerprint,
            digest,
            backend,
            profile: Mutex::new(Profile {
                linear_s_per_token: 1e-4,
                attention_s_per_pair: 0.0,
                fixed_s: 0.0,
            }),
            load: Mutex::new(EngineLoad::default()),
            blocks: Default::default(),
            commands: Mutex::new(None),
            recompute_waiters: Default::default(),
            registered_at: Instant::now(),
        })
    }

    fn catalog(e: &Arc<EngineEntry>) -> RegionCatalog {
        let registry = Arc::new(Registry::default());
        registry.insert(e.clone());
        RegionCatalog {
            registry,
            landing: LandingZone::new(1 << 20),
            metrics: Default::default(),
            egress: EgressCaps::default(),
            scopes: TenantScopes::new(&[crate::config::Peer {
                region: "b".into(),
                addr: "127.0.0.1:1".parse().unwrap(),
                gbps: 1.0,
                rtt_ms: 1.0,
                max_egress_gbps: 0.0,
                tenants: None,
                transport: Default::default(),
            }]),
            hint_threshold: None,
            faults: InjectedFaults::default(),
        }
    }

    fn request(e: &EngineEntry, hashes: &[BlockHash]) -> FetchRequest {
        FetchRequest {
            transfer_id: 7,
            tenant: TENANT.into(),
            fingerprint: e.digest,
            block_hashes: hashes.to_vec(),
            have_chunks: vec![],
            chunk_target_bytes: 1 << 20,
        }
    }

    fn chunk(e: &EngineEntry, blocks: (u32, u32)) -> ChunkSpec {
        let len = e.layout.bytes_per_block(0..2).unwrap() * u64::from(blocks.1 - blocks.0);
        ChunkSpec { id: 0, blocks, layers: (0, 2), len }
    }

    fn peer() -> RegionId {
        RegionId::new("kvferry.test", "b").unwrap()
    }

    fn publish(e: &EngineEntry, hashes: &[BlockHash], first_id: u32) {
        let mut ix = e.blocks.lock().unwrap();
        for (i, h) in hashes.iter().enumerate() {
            ix.store(*h, first_id + i as u32, TENANT, 0);
        }
    }

    #[tokio::test]
    async fn a_withdrawn_block_fails_the_read_and_nothing_is_served() {
        let e = engine();
        let cat = catalog(&e);
        let hashes = [[1u8; 32], [2; 32], [3; 32]];
        publish(&e, &hashes, 2);
        let served = cat.open(&peer(), &request(&e, &hashes)).unwrap();
        assert_eq!(served.blocks_held, 3);
        // untouched: the read passes
        served.source.read(chunk(&e, (0, 3))).await.unwrap();
        // block id 3 (the second block) is reused: withdrawn (acked) before the engine writes
        e.blocks.lock().unwrap().remove_id(3, 1);
        let err = served.source.read(chunk(&e, (0, 3))).await.map(|_| ()).unwrap_err();
        assert!(matches!(&err, ChunkError::Withdrawn(d) if d.contains(BLOCKS_REUSED)), "{err}");
        // a chunk of only the other blocks still passes (the check is per chunk's blocks)
        served.source.read(chunk(&e, (0, 1))).await.unwrap();
        assert_eq!(cat.metrics.served_reused.get(), 1);
        // re-published at the same id with the same hash: a new generation, still refused
        // for the transfer that indexed the old publication
        e.blocks.lock().unwrap().store(hashes[1], 3, TENANT, 2);
        assert!(served.source.read(chunk(&e, (1, 2))).await.is_err());
        // a new transfer sees the new publication
        let again = cat.open(&peer(), &request(&e, &hashes)).unwrap();
        again.source.read(chunk(&e, (0, 3))).await.unwrap();
    }

    /// A source that withdraws a block while "reading" (after the bytes were gathered, before
    /// the re-check): the eviction-during-read race, made deterministic.
    struct EvictsDuringRead {
        inner: Arc<dyn ChunkSource>,
        engine: Arc<EngineEntry>,
        evict: Arc<AtomicBool>,
    }

    impl ChunkSource for EvictsDuringRead {
        fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
            Box::pin(async move {
                let out = self.inner.read(spec).await?;
                if self.evict.load(Ordering::SeqCst) {
                    // the engine's withdrawal lands mid-read, then it overwrites the block
                    self.engine.blocks.lock().unwrap().remove_id(2, 5);
                    let ext = self.engine.layout.extents(&[2], 0..2).unwrap();
                    let mut st =
                        self.engine.backend.staging(ext.iter().map(|e| e.len as usize).sum()).unwrap();
                    st.as_mut_slice().fill(0xAB);
                    self.engine.backend.write(&ext, &st).await.unwrap();
                }
                Ok(out)
            })
        }
    }

    #[tokio::test]
    async fn eviction_during_the_read_is_caught_by_the_recheck() {
        let e = engine();
        let hashes = [[9u8; 32], [8; 32]];
        publish(&e, &hashes, 2);
        let ids = vec![2, 3];
        let blocks: Vec<_> = {
            let ix = e.blocks.lock().unwrap();
            hashes.iter().map(|h| (*h, ix.get(h).unwrap().id, ix.get(h).unwrap().generation)).collect()
        };
        let evict = Arc::new(AtomicBool::new(false));
        let inner: Arc<dyn ChunkSource> = Arc::new(EvictsDuringRead {
            inner: Arc::new(PoolChunks::new(e.layout.clone(), e.backend.clone(), ids)),
            engine: e.clone(),
            evict: evict.clone(),
        });
        let metrics: Arc<crate::metrics::Metrics> = Default::default();
        let src = Revalidated { inner, engine: e.clone(), blocks, metrics: metrics.clone() };
        src.read(chunk(&e, (0, 2))).await.unwrap();
        evict.store(true, Ordering::SeqCst);
        let err = src.read(chunk(&e, (0, 2))).await.map(|_| ()).unwrap_err();
        assert!(matches!(&err, ChunkError::Withdrawn(d) if d.contains("block id 2")), "{err}");
        assert_eq!(metrics.served_reused.get(), 1);
    }

    #[tokio::test]
    async fn a_request_that_starts_mid_chain_is_served_from_there() {
        // A striped fetch's later stripes ask for a chain from its middle: the first requested
        // block decides the tenant and where the served blocks start.
        let e = engine();
        let cat = catalog(&e);
        let tokens: Vec<u32> = (0..4 * 32).collect();
        let hashes = kvferry_layout::block_hashes(TENANT.as_bytes(), &tokens, 32);
        publish(&e, &hashes, 2); // ids 2, 3, 4, 5
        let whole = cat.open(&peer(), &request(&e, &hashes)).unwrap();
        let tail = cat.open(&peer(), &request(&e, &hashes[2..])).unwrap();
        assert_eq!((whole.blocks_held, tail.blocks_held), (4, 2));
        // The tail's blocks 0..2 are the chain's blocks 2..4 (ids 4, 5).
        let whole_bytes = whole.source.read(chunk(&e, (2, 4))).await.unwrap();
        let tail_bytes = tail.source.read(chunk(&e, (0, 2))).await.unwrap();
        assert_eq!((*whole_bytes).as_ref(), (*tail_bytes).as_ref());
        let direct = PoolChunks::new(e.layout.clone(), e.backend.clone(), vec![4, 5]);
        assert_eq!((*direct.read(chunk(&e, (0, 2))).await.unwrap()).as_ref(), (*tail_bytes).as_ref());
        // Another tenant asking for the same mid-chain blocks gets nothing.
        let mut other = request(&e, &hashes[2..]);
        other.tenant = "u".into();
        assert!(cat.open(&peer(), &other).is_err());
    }

    fn refusal(cat: &RegionCatalog, req: &FetchRequest) -> (RefusalCode, String) {
        match cat.open(&peer(), req) {
            Ok(s) => panic!("served {} blocks", s.blocks_held),
            Err(r) => r,
        }
    }

    #[test]
    fn a_request_is_refused_with_the_code_that_says_why() {
        let e = engine();
        let cat = catalog(&e);
        let hashes = [[1u8; 32], [2; 32]];
        publish(&e, &hashes, 0);
        // another layout
        let mut req = request(&e, &hashes);
        req.fingerprint = [0xee; 32];
        assert_eq!(refusal(&cat, &req).0, RefusalCode::FingerprintMismatch);
        // nothing asked
        assert_eq!(refusal(&cat, &request(&e, &[])).0, RefusalCode::BadRequest);
        // blocks nobody holds
        assert_eq!(refusal(&cat, &request(&e, &[[5; 32]])).0, RefusalCode::UnknownBlocks);
        // blocks of another tenant, in the pool and in the landing zone
        let mut req = request(&e, &hashes);
        req.tenant = "other".into();
        assert_eq!(refusal(&cat, &req).0, RefusalCode::TenantMismatch);
        let landed = [[6u8; 32]];
        let bytes = BlockShape::of(&e.layout).unwrap().block_bytes();
        let res = cat.landing.reserve(bytes).unwrap();
        cat.landing.commit(res, landed_blocks(TENANT, e.digest, &landed, vec![vec![1; bytes as usize]]));
        let mut req = request(&e, &landed);
        req.tenant = "other".into();
        assert_eq!(refusal(&cat, &req).0, RefusalCode::TenantMismatch);
        assert_eq!(cat.metrics.served_requests.get(), 0, "a refusal serves nothing");
        // the owner's own request is served: the longest held prefix, not the rest
        let served = cat.open(&peer(), &request(&e, &[hashes[0], hashes[1], [5; 32]])).unwrap();
        assert_eq!(served.blocks_held, 2);
    }

    #[test]
    fn a_tenant_off_the_peers_allow_list_is_refused_first_and_counted() {
        let e = engine();
        let mut cat = catalog(&e);
        let hashes = [[1u8; 32], [2; 32]];
        publish(&e, &hashes, 0);
        let peer_b = |tenants: Option<Vec<String>>| crate::config::Peer {
            region: "b".into(),
            addr: "127.0.0.1:1".parse().unwrap(),
            gbps: 1.0,
            rtt_ms: 1.0,
            max_egress_gbps: 0.0,
            tenants,
            transport: Default::default(),
        };
        cat.scopes = TenantScopes::new(&[peer_b(Some(vec!["someone-else".into()]))]);
        let (code, detail) = refusal(&cat, &request(&e, &hashes));
        assert_eq!(code, RefusalCode::NotAuthorized, "{detail}");
        // Refused before anything else is looked at: even a malformed request gets this answer.
        assert_eq!(refusal(&cat, &request(&e, &[])).0, RefusalCode::NotAuthorized);
        assert_eq!((cat.metrics.served_requests.get(), cat.metrics.tenant_denied_serve.get()), (0, 2));
        // A region that is not a peer is allowed nothing; an empty list allows no tenant.
        let stranger = RegionId::new("kvferry.test", "z").unwrap();
        assert!(matches!(cat.open(&stranger, &request(&e, &hashes)), Err((RefusalCode::NotAuthorized, _))));
        cat.scopes = TenantScopes::new(&[peer_b(Some(vec![]))]);
        assert_eq!(refusal(&cat, &request(&e, &hashes)).0, RefusalCode::NotAuthorized);
        // Named: served.
        cat.scopes = TenantScopes::new(&[peer_b(Some(vec![TENANT.into()]))]);
        assert_eq!(cat.open(&peer(), &request(&e, &hashes)).unwrap().blocks_held, 2);
    }

    #[tokio::test]
    async fn landed_blocks_are_served_back_byte_for_byte() {
        let e = engine();
        let cat = catalog(&e);
        let shape = BlockShape::of(&e.layout).unwrap();
        let n = shape.block_bytes() as usize;
        let hashes = [[3u8; 32], [4; 32]];
        let blocks: Vec<Vec<u8>> = (0..2u8).map(|b| (0..n).map(|i| (i as u8) ^ (b * 31)).collect()).collect();
        let res = cat.landing.reserve(2 * n as u64).unwrap();
        cat.landing.commit(res, landed_blocks(TENANT, e.digest, &hashes, blocks.clone()));
        let served = cat.open(&peer(), &request(&e, &hashes)).unwrap();
        assert_eq!((served.blocks_held, served.layers), (2, shape.layers()));
        // what a requester's landing sink assembles from the served chunk is the blocks again
        let spec = chunk(&e, (0, 2));
        let bytes = served.source.read(spec).await.unwrap();
        let sink = LandingSink::new(shape.clone(), cat.landing.clone(), 2);
        sink.land(spec, (*bytes).as_ref()).await.unwrap();
        assert_eq!(sink.landed_bytes.load(std::sync::atomic::Ordering::Relaxed), 2 * n as u64);
        assert_eq!(sink.into_blocks(), blocks);
    }

    #[tokio::test]
    async fn a_spare_s_earlier_bytes_never_show_through_a_committed_block() {
        let e = engine();
        let shape = BlockShape::of(&e.layout).unwrap();
        let n = shape.block_bytes() as usize;
        let zone = LandingZone::new(1 << 20);
        for _ in 0..3 {
            zone.give_back(vec![0xAB; n]); // an earlier tenant's blocks, now spares
        }
        // Layer 0 of blocks 0 and 1 lands; layer 1 of no block, and block 2 not at all.
        let sink = LandingSink::new(shape.clone(), zone.clone(), 3);
        let spec = ChunkSpec { id: 0, blocks: (0, 2), layers: (0, 1), len: shape.layer_bytes(0) * 2 };
        let payload: Vec<u8> = (0..spec.len).map(|i| (i % 100) as u8 + 1).collect();
        sink.land(spec, &payload).await.unwrap();
        // A chunk that fails part-way marks nothing: its layer stays unwritten.
        let bad = ChunkSpec { id: 1, blocks: (0, 2), layers: (1, 2), len: 3 };
        assert!(sink.land(bad, &[7; 3]).await.is_err());
        let blocks = sink.into_blocks();
        assert_eq!(blocks.len(), 3);
        for (b, buf) in blocks.iter().enumerate() {
            assert_eq!(buf.len(), n);
            assert!(!buf.contains(&0xAB), "block {b} shows a spare's bytes");
            let layer1 = &buf[shape.layer_range(1)];
            assert!(layer1.iter().all(|&x| x == 0), "block {b}: an unwritten layer is zeroed");
        }
        for (b, buf) in blocks.iter().enumerate().take(2) {
            assert!(buf[shape.layer_range(0)].iter().all(|&x| x != 0), "block {b}: layer 0 landed");
        }
        assert!(blocks[2].iter().all(|&x| x == 0), "a block no chunk covered is zeroed");
    }

    #[tokio::test]
    async fn a_chunk_that_does_not_fit_the_sink_is_a_typed_mismatch() {
        let e = engine();
        let shape = BlockShape::of(&e.layout).unwrap();
        let sink = LandingSink::new(shape, LandingZone::new(1 << 20), 2);
        let spec = chunk(&e, (0, 2));
        let err = sink.land(spec, &[0; 3]).await.unwrap_err();
        assert!(matches!(err, ChunkError::Mismatch { chunk: 0, .. }), "{err}");
        let past = ChunkSpec { blocks: (1, 3), ..spec };
        assert!(matches!(sink.land(past, &[]).await.unwrap_err(), ChunkError::Mismatch { .. }));
        assert_eq!(sink.landed_bytes.load(std::sync::atomic::Ordering::Relaxed), 0, "nothing landed");
    }

    #[test]
    fn egress_is_paced_on_one_clock_per_capped_peer() {
        let peer = |region: &str, cap: f64| crate::config::Peer {
            region: region.into(),
            addr: "127.0.0.1:1".parse().unwrap(),
            gbps: 1.0,
            rtt_ms: 50.0,
            max_egress_gbps: cap,
            tenants: None,
            transport: Default::default(),
        };
        let caps = EgressCaps::new(&[peer("b", 8.0), peer("c", 0.0)]);
        assert_eq!(caps.by_region.len(), 1, "a peer with cap 0 is not paced");
        let pacer = &caps.by_region["b"];
        // 8 Gbit/s is 1 GB/s: 1 GB books 1 s of the link, back to back (whatever the test's
        // own scheduling delays, as long as they are under a second)
        let t0 = pacer.book(1_000_000_000);
        let t1 = pacer.book(1_000_000_000);
        let t2 = pacer.book(0);
        assert_eq!(t1 - t0, Duration::from_secs(1));
        assert_eq!(t2 - t1, Duration::from_secs(1));
    }
}
