//! Block bookkeeping: the [`BlockAllocator`] (a free list over the pool's block ids) and the
//! per-request [`BlockTable`] (logical block index → physical block id, as vLLM's block
//! tables). Owns ids only; never touches pool bytes.

use crate::error::OutOfBlocks;
use crate::kv::BLOCK_SIZE;

/// Free list of physical block ids `0..num_blocks`. Hands out the lowest free id first, so a
/// fresh allocator is deterministic.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    /// Free ids, highest first (pop yields the lowest).
    free: Vec<u32>,
    num_blocks: u32,
}

impl BlockAllocator {
    /// All `num_blocks` blocks free.
    pub fn new(num_blocks: u32) -> Self {
        BlockAllocator { free: (0..num_blocks).rev().collect(), num_blocks }
    }

    /// Blocks managed.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Blocks free now.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// `n` blocks, or none at all if fewer are free.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, OutOfBlocks> {
        if n > self.free.len() {
            return Err(OutOfBlocks { wanted: n, free: self.free.len() });
        }
        let at = self.free.len() - n;
        let mut got = self.free.split_off(at);
        got.reverse();
        Ok(got)
    }

    /// Returns blocks to the free list.
    ///
    /// # Panics
    /// On an id out of range (a bookkeeping bug, not an input error). In debug builds also on
    /// a double free.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            assert!(b < self.num_blocks, "release of block {b} outside 0..{}", self.num_blocks);
            debug_assert!(!self.free.contains(&b), "double free of block {b}");
            self.free.push(b);
        }
        // Keep "lowest id first" after arbitrary release orders.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }
}

/// Logical → physical block ids of one request. Position `p` lives in block
/// `blocks[p / BLOCK_SIZE]`, slot `p % BLOCK_SIZE`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    /// A table over the given physical ids.
    pub fn new(blocks: Vec<u32>) -> Self {
        BlockTable { blocks }
    }

    /// Physical ids in logical order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Token capacity (`blocks * BLOCK_SIZE`).
    pub fn capacity(&self) -> usize {
        self.blocks.len() * BLOCK_SIZE
    }

    /// `(physical block, slot)` of token position `pos`, if the table covers it.
    pub fn locate(&self, pos: usize) -> Option<(u32, usize)> {
        self.blocks.get(pos / BLOCK_SIZE).map(|&b| (b, pos % BLOCK_SIZE))
    }

    /// Appends physical ids.
    pub fn extend(&mut self, more: &[u32]) {
        self.blocks.extend_from_slice(more);
    }

    /// Removes and returns all ids.
    pub fn take(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.blocks)
    }
}

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_SIZE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_is_all_or_nothing_and_lowest_first() {
        let mut a = BlockAllocator::new(5);
        assert_eq!(a.allocate(2).unwrap(), vec![0, 1]);
        assert_eq!(a.allocate(4), Err(OutOfBlocks { wanted: 4, free: 3 }));
        assert_eq!(a.free_count(), 3);
        a.release(&[1]);
        assert_eq!(a.allocate(2).unwrap(), vec![1, 2]);
        assert_eq!(a.allocate(0).unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn table_locates_positions() {
        let t = BlockTable::new(vec![7, 3]);
        assert_eq!(t.locate(0), Some((7, 0)));
        assert_eq!(t.locate(17), Some((3, 1)));
        assert_eq!(t.locate(32), None);
        assert_eq!(t.capacity(), 32);
        assert_eq!(blocks_for(0), 0);
        assert_eq!(blocks_for(16), 1);
        assert_eq!(blocks_for(17), 2);
    }
}
