//! Registered engines: their pools (layout, backend), leases, measured prefill profiles, the
//! blocks they hold (hash → block id, per tenant), and the command channel of their Attach
//! stream. Also the shm pools handed over the fd-passing socket, waiting for `RegisterPool`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvferry_layout::{BlockHash, LayoutFingerprint, PoolLayout};
use kvferry_pool::MemoryBackend;
use kvferry_proto::v1::DaemonCommand;
use tokio::sync::mpsc;

/// A measured prefill profile: `seconds(c, n) = a·n + b·(n·c + n(n+1)/2)`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Profile {
    pub linear_s_per_token: f64,
    pub attention_s_per_pair: f64,
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
    /// hash → (block id, tenant)
    pub blocks: Mutex<HashMap<BlockHash, (u32, String)>>,
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
        self.blocks.lock().ok()?.get(h).filter(|(_, t)| t == tenant).map(|(id, _)| *id)
    }

    /// Whether the engine's Attach stream is live.
    pub fn attached(&self) -> bool {
        self.commands.lock().map(|c| c.as_ref().is_some_and(|s| !s.is_closed())).unwrap_or(false)
    }
}

/// A pool received over the fd socket: model id, the layout it was offered with, its backend.
pub type PendingPool = (String, Option<PoolLayout>, Arc<dyn MemoryBackend>);

/// All engines of this region.
#[derive(Default)]
pub struct Registry {
    engines: Mutex<HashMap<String, Arc<EngineEntry>>>,
    /// Pools received over the fd-passing socket: token → (model id, layout, backend).
    pending_pools: Mutex<HashMap<String, PendingPool>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("engines", &self.all().len()).finish_non_exhaustive()
    }
}

impl Registry {
    /// Holds a pool handed over the fd socket until `RegisterPool` claims it.
    pub fn add_pending_pool(
        &self,
        token: String,
        model_id: String,
        layout: Option<PoolLayout>,
        backend: Arc<dyn MemoryBackend>,
    ) {
        if let Ok(mut m) = self.pending_pools.lock() {
            m.insert(token, (model_id, layout, backend));
        }
    }

    /// Claims a pending pool.
    pub fn take_pending_pool(&self, token: &str) -> Option<PendingPool> {
        self.pending_pools.lock().ok()?.remove(token)
    }

    /// Adds a registered engine.
    pub fn insert(&self, e: Arc<EngineEntry>) {
        if let Ok(mut m) = self.engines.lock() {
            m.insert(e.lease_id.clone(), e);
        }
    }

    /// Removes an engine (its lease ended).
    pub fn remove(&self, lease_id: &str) -> Option<Arc<EngineEntry>> {
        self.engines.lock().ok()?.remove(lease_id)
    }

    /// An engine by lease.
    pub fn by_lease(&self, lease_id: &str) -> Option<Arc<EngineEntry>> {
        self.engines.lock().ok()?.get(lease_id).cloned()
    }

    /// All engines.
    pub fn all(&self) -> Vec<Arc<EngineEntry>> {
        self.engines.lock().map(|m| m.values().cloned().collect()).unwrap_or_default()
    }

    /// The engine a migration targets: by id, else any attached engine of `model_id`
    /// (and of `digest` when given).
    pub fn target(
        &self,
        engine_id: &str,
        model_id: &str,
        digest: Option<&[u8; 32]>,
    ) -> Option<Arc<EngineEntry>> {
        let all = self.all();
        let mut c: Vec<_> = all
            .into_iter()
            .filter(|e| engine_id.is_empty() || e.engine_id == engine_id)
            .filter(|e| model_id.is_empty() || e.model_id == model_id)
            .filter(|e| digest.is_none_or(|d| *d == e.digest))
            .collect();
        c.sort_by_key(|e| (!e.attached(), e.engine_id.clone()));
        c.into_iter().next()
    }
}
