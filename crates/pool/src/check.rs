//! `check_batch`: the validation every backend runs on a whole batch before the first byte
//! moves. Pure; it never touches memory.

use crate::{Extent, PoolError, RegionInfo};

/// Validate a batch: staging owned by this backend, every extent names a known region and lies
/// inside it (`offset + len` computed without overflow), and the staging buffer holds the sum of
/// the extents' lengths. Returns that sum (the staging bytes the batch uses).
///
/// Shared by every backend, called before any byte moves, so a refused batch writes nothing.
/// An empty extent list is valid (returns 0). Zero-length extents are allowed (no-ops) but must
/// still start inside their region (`offset <= region_len`).
pub fn check_batch(
    regions: &[RegionInfo],
    extents: &[Extent],
    staging_len: usize,
    staging_owner: u64,
    backend_id: u64,
) -> Result<u64, PoolError> {
    if staging_owner != backend_id {
        return Err(PoolError::ForeignStaging);
    }
    let region_count = u32::try_from(regions.len()).unwrap_or(u32::MAX);
    let mut total: u64 = 0;
    for e in extents {
        let Some(region) = regions.get(e.region as usize) else {
            return Err(PoolError::UnknownRegion { region: e.region, regions: region_count });
        };
        let in_bounds = e.offset.checked_add(e.len).is_some_and(|end| end <= region.len);
        if !in_bounds {
            return Err(PoolError::OutOfBounds {
                region: e.region,
                offset: e.offset,
                len: e.len,
                region_len: region.len,
            });
        }
        // Cannot realistically overflow (each len <= its region's length), but never wrap.
        total = total
            .checked_add(e.len)
            .ok_or(PoolError::StagingSize { needed: u64::MAX, got: staging_len as u64 })?;
    }
    if total > staging_len as u64 {
        return Err(PoolError::StagingSize { needed: total, got: staging_len as u64 });
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: u64 = 42;

    fn regions() -> Vec<RegionInfo> {
        vec![RegionInfo { len: 4096 }, RegionInfo { len: 100 }]
    }

    fn ext(region: u32, offset: u64, len: u64) -> Extent {
        Extent { region, offset, len }
    }

    #[test]
    fn empty_list_is_ok() {
        assert_eq!(check_batch(&regions(), &[], 0, ME, ME).unwrap(), 0);
        assert_eq!(check_batch(&[], &[], 0, ME, ME).unwrap(), 0);
    }

    #[test]
    fn in_bounds_returns_total() {
        let b = [ext(0, 0, 4096), ext(1, 0, 100), ext(1, 99, 1), ext(1, 100, 0)];
        assert_eq!(check_batch(&regions(), &b, 4197, ME, ME).unwrap(), 4197);
        assert_eq!(check_batch(&regions(), &b, 1 << 20, ME, ME).unwrap(), 4197);
    }

    #[test]
    fn past_the_end_is_out_of_bounds() {
        let b = [ext(0, 0, 10), ext(1, 50, 51)];
        match check_batch(&regions(), &b, 1 << 20, ME, ME) {
            Err(PoolError::OutOfBounds { region: 1, offset: 50, len: 51, region_len: 100 }) => {}
            other => panic!("expected OutOfBounds for region 1, got {other:?}"),
        }
        assert!(matches!(
            check_batch(&regions(), &[ext(1, 101, 0)], 0, ME, ME),
            Err(PoolError::OutOfBounds { offset: 101, .. })
        ));
    }

    #[test]
    fn offset_plus_len_overflow_is_out_of_bounds() {
        let b = [ext(0, u64::MAX, 2)];
        assert!(matches!(
            check_batch(&regions(), &b, usize::MAX, ME, ME),
            Err(PoolError::OutOfBounds { region: 0, offset: u64::MAX, len: 2, region_len: 4096 })
        ));
        let b = [ext(0, 1, u64::MAX)];
        assert!(matches!(
            check_batch(&regions(), &b, usize::MAX, ME, ME),
            Err(PoolError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn unknown_region() {
        let b = [ext(0, 0, 1), ext(2, 0, 1)];
        assert!(matches!(
            check_batch(&regions(), &b, 1 << 20, ME, ME),
            Err(PoolError::UnknownRegion { region: 2, regions: 2 })
        ));
        assert!(matches!(
            check_batch(&regions(), &[ext(u32::MAX, 0, 0)], 0, ME, ME),
            Err(PoolError::UnknownRegion { region: u32::MAX, .. })
        ));
    }

    #[test]
    fn staging_too_small() {
        let b = [ext(0, 0, 4000), ext(1, 0, 100)];
        assert!(matches!(
            check_batch(&regions(), &b, 4099, ME, ME),
            Err(PoolError::StagingSize { needed: 4100, got: 4099 })
        ));
        assert_eq!(check_batch(&regions(), &b, 4100, ME, ME).unwrap(), 4100);
    }

    #[test]
    fn foreign_staging() {
        let b = [ext(0, 0, 1)];
        assert!(matches!(check_batch(&regions(), &b, 10, ME + 1, ME), Err(PoolError::ForeignStaging)));
        // Refused even for an empty batch: the caller mixed up backends.
        assert!(matches!(check_batch(&regions(), &[], 10, ME + 1, ME), Err(PoolError::ForeignStaging)));
    }
}
