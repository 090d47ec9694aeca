//! The owning side of one transfer (sans-IO).
//!
//! Owns: the chunk queue, which chunks still need sending or checksumming, retransmits, and the
//! transfer digest. The caller decides whether the request is acceptable (tenant, fingerprint,
//! which blocks it holds) before calling [`Owner::accept`]; it then asks [`Owner::next_work`]
//! for the next chunk, reads that chunk's bytes from its pool, and hands them back through
//! [`Owner::chunk_ready`], which returns the header to send. Chunks the requester already
//! holds (resume) are read and checksummed but not sent, so the digest covers every chunk and a
//! source that changed between connections is caught.

use std::collections::VecDeque;

use crate::checksum::{Summed, transfer_digest};
use crate::error::{LocalError, WireError};
use crate::frame::{ChunkHeader, Done, FetchRequest, Manifest, Refusal, RefusalCode};
use crate::plan::{ChunkPlan, ChunkSpec, MAX_CHUNK, MIN_CHUNK};
use crate::state::{Event, Machine, State};

/// Next thing the owner needs bytes for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Read the chunk and send it.
    Send(ChunkSpec),
    /// Read the chunk for the digest only (the requester already has it).
    ChecksumOnly(ChunkSpec),
}

impl Work {
    /// The chunk either way.
    pub fn spec(&self) -> ChunkSpec {
        match *self {
            Work::Send(s) | Work::ChecksumOnly(s) => s,
        }
    }
}

/// Resend requests allowed per transfer, as a multiple of its chunk count.
const RETRANSMIT_BUDGET_FACTOR: u32 = 4;

/// One transfer, owner side.
#[derive(Debug)]
pub struct Owner {
    transfer_id: u128,
    machine: Machine,
    plan: ChunkPlan,
    checksums: Vec<Option<u128>>,
    queue: VecDeque<Work>,
    retransmit_budget: u32,
    done_sent: bool,
}

impl Owner {
    /// Accepts a request for which the caller found the first `blocks_held` blocks, with the
    /// given layout numbers. Returns the manifest to send, or a refusal.
    pub fn accept(
        req: &FetchRequest,
        blocks_held: u32,
        layers: u32,
        bytes_per_block_layer: u64,
    ) -> Result<(Self, Manifest), Refusal> {
        let refuse = |code, detail: String| Refusal { transfer_id: req.transfer_id, code, detail };
        if blocks_held == 0 {
            return Err(refuse(
                RefusalCode::UnknownBlocks,
                "none of the requested blocks are held here".into(),
            ));
        }
        if blocks_held as usize > req.block_hashes.len() {
            return Err(refuse(RefusalCode::Internal, "holds more blocks than requested".into()));
        }
        let target = u64::from(req.chunk_target_bytes).clamp(MIN_CHUNK, MAX_CHUNK);
        let plan = ChunkPlan::new(blocks_held, layers, bytes_per_block_layer, target)
            .ok_or_else(|| refuse(RefusalCode::Internal, "empty layout".into()))?;
        let count = plan.count();
        let mut have = vec![false; count as usize];
        for &c in &req.have_chunks {
            if c >= count {
                return Err(refuse(
                    RefusalCode::BadRequest,
                    format!("have_chunks names chunk {c} of {count}"),
                ));
            }
            have[c as usize] = true;
        }
        let queue = plan
            .chunks()
            .map(|s| if have[s.id as usize] { Work::ChecksumOnly(s) } else { Work::Send(s) })
            .collect();
        let mut machine = Machine::default();
        machine.apply(Event::Manifest).map_err(|e| refuse(RefusalCode::Internal, e.to_string()))?;
        let manifest = Manifest {
            transfer_id: req.transfer_id,
            blocks_held,
            layers,
            bytes_per_block_layer,
            chunk_target_bytes: target as u32,
            total_bytes: plan.total_bytes(),
            chunk_count: count,
        };
        let owner = Self {
            transfer_id: req.transfer_id,
            machine,
            plan,
            checksums: vec![None; count as usize],
            queue,
            retransmit_budget: count.saturating_mul(RETRANSMIT_BUDGET_FACTOR).max(16),
            done_sent: false,
        };
        Ok((owner, manifest))
    }

