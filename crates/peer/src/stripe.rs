//! Striping one fetch over several QUIC connections (pure): which contiguous ranges of the
//! requested blocks each stripe fetches. Each stripe is its own transfer on its own connection,
//! so quinn drives the stripes' packets in separate tasks (separate runtime worker threads);
//! one connection's packets are always processed by one task. No I/O here; the requester
//! driver (`crate::requester`) runs the stripes.

use std::ops::Range;

/// The most stripes a fetch may use (the `stripes` setting's upper bound).
pub const MAX_STRIPES: u32 = 8;

/// Chunks a stripe should carry at least, so that each stripe's pipeline fills (a stripe of one
/// or two chunks would only add a handshake and a round trip).
pub const MIN_CHUNKS_PER_STRIPE: u64 = 4;

/// Splits `blocks` blocks into at most `want` contiguous ranges of at least `min_blocks` each
/// (`min_blocks` 0 counts as 1), as even as integer division allows (earlier ranges take the
/// remainder, one block each). Fewer blocks than two minimum stripes: one range. No blocks: no
/// range. The ranges are in order, none is empty, and together they cover `0..blocks` once.
pub fn stripe_ranges(blocks: u32, want: u32, min_blocks: u32) -> Vec<Range<u32>> {
    if blocks == 0 {
        return Vec::new();
    }
    let k = want.clamp(1, MAX_STRIPES).min(blocks / min_blocks.max(1)).max(1);
    let (base, extra) = (blocks / k, blocks % k);
    let mut at = 0;
    (0..k)
        .map(|i| {
            let len = base + u32::from(i < extra);
            let r = at..at + len;
            at += len;
            r
        })
        .collect()
}

/// Blocks a stripe needs at least: [`MIN_CHUNKS_PER_STRIPE`] chunks of `chunk_target_bytes`,
/// in blocks of `block_bytes` (every layer of a block), rounded up; at least 1.
pub fn min_blocks_per_stripe(chunk_target_bytes: u32, block_bytes: u64) -> u32 {
    let want = MIN_CHUNKS_PER_STRIPE * u64::from(chunk_target_bytes.max(1));
    want.div_ceil(block_bytes.max(1)).clamp(1, u64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one stripe's range is meant, not its blocks
    fn examples() {
        assert_eq!(stripe_ranges(10, 2, 1), vec![0..5, 5..10]);
        assert_eq!(stripe_ranges(11, 3, 2), vec![0..4, 4..8, 8..11]);
        // Too few blocks for two stripes of the minimum: one.
        assert_eq!(stripe_ranges(7, 2, 4), vec![0..7]);
        assert_eq!(stripe_ranges(8, 4, 4), vec![0..4, 4..8]);
        assert_eq!(stripe_ranges(0, 4, 1), Vec::<Range<u32>>::new());
        assert_eq!(stripe_ranges(100, 50, 1).len(), MAX_STRIPES as usize);
        assert_eq!(stripe_ranges(5, 0, 0), vec![0..5]);
        // 4 chunks of 4 MiB in 5 MiB blocks: 4 blocks (16 MiB ≤ 20 MiB).
        assert_eq!(min_blocks_per_stripe(4 << 20, 5 << 20), 4);
        assert_eq!(min_blocks_per_stripe(4 << 20, 64 << 20), 1);
        assert_eq!(min_blocks_per_stripe(4 << 20, 0), 16 << 20);
    }

    proptest! {
        #[test]
        fn ranges_cover_every_block_once_and_respect_the_minimum(
            blocks in 0u32..5000, want in 0u32..20, min in 0u32..200,
        ) {
            let r = stripe_ranges(blocks, want, min);
            if blocks == 0 {
                prop_assert!(r.is_empty());
                return Ok(());
            }
            let k = r.len() as u32;
            prop_assert!(k >= 1 && k <= want.clamp(1, MAX_STRIPES));
            // Contiguous, in order, from 0 to `blocks`, none empty.
            prop_assert_eq!(r[0].start, 0);
            prop_assert_eq!(r[r.len() - 1].end, blocks);
            for w in r.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            prop_assert!(r.iter().all(|x| !x.is_empty()));
            // Never more stripes than the minimum allows; with several, each holds the minimum.
            if k > 1 {
                prop_assert!(k <= blocks / min.max(1));
                prop_assert!(r.iter().all(|x| x.len() as u32 >= min.max(1)));
            }
            // As even as it gets.
            let (lo, hi) = (r.iter().map(|x| x.len()).min().unwrap(), r.iter().map(|x| x.len()).max().unwrap());
            prop_assert!(hi - lo <= 1);
        }
    }
}
