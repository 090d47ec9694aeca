//! Registered engines: their pools (layout, backend), leases, measured prefill profiles, the
//! blocks they hold ([`BlockIndex`]: hash → block id, tenant and generation), and the command
//! channel of their Attach stream. Also the shm pools handed over the fd-passing socket,
//! waiting for `RegisterPool`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvferry_layout::{BlockHash, LayoutFingerprint, PoolLayout};
use kvferry_pool::MemoryBackend;
use kvferry_pool::sync::LockExt;
use kvferry_proto::v1::DaemonCommand;
use tokio::sync::mpsc;

/// A measured prefill profile: `seconds(c, n) = f + a·n + b·(n·c + n(n+1)/2)` per step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Profile {
    pub linear_s_per_token: f64,
    pub attention_s_per_pair: f64,
    /// Seconds every prefill step costs whatever its tokens (0: the engine measures none).
    pub fixed_s: f64,
}

impl Profile {
    /// The profile an engine reported (`RegisterPool`, `LoadReport`), or why it is none:
    /// `linear_s_per_token` finite and > 0, `attention_s_per_pair` finite and ≥ 0, `fixed_s`
    /// finite in `[0, MAX_FIXED_PRIOR_S]`.
    pub fn reported(p: &kvferry_proto::v1::PrefillProfile) -> Result<Self, &'static str> {
        let linear_ok = p.linear_s_per_token.is_finite() && p.linear_s_per_token > 0.0;
        let attention_ok = p.attention_s_per_pair.is_finite() && p.attention_s_per_pair >= 0.0;
        if !(linear_ok && attention_ok) {
            return Err("profile: linear_s_per_token must be > 0 and attention_s_per_pair >= 0");
        }
        if !(p.fixed_s.is_finite()
            && (0.0..=kvferry_model::calibration::recompute::MAX_FIXED_PRIOR_S).contains(&p.fixed_s))
        {
            return Err("profile: fixed_s must be in [0, 60] seconds");
        }
        Ok(Self {
            linear_s_per_token: p.linear_s_per_token,
            attention_s_per_pair: p.attention_s_per_pair,
            fixed_s: p.fixed_s,
        })
    }
}

/// Engine-reported load.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineLoad {
    pub queue_depth: u32,
    pub utilization: f64,
}

/// One registered engine pool.
pub struct EngineEntry {
    pub engine_id: String,
    pub model_id: String,
    pub lease_id: String,
    pub layout: PoolLayout,
    pub fingerprint: LayoutFingerprint,
    pub digest: [u8; 32],
    pub backend: Arc<dyn MemoryBackend>,
    pub profile: Mutex<Profile>,
    pub load: Mutex<EngineLoad>,
    /// What the engine's pool holds, as published by the engine.
    pub blocks: Mutex<BlockIndex>,
    /// The Attach stream's sender, once attached.
    pub commands: Mutex<Option<mpsc::Sender<Result<DaemonCommand, tonic::Status>>>>,
    /// Recompute completions by session id.
    pub recompute_waiters: Mutex<HashMap<String, tokio::sync::oneshot::Sender<Result<u64, String>>>>,
    pub registered_at: Instant,
}

impl std::fmt::Debug for EngineEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineEntry")
            .field("engine_id", &self.engine_id)
            .field("lease_id", &self.lease_id)
            .finish()
    }
}

impl EngineEntry {
    /// Block id of `h` for `tenant`, if this engine holds it.
    pub fn block_of(&self, tenant: &str, h: &BlockHash) -> Option<u32> {
        self.held(tenant, h).map(|h| h.id)
    }

    /// The index entry of `h` for `tenant`, if this engine holds it.
    pub fn held(&self, tenant: &str, h: &BlockHash) -> Option<Held> {
        self.blocks.locked().get(h).filter(|e| e.tenant == tenant).cloned()
    }

    /// Whether the engine's Attach stream is live.
    pub fn attached(&self) -> bool {
        self.commands.locked().as_ref().is_some_and(|s| !s.is_closed())
    }
}

