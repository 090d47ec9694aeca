//! A driver may hash a chunk off its network thread and hand the cores a [`Summed`] instead of
//! the bytes. The summed calls judge exactly as the byte calls do, and a sum computed for
//! another chunk or transfer never verifies: the owner refuses to send under it, the requester
//! counts it corrupt and asks for the chunk again.

mod common;

use kvferry_wire::frame::Frame;
use kvferry_wire::{ChunkSpec, ChunkVerdict, LocalError, Owner, Requester, State, Summed, WireError};

const MS: u64 = 1_000_000;

fn payload(spec: &ChunkSpec) -> Vec<u8> {
    (0..spec.len).map(|i| (i as u8).wrapping_mul(13) ^ (spec.id as u8)).collect()
}

fn pair(id: u128) -> (Requester, Owner, kvferry_wire::Manifest) {
    let hashes: Vec<[u8; 32]> = (0..8u8).map(|i| [i; 32]).collect();
    let req = Requester::new(id, "t".into(), [2; 32], hashes, common::small_requester_config());
    let (owner, manifest) = Owner::accept(&req.request(), 8, 4, 32 << 10).unwrap();
    (req, owner, manifest)
}

#[test]
fn summed_calls_judge_as_the_byte_calls_do() {
    let (mut by_bytes, mut owner_a, manifest) = pair(7);
    let (mut by_sum, mut owner_b, _) = pair(7);
    by_bytes.on_manifest(MS, &manifest).unwrap();
    by_sum.on_manifest(MS, &manifest).unwrap();
    while let (Some(wa), Some(wb)) = (owner_a.next_work(), owner_b.next_work()) {
        assert_eq!(wa, wb);
        let bytes = payload(&wa.spec());
        let ha = owner_a.chunk_ready(wa, &bytes).unwrap().unwrap();
        let hb = owner_b.chunk_ready_summed(wb, &Summed::of(7, wb.spec().id, &bytes)).unwrap().unwrap();
        assert_eq!(ha, hb, "the same header from bytes and from their sum");
        let mut flipped = bytes.clone();
        flipped[0] ^= 1;
        for p in [&flipped, &bytes, &bytes] {
            let a = by_bytes.on_chunk(2 * MS, &ha, p).unwrap();
            let b = by_sum.on_chunk_summed(2 * MS, &ha, &Summed::of(7, ha.chunk_id, p)).unwrap();
            assert_eq!(a, b);
        }
    }
    for (req, owner) in [(&mut by_bytes, &mut owner_a), (&mut by_sum, &mut owner_b)] {
        let done = owner.poll_done().unwrap().expect("done");
        req.on_done(3 * MS, &done).unwrap();
        assert_eq!(req.state(), State::Committed);
    }
    assert_eq!(by_bytes.verified_bytes(), by_sum.verified_bytes());
}

#[test]
fn a_sum_for_another_chunk_or_transfer_never_verifies() {
    let (mut req, mut owner, manifest) = pair(7);
    req.on_manifest(MS, &manifest).unwrap();
    let work = owner.next_work().unwrap();
    let spec = work.spec();
    let bytes = payload(&spec);

    // The owner: a sum of the right bytes under another chunk or transfer id is refused.
    for wrong in [Summed::of(7, spec.id + 1, &bytes), Summed::of(8, spec.id, &bytes)] {
        let e = owner.chunk_ready_summed(work, &wrong).unwrap_err();
        assert!(
            matches!(e, WireError::Local(LocalError::MisboundSum { chunk }) if chunk == spec.id),
            "{e:?}"
        );
    }
    let h = owner.chunk_ready_summed(work, &Summed::of(7, spec.id, &bytes)).unwrap().unwrap();

    // The requester: the same misbound sums are corrupt chunks, refetched, never landed.
    for wrong in [Summed::of(7, spec.id + 1, &bytes), Summed::of(8, spec.id, &bytes)] {
        assert_eq!(
            req.on_chunk_summed(2 * MS, &h, &wrong).unwrap(),
            ChunkVerdict::Corrupt { chunk: spec.id }
        );
        assert!(matches!(req.poll_transmit(), Some(Frame::Retransmit(r)) if r.chunk_ids == vec![spec.id]));
    }
    assert_eq!(req.verified_bytes(), 0);
    // A sum of a shorter payload (its bytes a prefix of the real ones) does not verify either.
    let short = Summed::of(7, spec.id, &bytes[..bytes.len() - 1]);
    assert_eq!(req.on_chunk_summed(2 * MS, &h, &short).unwrap(), ChunkVerdict::Corrupt { chunk: spec.id });
    assert!(matches!(
        req.on_chunk_summed(2 * MS, &h, &Summed::of(7, spec.id, &bytes)).unwrap(),
        ChunkVerdict::Land(_)
    ));
}
