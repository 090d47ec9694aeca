//! The landing zone: fetched blocks, held in host memory until an engine loads them.
//!
//! Bounded in bytes, LRU among unleased entries, accounted per tenant. Space is reserved before
//! a fetch starts ([`LandingZone::reserve`]); blocks become visible only through
//! [`LandingZone::commit`], which the executor calls after the transfer verified every byte.
//! A failed fetch drops its reservation and nothing it touched is ever visible.

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
}
