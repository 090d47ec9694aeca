//! The engine's KV memory in shared memory: [`pool_layout`] builds the canonical
//! `PoolLayout::vllm_flash_attn(.., Nhd)` for the core's [`KvLayout`] and
//! [`check_layout_matches`] proves they agree byte for byte; [`ShmKvMemory`] implements the
//! core's `KvMemory` over an `ShmPool` (a sealed memfd the daemon maps too), optionally
//! registered with the engine's own NIXL agent ([`ShmKvMemory::export_nixl`]) so the daemon
//! reaches it through NIXL instead of mapping the memfd.
//!
//! Concurrency contract with the daemon (the reason the `unsafe` below is sound): the daemon
//! writes into this memory only during an `Engine.Load` call, only into the blocks the engine
//! allocated for that call, and the engine's single worker thread is blocked in that call,
//! holding no slice into the mapping, until the daemon answers. Slices into the mapping exist
//! only inside the core's compute calls on the worker thread. The daemon may read published
//! blocks at any time; reads by another process do not invalidate this process's references.
//! The same contract holds whether the daemon maps the memfd or moves bytes with NIXL.

use kvferry_engine::{KvDtype, KvLayout, KvMemory};
use kvferry_engine_sdk::{AttnSpec, Dtype, PoolLayout, ShmPool, StrideOrder};
use kvferry_layout::PlaneKind;
use kvferry_pool_nixl::{MemKind, NixlPoolDescriptor, NixlPoolExport, NixlRegion};
use kvferry_proto::v1::PoolLayoutSpec;

use crate::error::NodeError;

/// The layout kind name the Engine API uses for this pool.
pub const LAYOUT_KIND: &str = "vllm_flash_attn_nhd";

/// The layout crate's dtype for a core dtype.
pub fn layout_dtype(d: KvDtype) -> Dtype {
    match d {
        KvDtype::F32 => Dtype::F32,
        KvDtype::Bf16 => Dtype::Bf16,
    }
}

fn u32_of(v: usize, what: &str) -> Result<u32, NodeError> {
    u32::try_from(v).map_err(|_| NodeError::Layout(format!("{what} {v} does not fit u32")))
}

/// The canonical layout (`PoolLayout::vllm_flash_attn`, NHD) of the core's pool.
pub fn pool_layout(kv: &KvLayout) -> Result<PoolLayout, NodeError> {
    let spec = AttnSpec {
        layers: u32_of(kv.layers, "layers")?,
        kv_heads: u32_of(kv.kv_heads, "kv_heads")?,
        head_dim: u32_of(kv.head_dim, "head_dim")?,
        block_size: u32_of(kv.block_size, "block_size")?,
        dtype: layout_dtype(kv.dtype),
    };
    PoolLayout::vllm_flash_attn(spec, kv.num_blocks, StrideOrder::Nhd)
        .map_err(|e| NodeError::Layout(e.to_string()))
}

/// `Ok` when `pool` puts every K and V block of every layer exactly where the core's `kv`
/// reads and writes it (same regions, lengths, bases and strides).
pub fn check_layout_matches(kv: &KvLayout, pool: &PoolLayout) -> Result<(), NodeError> {
    let bad = |what: String| Err(NodeError::Layout(what));
    let lens: Vec<u64> = kv.region_lens().iter().map(|&l| l as u64).collect();
    if pool.region_lens() != lens.as_slice() {
        return bad(format!("region lengths {:?} vs core {:?}", pool.region_lens(), lens));
    }
    if pool.num_blocks() != kv.num_blocks || pool.spec().block_size as usize != kv.block_size {
        return bad("block count or block size differs".into());
    }
    let bb = kv.block_bytes() as u64;
    for layer in 0..kv.layers {
        let planes = pool.planes(layer as u32).unwrap_or_default();
        let want = [(PlaneKind::K, kv.k_offset(0) as u64), (PlaneKind::V, kv.v_offset(0) as u64)];
        if planes.len() != 2 {
            return bad(format!("layer {layer} has {} planes, the core has K and V", planes.len()));
        }
        for (p, (kind, base)) in planes.iter().zip(want) {
            let stride_ok = kv.num_blocks < 2 || p.stride == kv.k_offset(1) as u64 - kv.k_offset(0) as u64;
            if p.kind != kind
                || p.region as usize != layer
                || p.base != base
                || p.block_bytes != bb
                || !stride_ok
            {
                return bad(format!(
                    "layer {layer} plane {:?}: {p:?} vs core base {base}, block {bb}",
                    p.kind
                ));
            }
        }
    }
    Ok(())
}

