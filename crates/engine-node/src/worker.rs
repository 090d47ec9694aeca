//! The engine worker: one OS thread that owns the compute core (`Engine` over the shared
//! pool) and the prefix cache, and runs jobs one at a time from an mpsc queue — Generate
//! requests from the control service, Recompute and eviction hints from the daemon. Daemon
//! RPCs it needs mid-job (Lookup, Load) run on the tokio runtime through `Handle::block_on`,
//! so while the daemon writes a Load into the pool the worker is blocked and holds no slice
//! of it (the contract `memory` relies on).
//!
//! Block lifecycle per job: own-cache prefix hits (referenced), then fresh blocks (landing
//! blocks for the daemon's Load first, then blocks to compute into, with room for decoding).
//! At the end, every full block joins the cache (a duplicate of a cached hash is freed) and
//! is published with `BlockStored`; the partial tail is freed. Allocation evicts unreferenced
//! cached blocks, least recently used first, and reports them with `BlockRemoved`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_engine::Plane;
use kvferry_engine::{BLOCK_SIZE, Engine, EngineError, PrefillProfile as CoreProfile, Sequence};
use kvferry_layout::{BlockHash, block_hashes};
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::{
    GenerateRequest, GenerateResponse, LoadRequest, LookupRequest, PrefixDigestResponse, PrefixRequest,
    Recompute,
};
use sha2::{Digest, Sha256};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Channel;

use crate::cache::PrefixCache;
use crate::daemon::EventSink;
use crate::error::NodeError;
use crate::memory::ShmKvMemory;

/// Most tokens one Generate may decode.
pub const MAX_NEW_TOKENS: u32 = 1 << 16;

/// One unit of work for the worker.
#[derive(Debug)]
pub enum Job {
    /// A Generate call; the answer goes back on `reply`.
    Generate {
        /// The request.
        req: GenerateRequest,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<GenerateResponse, NodeError>>,
    },
    /// The daemon's Recompute command.
    Recompute(Recompute),
    /// The daemon's eviction hint (hashes).
    Evict(Vec<BlockHash>),
    /// Store synthetic KV for a prompt's full blocks (bench support).
    Fill {
        /// The prompt.
        req: PrefixRequest,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<PrefixDigestResponse, NodeError>>,
    },
    /// Publish every cached block again (`BlockStored`), after a re-registration: the daemon's
    /// index of this engine starts empty.
    Republish,
    /// Digest of the ready prefix's KV bytes.
    PrefixDigest {
        /// The prompt.
        req: PrefixRequest,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<PrefixDigestResponse, NodeError>>,
    },
}

/// Busy time of the worker: finished jobs plus the running one.
#[derive(Debug, Default)]
pub struct BusyClock {
    done: Duration,
    since: Option<Instant>,
}

impl BusyClock {
    /// Total busy time as of `now`.
    pub fn busy_at(&self, now: Instant) -> Duration {
        self.done + self.since.map_or(Duration::ZERO, |s| now.saturating_duration_since(s))
    }
}

/// Figures the worker shares with the load reporter.
#[derive(Debug, Default)]
pub struct Shared {
    /// Jobs queued or running.
    pub queued: AtomicUsize,
    /// Time spent running jobs.
    pub busy: Mutex<BusyClock>,
    /// The profile after the last job (EWMA-refreshed by served prefills).
    pub profile: Mutex<Option<CoreProfile>>,
    /// Signalled when the queue drains, so the daemon hears "idle" at once rather than up to
    /// a report interval late (a stale "busy" would price the next recompute with a queue).
    pub drained: tokio::sync::Notify,
    /// Recomputes queued or running, by session id: whether the daemon cancelled it.
    pub recomputes: Mutex<std::collections::HashMap<String, bool>>,
}

/// Tokens a cancellable recompute computes between two looks at its cancel flag (the prefill
/// is incremental, so the chunks' K/V equal one pass's).
pub const RECOMPUTE_CHUNK_TOKENS: usize = 4 * BLOCK_SIZE;

