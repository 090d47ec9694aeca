//! The paged KV pool: [`KvLayout`] (vLLM FlashAttention NHD geometry and byte offsets),
//! [`KvMemory`] (whatever memory backs the pool: owned vectors here, a shm memfd mapping or
//! NIXL-registered DRAM supplied by a backend crate), and [`KvPool`], which encodes/decodes
//! token K/V rows (f32 or bf16, little-endian) at those offsets. It does not allocate blocks
//! (see `blocks`) and never interprets what a block means.
//!
//! Per layer `l`, one region shaped `(2, num_blocks, block_size, kv_heads, head_dim)`:
//! K block `b` at `b * block_bytes`, V block `b` at `(num_blocks + b) * block_bytes`; inside a
//! block, token slot `s`, KV head `h`, dim `d` at element `(s * kv_heads + h) * head_dim + d`.

use sha2::{Digest, Sha256};

use crate::config::{KvDtype, ModelConfig};
use crate::error::PoolError;

/// Tokens per block (vLLM's default and the layout crate's unit of transfer).
pub const BLOCK_SIZE: usize = 16;

/// Geometry of a vLLM FlashAttention (NHD) pool: everything a layout crate needs to rebuild
/// `PoolLayout::vllm_flash_attn(AttnSpec { layers, kv_heads, head_dim, block_size, dtype },
/// num_blocks, StrideOrder::Nhd)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Layers (one region each).
    pub layers: usize,
    /// Blocks per plane.
    pub num_blocks: u32,
    /// Tokens per block (always [`BLOCK_SIZE`] here).
    pub block_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvLayout {
    /// The layout of `cfg`'s KV cache with `num_blocks` blocks.
    pub fn for_model(cfg: &ModelConfig, num_blocks: u32) -> Result<Self, PoolError> {
        let l = KvLayout {
            layers: cfg.layers,
            num_blocks,
            block_size: BLOCK_SIZE,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            dtype: cfg.kv_dtype,
        };
        if num_blocks == 0 {
            return Err(PoolError::Layout("zero blocks"));
        }
        l.region_len_checked().ok_or(PoolError::Layout("region length overflows"))?;
        Ok(l)
    }

    /// Layout kind name (vLLM FlashAttention, NHD stride order).
    pub fn kind_name(&self) -> &'static str {
        "vllm-flash-attn-nhd"
    }

    /// Elements in one token row of one plane, `kv_heads * head_dim`.
    pub fn row_elems(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of one token row of one plane.
    pub fn row_bytes(&self) -> usize {
        self.row_elems() * self.dtype.size()
    }

    /// Bytes of one block of one plane: `block_size * kv_heads * head_dim * elem`.
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.row_bytes()
    }

    /// Bytes of one plane (K or V) of one layer.
    pub fn plane_bytes(&self) -> usize {
        self.num_blocks as usize * self.block_bytes()
    }

    fn region_len_checked(&self) -> Option<usize> {
        self.block_size
            .checked_mul(self.kv_heads)?
            .checked_mul(self.head_dim)?
            .checked_mul(self.dtype.size())?
            .checked_mul(self.num_blocks as usize)?
            .checked_mul(2)
    }

    /// Bytes of one layer's region (K plane then V plane).
    pub fn region_len(&self) -> usize {
        2 * self.plane_bytes()
    }

    /// Region lengths, one per layer.
    pub fn region_lens(&self) -> Vec<usize> {
        vec![self.region_len(); self.layers]
    }

    /// Offset of K block `b` within its layer's region.
    pub fn k_offset(&self, block: u32) -> usize {
        block as usize * self.block_bytes()
    }

    /// Offset of V block `b` within its layer's region.
    pub fn v_offset(&self, block: u32) -> usize {
        self.plane_bytes() + block as usize * self.block_bytes()
    }

    /// Bytes of one block across all layers, K and V: the payload of [`KvPool::export_block`].
    pub fn payload_bytes(&self) -> usize {
        self.layers * 2 * self.block_bytes()
    }

    /// Stable SHA-256 of what makes a block's bytes meaningful to another pool (kind, dtype,
    /// layers, KV heads, head dim, block size; not `num_blocks`).
    pub fn fingerprint(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"kvferry-engine/layout/v1");
        h.update(self.kind_name().as_bytes());
        h.update([0]);
        h.update(self.dtype.name().as_bytes());
        h.update([0]);
        for v in [self.layers, self.kv_heads, self.head_dim, self.block_size] {
            h.update((v as u64).to_le_bytes());
        }
        h.finalize().into()
    }
}

/// Memory backing a pool: one byte region per layer. Implement it over a shm mapping or
/// NIXL-registered DRAM to run the engine on externally provided memory.
pub trait KvMemory {
    /// Number of regions.
    fn num_regions(&self) -> usize;
    /// Region `i` (read).
    fn region(&self, i: usize) -> &[u8];
    /// Region `i` (write).
    fn region_mut(&mut self, i: usize) -> &mut [u8];
}

