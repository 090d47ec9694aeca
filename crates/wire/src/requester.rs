//! The requesting side of one transfer (sans-IO).
//!
//! Owns: which chunks have verified, retries, the digest check, resume after a lost connection,
//! and the deadline. It never touches memory: [`Requester::on_chunk`] answers
//! [`ChunkVerdict::Land`] only for a payload whose checksum and header matched the plan, and
//! the caller lands exactly those bytes. Blocks become valid only when the machine reaches
//! `Committed` (every chunk verified and both digests equal); on any failure nothing it touched
//! is valid. Time is passed in as nanoseconds on the caller's clock.
//!
//! Calling contract (as quinn-proto's): feed every frame in through `on_*`, send what
//! [`Requester::poll_transmit`] returns, and call [`Requester::on_timer`] (then check
//! [`Requester::stalled`]) no later than [`Requester::poll_timeout`]; the driver needs no tick
//! of its own.

use std::collections::VecDeque;

use crate::checksum::{Summed, transfer_digest};
use crate::error::WireError;
use crate::frame::{
    BlockHash, ChunkHeader, Complete, Done, FetchRequest, Frame, Manifest, Refusal, Retransmit,
};
use crate::plan::{ChunkPlan, ChunkSpec};
use crate::state::{Event, Machine, State};

/// What the requester expects and tolerates.
#[derive(Debug, Clone, Copy)]
pub struct RequesterConfig {
    /// Layers per block in our layout.
    pub layers: u32,
    /// Bytes of one block in one layer in our layout.
    pub bytes_per_block_layer: u64,
    /// Chunk size to ask for.
    pub chunk_target_bytes: u32,
    /// Re-fetches allowed per chunk after failed verification.
    pub max_retries_per_chunk: u32,
    /// Absolute deadline, ns on the caller's clock.
    pub deadline_ns: u64,
    /// After the owner's `Done`, how long to wait for in-flight chunks before re-requesting the
    /// missing ones.
    pub missing_grace_ns: u64,
    /// With no progress (manifest, verified chunk, done) for this long the transfer counts as
    /// stalled and the driver should resume it on a new connection.
    pub stall_timeout_ns: u64,
}

/// What to do with a received chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkVerdict {
    /// Verified: land the payload at this chunk's place.
    Land(ChunkSpec),
    /// Already verified earlier: drop it.
    Duplicate,
    /// Failed verification: dropped, a retransmit is queued.
    Corrupt { chunk: u32 },
    /// Arrived before the manifest (chunks ride other streams than the control frames and
    /// may overtake it): the driver holds the chunk and feeds it again after
    /// [`Requester::on_manifest`]. Nothing was checked yet.
    Early,
    /// Not part of the plan or a stale transfer: dropped.
    Ignored,
}

/// One transfer, requester side.
#[derive(Debug)]
pub struct Requester {
    transfer_id: u128,
    tenant: String,
    fingerprint: [u8; 32],
    hashes: Vec<BlockHash>,
    cfg: RequesterConfig,
    machine: Machine,
    plan: Option<ChunkPlan>,
    blocks_held: u32,
    checksums: Vec<Option<u128>>,
    verified: u32,
    verified_bytes: u64,
    retries: Vec<u32>,
    owner_digest: Option<(u128, u64)>,
    outbox: VecDeque<Frame>,
    retransmit_asked_at: Option<u64>,
    last_progress_ns: u64,
}

impl Requester {
    /// Starts a transfer of `hashes` (prefix order).
    pub fn new(
        transfer_id: u128,
        tenant: String,
        fingerprint: [u8; 32],
        hashes: Vec<BlockHash>,
        cfg: RequesterConfig,
    ) -> Self {
        Self {
            transfer_id,
            tenant,
            fingerprint,
            hashes,
            cfg,
            machine: Machine::default(),
            plan: None,
            blocks_held: 0,
            checksums: Vec::new(),
            verified: 0,
            verified_bytes: 0,
            retries: Vec::new(),
            owner_digest: None,
            outbox: VecDeque::new(),
            retransmit_asked_at: None,
            last_progress_ns: 0,
        }
    }

