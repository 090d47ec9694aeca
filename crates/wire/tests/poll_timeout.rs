//! The requester core says when its timer is next due ([`Requester::poll_timeout`]), so a
//! driver sleeps exactly until then instead of ticking: the stall timeout and the deadline
//! before anything arrives, the retransmit grace once the owner's `Done` left chunks missing.

mod common;

use kvferry_wire::frame::Frame;
use kvferry_wire::{ChunkSpec, ChunkVerdict, Owner, Requester, State};

const MS: u64 = 1_000_000;

fn payload(spec: &ChunkSpec) -> Vec<u8> {
    (0..spec.len).map(|i| (i as u8) ^ (spec.id as u8)).collect()
}

#[test]
fn the_timer_is_due_at_the_stall_timeout_then_at_the_retransmit_grace() {
    let hashes: Vec<[u8; 32]> = (0..8u8).map(|i| [i; 32]).collect();
    let mut req = Requester::new(7, "t".into(), [1; 32], hashes, common::small_requester_config());
    // Nothing received yet: the stall timeout (before the deadline) is what is due.
    assert_eq!(req.poll_timeout(), Some(1_000 * MS));

    let (mut owner, manifest) = Owner::accept(&req.request(), 8, 4, 32 << 10).unwrap();
    req.on_manifest(10 * MS, &manifest).unwrap();
    assert_eq!(req.poll_timeout(), Some(1_010 * MS), "progress moves the stall timeout");

    // The owner sends every chunk; all but the last arrive. Then the owner's Done.
    let mut chunks = Vec::new();
    while let Some(work) = owner.next_work() {
        let bytes = payload(&work.spec());
        let header = owner.chunk_ready(work, &bytes).unwrap().expect("a chunk to send");
        chunks.push((header, bytes));
    }
    assert!(chunks.len() > 2, "{} chunks", chunks.len());
    chunks.pop();
    for (header, bytes) in &chunks {
        assert!(matches!(req.on_chunk(20 * MS, header, bytes).unwrap(), ChunkVerdict::Land(_)));
    }
    let done = owner.poll_done().unwrap().expect("done after every chunk was produced");
    req.on_done(30 * MS, &done).unwrap();
    assert_eq!(req.poll_timeout(), Some(230 * MS), "a grace period after Done");

    // Not yet due: no retransmit. Due: one retransmit, and the next ask a grace later.
    req.on_timer(229 * MS).unwrap();
    assert!(req.poll_transmit().is_none());
    req.on_timer(230 * MS).unwrap();
    assert!(matches!(req.poll_transmit(), Some(Frame::Retransmit(r)) if r.chunk_ids.len() == 1));
    assert_eq!(req.poll_timeout(), Some(430 * MS));
    assert_ne!(req.state(), State::Committed);
}