/// One published block: where it lives and which publication put it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Block id in the engine's pool.
    pub id: u32,
    /// Tenant whose salt the hash carries.
    pub tenant: String,
    /// Unique per publication (never reused within a daemon's life): a block withdrawn and
    /// published again, even at the same id with the same hash, gets a new generation, so a
    /// reader that saw the old one can tell.
    pub generation: u64,
}

/// An engine's published blocks: hash → [`Held`], and block id → hash (a block id holds one
/// content at a time: storing a new hash at an id drops the old hash).
///
/// Ordered publications (`Publish` with an epoch) also remember, per block id, the epoch of
/// its last withdrawal: a store stamped with an older epoch (a publication that raced with
/// the block's reuse) is dropped rather than resurrecting bytes the engine overwrote.
#[derive(Debug, Default)]
pub struct BlockIndex {
    by_hash: HashMap<BlockHash, Held>,
    by_id: HashMap<u32, BlockHash>,
    withdrawn_epoch: HashMap<u32, u64>,
    next_generation: u64,
}

/// A global generation counter, so generations are unique across engines too.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl BlockIndex {
    /// Records that block `id` holds `h` (of `tenant`). `epoch` 0 is unordered (Attach
    /// events): always applied. Returns `false` when the store is stale (an ordered store
    /// older than the id's last withdrawal) and was dropped.
    pub fn store(&mut self, h: BlockHash, id: u32, tenant: &str, epoch: u64) -> bool {
        if epoch > 0 && self.withdrawn_epoch.get(&id).is_some_and(|&w| epoch < w) {
            return false;
        }
        if let Some(old) = self.by_id.remove(&id) {
            self.by_hash.remove(&old);
        }
        if let Some(prev) = self.by_hash.remove(&h) {
            self.by_id.remove(&prev.id);
        }
        self.next_generation = GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.by_hash.insert(h, Held { id, tenant: tenant.to_owned(), generation: self.next_generation });
        self.by_id.insert(id, h);
        true
    }

    /// Drops `h`; returns whether it was held.
    pub fn remove_hash(&mut self, h: &BlockHash) -> bool {
        match self.by_hash.remove(h) {
            Some(held) => {
                self.by_id.remove(&held.id);
                true
            }
            None => false,
        }
    }

    /// Drops whatever block `id` holds and (with `epoch > 0`) remembers the withdrawal's epoch;
    /// returns whether it held anything.
    pub fn remove_id(&mut self, id: u32, epoch: u64) -> bool {
        if epoch > 0 {
            let w = self.withdrawn_epoch.entry(id).or_insert(0);
            *w = (*w).max(epoch);
        }
        match self.by_id.remove(&id) {
            Some(h) => {
                self.by_hash.remove(&h);
                true
            }
            None => false,
        }
    }

    /// The entry of `h`.
    pub fn get(&self, h: &BlockHash) -> Option<&Held> {
        self.by_hash.get(h)
    }

    /// Whether `h` is still held at `id` by the same publication.
    pub fn still_holds(&self, h: &BlockHash, id: u32, generation: u64) -> bool {
        self.by_hash.get(h).is_some_and(|e| e.id == id && e.generation == generation)
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// What a migration asks of the engine that will serve it (empty strings and `None` match any).
#[derive(Debug, Clone, Copy)]
pub struct TargetFilter<'a> {
    pub engine_id: &'a str,
    pub model_id: &'a str,
    pub digest: Option<&'a [u8; 32]>,
}