/// Owned, zero-initialised heap memory: one `Vec<u8>` per layer.
#[derive(Debug, Clone)]
pub struct VecMemory(pub Vec<Vec<u8>>);

impl VecMemory {
    /// Zeroed regions of the given lengths.
    pub fn zeroed(lens: &[usize]) -> Self {
        VecMemory(lens.iter().map(|&n| vec![0u8; n]).collect())
    }
}

impl KvMemory for VecMemory {
    fn num_regions(&self) -> usize {
        self.0.len()
    }
    fn region(&self, i: usize) -> &[u8] {
        &self.0[i]
    }
    fn region_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.0[i]
    }
}

/// Borrowed regions (e.g. slices of a mapping someone else owns).
#[derive(Debug)]
pub struct SliceMemory<'a>(pub Vec<&'a mut [u8]>);

impl KvMemory for SliceMemory<'_> {
    fn num_regions(&self) -> usize {
        self.0.len()
    }
    fn region(&self, i: usize) -> &[u8] {
        self.0[i]
    }
    fn region_mut(&mut self, i: usize) -> &mut [u8] {
        self.0[i]
    }
}

/// Rounds `x` to bfloat16 (nearest, ties to even; NaN stays a quiet NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let bias = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(bias) >> 16) as u16
}

/// Widens a bfloat16 to f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// K plane or V plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Plane {
    /// Keys.
    K,
    /// Values.
    V,
}

/// A KV pool: a layout over memory. Reads and writes token rows; exports/imports whole
/// blocks byte-for-byte.
#[derive(Debug)]
pub struct KvPool<M: KvMemory> {
    layout: KvLayout,
    mem: M,
}

impl<M: KvMemory> KvPool<M> {
    /// A pool of `layout` over `mem`; `mem` must have one region per layer, each at least
    /// `layout.region_len()` bytes.
    pub fn new(layout: KvLayout, mem: M) -> Result<Self, PoolError> {
        if mem.num_regions() != layout.layers {
            return Err(PoolError::RegionCount { want: layout.layers, got: mem.num_regions() });
        }
        for l in 0..layout.layers {
            let got = mem.region(l).len();
            if got < layout.region_len() {
                return Err(PoolError::RegionTooSmall { layer: l, want: layout.region_len(), got });
            }
        }
        Ok(KvPool { layout, mem })
    }

    /// The pool's layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The backing memory.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// The backing memory, mutably (e.g. for a transfer engine to land blocks).
    pub fn memory_mut(&mut self) -> &mut M {
        &mut self.mem
    }

    /// Consumes the pool, returning its memory.
    pub fn into_memory(self) -> M {
        self.mem
    }

    fn check_block(&self, block: u32) -> Result<(), PoolError> {
        if block >= self.layout.num_blocks {
            return Err(PoolError::BlockOutOfRange { block, num_blocks: self.layout.num_blocks });
        }
        Ok(())
    }

    fn plane_offset(&self, plane: Plane, block: u32) -> usize {
        match plane {
            Plane::K => self.layout.k_offset(block),
            Plane::V => self.layout.v_offset(block),
        }
    }

    /// The bytes of block `block` of `plane` in `layer`.
    pub fn block(&self, layer: usize, plane: Plane, block: u32) -> Result<&[u8], PoolError> {
        self.check_block(block)?;
        let off = self.plane_offset(plane, block);
        Ok(&self.mem.region(layer)[off..off + self.layout.block_bytes()])
    }

    /// The bytes of block `block` of `plane` in `layer`, mutably.
    pub fn block_mut(&mut self, layer: usize, plane: Plane, block: u32) -> Result<&mut [u8], PoolError> {
        self.check_block(block)?;
        let off = self.plane_offset(plane, block);
        let bb = self.layout.block_bytes();
        Ok(&mut self.mem.region_mut(layer)[off..off + bb])
    }

    /// Block `block` across all layers as one payload: for each layer, K bytes then V bytes.
    pub fn export_block(&self, block: u32) -> Result<Vec<u8>, PoolError> {
        let mut out = Vec::with_capacity(self.layout.payload_bytes());
        for l in 0..self.layout.layers {
            out.extend_from_slice(self.block(l, Plane::K, block)?);
            out.extend_from_slice(self.block(l, Plane::V, block)?);
        }
        Ok(out)
    }

    /// Writes a payload produced by [`KvPool::export_block`] into block `block`.
    pub fn import_block(&mut self, block: u32, payload: &[u8]) -> Result<(), PoolError> {
        let want = self.layout.payload_bytes();
        if payload.len() != want {
            return Err(PoolError::PayloadLen { want, got: payload.len() });
        }
        let bb = self.layout.block_bytes();
        for (l, chunk) in payload.chunks_exact(2 * bb).enumerate() {
            self.block_mut(l, Plane::K, block)?.copy_from_slice(&chunk[..bb]);
            self.block_mut(l, Plane::V, block)?.copy_from_slice(&chunk[bb..]);
        }
        Ok(())
    }

