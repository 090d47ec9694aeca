//! Copy planning (pure, no driver): coalescing a validated batch of extents into the fewest
//! contiguous copies, the copy triples the kernel reads, and the kernel's launch geometry.
//!
//! Compiled with and without the `cuda` feature so that it is unit tested on machines with no
//! GPU. The slicing arithmetic in [`cta_slice`] mirrors `native/kv_gather.cu` line for line.

use kvferry_pool::Extent;

/// One contiguous copy between a pool region and staging (staging holds a batch's extents
/// back to back, so consecutive extents that are also adjacent in their region merge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedCopy {
    /// Pool region index.
    pub region: u32,
    /// Byte offset in the region.
    pub region_offset: u64,
    /// Byte offset in staging.
    pub staging_offset: u64,
    /// Bytes to copy (> 0).
    pub len: u64,
}

/// Merges adjacent extents into copies. Call only on a batch that `check_batch` accepted
/// (offsets do not overflow); zero-length extents are skipped.
pub fn coalesce(extents: &[Extent]) -> Vec<PlannedCopy> {
    let mut out: Vec<PlannedCopy> = Vec::with_capacity(extents.len());
    let mut staging_offset = 0u64;
    for e in extents.iter().filter(|e| e.len > 0) {
        match out.last_mut() {
            Some(last) if last.region == e.region && last.region_offset + last.len == e.offset => {
                last.len += e.len;
            }
            _ => out.push(PlannedCopy {
                region: e.region,
                region_offset: e.offset,
                staging_offset,
                len: e.len,
            }),
        }
        staging_offset += e.len;
    }
    out
}

/// Direction of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Pool → staging (`MemoryBackend::read`).
    Gather,
    /// Staging → pool (`MemoryBackend::write`).
    Scatter,
}

/// The kernel's copy list: `(src, dst, len)` per copy, addresses absolute in the unified
/// address space. `region_bases[r]` is the device address of region `r`; `staging_base` is
/// the device address of the mapped staging buffer.
pub fn triples(copies: &[PlannedCopy], region_bases: &[u64], staging_base: u64, dir: Direction) -> Vec<u64> {
    let mut out = Vec::with_capacity(copies.len() * 3);
    for c in copies {
        let pool = region_bases[c.region as usize] + c.region_offset;
        let staging = staging_base + c.staging_offset;
        let (src, dst) = match dir {
            Direction::Gather => (pool, staging),
            Direction::Scatter => (staging, pool),
        };
        out.extend_from_slice(&[src, dst, c.len]);
    }
    out
}

/// Threads per CTA of the copy kernel.
pub const BLOCK_THREADS: u32 = 256;
/// Bytes one CTA should move at least before another CTA is given to the same copy.
pub const BYTES_PER_CTA: u64 = 64 << 10;
/// Upper bound on CTAs per copy (grid x).
pub const MAX_CTAS_PER_COPY: u64 = 1024;
/// Upper bound on grid y (a hardware limit); larger batches loop in the kernel.
pub const MAX_GRID_Y: u64 = 65_535;

/// Launch geometry of one kernel launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// CTAs per copy.
    pub grid_x: u32,
    /// Copies handled concurrently (the kernel strides over the rest).
    pub grid_y: u32,
    /// Threads per CTA.
    pub block: u32,
}

/// Geometry for a copy list: enough CTAs per copy for the longest copy to get one CTA per
/// [`BYTES_PER_CTA`]. `None` for an empty list.
pub fn geometry(copies: &[PlannedCopy]) -> Option<Geometry> {
    let longest = copies.iter().map(|c| c.len).max()?;
    let grid_x = longest.div_ceil(BYTES_PER_CTA).clamp(1, MAX_CTAS_PER_COPY);
    let grid_y = (copies.len() as u64).clamp(1, MAX_GRID_Y);
    Some(Geometry {
        grid_x: u32::try_from(grid_x).expect("clamped to 1024"),
        grid_y: u32::try_from(grid_y).expect("clamped to 65535"),
        block: BLOCK_THREADS,
    })
}