/// The daemon side of the worker: client, lease, events, RPC deadline. Clones share the
/// client, so a reconnect ([`DaemonLink::set_client`]) reaches the worker too.
#[derive(Debug, Clone)]
pub struct DaemonLink {
    /// Engine API client (replaced on reconnect).
    pub client: Arc<Mutex<EngineClient<Channel>>>,
    /// Attach events (carries the lease id).
    pub events: EventSink,
    /// Runtime to run RPCs on.
    pub handle: Handle,
    /// Deadline per RPC.
    pub timeout: Duration,
}

impl DaemonLink {
    /// The current client.
    pub fn client(&self) -> EngineClient<Channel> {
        self.client.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the client (a new connection to a restarted daemon).
    pub fn set_client(&self, c: EngineClient<Channel>) {
        *self.client.lock().unwrap_or_else(|p| p.into_inner()) = c;
    }
}

/// The worker's state.
#[derive(Debug)]
pub struct Worker {
    engine: Engine<ShmKvMemory>,
    cache: PrefixCache,
    link: DaemonLink,
    shared: Arc<Shared>,
}

/// How a job's prefix was obtained.
#[derive(Debug)]
struct Prepared {
    seq: Sequence,
    /// Leading blocks referenced from the own cache.
    shared: usize,
    /// Prompt tokens not computed (own cache + daemon).
    reused_tokens: usize,
}

fn digest(logits: &[f32]) -> Vec<u8> {
    let mut h = Sha256::new();
    for x in logits {
        h.update(x.to_le_bytes());
    }
    h.finalize().to_vec()
}

impl Worker {
    /// A worker over a built engine (profile measured, pool registered).
    pub fn new(engine: Engine<ShmKvMemory>, link: DaemonLink, shared: Arc<Shared>) -> Self {
        *shared.profile.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = engine.profile().cloned();
        Worker { engine, cache: PrefixCache::new(), link, shared }
    }

    /// Runs jobs until every sender is gone.
    pub fn run(mut self, mut jobs: mpsc::UnboundedReceiver<Job>) {
        while let Some(job) = jobs.blocking_recv() {
            self.shared.busy.lock().unwrap_or_else(std::sync::PoisonError::into_inner).since =
                Some(Instant::now());
            match job {
                Job::Generate { req, reply } => {
                    let _ = reply.send(self.generate(req));
                }
                Job::Recompute(cmd) => self.recompute(cmd),
                Job::Fill { req, reply } => {
                    let _ = reply.send(self.fill(req));
                }
                Job::PrefixDigest { req, reply } => {
                    let _ = reply.send(self.prefix_digest(req));
                }
                Job::Republish => self.republish(),
                Job::Evict(hashes) => {
                    let gone = self.cache.evict_hashes(&hashes);
                    self.free_evicted(gone);
                }
            }
            {
                let mut busy = self.shared.busy.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let now = Instant::now();
                busy.done = busy.busy_at(now);
                busy.since = None;
            }
            *self.shared.profile.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                self.engine.profile().cloned();
            if self.shared.queued.fetch_sub(1, Ordering::Relaxed) == 1 {
                self.shared.drained.notify_one();
            }
        }
        tracing::debug!("engine worker: job queue closed, exiting");
    }

    /// Publishes every cached block again (each tenant's blocks in one `BlockStored`).
    fn republish(&self) {
        let held = self.cache.held();
        let blocks: usize = held.iter().map(|(_, v)| v.len()).sum();
        for (tenant, v) in &held {
            self.link.events.stored(tenant, v);
        }
        tracing::info!(blocks, tenants = held.len(), "cached blocks published again");
    }

    fn free_evicted(&mut self, gone: Vec<(u32, BlockHash)>) {
        if gone.is_empty() {
            return;
        }
        let (ids, hashes): (Vec<u32>, Vec<BlockHash>) = gone.into_iter().unzip();
        // Tell the daemon before the ids can be reused for other content.
        self.link.events.removed(&hashes);
        self.engine.release_blocks(&ids);
    }