/// The Engine API's description of the pool.
pub fn layout_spec(kv: &KvLayout) -> PoolLayoutSpec {
    PoolLayoutSpec {
        kind: LAYOUT_KIND.to_owned(),
        layers: kv.layers as u32,
        kv_heads: kv.kv_heads as u32,
        head_dim: kv.head_dim as u32,
        block_size: kv.block_size as u32,
        num_blocks: kv.num_blocks,
        dtype: kv.dtype.name().to_owned(),
    }
}

/// The core's `KvMemory` over a shared-memory pool: region `i` (layer `i`) is
/// `ShmPool::region_ptr(i)` for `layout().region_lens()[i]` bytes. Owns the pool, so the
/// mapping outlives every slice handed out, and (with `--pool nixl`) the NIXL export of its
/// regions, so the registrations live exactly as long as the engine.
#[derive(Debug)]
pub struct ShmKvMemory {
    // Declared before `pool`: the NIXL registrations are released before the mapping goes.
    nixl: Option<NixlPoolExport>,
    pool: ShmPool,
    lens: Vec<usize>,
}

impl ShmKvMemory {
    /// Creates the shared pool for `kv` (zeroed memfd, its pages allocated), after checking
    /// that the canonical layout matches the core's byte for byte.
    pub fn create(kv: &KvLayout) -> Result<Self, NodeError> {
        let layout = pool_layout(kv)?;
        check_layout_matches(kv, &layout)?;
        let pool = ShmPool::create(layout).map_err(|e| NodeError::Pool(e.to_string()))?;
        // A serving engine's KV cache is allocated at start (vLLM zeroes its tensors), not
        // page by page during the first loads of fetched blocks, whose cost the daemon learns
        // as part of a fetch's (`kvferry_model::calibration::load`).
        pool.allocate_pages().map_err(|e| NodeError::Pool(e.to_string()))?;
        let lens = pool
            .layout()
            .region_lens()
            .iter()
            .map(|&l| usize::try_from(l).map_err(|_| NodeError::Pool(format!("region of {l} bytes"))))
            .collect::<Result<Vec<_>, _>>()?;
        for i in 0..lens.len() {
            if pool.region_ptr(i as u32).is_none() {
                return Err(NodeError::Pool(format!("region {i} missing from the shared table")));
            }
        }
        Ok(ShmKvMemory { nixl: None, pool, lens })
    }

    /// Registers every region (layer) of the pool, as DRAM, with a new NIXL agent named
    /// `agent_name`, keeps the export for the life of this memory, and returns the descriptor
    /// to send the daemon (region `i` of the descriptor is region `i` of the layout).
    pub fn export_nixl(&mut self, agent_name: &str) -> Result<NixlPoolDescriptor, NodeError> {
        if self.nixl.is_some() {
            return Err(NodeError::Pool("the pool is already exported through NIXL".into()));
        }
        fn nixl_err(what: &str, e: impl std::fmt::Display) -> NodeError {
            NodeError::Pool(format!("NIXL: {what}: {e}"))
        }
        let mut export = NixlPoolExport::new(agent_name).map_err(|e| nixl_err("create the agent", e))?;
        for (i, &len) in self.lens.iter().enumerate() {
            let region =
                NixlRegion { addr: self.ptr(i) as u64, len: len as u64, mem_type: MemKind::Dram, dev: 0 };
            // SAFETY: `[ptr(i), ptr(i) + lens[i])` is region `i` inside the live `MAP_SHARED`
            // mapping owned by `self.pool` (checked in `create`; the memfd is sealed against
            // shrinking), plain host memory. The export is stored in `self.nixl`, declared
            // before `self.pool`, so every registration is dropped before the mapping is
            // unmapped. The daemon's NIXL accesses follow the module's concurrency contract
            // (writes only into blocks of an in-flight Load, while the worker holds no slice),
            // exactly as its accesses through the shared mapping do.
            unsafe { export.register(region) }.map_err(|e| nixl_err(&format!("register region {i}"), e))?;
        }
        let desc = export.descriptor().map_err(|e| nixl_err("describe the pool", e))?;
        self.nixl = Some(export);
        Ok(desc)
    }

    /// The NIXL export of the pool, after [`ShmKvMemory::export_nixl`].
    pub fn nixl_export(&self) -> Option<&NixlPoolExport> {
        self.nixl.as_ref()
    }