/// The byte range `[begin, end)` of copy length `len` that CTA `x` of `grid_x` copies, as the
/// kernel computes it (`None`: that CTA has nothing to do). Slices are multiples of 16 bytes
/// (except the last), so every slice keeps the copy's own alignment.
pub fn cta_slice(len: u64, grid_x: u64, x: u64) -> Option<(u64, u64)> {
    let per_cta = (len.div_ceil(grid_x) + 15) & !15;
    let begin = per_cta * x;
    (begin < len).then(|| (begin, (begin + per_cta).min(len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(region: u32, offset: u64, len: u64) -> Extent {
        Extent { region, offset, len }
    }

    #[test]
    fn adjacent_extents_merge_in_order() {
        let e = [ext(0, 0, 10), ext(0, 10, 5), ext(1, 15, 1), ext(0, 15, 2), ext(0, 100, 4), ext(0, 104, 4)];
        let c = coalesce(&e);
        assert_eq!(
            c,
            vec![
                PlannedCopy { region: 0, region_offset: 0, staging_offset: 0, len: 15 },
                PlannedCopy { region: 1, region_offset: 15, staging_offset: 15, len: 1 },
                PlannedCopy { region: 0, region_offset: 15, staging_offset: 16, len: 2 },
                PlannedCopy { region: 0, region_offset: 100, staging_offset: 18, len: 8 },
            ]
        );
    }

    #[test]
    fn backwards_or_repeated_extents_do_not_merge() {
        let e = [ext(0, 10, 5), ext(0, 0, 10), ext(0, 0, 10)];
        assert_eq!(coalesce(&e).len(), 3);
        assert!(coalesce(&[]).is_empty());
        assert!(coalesce(&[ext(0, 5, 0)]).is_empty());
    }

    #[test]
    fn triples_swap_roles_by_direction() {
        let c = [PlannedCopy { region: 1, region_offset: 8, staging_offset: 32, len: 4 }];
        let bases = [0x1000, 0x9000];
        assert_eq!(triples(&c, &bases, 0x50000, Direction::Gather), vec![0x9008, 0x50020, 4]);
        assert_eq!(triples(&c, &bases, 0x50000, Direction::Scatter), vec![0x50020, 0x9008, 4]);
    }

    #[test]
    fn geometry_scales_with_longest_copy() {
        assert_eq!(geometry(&[]), None);
        let small = [PlannedCopy { region: 0, region_offset: 0, staging_offset: 0, len: 100 }; 3];
        assert_eq!(geometry(&small), Some(Geometry { grid_x: 1, grid_y: 3, block: BLOCK_THREADS }));
        let big = [PlannedCopy { region: 0, region_offset: 0, staging_offset: 0, len: 2 << 20 }; 64];
        assert_eq!(geometry(&big).unwrap().grid_x, 32);
        let many = vec![PlannedCopy { region: 0, region_offset: 0, staging_offset: 0, len: 1 }; 100_000];
        assert_eq!(geometry(&many).unwrap().grid_y, 65_535);
        let huge = [PlannedCopy { region: 0, region_offset: 0, staging_offset: 0, len: 1 << 40 }];
        assert_eq!(geometry(&huge).unwrap().grid_x, 1024);
    }

    #[test]
    fn cta_slices_tile_every_copy_exactly() {
        for len in [1u64, 15, 16, 17, 4095, 4096, 65_537, (2 << 20) + 3] {
            for grid_x in [1u64, 2, 3, 7, 32, 1024] {
                let mut next = 0;
                for x in 0..grid_x {
                    if let Some((b, e)) = cta_slice(len, grid_x, x) {
                        assert_eq!(b, next, "gap or overlap: len {len} grid {grid_x} cta {x}");
                        assert_eq!(b % 16, 0);
                        assert!(e > b);
                        next = e;
                    }
                }
                assert_eq!(next, len, "len {len} grid {grid_x} not covered");
            }
        }
    }
}
