//! Chunks ride other streams than the control frames, so one may arrive before the manifest
//! that makes it meaningful. The requester core answers [`ChunkVerdict::Early`] for such a
//! chunk (checking nothing, landing nothing), and the same chunk fed again after the manifest
//! verifies and lands: no retransmit, no grace period waited, the transfer commits with every
//! chunk sent once.

mod common;

use kvferry_wire::frame::Frame;
use kvferry_wire::{ChunkSpec, ChunkVerdict, Owner, Requester, State};

const MS: u64 = 1_000_000;

fn payload(spec: &ChunkSpec) -> Vec<u8> {
    (0..spec.len).map(|i| (i as u8).wrapping_mul(7) ^ (spec.id as u8)).collect()
}

#[test]
fn chunks_that_overtake_the_manifest_are_held_then_land_without_a_retransmit() {
    let hashes: Vec<[u8; 32]> = (0..8u8).map(|i| [i; 32]).collect();
    let mut req = Requester::new(9, "t".into(), [2; 32], hashes, common::small_requester_config());
    let (mut owner, manifest) = Owner::accept(&req.request(), 8, 4, 32 << 10).unwrap();
    let mut chunks = Vec::new();
    while let Some(work) = owner.next_work() {
        let bytes = payload(&work.spec());
        chunks.push((owner.chunk_ready(work, &bytes).unwrap().expect("a chunk to send"), bytes));
    }
    assert!(chunks.len() > 2, "{} chunks", chunks.len());

    // Every chunk, a corrupt one among them, arrives before the manifest: nothing is judged.
    let mut corrupt = chunks[1].1.clone();
    corrupt[0] ^= 1;
    assert_eq!(req.on_chunk(5 * MS, &chunks[1].0, &corrupt).unwrap(), ChunkVerdict::Early);
    for (h, bytes) in &chunks {
        assert_eq!(req.on_chunk(5 * MS, h, bytes).unwrap(), ChunkVerdict::Early);
    }
    assert_eq!(req.state(), State::Requested);
    assert_eq!(req.verified_bytes(), 0);
    assert!(req.poll_transmit().is_none(), "an early chunk asks for nothing");

    // After the manifest the held chunks are fed again, in arrival order.
    req.on_manifest(10 * MS, &manifest).unwrap();
    assert_eq!(req.on_chunk(11 * MS, &chunks[1].0, &corrupt).unwrap(), ChunkVerdict::Corrupt { chunk: 1 });
    assert!(matches!(req.poll_transmit(), Some(Frame::Retransmit(r)) if r.chunk_ids == vec![1]));
    for (h, bytes) in &chunks {
        assert!(matches!(req.on_chunk(11 * MS, h, bytes).unwrap(), ChunkVerdict::Land(_)));
    }
    let done = owner.poll_done().unwrap().expect("done after every chunk was produced");
    req.on_done(12 * MS, &done).unwrap();
    assert_eq!(req.state(), State::Committed);
    assert!(matches!(req.poll_transmit(), Some(Frame::Complete(_))));
    assert!(req.poll_transmit().is_none(), "no retransmit of an early chunk");
}

#[test]
fn an_early_chunk_of_another_transfer_is_still_ignored() {
    let hashes: Vec<[u8; 32]> = (0..4u8).map(|i| [i; 32]).collect();
    let mut req = Requester::new(9, "t".into(), [2; 32], hashes.clone(), common::small_requester_config());
    let other = Requester::new(10, "t".into(), [2; 32], hashes, common::small_requester_config());
    let (mut owner, _) = Owner::accept(&other.request(), 4, 4, 32 << 10).unwrap();
    let work = owner.next_work().unwrap();
    let bytes = payload(&work.spec());
    let h = owner.chunk_ready(work, &bytes).unwrap().unwrap();
    assert_eq!(req.on_chunk(1, &h, &bytes).unwrap(), ChunkVerdict::Ignored);
}