/// The rule choosing the engine that serves a migration, over plain facts per registered engine
/// `(engine id, model id, layout digest, attached)`: among those the filter admits, an attached
/// one first, then the lowest engine id (deterministic). The index into `engines`, or `None`.
pub fn choose_target(want: &TargetFilter<'_>, engines: &[(&str, &str, &[u8; 32], bool)]) -> Option<usize> {
    engines
        .iter()
        .enumerate()
        .filter(|(_, (id, model, digest, _))| {
            (want.engine_id.is_empty() || *id == want.engine_id)
                && (want.model_id.is_empty() || *model == want.model_id)
                && want.digest.is_none_or(|d| d == *digest)
        })
        .min_by_key(|(_, (id, _, _, attached))| (!attached, *id))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reported_profile_is_checked_whole() {
        let ok = kvferry_proto::v1::PrefillProfile {
            linear_s_per_token: 1e-4,
            attention_s_per_pair: 1e-9,
            samples: 3,
            fixed_s: 0.02,
        };
        assert_eq!(
            Profile::reported(&ok),
            Ok(Profile { linear_s_per_token: 1e-4, attention_s_per_pair: 1e-9, fixed_s: 0.02 })
        );
        // An engine that measures no fixed cost (an older one: the field absent) prices none.
        assert_eq!(
            Profile::reported(&kvferry_proto::v1::PrefillProfile { fixed_s: 0.0, ..ok }).unwrap().fixed_s,
            0.0
        );
        for bad in [
            kvferry_proto::v1::PrefillProfile { linear_s_per_token: 0.0, ..ok },
            kvferry_proto::v1::PrefillProfile { linear_s_per_token: f64::INFINITY, ..ok },
            kvferry_proto::v1::PrefillProfile { linear_s_per_token: f64::NAN, ..ok },
            kvferry_proto::v1::PrefillProfile { attention_s_per_pair: -1e-9, ..ok },
            kvferry_proto::v1::PrefillProfile { attention_s_per_pair: f64::INFINITY, ..ok },
            kvferry_proto::v1::PrefillProfile { fixed_s: -0.01, ..ok },
            kvferry_proto::v1::PrefillProfile { fixed_s: f64::NAN, ..ok },
            kvferry_proto::v1::PrefillProfile { fixed_s: 61.0, ..ok },
            kvferry_proto::v1::PrefillProfile::default(),
        ] {
            assert!(Profile::reported(&bad).unwrap_err().starts_with("profile: "), "{bad:?}");
        }
    }

    #[test]
    fn one_content_per_block_id_and_fresh_generations() {
        let mut ix = BlockIndex::default();
        assert!(ix.store([1; 32], 5, "t", 0));
        let g1 = ix.get(&[1; 32]).unwrap().generation;
        // another hash stored at id 5 replaces the first
        assert!(ix.store([2; 32], 5, "t", 0));
        assert!(ix.get(&[1; 32]).is_none());
        assert_eq!(ix.len(), 1);
        // the same hash moved to id 6 frees id 5
        assert!(ix.store([2; 32], 6, "t", 0));
        assert!(!ix.remove_id(5, 0));
        assert!(ix.remove_id(6, 0));
        assert!(ix.is_empty());
        // re-published at the same id with the same hash: a new generation
        ix.store([1; 32], 5, "t", 0);
        let g2 = ix.get(&[1; 32]).unwrap().generation;
        assert_ne!(g1, g2);
        assert!(ix.still_holds(&[1; 32], 5, g2));
        assert!(!ix.still_holds(&[1; 32], 5, g1));
        assert!(ix.remove_hash(&[1; 32]));
        assert!(!ix.remove_hash(&[1; 32]));
    }

    #[test]
    fn ordered_stores_older_than_a_withdrawal_are_dropped() {
        let mut ix = BlockIndex::default();
        ix.remove_id(9, 10); // the block was reused at step 10
        assert!(!ix.store([3; 32], 9, "t", 9), "a step-9 publication arriving late");
        assert!(ix.get(&[3; 32]).is_none());
        assert!(ix.store([3; 32], 9, "t", 10), "completed in the step that reused it");
        assert!(ix.store([4; 32], 9, "t", 11));
        assert!(ix.store([5; 32], 9, "t", 0), "unordered stores always apply");
    }

    #[test]
    fn target_rule_prefers_attached_then_lowest_id_within_the_filter() {
        let (d1, d2) = ([1u8; 32], [2u8; 32]);
        let engines = [
            ("e2", "m", &d1, true),
            ("e1", "m", &d1, false),
            ("e3", "other", &d2, true),
            ("e0", "m", &d1, true),
        ];
        let any = TargetFilter { engine_id: "", model_id: "", digest: None };
        assert_eq!(choose_target(&any, &engines), Some(3), "attached e0 before attached e2 and detached e1");
        let m = TargetFilter { model_id: "other", ..any };
        assert_eq!(choose_target(&m, &engines), Some(2));
        let by_id = TargetFilter { engine_id: "e1", ..any };
        assert_eq!(choose_target(&by_id, &engines), Some(1), "a named engine is served even detached");
        let by_digest = TargetFilter { digest: Some(&d2), ..any };
        assert_eq!(choose_target(&by_digest, &engines), Some(2));
        let none = TargetFilter { engine_id: "e3", model_id: "m", digest: None };
        assert_eq!(choose_target(&none, &engines), None, "every field must match");
        assert_eq!(choose_target(&any, &[]), None);
        let detached = [("b", "m", &d1, false), ("a", "m", &d1, false)];
        assert_eq!(choose_target(&any, &detached), Some(1), "lowest id among detached");
    }
}