    /// The transfer id.
    pub fn transfer_id(&self) -> u128 {
        self.transfer_id
    }

    /// The chunk plan.
    pub fn plan(&self) -> &ChunkPlan {
        &self.plan
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.machine.state()
    }

    /// The next chunk to read, if any.
    pub fn next_work(&mut self) -> Option<Work> {
        if self.machine.is_terminal() {
            return None;
        }
        self.queue.pop_front()
    }

    /// The bytes of a chunk from [`Owner::next_work`]; returns the header to send for
    /// [`Work::Send`], `None` for [`Work::ChecksumOnly`].
    pub fn chunk_ready(&mut self, work: Work, payload: &[u8]) -> Result<Option<ChunkHeader>, WireError> {
        let summed = Summed::of(self.transfer_id, work.spec().id, payload);
        self.chunk_ready_summed(work, &summed)
    }

    /// [`Owner::chunk_ready`] for a chunk the driver already hashed ([`Summed::of`] with this
    /// transfer's id and the work's chunk id), so the hashing can run off the network thread.
    pub fn chunk_ready_summed(
        &mut self,
        work: Work,
        summed: &Summed,
    ) -> Result<Option<ChunkHeader>, WireError> {
        let spec = work.spec();
        if summed.len() != spec.len || self.plan.chunk(spec.id) != Some(spec) {
            return Err(LocalError::ChunkSize { chunk: spec.id, got: summed.len(), planned: spec.len }.into());
        }
        let Some(sum) = summed.checksum_for(self.transfer_id, spec.id) else {
            return Err(LocalError::MisboundSum { chunk: spec.id }.into());
        };
        match self.checksums[spec.id as usize] {
            Some(old) if old != sum => {
                // The source changed under us: these blocks are no longer what we promised.
                let _ = self.machine.apply(Event::Fail);
                return Err(LocalError::SourceChanged { chunk: spec.id }.into());
            }
            _ => self.checksums[spec.id as usize] = Some(sum),
        }
        self.machine.apply(Event::Chunk)?;
        Ok(match work {
            Work::Send(_) => Some(ChunkHeader {
                transfer_id: self.transfer_id,
                chunk_id: spec.id,
                blocks: spec.blocks,
                layers: spec.layers,
                len: spec.len,
                checksum: sum,
            }),
            Work::ChecksumOnly(_) => None,
        })
    }

    /// Once every chunk has been read and no work is queued: the `Done` frame (once).
    pub fn poll_done(&mut self) -> Result<Option<Done>, WireError> {
        if self.done_sent || !self.queue.is_empty() || self.checksums.iter().any(Option::is_none) {
            return Ok(None);
        }
        if self.state() != State::Verifying {
            self.machine.apply(Event::AllChunks)?;
        }
        self.done_sent = true;
        let sums: Vec<u128> = self.checksums.iter().map(|c| c.unwrap_or_default()).collect();
        Ok(Some(Done { transfer_id: self.transfer_id, digest: transfer_digest(self.transfer_id, &sums) }))
    }

    /// The requester asks for chunks again.
    pub fn on_retransmit(&mut self, ids: &[u32]) -> Result<(), WireError> {
        for &id in ids {
            let spec = self
                .plan
                .chunk(id)
                .ok_or_else(|| WireError::Protocol(format!("retransmit of unknown chunk {id}")))?;
            if self.retransmit_budget == 0 {
                let _ = self.machine.apply(Event::Fail);
                return Err(WireError::Protocol("retransmit budget exhausted".into()));
            }
            self.retransmit_budget -= 1;
            if !self.queue.contains(&Work::Send(spec)) {
                self.queue.push_back(Work::Send(spec));
            }
        }
        Ok(())
    }

    /// The requester committed.
    pub fn on_complete(&mut self) -> Result<(), WireError> {
        if !self.done_sent {
            let _ = self.machine.apply(Event::Fail);
            return Err(WireError::Protocol("complete before done".into()));
        }
        self.machine.apply(Event::DigestOk)?;
        Ok(())
    }

    /// Stops the transfer.
    pub fn cancel(&mut self) {
        let _ = self.machine.apply(Event::Fail);
    }
}
