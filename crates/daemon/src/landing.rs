//! The landing zone: fetched blocks, held in host memory until an engine loads them.
//!
//! Bounded in bytes, LRU among unleased entries, accounted per tenant. Space is reserved before
//! a fetch starts ([`LandingZone::reserve`]); blocks become visible only through
//! [`LandingZone::commit`], which the executor calls after the transfer verified every byte.
//! A failed fetch drops its reservation and nothing it touched is ever visible.
//!
//! The zone also keeps the buffers of blocks it let go (released, evicted, a failed fetch's,
//! a duplicate's) as *spares*, by length, and hands them to the next fetch
//! ([`LandingZone::buffer`]) instead of fresh memory: on this host a fresh page costs the
//! kernel a fault and a clear, and the target of a 2 GiB fetch spent 46 % of its CPU there
//! (`bench/results/cpu-profile-2026-12-03/`). A spare is zeroed before it is handed out, so
//! nothing of one fetch (or tenant) can show through another. Memory the zone holds —
//! landed blocks, spares and what in-flight fetches took — stays within its capacity: taking
//! a spare or keeping one never adds memory, and before a fresh allocation the zone drops
//! spares until `used + reserved + spare` fits (what a fetch took is within its reservation).
//! [`LandingZone::prefault`] fills the free capacity with spares up front (`[limits]
//! landing_prefault`), so even a daemon's first fetches land in memory already faulted in;
//! [`spawn_prefault`] runs it on its own thread at idle priority, because faulting a zone in
//! costs a whole core for seconds (3 GiB took 10–15 s here) and it starts when an engine
//! registers, beside that engine's own start and first requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvferry_layout::BlockHash;
use kvferry_pool::sync::LockExt;

/// A landed, verified block.
#[derive(Debug, Clone)]
pub struct Landed {
    pub tenant: String,
    /// Layout fingerprint digest the bytes are laid out for.
    pub fingerprint: [u8; 32],
    /// One block, all layers, staging order.
    pub bytes: Arc<Vec<u8>>,
}

#[derive(Debug)]
struct Entry {
    landed: Landed,
    tick: u64,
    leases: u32,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<BlockHash, Entry>,
    used: u64,
    reserved: u64,
    tick: u64,
    per_tenant: HashMap<String, u64>,
    /// Idle buffers by length, and their total bytes.
    spares: HashMap<usize, Vec<Vec<u8>>>,
    spare: u64,
}

/// The zone.
#[derive(Debug)]
pub struct LandingZone {
    capacity: u64,
    inner: Mutex<Inner>,
}

/// Space held for an in-flight fetch; released on drop unless committed.
#[derive(Debug)]
pub struct Reservation {
    zone: Arc<LandingZone>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        {
            let mut g = self.zone.inner.locked();
            g.reserved = g.reserved.saturating_sub(self.bytes);
        }
    }
}

/// The zone is full even after evicting every unleased block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("landing zone full: need {need} bytes, {free} free of {capacity}")]
pub struct ZoneFull {
    pub need: u64,
    pub free: u64,
    pub capacity: u64,
}