    /// The transfer id.
    pub fn transfer_id(&self) -> u128 {
        self.transfer_id
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.machine.state()
    }

    /// The request to send on a (new) connection; lists the chunks already verified.
    pub fn request(&self) -> FetchRequest {
        FetchRequest {
            transfer_id: self.transfer_id,
            tenant: self.tenant.clone(),
            fingerprint: self.fingerprint,
            block_hashes: self.hashes.clone(),
            have_chunks: (0..self.checksums.len() as u32)
                .filter(|&i| self.checksums[i as usize].is_some())
                .collect(),
            chunk_target_bytes: self.cfg.chunk_target_bytes,
        }
    }

    /// The plan, once a manifest arrived.
    pub fn plan(&self) -> Option<&ChunkPlan> {
        self.plan.as_ref()
    }

    /// Blocks the owner holds (valid here only once committed).
    pub fn blocks_held(&self) -> u32 {
        self.blocks_held
    }

    /// Payload bytes verified so far.
    pub fn verified_bytes(&self) -> u64 {
        self.verified_bytes
    }

    /// Whether every chunk of layer group 0 (the first layers) has verified.
    pub fn first_layer_verified(&self) -> bool {
        match &self.plan {
            None => false,
            Some(p) => {
                p.chunks().filter(|c| c.layers.0 == 0).all(|c| self.checksums[c.id as usize].is_some())
            }
        }
    }

    /// Number of blocks valid for readers: all held blocks once committed, otherwise zero.
    pub fn valid_blocks(&self) -> u32 {
        if self.state() == State::Committed { self.blocks_held } else { 0 }
    }

