//! Block addressing: (block ids, layer range) → byte extents in canonical staging order,
//! coalesced and bounds-checked, plus the staging sizes that go with them.
//!
//! Staging order (the order bytes sit back to back in a staging buffer, identical in both
//! regions): for each layer in the range, for each of the layer's planes, for each block id in
//! the order given. Adjacent extents in that order coalesce when contiguous in one region.

use std::ops::Range;

use crate::{Extent, LayoutError, PoolLayout};

impl PoolLayout {
    /// The byte extents of `block_ids` over `layers`, in staging order, coalesced.
    ///
    /// Refuses block ids `>= num_blocks`, duplicate block ids, and a layer range that is
    /// reversed or reaches past the last layer; every extent is checked against
    /// [`PoolLayout::region_lens`]. An empty block list or layer range gives no extents.
    pub fn extents(&self, block_ids: &[u32], layers: Range<u32>) -> Result<Vec<Extent>, LayoutError> {
        let mut out: Vec<Extent> = Vec::new();
        self.for_each_extent(block_ids, layers, |e| match out.last_mut() {
            Some(last) if last.region == e.region && last.offset + last.len == e.offset => last.len += e.len,
            _ => out.push(e),
        })?;
        Ok(out)
    }

    /// Like [`PoolLayout::extents`] but one extent per (layer, plane, block), never coalesced.
    pub fn extents_uncoalesced(
        &self,
        block_ids: &[u32],
        layers: Range<u32>,
    ) -> Result<Vec<Extent>, LayoutError> {
        let mut out = Vec::new();
        self.for_each_extent(block_ids, layers, |e| out.push(e))?;
        Ok(out)
    }

    fn for_each_extent(
        &self,
        block_ids: &[u32],
        layers: Range<u32>,
        mut f: impl FnMut(Extent),
    ) -> Result<(), LayoutError> {
        self.check_layers(&layers)?;
        self.check_blocks(block_ids)?;
        for l in layers {
            for pl in &self.layers[l as usize] {
                let region_len = self.region_lens[pl.region as usize];
                for &b in block_ids {
                    // Cannot overflow or leave the region for a validated layout and b < num_blocks;
                    // checked anyway so that no extent ever escapes its region.
                    let offset = u64::from(b)
                        .checked_mul(pl.stride)
                        .and_then(|o| o.checked_add(pl.base))
                        .ok_or(LayoutError::Overflow { what: "extent offset" })?;
                    let e = Extent { region: pl.region, offset, len: pl.block_bytes };
                    if offset.checked_add(e.len).is_none_or(|end| end > region_len) {
                        return Err(LayoutError::ExtentOutOfRegion {
                            region: e.region,
                            offset,
                            len: e.len,
                            region_len,
                        });
                    }
                    f(e);
                }
            }
        }
        Ok(())
    }

    fn check_layers(&self, layers: &Range<u32>) -> Result<(), LayoutError> {
        if layers.start > layers.end || layers.end > self.spec.layers {
            return Err(LayoutError::LayerOutOfRange {
                start: layers.start,
                end: layers.end,
                layers: self.spec.layers,
            });
        }
        Ok(())
    }

    fn check_blocks(&self, block_ids: &[u32]) -> Result<(), LayoutError> {
        if let Some(&block) = block_ids.iter().find(|&&b| b >= self.num_blocks) {
            return Err(LayoutError::BlockOutOfRange { block, num_blocks: self.num_blocks });
        }
        let mut sorted = block_ids.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(LayoutError::DuplicateBlock { block: w[0] });
        }
        Ok(())
    }

    /// Bytes of one block in one layer (all its planes), `None` past the last layer.
    pub fn block_bytes_in_layer(&self, layer: u32) -> Option<u64> {
        self.layers.get(layer as usize).map(|planes| planes.iter().map(|p| p.block_bytes).sum())
    }

    /// Bytes of one block over `layers` (all planes).
    pub fn bytes_per_block(&self, layers: Range<u32>) -> Result<u64, LayoutError> {
        self.check_layers(&layers)?;
        layers.map(|l| self.block_bytes_in_layer(l).unwrap_or(0)).try_fold(0u64, |acc, b| {
            acc.checked_add(b).ok_or(LayoutError::Overflow { what: "bytes per block" })
        })
    }

    /// Staging bytes for `n_blocks` blocks over `layers`: the sum of the lengths of
    /// [`PoolLayout::extents`] for any `n_blocks` distinct valid block ids.
    pub fn staging_len(&self, n_blocks: u64, layers: Range<u32>) -> Result<u64, LayoutError> {
        self.bytes_per_block(layers)?
            .checked_mul(n_blocks)
            .ok_or(LayoutError::Overflow { what: "staging length" })
    }
}

#[cfg(test)]
mod tests {
    use crate::{AttnSpec, Dtype, LayoutError, PoolLayout, StrideOrder};

    fn small() -> PoolLayout {
        let spec = AttnSpec { layers: 3, kv_heads: 1, head_dim: 4, block_size: 2, dtype: Dtype::F16 };
        PoolLayout::vllm_flash_attn(spec, 8, StrideOrder::Nhd).unwrap() // 16-byte blocks
    }

    #[test]
    fn coalesces_contiguous_runs_only() {
        let l = small();
        let e = l.extents(&[1, 2, 3, 5], 0..1).unwrap();
        let spans: Vec<(u64, u64)> = e.iter().map(|e| (e.offset, e.len)).collect();
        // K: blocks 1..=3 contiguous, 5 alone; V likewise at base 128.
        assert_eq!(spans, vec![(16, 48), (80, 16), (144, 48), (208, 16)]);
        // Reversed order does not coalesce (staging order is the given order).
        assert_eq!(l.extents(&[3, 2], 0..1).unwrap().len(), 4);
        // All blocks of a layer: K plane and V plane are adjacent -> one extent.
        let all: Vec<u32> = (0..8).collect();
        assert_eq!(l.extents(&all, 1..2).unwrap(), vec![crate::Extent { region: 1, offset: 0, len: 256 }]);
    }

    #[test]
    fn refuses_out_of_range() {
        let l = small();
        assert_eq!(l.extents(&[8], 0..1), Err(LayoutError::BlockOutOfRange { block: 8, num_blocks: 8 }));
        assert_eq!(l.extents(&[0], 0..4), Err(LayoutError::LayerOutOfRange { start: 0, end: 4, layers: 3 }));
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 2..1;
        assert!(matches!(l.extents(&[0], reversed), Err(LayoutError::LayerOutOfRange { .. })));
        assert_eq!(l.extents(&[1, 4, 1], 0..1), Err(LayoutError::DuplicateBlock { block: 1 }));
        assert!(l.extents(&[], 0..3).unwrap().is_empty());
        assert!(l.extents(&[1], 2..2).unwrap().is_empty());
    }

    #[test]
    fn staging_len_matches_extents() {
        let l = small();
        assert_eq!(l.staging_len(3, 0..3).unwrap(), 3 * 3 * 2 * 16);
        let e = l.extents(&[0, 7, 4], 0..3).unwrap();
        assert_eq!(e.iter().map(|e| e.len).sum::<u64>(), l.staging_len(3, 0..3).unwrap());
        assert_eq!(l.block_bytes_in_layer(2), Some(32));
        assert_eq!(l.block_bytes_in_layer(3), None);
    }
}