impl LandingZone {
    /// A zone of `capacity` bytes.
    pub fn new(capacity: u64) -> Arc<Self> {
        Arc::new(Self { capacity, inner: Mutex::new(Inner::default()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Reserves `bytes`, evicting least-recently-used unleased blocks if needed.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, ZoneFull> {
        let mut g = self.lock();
        while g.used + g.reserved + bytes > self.capacity {
            let victim =
                g.entries.iter().filter(|(_, e)| e.leases == 0).min_by_key(|(_, e)| e.tick).map(|(h, _)| *h);
            let Some(h) = victim else {
                let free = self.capacity.saturating_sub(g.used + g.reserved);
                return Err(ZoneFull { need: bytes, free, capacity: self.capacity });
            };
            remove(&mut g, &h);
        }
        g.reserved += bytes;
        Ok(Reservation { zone: self.clone(), bytes })
    }

    /// Makes verified blocks visible, consuming their reservation.
    pub fn commit(&self, reservation: Reservation, blocks: Vec<(BlockHash, Landed)>) {
        let mut g = self.lock();
        g.reserved = g.reserved.saturating_sub(reservation.bytes);
        // The reservation's bytes are now accounted as used instead.
        std::mem::forget(reservation);
        for (h, landed) in blocks {
            if g.entries.contains_key(&h) {
                keep_spare(&mut g, landed.bytes);
                continue;
            }
            g.tick += 1;
            let n = landed.bytes.len() as u64;
            g.used += n;
            *g.per_tenant.entry(landed.tenant.clone()).or_default() += n;
            let tick = g.tick;
            g.entries.insert(h, Entry { landed, tick, leases: 0 });
        }
    }

    /// A visible block of `tenant`, marking it recently used.
    pub fn get(&self, tenant: &str, h: &BlockHash) -> Option<Landed> {
        let mut g = self.lock();
        g.tick += 1;
        let tick = g.tick;
        let e = g.entries.get_mut(h)?;
        if e.landed.tenant != tenant {
            return None;
        }
        e.tick = tick;
        Some(e.landed.clone())
    }

    /// Whether a block is visible (any tenant), and whose it is.
    pub fn owner_of(&self, h: &BlockHash) -> Option<String> {
        self.lock().entries.get(h).map(|e| e.landed.tenant.clone())
    }

    /// Pins blocks against eviction while an engine loads them.
    pub fn lease(&self, hashes: &[BlockHash]) {
        let mut g = self.lock();
        for h in hashes {
            if let Some(e) = g.entries.get_mut(h) {
                e.leases += 1;
            }
        }
    }

    /// Releases pins taken by [`LandingZone::lease`].
    pub fn unlease(&self, hashes: &[BlockHash]) {
        let mut g = self.lock();
        for h in hashes {
            if let Some(e) = g.entries.get_mut(h) {
                e.leases = e.leases.saturating_sub(1);
            }
        }
    }

    /// Drops blocks (an engine released them after loading, or an eviction).
    pub fn remove(&self, hashes: &[BlockHash]) {
        let mut g = self.lock();
        for h in hashes {
            if g.entries.get(h).is_some_and(|e| e.leases == 0) {
                remove(&mut g, h);
            }
        }
    }

    /// (used, reserved, capacity) bytes.
    pub fn occupancy(&self) -> (u64, u64, u64) {
        let g = self.lock();
        (g.used, g.reserved, self.capacity)
    }

    /// Bytes held per tenant.
    pub fn per_tenant(&self) -> HashMap<String, u64> {
        self.lock().per_tenant.clone()
    }

    /// Bytes of idle buffers kept for reuse.
    pub fn spare_bytes(&self) -> u64 {
        self.lock().spare
    }

    /// A zeroed buffer of `len` bytes for a block being fetched under a reservation: a spare
    /// of that length if the zone has one, else fresh memory (after dropping spares of other
    /// lengths that would take the zone over its capacity).
    pub fn buffer(&self, len: usize) -> Vec<u8> {
        match self.take_spare(len) {
            Some(mut b) => {
                b.fill(0);
                b
            }
            None => vec![0; len],
        }
    }

    /// [`LandingZone::buffer`] for a caller that overwrites every byte before the buffer can
    /// become visible, or zeroes what it did not ([`crate::catalog::LandingSink`] tracks what
    /// it landed): a spare comes back with an earlier block's bytes instead of zeroed (zeroing
    /// it was a memset of every byte a fetch lands). Fresh memory is zeroed.
    pub fn buffer_to_fill(&self, len: usize) -> Vec<u8> {
        self.take_spare(len).unwrap_or_else(|| vec![0; len])
    }

    /// A spare of `len` bytes as it was given back; `None` (after dropping spares of other
    /// lengths that would take the zone over its capacity with a fresh buffer) when there is
    /// none. Fresh memory comes zeroed from the allocator, so neither caller zeroes it again.
    fn take_spare(&self, len: usize) -> Option<Vec<u8>> {
        let mut g = self.lock();
        match g.spares.get_mut(&len).and_then(Vec::pop) {
            Some(b) => {
                g.spare -= len as u64;
                Some(b)
            }
            None => {
                trim(&mut g, self.capacity);
                None
            }
        }
    }

    /// Takes back a buffer a fetch no longer needs (it failed, or was cancelled).
    pub fn give_back(&self, buf: Vec<u8>) {
        if !buf.is_empty() {
            let mut g = self.lock();
            keep_spare(&mut g, Arc::new(buf));
            trim(&mut g, self.capacity);
        }
    }

    /// Fills the zone's free capacity with faulted-in spares of `len` bytes; returns how many
    /// bytes it added. Blocking (it writes every page): call it off the async runtime.
    pub fn prefault(&self, len: usize) -> u64 {
        if len == 0 {
            return 0;
        }
        let mut added = 0;
        loop {
            {
                let g = self.lock();
                if g.used + g.reserved + g.spare + len as u64 > self.capacity {
                    return added;
                }
            }
            // Written, not only allocated: calloc'd memory is not faulted in until touched.
            let b = vec![1u8; len];
            let mut g = self.lock();
            if g.used + g.reserved + g.spare + len as u64 > self.capacity {
                return added;
            }
            g.spare += len as u64;
            g.spares.entry(len).or_default().push(b);
            added += len as u64;
        }
    }
}

/// Runs [`LandingZone::prefault`] on a thread of its own at `SCHED_IDLE` priority (only on CPU
/// time no other thread wants), and calls `done` with the bytes it added and its seconds.
///
/// Faulting a zone in is a background optimisation, never worth slowing an engine for: on
/// this host the bench's vLLM sweeps shared their two cores with both daemons' prefaults
/// (3 GiB each, 10–15 s of a core) and their decisions were the worse for it. A thread of its
/// own, not the blocking pool's: the priority stays with the thread. If the kernel refuses
/// the priority, the prefault runs at normal priority.
pub fn spawn_prefault(
    zone: Arc<LandingZone>,
    len: usize,
    done: impl FnOnce(u64, f64) + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    spawn_idle("kvferry-prefault", move || {
        let t0 = std::time::Instant::now();
        let added = zone.prefault(len);
        done(added, t0.elapsed().as_secs_f64());
    })
}

/// Spawns `f` on a named thread lowered to `SCHED_IDLE` before `f` runs.
fn spawn_idle<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<T>> {
    std::thread::Builder::new().name(name.into()).spawn(move || {
        if let Err(e) = lower_to_idle() {
            tracing::debug!(error = %e, "could not lower the thread to SCHED_IDLE");
        }
        f()
    })
}

/// Lowers the calling thread (Linux: pid 0 is the calling thread) to `SCHED_IDLE`.
fn lower_to_idle() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `sched_setscheduler` only reads `param`, a valid, initialised `sched_param` that
    // outlives the call; pid 0 names the calling thread alone; SCHED_IDLE requires priority
    // 0, which `param` holds. No memory is shared or freed.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Keeps `bytes` as a spare if nobody else holds it (an engine's load may still read it).
fn keep_spare(g: &mut Inner, bytes: Arc<Vec<u8>>) {
    if let Ok(b) = Arc::try_unwrap(bytes) {
        g.spare += b.len() as u64;
        g.spares.entry(b.len()).or_default().push(b);
    }
}

/// Drops spares until landed, reserved and spare bytes fit the capacity.
fn trim(g: &mut Inner, capacity: u64) {
    while g.used + g.reserved + g.spare > capacity {
        let Some(len) = g.spares.iter().find(|(_, v)| !v.is_empty()).map(|(l, _)| *l) else {
            return;
        };
        if let Some(list) = g.spares.get_mut(&len) {
            list.pop();
            g.spare -= len as u64;
            if list.is_empty() {
                g.spares.remove(&len);
            }
        }
    }
}

fn remove(g: &mut Inner, h: &BlockHash) {
    if let Some(e) = g.entries.remove(h) {
        let n = e.landed.bytes.len() as u64;
        g.used -= n;
        if let Some(t) = g.per_tenant.get_mut(&e.landed.tenant) {
            *t = t.saturating_sub(n);
            if *t == 0 {
                g.per_tenant.remove(&e.landed.tenant);
            }
        }
        keep_spare(g, e.landed.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn landed(t: &str, n: usize) -> Landed {
        Landed { tenant: t.into(), fingerprint: [0; 32], bytes: Arc::new(vec![7; n]) }
    }

    #[test]
    fn reserve_commit_get_and_tenant_isolation() {
        let z = LandingZone::new(1000);
        let r = z.reserve(300).unwrap();
        assert_eq!(z.occupancy(), (0, 300, 1000));
        assert!(z.get("a", &[1; 32]).is_none(), "nothing is visible before commit");
        z.commit(r, vec![([1; 32], landed("a", 100)), ([2; 32], landed("a", 200))]);
        assert_eq!(z.occupancy(), (300, 0, 1000));
        assert!(z.get("a", &[1; 32]).is_some());
        assert!(z.get("b", &[1; 32]).is_none(), "another tenant never sees it");
        assert_eq!(z.per_tenant()["a"], 300);
    }

    #[test]
    fn a_dropped_reservation_leaves_nothing_behind() {
        let z = LandingZone::new(1000);
        drop(z.reserve(900).unwrap());
        assert_eq!(z.occupancy(), (0, 0, 1000));
    }

    #[test]
    fn lru_eviction_spares_leased_blocks() {
        let z = LandingZone::new(300);
        let r = z.reserve(300).unwrap();
        z.commit(
            r,
            vec![([1; 32], landed("a", 100)), ([2; 32], landed("a", 100)), ([3; 32], landed("b", 100))],
        );
        z.lease(&[[1; 32]]);
        let _ = z.get("a", &[2; 32]); // 2 is now more recent than 3
        let r = z.reserve(100).unwrap(); // evicts 3 (oldest unleased)
        assert!(z.owner_of(&[3; 32]).is_none());
        assert!(z.owner_of(&[1; 32]).is_some() && z.owner_of(&[2; 32]).is_some());
        drop(r);
        let _r2 = z.reserve(200).unwrap(); // evicts 2; 1 is leased
        assert!(z.owner_of(&[1; 32]).is_some());
        assert_eq!(z.reserve(200).unwrap_err().need, 200);
        z.unlease(&[[1; 32]]);
        assert!(z.reserve(100).is_ok());
    }

    /// Memory the zone holds: landed, spare, and `taken` bytes handed to fetches.
    fn held(z: &LandingZone, taken: u64) -> u64 {
        let (used, _, _) = z.occupancy();
        used + z.spare_bytes() + taken
    }

    #[test]
    fn a_released_block_buffer_is_reused_zeroed() {
        let z = LandingZone::new(1000);
        let r = z.reserve(100).unwrap();
        let b = z.buffer(100);
        let ptr = b.as_ptr();
        z.commit(
            r,
            vec![(
                [1; 32],
                Landed { tenant: "a".into(), fingerprint: [0; 32], bytes: Arc::new(vec![9; 100]) },
            )],
        );
        drop(b); // (a buffer not given back is simply freed)
        z.remove(&[[1; 32]]);
        assert_eq!((z.spare_bytes(), z.occupancy().0), (100, 0), "the released block's buffer is a spare");
        let _r = z.reserve(100).unwrap();
        let again = z.buffer(100);
        assert_eq!(again, vec![0; 100], "another tenant's bytes never show through");
        assert_eq!(z.spare_bytes(), 0);
        let other = z.buffer(100);
        assert_ne!(other.as_ptr(), ptr);
    }

    #[test]
    fn evicted_and_duplicate_blocks_become_spares_and_a_shared_one_does_not() {
        let z = LandingZone::new(200);
        let r = z.reserve(200).unwrap();
        let shared = Arc::new(vec![5; 100]);
        let l = |bytes: Arc<Vec<u8>>| Landed { tenant: "a".into(), fingerprint: [0; 32], bytes };
        z.commit(r, vec![([1; 32], l(shared.clone())), ([2; 32], l(Arc::new(vec![6; 100])))]);
        let r = z.reserve(100).unwrap(); // evicts block 1, still held by `shared` (a load)
        assert_eq!(z.spare_bytes(), 0, "a buffer someone still reads is not reused");
        z.commit(r, vec![([2; 32], l(Arc::new(vec![7; 100])))]); // a duplicate of 2
        assert_eq!(z.spare_bytes(), 100, "the duplicate's buffer is kept");
        assert_eq!(z.get("a", &[2; 32]).unwrap().bytes[0], 6, "the first copy stays visible");
        drop(shared);
    }

    #[test]
    fn spawned_prefault_runs_at_idle_priority_and_fills_the_zone() {
        // SAFETY: `sched_getscheduler(0)` reads the calling thread's policy; no pointers.
        let policy = spawn_idle("t", || unsafe { libc::sched_getscheduler(0) }).unwrap().join().unwrap();
        assert_eq!(policy, libc::SCHED_IDLE, "the prefault thread runs at idle priority");
        // SAFETY: as above.
        let mine = unsafe { libc::sched_getscheduler(0) };
        assert_ne!(mine, libc::SCHED_IDLE, "the caller's own policy is untouched");
        let z = LandingZone::new(1000);
        let (tx, rx) = std::sync::mpsc::channel();
        spawn_prefault(z.clone(), 100, move |added, _s| tx.send(added).unwrap()).unwrap().join().unwrap();
        assert_eq!(rx.recv().unwrap(), 1000);
        assert_eq!(z.prefault(100), 0, "the spawned prefault filled the zone");
    }

    #[test]
    fn prefault_fills_the_free_capacity_and_fresh_buffers_trim_spares() {
        let z = LandingZone::new(1000);
        let r = z.reserve(300).unwrap();
        assert_eq!(z.prefault(100), 700, "capacity less reserved, in whole buffers");
        assert_eq!(z.prefault(100), 0, "already full");
        drop(r);
        assert_eq!(z.prefault(0), 0);
        // a fetch of another block size: its fresh buffers push out spares of the first size
        let _r = z.reserve(500).unwrap();
        let _b = z.buffer(250);
        let (used, reserved, cap) = z.occupancy();
        assert!(
            used + reserved + z.spare_bytes() <= cap,
            "{used} + {reserved} + {} > {cap}",
            z.spare_bytes()
        );
        assert_eq!(z.spare_bytes(), 500);
    }

    #[test]
    fn a_failed_fetch_gives_its_buffers_back() {
        let z = LandingZone::new(1000);
        let r = z.reserve(200).unwrap();
        let (a, b) = (z.buffer(100), z.buffer(100));
        drop(r);
        z.give_back(a);
        z.give_back(b);
        z.give_back(Vec::new());
        assert_eq!(z.spare_bytes(), 200);
        assert_eq!(held(&z, 0), 200);
    }

    proptest::proptest! {
        /// Whatever the sequence of fetches, commits, releases and failures, the memory the
        /// zone holds (landed + spare + handed out) never exceeds its capacity, and nothing
        /// handed out is ever non-zero.
        #[test]
        fn the_zone_never_holds_more_than_its_capacity(ops in proptest::collection::vec((0u8..4, 1usize..4, 0u8..8), 1..60)) {
            let cap = 1000u64;
            let z = LandingZone::new(cap);
            let mut next = 0u8;
            let mut landed: Vec<BlockHash> = Vec::new();
            for (op, n, pick) in ops {
                let len = [50usize, 100, 150][n - 1];
                match op {
                    // a fetch of 1..=3 blocks that completes
                    0 | 1 => {
                        let k = 1 + pick as usize % 3;
                        let Ok(r) = z.reserve((k * len) as u64) else { continue };
                        let mut blocks = Vec::new();
                        for _ in 0..k {
                            let b = z.buffer(len);
                            proptest::prop_assert!(b.iter().all(|&x| x == 0));
                            let taken = (blocks.len() * len + len) as u64;
                            proptest::prop_assert!(held(&z, taken) <= cap);
                            blocks.push(b);
                        }
                        let out: Vec<_> = blocks.into_iter().map(|mut b| {
                            b.fill(0xAB);
                            next = next.wrapping_add(1);
                            let h = [next; 32];
                            landed.push(h);
                            (h, Landed { tenant: "t".into(), fingerprint: [0; 32], bytes: Arc::new(b) })
                        }).collect();
                        if op == 0 {
                            z.commit(r, out);
                        } else {
                            for (_, l) in out {
                                z.give_back(Arc::try_unwrap(l.bytes).unwrap());
                            }
                            drop(r);
                        }
                    }
                    2 => {
                        if let Some(h) = landed.get(pick as usize % landed.len().max(1)).copied() {
                            z.remove(&[h]);
                        }
                    }
                    _ => {
                        z.prefault(len);
                    }
                }
                proptest::prop_assert!(held(&z, 0) <= cap, "held {} > {cap}", held(&z, 0));
            }
        }
    }
}
