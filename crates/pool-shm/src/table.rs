//! `RegionTable`: where each region of a pool sits inside the one shared-memory file, and its
//! validation (page-aligned, non-overlapping, inside the file). Both sides compute it with
//! [`RegionTable::packed`]; the receiving side re-validates whatever it is sent.

use serde::{Deserialize, Serialize};

use kvferry_pool::PoolError;

/// Alignment of every region's start in the file (one page).
pub const REGION_ALIGN: u64 = 4096;

/// One region: `len` bytes at `offset` in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmRegion {
    /// Byte offset in the file (multiple of [`REGION_ALIGN`]).
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The regions of a pool inside one shared-memory file of `file_len` bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawTable")]
pub struct RegionTable {
    regions: Vec<ShmRegion>,
    file_len: u64,
}

#[derive(Deserialize)]
struct RawTable {
    regions: Vec<ShmRegion>,
    file_len: u64,
}

impl TryFrom<RawTable> for RegionTable {
    type Error = PoolError;
    fn try_from(r: RawTable) -> Result<Self, PoolError> {
        RegionTable::new(r.regions, r.file_len)
    }
}

fn bad(msg: String) -> PoolError {
    PoolError::BadMetadata(msg)
}

impl RegionTable {
    /// Regions of `lens` bytes laid back to back, each starting on a page boundary; the file
    /// length is the end of the last region rounded up to a page.
    pub fn packed(lens: &[u64]) -> Result<Self, PoolError> {
        let mut regions = Vec::with_capacity(lens.len());
        let mut at: u64 = 0;
        for (i, &len) in lens.iter().enumerate() {
            regions.push(ShmRegion { offset: at, len });
            at = at
                .checked_add(len)
                .and_then(|e| e.checked_next_multiple_of(REGION_ALIGN))
                .ok_or_else(|| bad(format!("region {i}: pool size overflows u64")))?;
        }
        Self::new(regions, at)
    }

    /// A table from explicit regions, validated: every offset page-aligned, every region inside
    /// `file_len`, no two regions sharing a byte, and the file mappable on this platform.
    pub fn new(regions: Vec<ShmRegion>, file_len: u64) -> Result<Self, PoolError> {
        if usize::try_from(file_len).is_err() || file_len > isize::MAX as u64 {
            return Err(bad(format!("file length {file_len} cannot be mapped")));
        }
        u32::try_from(regions.len()).map_err(|_| bad(format!("{} regions", regions.len())))?;
        for (i, r) in regions.iter().enumerate() {
            if !r.offset.is_multiple_of(REGION_ALIGN) {
                return Err(bad(format!("region {i} offset {} is not {REGION_ALIGN}-aligned", r.offset)));
            }
            if r.offset.checked_add(r.len).is_none_or(|end| end > file_len) {
                return Err(bad(format!(
                    "region {i} (offset {} len {}) reaches past the file end {file_len}",
                    r.offset, r.len
                )));
            }
        }
        let mut sorted: Vec<(usize, &ShmRegion)> =
            regions.iter().enumerate().filter(|(_, r)| r.len > 0).collect();
        sorted.sort_by_key(|(_, r)| r.offset);
        if let Some(w) = sorted.windows(2).find(|w| w[0].1.offset + w[0].1.len > w[1].1.offset) {
            return Err(bad(format!("regions {} and {} overlap", w[0].0, w[1].0)));
        }
        Ok(Self { regions, file_len })
    }

    /// The regions, index = `Extent::region`.
    pub fn regions(&self) -> &[ShmRegion] {
        &self.regions
    }

    /// Region lengths.
    pub fn lens(&self) -> Vec<u64> {
        self.regions.iter().map(|r| r.len).collect()
    }

    /// Bytes of the file.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_is_aligned_and_tight() {
        let t = RegionTable::packed(&[10, 0, 4096, 5000]).unwrap();
        let offs: Vec<u64> = t.regions().iter().map(|r| r.offset).collect();
        assert_eq!(offs, vec![0, 4096, 4096, 8192]);
        assert_eq!(t.file_len(), 16384);
        assert_eq!(t.lens(), vec![10, 0, 4096, 5000]);
        assert_eq!(RegionTable::packed(&[]).unwrap().file_len(), 0);
    }

    #[test]
    fn refuses_bad_tables() {
        let r = |offset, len| ShmRegion { offset, len };
        assert!(
            matches!(RegionTable::new(vec![r(1, 10)], 4096), Err(PoolError::BadMetadata(m)) if m.contains("aligned"))
        );
        assert!(
            matches!(RegionTable::new(vec![r(0, 4097)], 4096), Err(PoolError::BadMetadata(m)) if m.contains("past the file end"))
        );
        assert!(matches!(RegionTable::new(vec![r(4096, u64::MAX)], 4096), Err(PoolError::BadMetadata(_))));
        assert!(matches!(
            RegionTable::new(vec![r(0, 8192), r(4096, 10)], 16384),
            Err(PoolError::BadMetadata(m)) if m.contains("overlap")
        ));
        assert!(matches!(RegionTable::packed(&[u64::MAX - 10]), Err(PoolError::BadMetadata(_))));
        let json = r#"{"regions":[{"offset":0,"len":9000}],"file_len":8192}"#;
        assert!(serde_json::from_str::<RegionTable>(json).is_err());
    }
}