    /// Frames to send to the owner (retransmit requests, completion).
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.outbox.pop_front()
    }

    fn fail(&mut self, e: WireError) -> WireError {
        let _ = self.machine.apply(Event::Fail);
        e
    }

    fn check_deadline(&mut self, now_ns: u64) -> Result<(), WireError> {
        if now_ns >= self.cfg.deadline_ns {
            return Err(self.fail(WireError::DeadlineExceeded));
        }
        Ok(())
    }

    /// The owner's manifest.
    pub fn on_manifest(&mut self, now_ns: u64, m: &Manifest) -> Result<(), WireError> {
        self.check_deadline(now_ns)?;
        if m.transfer_id != self.transfer_id {
            return Err(self.fail(WireError::Protocol("manifest for another transfer".into())));
        }
        let mismatch = |field, ours: u64, theirs: u64| WireError::LayoutMismatch { field, ours, theirs };
        if m.layers != self.cfg.layers {
            return Err(self.fail(mismatch("layers", self.cfg.layers.into(), m.layers.into())));
        }
        if m.bytes_per_block_layer != self.cfg.bytes_per_block_layer {
            return Err(self.fail(mismatch(
                "bytes_per_block_layer",
                self.cfg.bytes_per_block_layer,
                m.bytes_per_block_layer,
            )));
        }
        if m.blocks_held == 0 || m.blocks_held as usize > self.hashes.len() {
            return Err(self.fail(WireError::Protocol(format!(
                "manifest holds {} of {} requested blocks",
                m.blocks_held,
                self.hashes.len()
            ))));
        }
        let plan =
            ChunkPlan::new(m.blocks_held, m.layers, m.bytes_per_block_layer, m.chunk_target_bytes.into())
                .ok_or_else(|| WireError::Protocol("empty chunk plan".into()))?;
        if self.state() != State::Requested && self.plan == Some(plan) {
            // The same manifest again (a duplicated frame): nothing changes.
            return Ok(());
        }
        if plan.count() != m.chunk_count || plan.total_bytes() != m.total_bytes {
            return Err(self.fail(WireError::Protocol("manifest totals do not match its plan".into())));
        }
        match &self.plan {
            Some(old) if *old != plan => {
                return Err(self.fail(WireError::Protocol("resumed manifest changed the chunk plan".into())));
            }
            Some(_) => {}
            None => {
                self.checksums = vec![None; plan.count() as usize];
                self.retries = vec![0; plan.count() as usize];
                self.plan = Some(plan);
                self.blocks_held = m.blocks_held;
            }
        }
        self.machine.apply(Event::Manifest)?;
        self.last_progress_ns = now_ns;
        if self.verified == plan.count() {
            self.machine.apply(Event::AllChunks)?;
        }
        Ok(())
    }

    /// A typed refusal ends the transfer.
    pub fn on_refusal(&mut self, r: &Refusal) -> WireError {
        self.fail(WireError::Refused { code: r.code, detail: r.detail.clone() })
    }

    /// A chunk header and its payload.
    pub fn on_chunk(
        &mut self,
        now_ns: u64,
        h: &ChunkHeader,
        payload: &[u8],
    ) -> Result<ChunkVerdict, WireError> {
        let summed = Summed::of(h.transfer_id, h.chunk_id, payload);
        self.on_chunk_summed(now_ns, h, &summed)
    }

    /// [`Requester::on_chunk`] for a payload the driver already hashed ([`Summed::of`] with the
    /// header's transfer and chunk id), so the hashing can run off the network thread. A sum
    /// computed for another transfer or chunk does not verify.
    pub fn on_chunk_summed(
        &mut self,
        now_ns: u64,
        h: &ChunkHeader,
        summed: &Summed,
    ) -> Result<ChunkVerdict, WireError> {
        self.check_deadline(now_ns)?;
        if h.transfer_id != self.transfer_id || self.machine.is_terminal() {
            return Ok(ChunkVerdict::Ignored);
        }
        if self.state() == State::Requested {
            return Ok(ChunkVerdict::Early);
        }
        if !matches!(self.state(), State::Manifest | State::Streaming | State::Verifying) {
            // A late chunk from a connection we already gave up on.
            return Ok(ChunkVerdict::Ignored);
        }
        let Some(plan) = self.plan else { return Ok(ChunkVerdict::Ignored) };
        let Some(spec) = plan.chunk(h.chunk_id) else { return Ok(ChunkVerdict::Ignored) };
        let idx = spec.id as usize;
        if self.checksums[idx].is_some() {
            return Ok(ChunkVerdict::Duplicate);
        }
        let header_ok = h.blocks == spec.blocks && h.layers == spec.layers && h.len == spec.len;
        let payload_ok = header_ok
            && summed.len() == spec.len
            && summed.checksum_for(self.transfer_id, spec.id) == Some(h.checksum);
        if !payload_ok {
            self.retries[idx] += 1;
            if self.retries[idx] > self.cfg.max_retries_per_chunk {
                let attempts = self.retries[idx];
                return Err(self.fail(WireError::TooManyRetries { chunk: spec.id, attempts }));
            }
            self.outbox.push_back(Frame::Retransmit(Retransmit {
                transfer_id: self.transfer_id,
                chunk_ids: vec![spec.id],
            }));
            return Ok(ChunkVerdict::Corrupt { chunk: spec.id });
        }
        self.checksums[idx] = Some(h.checksum);
        self.verified += 1;
        self.verified_bytes += spec.len;
        self.last_progress_ns = now_ns;
        self.machine.apply(Event::Chunk)?;
        if self.verified == plan.count() {
            self.machine.apply(Event::AllChunks)?;
            self.try_commit()?;
        }
        Ok(ChunkVerdict::Land(spec))
    }

    /// The owner's `Done`: every chunk was sent at least once.
    pub fn on_done(&mut self, now_ns: u64, d: &Done) -> Result<(), WireError> {
        self.check_deadline(now_ns)?;
        if d.transfer_id != self.transfer_id {
            return Err(self.fail(WireError::Protocol("done for another transfer".into())));
        }
        // A `Done` may overtake the manifest on a reordering path; it is kept until the plan
        // is known and every chunk verified.
        self.owner_digest = Some((d.digest, now_ns));
        self.retransmit_asked_at = None;
        self.last_progress_ns = now_ns;
        self.try_commit()
    }

    /// Periodic: the deadline, and chunks still missing a grace period after `Done`.
    pub fn on_timer(&mut self, now_ns: u64) -> Result<(), WireError> {
        if self.machine.is_terminal() {
            return Ok(());
        }
        self.check_deadline(now_ns)?;
        // Ask again for missing chunks a grace period after `Done`, and again a grace period
        // after each unanswered ask.
        let since = self.retransmit_asked_at.or(self.owner_digest.map(|(_, at)| at));
        if let Some(at) = since
            && now_ns.saturating_sub(at) >= self.cfg.missing_grace_ns
        {
            let missing: Vec<u32> =
                (0..self.checksums.len() as u32).filter(|&i| self.checksums[i as usize].is_none()).collect();
            if !missing.is_empty() {
                self.retransmit_asked_at = Some(now_ns);
                self.outbox.push_back(Frame::Retransmit(Retransmit {
                    transfer_id: self.transfer_id,
                    chunk_ids: missing,
                }));
            }
        }
        Ok(())
    }

    /// When the driver must next call [`Self::on_timer`] and check [`Self::stalled`], ns on the
    /// caller's clock: the earliest of the deadline, the stall timeout after the last progress,
    /// and (chunks missing after the owner's `Done`) the end of the retransmit grace. `None`
    /// once the transfer ended. May lie in the past: the timer is due now.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.machine.is_terminal() {
            return None;
        }
        let mut at =
            self.cfg.deadline_ns.min(self.last_progress_ns.saturating_add(self.cfg.stall_timeout_ns));
        let missing = self.checksums.iter().any(Option::is_none);
        if missing && let Some(since) = self.retransmit_asked_at.or(self.owner_digest.map(|(_, at)| at)) {
            at = at.min(since.saturating_add(self.cfg.missing_grace_ns));
        }
        Some(at)
    }

    /// Whether nothing has progressed for the stall timeout: the driver should treat the
    /// connection as lost and resume.
    pub fn stalled(&self, now_ns: u64) -> bool {
        !self.machine.is_terminal()
            && now_ns.saturating_sub(self.last_progress_ns) >= self.cfg.stall_timeout_ns
    }

    /// The connection died: returns the request for a new connection (resume), or the error
    /// that ends the transfer.
    pub fn on_connection_lost(&mut self, now_ns: u64) -> Result<FetchRequest, WireError> {
        if self.machine.is_terminal() {
            return Err(WireError::Protocol(format!("transfer already {:?}", self.state())));
        }
        self.check_deadline(now_ns)?;
        self.machine.apply(Event::Reconnect)?;
        self.owner_digest = None;
        self.retransmit_asked_at = None;
        self.last_progress_ns = now_ns;
        self.outbox.clear();
        Ok(self.request())
    }

    /// Cancels the transfer locally; nothing becomes valid.
    pub fn cancel(&mut self, why: &str) -> WireError {
        self.fail(WireError::Cancelled(why.to_owned()))
    }

    fn try_commit(&mut self) -> Result<(), WireError> {
        let Some((digest, _)) = self.owner_digest else { return Ok(()) };
        if self.state() != State::Verifying {
            return Ok(());
        }
        let sums: Vec<u128> = self.checksums.iter().map(|c| c.unwrap_or_default()).collect();
        if transfer_digest(self.transfer_id, &sums) != digest {
            return Err(self.fail(WireError::DigestMismatch));
        }
        self.machine.apply(Event::DigestOk)?;
        self.outbox.push_back(Frame::Complete(Complete { transfer_id: self.transfer_id }));
        Ok(())
    }
}
