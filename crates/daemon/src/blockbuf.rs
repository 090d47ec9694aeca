//! Conversions between chunk payloads (the wire's staging order for blocks × layers) and
//! per-block buffers (one block, all layers, staging order), which is how the landing zone
//! keeps fetched blocks. Pure: no I/O.
//!
//! A chunk for blocks `[b0, b1)` and layers `[l0, l1)` is laid out `for layer, for plane, for
//! block`; a block buffer is `for layer, for plane`. Plane sizes per layer come from the
//! layout, so both directions are exact permutations of bytes.

use kvferry_layout::PoolLayout;
use kvferry_wire::ChunkSpec;

/// Per-layer plane sizes of one block, and each layer's offset inside a block buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockShape {
    planes: Vec<Vec<u64>>,
    layer_offsets: Vec<u64>,
    block_bytes: u64,
}

impl BlockShape {
    /// Derives the shape from a layout (block 0's extents, uncoalesced).
    pub fn of(layout: &PoolLayout) -> Result<Self, String> {
        let mut planes = Vec::new();
        let mut layer_offsets = Vec::new();
        let mut at = 0;
        for l in 0..layout.num_layers() {
            let ext = layout.extents_uncoalesced(&[0], l..l + 1).map_err(|e| e.to_string())?;
            layer_offsets.push(at);
            let lens: Vec<u64> = ext.iter().map(|e| e.len).collect();
            at += lens.iter().sum::<u64>();
            planes.push(lens);
        }
        Ok(Self { planes, layer_offsets, block_bytes: at })
    }

    /// Bytes of one block over all layers.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Number of layers.
    pub fn layers(&self) -> u32 {
        self.planes.len() as u32
    }

    /// Bytes of one block in layer `l`.
    pub fn layer_bytes(&self, l: u32) -> u64 {
        self.planes[l as usize].iter().sum()
    }

    /// Where layer `l` lies in a block buffer.
    pub fn layer_range(&self, l: u32) -> std::ops::Range<usize> {
        let at = self.layer_offsets[l as usize] as usize;
        at..at + self.layer_bytes(l) as usize
    }

    fn check(&self, spec: &ChunkSpec, blocks: usize, payload_len: usize) -> Result<(), String> {
        let ok_layers = spec.layers.0 < spec.layers.1 && spec.layers.1 as usize <= self.planes.len();
        let ok_blocks = spec.blocks.0 < spec.blocks.1 && spec.blocks.1 as usize <= blocks;
        if !ok_layers || !ok_blocks {
            return Err(format!("chunk {} names blocks or layers outside this transfer", spec.id));
        }
        let want: u64 = (spec.layers.0..spec.layers.1).map(|l| self.layer_bytes(l)).sum::<u64>()
            * u64::from(spec.blocks.1 - spec.blocks.0);
        if want != payload_len as u64 {
            return Err(format!(
                "chunk {} does not fit this layout ({} bytes, expected {want})",
                spec.id, payload_len
            ));
        }
        Ok(())
    }

    /// Scatters a chunk payload into the per-block buffers it covers.
    pub fn scatter(&self, spec: &ChunkSpec, payload: &[u8], blocks: &mut [Vec<u8>]) -> Result<(), String> {
        self.check(spec, blocks.len(), payload.len())?;
        let mut src = 0usize;
        for l in spec.layers.0..spec.layers.1 {
            let mut plane_off = self.layer_offsets[l as usize] as usize;
            for &p in &self.planes[l as usize] {
                let p = p as usize;
                for b in spec.blocks.0..spec.blocks.1 {
                    let buf = &mut blocks[b as usize];
                    if buf.len() != self.block_bytes as usize {
                        return Err(format!(
                            "block buffer {b} has {} bytes, expected {}",
                            buf.len(),
                            self.block_bytes
                        ));
                    }
                    buf[plane_off..plane_off + p].copy_from_slice(&payload[src..src + p]);
                    src += p;
                }
                plane_off += p;
            }
        }
        Ok(())
    }