    /// The shared pool (to share its fd with the daemon).
    pub fn shm(&self) -> &ShmPool {
        &self.pool
    }

    fn ptr(&self, i: usize) -> *mut u8 {
        // Checked in `create`: every region index below `lens.len()` has a pointer.
        self.pool.region_ptr(i as u32).expect("region checked at creation")
    }
}

impl KvMemory for ShmKvMemory {
    fn num_regions(&self) -> usize {
        self.lens.len()
    }

    fn region(&self, i: usize) -> &[u8] {
        let len = self.lens[i];
        let ptr = self.ptr(i);
        // SAFETY: `ptr` is the start of region `i` inside the live `MAP_SHARED` mapping owned
        // by `self.pool` (the region table lies inside the mapping, each region `lens[i]`
        // bytes; the memfd is sealed against shrinking, so no page can vanish); the slice
        // borrows `self`, so the mapping outlives it. u8 needs no alignment. Nothing in this
        // process writes the mapping except through `region_mut` (which needs `&mut self`), and
        // the daemon writes only blocks of an in-flight Load while the worker holds no slice
        // (module doc), so the bytes do not change while this shared slice lives.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    fn region_mut(&mut self, i: usize) -> &mut [u8] {
        let len = self.lens[i];
        let ptr = self.ptr(i);
        // SAFETY: as in `region`; in addition `&mut self` guarantees no other slice into the
        // mapping exists in this process while this one lives, and the daemon does not write
        // while the worker computes (module doc). Its concurrent reads of published blocks
        // (which the engine never rewrites) do not alias a write.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_engine::{Engine, ModelConfig, Plane};

    #[test]
    fn canonical_layout_matches_the_core_for_both_dtypes() {
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
            let mut cfg = ModelConfig::tiny(1);
            cfg.kv_dtype = dtype;
            let kv = KvLayout::for_model(&cfg, 12).unwrap();
            let pool = pool_layout(&kv).unwrap();
            check_layout_matches(&kv, &pool).unwrap();
            // And the extents the daemon would copy for block 5 are the core's K/V bytes.
            let ext = pool.extents(&[5], 1..2).unwrap();
            let starts: Vec<u64> = ext.iter().map(|e| e.offset).collect();
            assert_eq!(starts, vec![kv.k_offset(5) as u64, kv.v_offset(5) as u64]);
            let spec = layout_spec(&kv);
            assert_eq!((spec.kind.as_str(), spec.dtype.as_str()), (LAYOUT_KIND, dtype.name()));
        }
        // A foreign layout (FlashInfer) is refused.
        let kv = KvLayout::for_model(&ModelConfig::tiny(1), 12).unwrap();
        let spec = *pool_layout(&kv).unwrap().spec();
        let fi = PoolLayout::flashinfer(spec, 12, StrideOrder::Nhd).unwrap();
        assert!(matches!(check_layout_matches(&kv, &fi), Err(NodeError::Layout(_))));
    }

    #[test]
    fn engine_over_shm_writes_where_the_daemon_reads() {
        let cfg = ModelConfig::tiny(7);
        let kv = KvLayout::for_model(&cfg, 6).unwrap();
        let mem = ShmKvMemory::create(&kv).unwrap();
        let mut e = Engine::new(cfg.clone(), 6, mem).unwrap();
        let prompt: Vec<u32> = (0..20).map(|i| i * 11 % 256).collect();
        let mut s = e.start(&prompt).unwrap();
        let logits = e.prefill(&mut s).unwrap();
        let block = s.table().blocks()[0];
        // What the daemon would read through the shared mapping (staging order: per layer K
        // then V) equals the core's export.
        let payload = e.export_blocks(&s, 0..1).unwrap().remove(0);
        let mut via_shm = vec![0u8; payload.len()];
        e.pool().memory().shm().read_blocks(&[block], 0..cfg.layers as u32, &mut via_shm).unwrap();
        assert_eq!(via_shm, payload);
        assert_ne!(e.pool().block(0, Plane::K, block).unwrap(), &vec![0u8; kv.block_bytes()][..]);
        // And the same prompt on heap memory gives the same logits.
        let mut h = Engine::with_heap_pool(cfg, 6).unwrap();
        let mut hs = h.start(&prompt).unwrap();
        assert_eq!(h.prefill(&mut hs).unwrap(), logits);
    }
}