    /// `n` fresh blocks, evicting unreferenced cached blocks when the free list is short.
    fn allocate(&mut self, n: usize) -> Result<Vec<u32>, NodeError> {
        let free = self.engine.free_blocks();
        if n > free + self.cache.evictable() {
            return Err(kvferry_engine::OutOfBlocks { wanted: n, free: free + self.cache.evictable() }.into());
        }
        if n > free {
            let gone = self.cache.evict_lru(n - free);
            self.free_evicted(gone);
        }
        Ok(self.engine.allocate_blocks(n)?)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), NodeError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt.into());
        }
        let vocab = self.engine.config().vocab;
        if let Some(i) = tokens.iter().position(|&t| t as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { token: tokens[i], position: i, vocab }.into());
        }
        Ok(())
    }

    /// Leading full blocks of `tokens` that are ready in the region (daemon Lookup), checked
    /// against our own hashes; 0 when the daemon cannot say.
    fn lookup(&self, tenant: &str, tokens: &[u32], hashes: &[BlockHash]) -> usize {
        let req = LookupRequest {
            lease_id: self.link.events.lease_id(),
            tenant: tenant.to_owned(),
            token_ids: tokens.to_vec(),
        };
        let mut client = self.link.client();
        let timeout = self.link.timeout;
        // Futures are built inside the runtime context (timers need its driver).
        let res =
            self.link.handle.block_on(async move { tokio::time::timeout(timeout, client.lookup(req)).await });
        let resp = match res {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => {
                tracing::warn!(%status, "daemon Lookup failed; computing locally");
                return 0;
            }
            Err(_) => {
                tracing::warn!("daemon Lookup timed out; computing locally");
                return 0;
            }
        };
        let mut ready = (resp.ready_tokens / BLOCK_SIZE as u64).min(hashes.len() as u64) as usize;
        if !resp.block_hashes.is_empty() {
            let agree = resp
                .block_hashes
                .iter()
                .zip(hashes)
                .take_while(|(a, b)| a.as_slice() == b.as_slice())
                .count();
            if agree < ready {
                tracing::warn!(
                    ready,
                    agree,
                    "daemon Lookup hashes disagree with ours; using the agreeing prefix"
                );
                ready = agree;
            }
        }
        ready
    }

    /// `Engine.Load` of `hashes` into `ids`; returns how many leading blocks are valid.
    fn load(&self, tenant: &str, hashes: &[BlockHash], ids: &[u32]) -> usize {
        let req = LoadRequest {
            lease_id: self.link.events.lease_id(),
            tenant: tenant.to_owned(),
            block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
            block_ids: ids.to_vec(),
        };
        let mut client = self.link.client();
        // The worker blocks here: no slice of the pool is live while the daemon writes.
        let timeout = self.link.timeout;
        match self.link.handle.block_on(async move { tokio::time::timeout(timeout, client.load(req)).await })
        {
            Ok(Ok(r)) => (r.into_inner().blocks_loaded as usize).min(ids.len()),
            Ok(Err(status)) => {
                tracing::warn!(%status, blocks = ids.len(), "daemon Load failed; recomputing those blocks");
                0
            }
            Err(_) => {
                tracing::warn!(blocks = ids.len(), "daemon Load timed out; recomputing those blocks");
                0
            }
        }
    }

    /// Blocks for `tokens` (+ `extra` decode slots): own-cache prefix, daemon-loaded blocks,
    /// fresh blocks. `need_logits`: the last token must be computed, so the block holding it
    /// is never taken from a cache (shared blocks are never written).
    fn prepare(
        &mut self,
        tenant: &str,
        tokens: &[u32],
        extra: usize,
        use_cache: bool,
        need_logits: bool,
    ) -> Result<Prepared, NodeError> {
        let hashes = block_hashes(tenant.as_bytes(), tokens, BLOCK_SIZE as u32);
        let usable = if need_logits { (tokens.len() - 1) / BLOCK_SIZE } else { tokens.len() / BLOCK_SIZE };
        let usable = &hashes[..usable.min(hashes.len())];
        let own = if use_cache { self.cache.acquire_prefix(usable) } else { Vec::new() };
        let k = own.len();
        let ready = if use_cache && k < usable.len() { self.lookup(tenant, tokens, usable) } else { 0 };
        let to_load = ready.saturating_sub(k);
        let total = (tokens.len() + extra).div_ceil(BLOCK_SIZE);
        let fresh = match self.allocate(total - k) {
            Ok(f) => f,
            Err(e) => {
                self.release_refs(&own);
                return Err(e);
            }
        };
        let loaded =
            if to_load > 0 { self.load(tenant, &usable[k..k + to_load], &fresh[..to_load]) } else { 0 };
        let blocks: Vec<u32> = own.iter().chain(&fresh).copied().collect();
        let mut seq = match self.engine.start_with_blocks(tokens, blocks) {
            Ok(s) => s,
            Err(e) => {
                self.release_refs(&own);
                self.engine.release_blocks(&fresh);
                return Err(e.into());
            }
        };
        let reused_tokens = (k + loaded) * BLOCK_SIZE;
        if reused_tokens > 0 {
            // Cannot fail: reused_tokens <= tokens.len() and nothing is computed yet.
            self.engine.mark_loaded(&mut seq, reused_tokens)?;
        }
        tracing::debug!(tenant, tokens = tokens.len(), own = k, ready, loaded, "prefix prepared");
        Ok(Prepared { seq, shared: k, reused_tokens })
    }

    fn release_refs(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            self.cache.release(b);
        }
    }

    /// Ends a job's sequence: shared blocks lose their reference, full computed blocks join
    /// the cache (tail first, so the tail is evicted first) and are published when `publish`,
    /// the rest is freed.
    fn finish(&mut self, tenant: &str, seq: Sequence, shared: usize, publish: bool) -> usize {
        let full = if publish { seq.computed() / BLOCK_SIZE } else { shared };
        let hashes = block_hashes(tenant.as_bytes(), &seq.tokens()[..full * BLOCK_SIZE], BLOCK_SIZE as u32);
        let blocks = seq.into_blocks();
        let mut stored = Vec::new();
        let mut free = Vec::new();
        for (i, &b) in blocks.iter().enumerate().rev() {
            if i < shared {
                self.cache.release(b);
            } else if i < full && self.cache.insert(tenant, hashes[i], b) {
                stored.push((hashes[i], b));
            } else {
                free.push(b);
            }
        }
        self.engine.release_blocks(&free);
        stored.reverse();
        self.link.events.stored(tenant, &stored);
        full * BLOCK_SIZE
    }

    fn generate(&mut self, req: GenerateRequest) -> Result<GenerateResponse, NodeError> {
        self.check_tokens(&req.token_ids)?;
        if req.max_new_tokens > MAX_NEW_TOKENS {
            return Err(NodeError::InvalidRequest(format!(
                "max_new_tokens {} exceeds {MAX_NEW_TOKENS}",
                req.max_new_tokens
            )));
        }
        let t0 = Instant::now();
        let steps = req.max_new_tokens as usize;
        let p = self.prepare(&req.tenant, &req.token_ids, steps, req.use_cache, true)?;
        let (mut seq, shared) = (p.seq, p.shared);
        let run = (|| -> Result<(Vec<f32>, f64, Vec<u32>), NodeError> {
            let logits = self.engine.prefill(&mut seq)?;
            let prefill_s = t0.elapsed().as_secs_f64();
            let new_tokens = self.engine.decode(&mut seq, steps)?;
            Ok((logits, prefill_s, new_tokens))
        })();
        match run {
            Ok((logits, prefill_s, new_tokens)) => {
                self.finish(&req.tenant, seq, shared, true);
                let prompt = req.token_ids.len();
                Ok(GenerateResponse {
                    new_tokens,
                    loaded_tokens: p.reused_tokens as u64,
                    computed_tokens: (prompt - p.reused_tokens) as u64,
                    logits_digest: digest(&logits),
                    prefill_s,
                })
            }
            Err(e) => {
                self.finish(&req.tenant, seq, shared, false);
                Err(e)
            }
        }
    }

    /// SHA-256 over the pool bytes of `blocks` (each: every layer's K then V).
    fn digest_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>, NodeError> {
        let pool = self.engine.pool();
        let mut h = Sha256::new();
        for &b in blocks {
            for l in 0..self.engine.layout().layers {
                h.update(pool.block(l, Plane::K, b).map_err(EngineError::from)?);
                h.update(pool.block(l, Plane::V, b).map_err(EngineError::from)?);
            }
        }
        Ok(h.finalize().to_vec())
    }

    /// Bench support: the prompt's full blocks get synthetic KV — bytes from an xorshift
    /// stream seeded by each block's hash, so any region can regenerate them — and are cached
    /// and published exactly like computed blocks.
    fn fill(&mut self, req: PrefixRequest) -> Result<PrefixDigestResponse, NodeError> {
        self.check_tokens(&req.token_ids)?;
        let t0 = Instant::now();
        let full = req.token_ids.len() / BLOCK_SIZE;
        if full == 0 {
            return Err(NodeError::InvalidRequest(format!(
                "Fill needs at least one full block ({BLOCK_SIZE} tokens)"
            )));
        }
        let tokens = &req.token_ids[..full * BLOCK_SIZE];
        let hashes = block_hashes(req.tenant.as_bytes(), tokens, BLOCK_SIZE as u32);
        let p = self.prepare(&req.tenant, tokens, 0, false, false)?;
        let mut seq = p.seq;
        let blocks = seq.table().blocks().to_vec();
        let layers = self.engine.layout().layers;
        for (hash, &b) in hashes.iter().zip(&blocks) {
            let mut x = u64::from_le_bytes(hash[..8].try_into().expect("8 bytes")) | 1;
            for l in 0..layers {
                for plane in [Plane::K, Plane::V] {
                    let dst = self.engine.pool_mut().block_mut(l, plane, b).map_err(EngineError::from)?;
                    for w in dst.chunks_mut(8) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
                    }
                }
            }
        }
        let digest = self.digest_blocks(&blocks)?;
        if let Err(e) = self.engine.mark_loaded(&mut seq, tokens.len()) {
            self.finish(&req.tenant, seq, p.shared, false);
            return Err(e.into());
        }
        self.finish(&req.tenant, seq, p.shared, true);
        Ok(PrefixDigestResponse {
            tokens: tokens.len() as u64,
            digest,
            bytes: (blocks.len() * self.engine.layout().payload_bytes()) as u64,
            loaded_tokens: 0,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// The digest of the ready prefix (own cache, then the daemon's Load), computing nothing.
    fn prefix_digest(&mut self, req: PrefixRequest) -> Result<PrefixDigestResponse, NodeError> {
        self.check_tokens(&req.token_ids)?;
        let t0 = Instant::now();
        let p = self.prepare(&req.tenant, &req.token_ids, 0, true, false)?;
        let ready = p.reused_tokens / BLOCK_SIZE;
        let blocks = p.seq.table().blocks()[..ready].to_vec();
        let digest = self.digest_blocks(&blocks);
        self.finish(&req.tenant, p.seq, p.shared, true);
        Ok(PrefixDigestResponse {
            tokens: (ready * BLOCK_SIZE) as u64,
            digest: digest?,
            bytes: (ready * self.engine.layout().payload_bytes()) as u64,
            loaded_tokens: ((ready - p.shared) * BLOCK_SIZE) as u64,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Whether the daemon cancelled the recompute `session`.
    fn cancelled(&self, session: &str) -> bool {
        self.shared
            .recomputes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(session)
            .copied()
            .unwrap_or(false)
    }

    /// Runs the daemon's Recompute, in chunks of [`RECOMPUTE_CHUNK_TOKENS`] with a look at its
    /// cancel flag before each: a cancelled recompute stops (keeping and publishing the full
    /// blocks computed so far) and answers with `cancelled`; one still queued never starts.
    fn recompute(&mut self, cmd: Recompute) {
        let t0 = Instant::now();
        let mut stopped = false;
        let res = if self.cancelled(&cmd.session_id) {
            stopped = true;
            Ok(0)
        } else {
            self.check_tokens(&cmd.token_ids).and_then(|()| {
                let p = self.prepare(&cmd.tenant, &cmd.token_ids, 0, true, false)?;
                let mut seq = p.seq;
                let len = cmd.token_ids.len();
                let mut done = Ok(());
                while seq.computed() < len {
                    if self.cancelled(&cmd.session_id) {
                        stopped = true;
                        break;
                    }
                    let end = (seq.computed() + RECOMPUTE_CHUNK_TOKENS).min(len);
                    done = self.engine.prefill_to(&mut seq, end);
                    if done.is_err() {
                        break;
                    }
                }
                match done {
                    Ok(()) => Ok(self.finish(&cmd.tenant, seq, p.shared, true)),
                    Err(e) => {
                        self.finish(&cmd.tenant, seq, p.shared, false);
                        Err(NodeError::from(e))
                    }
                }
            })
        };
        self.shared
            .recomputes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&cmd.session_id);
        let seconds = t0.elapsed().as_secs_f64();
        match res {
            Ok(ready) => {
                if stopped {
                    tracing::info!(session = ?cmd.session_id, ready, seconds, "recompute cancelled by the daemon");
                } else {
                    tracing::info!(session = ?cmd.session_id, ready, seconds, "recompute done");
                }
                self.link.events.recompute_done(
                    cmd.session_id,
                    ready as u64,
                    seconds,
                    String::new(),
                    stopped,
                );
            }
            Err(e) => {
                tracing::warn!(session = ?cmd.session_id, error = %e, "recompute failed");
                self.link.events.recompute_done(cmd.session_id, 0, seconds, e.to_string(), false);
            }
        }
    }
}

/// The sending side of the worker's queue; counts queued jobs for load reports.
#[derive(Debug, Clone)]
pub struct JobQueue {
    tx: mpsc::UnboundedSender<Job>,
    shared: Arc<Shared>,
}

impl JobQueue {
    /// A queue and its receiving end (for [`Worker::run`]).
    pub fn new(shared: Arc<Shared>) -> (Self, mpsc::UnboundedReceiver<Job>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (JobQueue { tx, shared }, rx)
    }

    /// Notes a Recompute about to be queued (so a CancelRecompute can find it).
    pub fn recompute_queued(&self, session: &str) {
        self.shared
            .recomputes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(session.to_owned(), false);
    }

    /// Flags the queued or running recompute `session` as cancelled; `false` when there is
    /// none (it already answered).
    pub fn cancel_recompute(&self, session: &str) -> bool {
        self.shared
            .recomputes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_mut(session)
            .map(|c| *c = true)
            .is_some()
    }

    /// Queues a job; fails when the worker is gone.
    pub fn submit(&self, job: Job) -> Result<(), NodeError> {
        self.shared.queued.fetch_add(1, Ordering::Relaxed);
        self.tx.send(job).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            NodeError::WorkerGone("job queue closed".into())
        })
    }

    /// Runs a Fill on the worker and waits for its answer.
    pub async fn fill(&self, req: PrefixRequest) -> Result<PrefixDigestResponse, NodeError> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Fill { req, reply })?;
        rx.await.map_err(|_| NodeError::WorkerGone("the worker dropped the request".into()))?
    }

    /// Runs a PrefixDigest on the worker and waits for its answer.
    pub async fn prefix_digest(&self, req: PrefixRequest) -> Result<PrefixDigestResponse, NodeError> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::PrefixDigest { req, reply })?;
        rx.await.map_err(|_| NodeError::WorkerGone("the worker dropped the request".into()))?
    }

    /// Runs a Generate on the worker and waits for its answer.
    pub async fn generate(&self, req: GenerateRequest) -> Result<GenerateResponse, NodeError> {
        let (reply, rx) = oneshot::channel();
        self.submit(Job::Generate { req, reply })?;
        rx.await.map_err(|_| NodeError::WorkerGone("the worker dropped the request".into()))?
    }
}