    /// Gathers a chunk payload from per-block buffers.
    pub fn gather(&self, spec: &ChunkSpec, blocks: &[&[u8]]) -> Result<Vec<u8>, String> {
        if spec.layers.1 as usize > self.planes.len() || spec.layers.0 >= spec.layers.1 {
            return Err(format!("chunk {} names layers outside this layout", spec.id));
        }
        let len: u64 = (spec.layers.0..spec.layers.1).map(|l| self.layer_bytes(l)).sum::<u64>()
            * u64::from(spec.blocks.1.saturating_sub(spec.blocks.0));
        self.check(spec, blocks.len(), len as usize)?;
        let mut out = Vec::with_capacity(len as usize);
        for l in spec.layers.0..spec.layers.1 {
            let mut plane_off = self.layer_offsets[l as usize] as usize;
            for &p in &self.planes[l as usize] {
                let p = p as usize;
                for b in spec.blocks.0..spec.blocks.1 {
                    let buf = blocks[b as usize];
                    if buf.len() != self.block_bytes as usize {
                        return Err(format!("block buffer {b} has {} bytes", buf.len()));
                    }
                    out.extend_from_slice(&buf[plane_off..plane_off + p]);
                }
                plane_off += p;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_layout::{AttnSpec, Dtype, StrideOrder};
    use kvferry_wire::ChunkPlan;

    fn layouts() -> Vec<PoolLayout> {
        let spec = AttnSpec { layers: 5, kv_heads: 2, head_dim: 16, block_size: 16, dtype: Dtype::Bf16 };
        vec![
            PoolLayout::vllm_flash_attn(spec, 12, StrideOrder::Nhd).unwrap(),
            PoolLayout::vllm_flash_attn(spec, 12, StrideOrder::Hnd).unwrap(),
            PoolLayout::flashinfer(spec, 12, StrideOrder::Nhd).unwrap(),
        ]
    }

    #[test]
    fn scatter_then_gather_is_identity_for_every_chunk_plan() {
        for layout in layouts() {
            let shape = BlockShape::of(&layout).unwrap();
            let n = 9u32;
            let bpbl = shape.layer_bytes(0);
            for target in [1u64, bpbl, 3 * bpbl, 64 << 10, 1 << 30] {
                let plan = ChunkPlan::new(n, shape.layers(), bpbl, target).unwrap();
                // A payload per chunk with distinct bytes.
                let payloads: Vec<Vec<u8>> = plan
                    .chunks()
                    .map(|c| (0..c.len).map(|i| (i as u8) ^ (c.id as u8).wrapping_mul(31)).collect())
                    .collect();
                let mut blocks = vec![vec![0u8; shape.block_bytes() as usize]; n as usize];
                for (c, p) in plan.chunks().zip(&payloads) {
                    shape.scatter(&c, p, &mut blocks).unwrap();
                }
                let refs: Vec<&[u8]> = blocks.iter().map(|b| b.as_slice()).collect();
                for (c, p) in plan.chunks().zip(&payloads) {
                    assert_eq!(&shape.gather(&c, &refs).unwrap(), p, "chunk {}", c.id);
                }
            }
        }
    }

    #[test]
    fn a_block_buffer_is_the_layouts_staging_order_for_that_block() {
        let layout = &layouts()[0];
        let shape = BlockShape::of(layout).unwrap();
        assert_eq!(shape.block_bytes(), layout.staging_len(1, 0..5).unwrap());
    }

    #[test]
    fn misfit_chunks_are_refused() {
        let layout = &layouts()[0];
        let shape = BlockShape::of(layout).unwrap();
        let mut blocks = vec![vec![0u8; shape.block_bytes() as usize]; 2];
        let spec = ChunkSpec { id: 0, blocks: (0, 3), layers: (0, 1), len: 0 };
        assert!(shape.scatter(&spec, &[], &mut blocks).is_err());
        let spec = ChunkSpec { id: 0, blocks: (0, 1), layers: (0, 9), len: 0 };
        assert!(shape.scatter(&spec, &[], &mut blocks).is_err());
    }
}
