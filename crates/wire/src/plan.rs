//! The chunk plan: how a transfer of `blocks × layers` is cut into layer-major chunks.
//!
//! Both sides derive the same plan from the manifest's numbers, so chunk ids mean the same
//! thing on both ends without sending the plan. Layer-major: chunk 0 carries the first layers,
//! so a receiver can start on layer 0 before the last layers arrive. When one layer of all
//! blocks fits the target size, whole layers are grouped; otherwise a layer is cut into runs of
//! blocks. A chunk's payload is the layout's staging order for its (blocks, layers): for layer,
//! for plane, for block.

/// One chunk: blocks `[blocks.0, blocks.1)` × layers `[layers.0, layers.1)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSpec {
    pub id: u32,
    pub blocks: (u32, u32),
    pub layers: (u32, u32),
    pub len: u64,
}

/// Smallest and largest chunk payloads a plan uses (the target is clamped into this range).
pub const MIN_CHUNK: u64 = 64 << 10;
pub const MAX_CHUNK: u64 = 64 << 20;

/// A deterministic chunk plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlan {
    pub blocks: u32,
    pub layers: u32,
    pub bytes_per_block_layer: u64,
    /// Layers per chunk (≥ 1) when whole layers are grouped; 1 when layers are cut.
    layers_per_chunk: u32,
    /// Blocks per chunk (≤ blocks).
    blocks_per_chunk: u32,
}

impl ChunkPlan {
    /// Plans `blocks × layers` with a target chunk size. `None` if any dimension is zero, or the
    /// total bytes or chunk count would overflow.
    pub fn new(blocks: u32, layers: u32, bytes_per_block_layer: u64, target: u64) -> Option<Self> {
        if blocks == 0 || layers == 0 || bytes_per_block_layer == 0 {
            return None;
        }
        let target = target.clamp(MIN_CHUNK, MAX_CHUNK);
        // Totals must fit the plan's integer types (`total_bytes` u64, `count` u32).
        u64::from(blocks).checked_mul(u64::from(layers))?.checked_mul(bytes_per_block_layer)?;
        let layer_bytes = u64::from(blocks).checked_mul(bytes_per_block_layer)?;
        let (layers_per_chunk, blocks_per_chunk) = if layer_bytes <= target {
            ((target / layer_bytes).clamp(1, u64::from(layers)) as u32, blocks)
        } else {
            (1, (target / bytes_per_block_layer).clamp(1, u64::from(blocks)) as u32)
        };
        let count =
            u64::from(layers.div_ceil(layers_per_chunk)) * u64::from(blocks.div_ceil(blocks_per_chunk));
        if count > u64::from(u32::MAX) {
            return None;
        }
        Some(Self { blocks, layers, bytes_per_block_layer, layers_per_chunk, blocks_per_chunk })
    }

    fn block_groups(&self) -> u32 {
        self.blocks.div_ceil(self.blocks_per_chunk)
    }

    /// Number of chunks.
    pub fn count(&self) -> u32 {
        self.layers.div_ceil(self.layers_per_chunk) * self.block_groups()
    }

    /// Total payload bytes.
    pub fn total_bytes(&self) -> u64 {
        u64::from(self.blocks) * u64::from(self.layers) * self.bytes_per_block_layer
    }

    /// Chunk `id`, or `None` past the end. Ids run layer group by layer group.
    pub fn chunk(&self, id: u32) -> Option<ChunkSpec> {
        if id >= self.count() {
            return None;
        }
        let groups = self.block_groups();
        let (lg, bg) = (id / groups, id % groups);
        let l0 = lg * self.layers_per_chunk;
        let l1 = l0.saturating_add(self.layers_per_chunk).min(self.layers);
        let b0 = bg * self.blocks_per_chunk;
        // Saturating: the last group's nominal end can pass u32::MAX when blocks is near it.
        let b1 = b0.saturating_add(self.blocks_per_chunk).min(self.blocks);
        let len = u64::from(b1 - b0) * u64::from(l1 - l0) * self.bytes_per_block_layer;
        Some(ChunkSpec { id, blocks: (b0, b1), layers: (l0, l1), len })
    }

    /// All chunks in id order.
    pub fn chunks(&self) -> impl Iterator<Item = ChunkSpec> + '_ {
        (0..self.count()).filter_map(|i| self.chunk(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The chunks tile blocks × layers exactly once, in layer-major order, within size bounds.
        #[test]
        fn chunks_tile_the_transfer(blocks in 1u32..600, layers in 1u32..130, bpbl in 1u64..(4 << 20), target in 0u64..(128 << 20)) {
            let plan = ChunkPlan::new(blocks, layers, bpbl, target).unwrap();
            let mut covered = vec![0u8; (blocks * layers) as usize];
            let mut total = 0;
            let mut last_layer = 0;
            for c in plan.chunks() {
                prop_assert!(c.layers.0 >= last_layer);
                last_layer = c.layers.0;
                for l in c.layers.0..c.layers.1 {
                    for b in c.blocks.0..c.blocks.1 {
                        covered[(l * blocks + b) as usize] += 1;
                    }
                }
                total += c.len;
                // A chunk exceeds the clamped target only when one block-layer alone does.
                let t = target.clamp(MIN_CHUNK, MAX_CHUNK);
                prop_assert!(c.len <= t.max(bpbl));
            }
            prop_assert!(covered.iter().all(|&n| n == 1));
            prop_assert_eq!(total, plan.total_bytes());
            prop_assert!(plan.chunk(plan.count()).is_none());
        }
    }

    #[test]
    fn groups_small_layers_and_cuts_big_ones() {
        // 10 blocks × 64 KiB = 640 KiB per layer; 4 MiB target → 6 layers per chunk.
        let p = ChunkPlan::new(10, 80, 64 << 10, 4 << 20).unwrap();
        assert_eq!(p.chunk(0).unwrap().layers, (0, 6));
        assert_eq!(p.count(), 14);
        // 1000 blocks × 64 KiB per layer; 4 MiB target → 64 blocks per chunk.
        let p = ChunkPlan::new(1000, 2, 64 << 10, 4 << 20).unwrap();
        assert_eq!(p.chunk(0).unwrap().blocks, (0, 64));
        assert_eq!(p.chunk(15).unwrap().blocks, (960, 1000));
        assert_eq!(p.chunk(16).unwrap().layers, (1, 2));
        assert!(ChunkPlan::new(0, 1, 1, 1).is_none());
        // Totals that overflow are refused, not wrapped (found by fuzz_owner::chunk_plan_is_total).
        assert!(ChunkPlan::new(u32::MAX, u32::MAX, 1 << 30, 0).is_none());
        assert!(ChunkPlan::new(u32::MAX, u32::MAX, MAX_CHUNK + 1, 0).is_none());
        // The last block group's nominal end is 2^32 (found by fuzz_owner in CI, seed
        // 146203412413880193896276673902619886935): it must clamp, not overflow.
        let p = ChunkPlan::new(4_244_635_648, 16_777_216, 1, 64 << 20).unwrap();
        let last = p.chunk(p.count() - 1).unwrap();
        assert_eq!(last.blocks, (63 * (64 << 20), 4_244_635_648));
    }
}
