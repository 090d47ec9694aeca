//! Runs the conformance suite against a plain heap backend (regions are `Mutex<Vec<u8>>`), and
//! proves the suite can fail: deliberately broken variants of that backend (partial write
//! before validation, no owner check, wrong gather order, dropped concurrent writes,
//! offsets wrapped at 64 MiB) must be
//! caught by the case aimed at them.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use kvferry_pool::conformance::{self, Created, EngineSide, Fixture, FixtureError};
use kvferry_pool::{
    BoxFut, Extent, MemoryBackend, PoolError, RegionInfo, Staging, check_batch, next_backend_id,
};

type Regions = Arc<Vec<Mutex<Vec<u8>>>>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flaw {
    None,
    WritesBeforeChecking,
    IgnoresOwner,
    GathersBackwards,
    LosesOddWrites,
    WrapsAt64MiB,
}

struct Heap {
    id: u64,
    info: Vec<RegionInfo>,
    mem: Regions,
    flaw: Flaw,
    writes: std::sync::atomic::AtomicU64,
}

/// The backend's two copies, flaws included; the trait impl below only hands them out.
impl Heap {
    fn owner(&self, staging_owner: u64) -> u64 {
        if self.flaw == Flaw::IgnoresOwner { self.id } else { staging_owner }
    }

    async fn gather(&self, extents: &[Extent], staging: &mut Staging) -> Result<(), PoolError> {
        check_batch(&self.info, extents, staging.len(), self.owner(staging.owner()), self.id)?;
        let mut at = 0usize;
        let order: Vec<&Extent> = if self.flaw == Flaw::GathersBackwards {
            extents.iter().rev().collect()
        } else {
            extents.iter().collect()
        };
        for e in order {
            let m = self.mem[e.region as usize].lock().unwrap();
            let n = e.len as usize;
            staging.as_mut_slice()[at..at + n].copy_from_slice(&m[e.offset as usize..e.offset as usize + n]);
            at += n;
        }
        Ok(())
    }

    async fn scatter(&self, extents: &[Extent], staging: &Staging) -> Result<(), PoolError> {
        let owner = self.owner(staging.owner());
        if self.flaw != Flaw::WritesBeforeChecking {
            check_batch(&self.info, extents, staging.len(), owner, self.id)?;
        }
        let nth = self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.flaw == Flaw::LosesOddWrites && nth % 2 == 1 {
            return Ok(());
        }
        let mut at = 0usize;
        for (i, e) in extents.iter().enumerate() {
            if self.flaw == Flaw::WritesBeforeChecking {
                check_batch(&self.info, &extents[i..=i], staging.len() - at, owner, self.id)?;
            }
            let mut m = self.mem[e.region as usize].lock().unwrap();
            let n = e.len as usize;
            let off = if self.flaw == Flaw::WrapsAt64MiB { e.offset % (64 << 20) } else { e.offset };
            m[off as usize..off as usize + n].copy_from_slice(&staging.as_slice()[at..at + n]);
            at += n;
        }
        Ok(())
    }
}

impl MemoryBackend for Heap {
    fn name(&self) -> &'static str {
        "heap"
    }
    fn regions(&self) -> &[RegionInfo] {
        &self.info
    }
    fn read<'a>(
        &'a self,
        extents: &'a [Extent],
        staging: &'a mut Staging,
    ) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(self.gather(extents, staging))
    }
    fn write<'a>(&'a self, extents: &'a [Extent], staging: &'a Staging) -> BoxFut<'a, Result<(), PoolError>> {
        Box::pin(self.scatter(extents, staging))
    }
    fn staging(&self, len: usize) -> Result<Staging, PoolError> {
        Ok(Staging::new_host(len, self.id))
    }
    fn id(&self) -> u64 {
        self.id
    }
}

struct HeapEngine(Regions);

impl EngineSide for HeapEngine {
    fn read(&self, region: u32, offset: u64, out: &mut [u8]) -> Result<(), FixtureError> {
        let m = self.0[region as usize].lock().unwrap();
        out.copy_from_slice(&m[offset as usize..offset as usize + out.len()]);
        Ok(())
    }
    fn write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), FixtureError> {
        let mut m = self.0[region as usize].lock().unwrap();
        m[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
}

struct HeapFixture(Flaw);

impl Fixture for HeapFixture {
    fn create(&self, region_lens: &[u64]) -> Result<Created, FixtureError> {
        let mem: Regions = Arc::new(region_lens.iter().map(|&l| Mutex::new(vec![0u8; l as usize])).collect());
        let backend = Heap {
            id: next_backend_id(),
            info: region_lens.iter().map(|&len| RegionInfo { len }).collect(),
            mem: mem.clone(),
            flaw: self.0,
            writes: 0.into(),
        };
        Ok((Box::new(backend), Box::new(HeapEngine(mem))))
    }
}

const SOUND: HeapFixture = HeapFixture(Flaw::None);

#[test]
fn heap_passes_every_case() {
    conformance::run_all(&SOUND);
}

fn must_fail(case: impl FnOnce(), flaw: Flaw) {
    let r = catch_unwind(AssertUnwindSafe(case));
    let msg = match r {
        Ok(()) => panic!("the suite did not catch flaw {flaw:?}"),
        Err(p) => p.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    assert!(msg.starts_with("conformance[heap]"), "flaw {flaw:?}: unexpected failure message {msg:?}");
    eprintln!("caught {flaw:?}: {msg}");
}

#[test]
fn catches_partial_write_before_validation() {
    let fx = HeapFixture(Flaw::WritesBeforeChecking);
    must_fail(|| conformance::out_of_bounds_writes_nothing(&fx, 0x5EED_0001), fx.0);
}

#[test]
fn catches_missing_owner_check() {
    let fx = HeapFixture(Flaw::IgnoresOwner);
    must_fail(|| conformance::foreign_staging(&fx), fx.0);
}

#[test]
fn catches_wrong_gather_order() {
    let fx = HeapFixture(Flaw::GathersBackwards);
    must_fail(|| conformance::read_after_write(&fx, 0x5EED_0002), fx.0);
}

#[test]
fn catches_lost_writes() {
    let fx = HeapFixture(Flaw::LosesOddWrites);
    must_fail(|| conformance::concurrent_disjoint(&fx, 0x5EED_0003), fx.0);
}

#[test]
fn catches_offset_wrap_in_large_pool() {
    let fx = HeapFixture(Flaw::WrapsAt64MiB);
    must_fail(|| conformance::large_pool(&fx), fx.0);
}