    /// Zeroes block `block` in every layer and plane.
    pub fn zero_block(&mut self, block: u32) -> Result<(), PoolError> {
        for l in 0..self.layout.layers {
            self.block_mut(l, Plane::K, block)?.fill(0);
            self.block_mut(l, Plane::V, block)?.fill(0);
        }
        Ok(())
    }

    fn row_offset(&self, plane: Plane, block: u32, slot: usize) -> usize {
        self.plane_offset(plane, block) + slot * self.layout.row_bytes()
    }

    /// Stores one token's row (`kv_heads * head_dim` values) at `(block, slot)` of `plane`,
    /// rounding to the pool's dtype.
    pub(crate) fn write_row(&mut self, layer: usize, plane: Plane, block: u32, slot: usize, row: &[f32]) {
        let off = self.row_offset(plane, block, slot);
        let dtype = self.layout.dtype;
        let dst = &mut self.mem.region_mut(layer)[off..off + self.layout.row_bytes()];
        match dtype {
            KvDtype::F32 => {
                for (d, x) in dst.chunks_exact_mut(4).zip(row) {
                    d.copy_from_slice(&x.to_le_bytes());
                }
            }
            KvDtype::Bf16 => {
                for (d, x) in dst.chunks_exact_mut(2).zip(row) {
                    d.copy_from_slice(&f32_to_bf16(*x).to_le_bytes());
                }
            }
        }
    }

    /// Decodes one token's row at `(block, slot)` of `plane` into `out` (widening bf16).
    pub(crate) fn read_row(&self, layer: usize, plane: Plane, block: u32, slot: usize, out: &mut [f32]) {
        let off = self.row_offset(plane, block, slot);
        let src = &self.mem.region(layer)[off..off + self.layout.row_bytes()];
        match self.layout.dtype {
            KvDtype::F32 => {
                for (o, s) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                }
            }
            KvDtype::Bf16 => {
                for (o, s) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        // Halfway above an odd mantissa rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(f32_to_bf16(-2.5)), -2.5);
    }

    #[test]
    fn offsets_follow_vllm_flash_attn() {
        let cfg = ModelConfig::tiny(1); // 2 layers, kv_heads 2, head_dim 16
        let l = KvLayout::for_model(&cfg, 10).unwrap();
        assert_eq!(l.block_bytes(), 16 * 2 * 16 * 4);
        assert_eq!(l.region_len(), 2 * 10 * l.block_bytes());
        assert_eq!(l.k_offset(3), 3 * l.block_bytes());
        assert_eq!(l.v_offset(3), 13 * l.block_bytes());
        assert_eq!(l.region_lens(), vec![l.region_len(); 2]);
        let mut pool = KvPool::new(l, VecMemory::zeroed(&l.region_lens())).unwrap();
        let row: Vec<f32> = (0..32).map(|i| i as f32).collect();
        pool.write_row(1, Plane::V, 3, 5, &row);
        let region = pool.memory().region(1);
        let at = l.v_offset(3) + (5 * 2 + 1) * 16 * 4 + 2 * 4; // slot 5, head 1, dim 2
        assert_eq!(&region[at..at + 4], &18.0f32.to_le_bytes());
        let mut back = vec![0.0; 32];
        pool.read_row(1, Plane::V, 3, 5, &mut back);
        assert_eq!(back, row);
    }

    #[test]
    fn memory_is_checked_and_payload_roundtrips() {
        let cfg = ModelConfig::tiny(1);
        let l = KvLayout::for_model(&cfg, 4).unwrap();
        assert!(matches!(
            KvPool::new(l, VecMemory::zeroed(&[l.region_len()])),
            Err(PoolError::RegionCount { want: 2, got: 1 })
        ));
        assert!(matches!(
            KvPool::new(l, VecMemory::zeroed(&[l.region_len(), 8])),
            Err(PoolError::RegionTooSmall { layer: 1, .. })
        ));
        let mut backing = [vec![0u8; l.region_len()], vec![0u8; l.region_len()]];
        let [a, b] = &mut backing;
        let mut pool = KvPool::new(l, SliceMemory(vec![a.as_mut_slice(), b.as_mut_slice()])).unwrap();
        pool.block_mut(1, Plane::K, 2).unwrap().fill(7);
        let payload = pool.export_block(2).unwrap();
        assert_eq!(payload.len(), l.payload_bytes());
        pool.import_block(0, &payload).unwrap();
        assert_eq!(pool.export_block(0).unwrap(), payload);
        assert!(matches!(pool.block(1, Plane::K, 4), Err(PoolError::BlockOutOfRange { .. })));
        assert!(matches!(pool.import_block(0, &payload[1..]), Err(PoolError::PayloadLen { .. })));
    }
}