/// A pool received over the fd socket: model id, the layout it was offered with, its backend.
pub type PendingPool = (String, Option<PoolLayout>, Arc<dyn MemoryBackend>);

/// A pending pool and when it was offered (unclaimed offers expire).
type Offered = (PendingPool, Instant);

/// All engines of this region.
#[derive(Default)]
pub struct Registry {
    engines: Mutex<HashMap<String, Arc<EngineEntry>>>,
    /// Pools received over the fd-passing socket: token → (model id, layout, backend).
    pending_pools: Mutex<HashMap<String, Offered>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("engines", &self.all().len()).finish_non_exhaustive()
    }
}

impl Registry {
    /// Holds a pool handed over the fd socket until `RegisterPool` claims it, unless `max`
    /// offers are already waiting (then the pool is dropped and `Err` carries how many wait).
    pub fn add_pending_pool(
        &self,
        token: String,
        model_id: String,
        layout: Option<PoolLayout>,
        backend: Arc<dyn MemoryBackend>,
        max: usize,
    ) -> Result<(), usize> {
        let mut p = self.pending_pools.locked();
        if p.len() >= max {
            return Err(p.len());
        }
        p.insert(token, ((model_id, layout, backend), Instant::now()));
        Ok(())
    }

    /// Claims a pending pool.
    pub fn take_pending_pool(&self, token: &str) -> Option<PendingPool> {
        self.pending_pools.locked().remove(token).map(|(p, _)| p)
    }

    /// Drops the pending pools offered more than `ttl` ago; returns how many. Their backends
    /// are dropped outside the lock (an shm backend unmaps and closes its fd on drop).
    pub fn expire_pending_pools(&self, ttl: std::time::Duration) -> usize {
        let gone: Vec<Offered> = {
            let mut p = self.pending_pools.locked();
            let old: Vec<String> =
                p.iter().filter(|(_, (_, at))| at.elapsed() >= ttl).map(|(k, _)| k.clone()).collect();
            old.iter().filter_map(|k| p.remove(k)).collect()
        };
        gone.len()
    }

    /// Pool offers waiting for `RegisterPool`.
    pub fn pending_pools(&self) -> usize {
        self.pending_pools.locked().len()
    }

    /// Adds a registered engine.
    pub fn insert(&self, e: Arc<EngineEntry>) {
        self.engines.locked().insert(e.lease_id.clone(), e);
    }

    /// Removes an engine (its lease ended).
    pub fn remove(&self, lease_id: &str) -> Option<Arc<EngineEntry>> {
        self.engines.locked().remove(lease_id)
    }

    /// An engine by lease.
    pub fn by_lease(&self, lease_id: &str) -> Option<Arc<EngineEntry>> {
        self.engines.locked().get(lease_id).cloned()
    }

    /// All engines.
    pub fn all(&self) -> Vec<Arc<EngineEntry>> {
        self.engines.locked().values().cloned().collect()
    }

    /// The engine a migration targets: by id, else any attached engine of `model_id`
    /// (and of `digest` when given).
    pub fn target(
        &self,
        engine_id: &str,
        model_id: &str,
        digest: Option<&[u8; 32]>,
    ) -> Option<Arc<EngineEntry>> {
        let want = TargetFilter { engine_id, model_id, digest };
        let all = self.all();
        let facts: Vec<_> = all
            .iter()
            .map(|e| (e.engine_id.as_str(), e.model_id.as_str(), &e.digest, e.attached()))
            .collect();
        choose_target(&want, &facts).map(|i| all[i].clone())
    }
}
