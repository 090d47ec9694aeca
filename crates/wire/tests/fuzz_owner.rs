//! Fuzz targets for the owner core (`Owner::accept` and what follows) and the chunk plan.
//!
//! `Owner::accept` gets arbitrary `FetchRequest`s (any transfer id, tenant, hash count,
//! `have_chunks`, chunk target) against a layout the owner holds; an accepted owner is then
//! driven through arbitrary interleavings of reading chunks, retransmit requests with arbitrary
//! chunk ids, `Done`, completion and cancellation. Properties: nothing panics; a refusal is
//! typed and names the request's transfer; the manifest is consistent with its plan; the
//! owner sends exactly the chunks not in `have_chunks` (plus retransmits), computes a digest
//! over every chunk, sends `Done` at most once, and never leaves a terminal state.
//! `ChunkPlan::new` with arbitrary dimensions either refuses or yields a plan whose chunks tile
//! the transfer.
//!
//! Bounded under `cargo test`; with a real engine:
//!
//! ```text
//! cargo +nightly bolero test -p kvferry-wire --test fuzz_owner accept_and_retransmit_never_panic \
//!     --engine libfuzzer
//! ```

use std::collections::HashSet;
use std::time::Duration;

use bolero::{TypeGenerator, check, produce};
use kvferry_wire::checksum::{chunk_checksum, transfer_digest};
use kvferry_wire::frame::{FetchRequest, RefusalCode};
use kvferry_wire::{ChunkPlan, Owner, State, Work};

const ITERATIONS: usize = 100_000;
const TIME: Duration = Duration::from_secs(3);

#[derive(Debug, TypeGenerator)]
enum Step {
    /// Read and hand over the next `n` chunks.
    Work(#[generator(1u8..8)] u8),
    Retransmit(#[generator(produce::<Vec<u32>>().with().len(0usize..6))] Vec<u32>),
    /// Retransmit ids that exist in the plan (`id % count`).
    RetransmitKnown(#[generator(produce::<Vec<u32>>().with().len(0usize..6))] Vec<u32>),
    PollDone,
    Complete,
    Cancel,
}

#[derive(Debug, TypeGenerator)]
struct Case {
    transfer_id: u128,
    tenant: String,
    fingerprint: [u8; 32],
    #[generator(0usize..80)]
    requested: usize,
    have: Vec<u32>,
    /// `have` entries taken modulo a small bound, so resumes name real chunks too.
    have_mod: Option<u8>,
    target: u32,
    /// Blocks the owner holds, before clamping (arbitrary: may exceed the request).
    held: u32,
    #[generator(1u32..=16)]
    layers: u32,
    #[generator(1u64..=(8 << 10))]
    bpbl: u64,
    #[generator(produce::<Vec<Step>>().with().len(0usize..40))]
    steps: Vec<Step>,
}

fn payload(len: u64, id: u32) -> Vec<u8> {
    vec![id as u8 ^ 0x3C; len as usize]
}

fn run(case: &Case) {
    let have: Vec<u32> = match case.have_mod {
        Some(m) => case.have.iter().map(|h| h % u32::from(m.max(1))).collect(),
        None => case.have.clone(),
    };
    let req = FetchRequest {
        transfer_id: case.transfer_id,
        tenant: case.tenant.clone(),
        fingerprint: case.fingerprint,
        block_hashes: (0..case.requested).map(|i| [i as u8; 32]).collect(),
        have_chunks: have.clone(),
        chunk_target_bytes: case.target,
    };
    // Half the cases hold a plausible prefix; the rest an arbitrary count.
    let held = if case.held & 1 == 0 { case.held % (case.requested as u32 + 1) } else { case.held };
    let (mut owner, m) = match Owner::accept(&req, held, case.layers, case.bpbl) {
        Ok(x) => x,
        Err(r) => {
            assert_eq!(r.transfer_id, case.transfer_id);
            let expected = if held == 0 {
                RefusalCode::UnknownBlocks
            } else if held as usize > case.requested {
                RefusalCode::Internal
            } else {
                RefusalCode::BadRequest
            };
            assert_eq!(r.code, expected, "{r:?}");
            return;
        }
    };
    assert!(held > 0 && held as usize <= case.requested);
    let plan = *owner.plan();
    assert_eq!(m.transfer_id, case.transfer_id);
    assert_eq!((m.blocks_held, m.layers, m.bytes_per_block_layer), (held, case.layers, case.bpbl));
    assert_eq!((m.chunk_count, m.total_bytes), (plan.count(), plan.total_bytes()));
    assert_eq!(ChunkPlan::new(held, case.layers, case.bpbl, m.chunk_target_bytes.into()), Some(plan));
    assert!(have.iter().all(|&h| h < plan.count()));
    assert_eq!(owner.state(), State::Manifest);

    let have: HashSet<u32> = have.into_iter().collect();
    let mut sent: HashSet<u32> = HashSet::new();
    let mut read: HashSet<u32> = HashSet::new();
    let mut dones = 0;
    for step in &case.steps {
        let before = owner.state();
        match step {
            Step::Work(n) => {
                for _ in 0..*n {
                    let Some(work) = owner.next_work() else { break };
                    let spec = work.spec();
                    assert_eq!(plan.chunk(spec.id), Some(spec));
                    let p = payload(spec.len, spec.id);
                    let h = owner.chunk_ready(work, &p).expect("correct bytes refused");
                    read.insert(spec.id);
                    match (work, h) {
                        (Work::Send(_), Some(h)) => {
                            assert_eq!(h.checksum, chunk_checksum(case.transfer_id, spec.id, &p));
                            assert_eq!((h.chunk_id, h.len), (spec.id, spec.len));
                            sent.insert(spec.id);
                        }
                        (Work::ChecksumOnly(_), None) => assert!(have.contains(&spec.id)),
                        other => panic!("work and header disagree: {other:?}"),
                    }
                }
            }
            Step::Retransmit(ids) => {
                let _ = owner.on_retransmit(ids);
            }
            Step::RetransmitKnown(ids) => {
                let ids: Vec<u32> = ids.iter().map(|i| i % plan.count()).collect();
                let _ = owner.on_retransmit(&ids);
            }
            Step::PollDone => {
                if let Ok(Some(d)) = owner.poll_done() {
                    dones += 1;
                    assert_eq!(dones, 1, "Done sent twice");
                    assert_eq!(read.len() as u32, plan.count(), "Done before every chunk was read");
                    // Every chunk not held by the requester went out at least once.
                    assert!(plan.chunks().all(|c| have.contains(&c.id) || sent.contains(&c.id)));
                    let sums: Vec<u128> = plan
                        .chunks()
                        .map(|c| chunk_checksum(case.transfer_id, c.id, &payload(c.len, c.id)))
                        .collect();
                    assert_eq!(d.digest, transfer_digest(case.transfer_id, &sums));
                }
            }
            Step::Complete => {
                let r = owner.on_complete();
                if dones == 0 {
                    assert!(r.is_err(), "completed before Done");
                }
            }
            Step::Cancel => owner.cancel(),
        }
        let after = owner.state();
        if matches!(before, State::Committed | State::Aborted) {
            assert_eq!(after, before, "left terminal state {before:?}");
            assert!(owner.next_work().is_none(), "work after the end");
        }
    }
}

#[test]
fn accept_and_retransmit_never_panic() {
    check!().with_type::<Case>().with_iterations(ITERATIONS).with_test_time(TIME).for_each(run);
}

/// The plan over arbitrary dimensions: refused, or a tiling of blocks × layers. Each dimension
/// is a random value shifted right by a random amount, so small, large and extreme magnitudes
/// all occur (uniform u64s alone would almost always overflow the first product).
#[test]
fn chunk_plan_is_total() {
    type Dims = ((u32, u8), (u32, u8), (u64, u8), (u64, u8), u32);
    check!().with_type::<Dims>().with_iterations(ITERATIONS).with_test_time(TIME).for_each(
        |&((b, bs), (l, ls), (p, ps), (t, ts), probe)| {
            let (blocks, layers) = (b >> (bs % 32), l >> (ls % 32));
            let (bpbl, target) = (p >> (ps % 64), t >> (ts % 64));
            let Some(plan) = ChunkPlan::new(blocks, layers, bpbl, target) else { return };
            let count = plan.count();
            assert!(count >= 1);
            let total = u128::from(blocks) * u128::from(layers) * u128::from(bpbl);
            assert_eq!(u128::from(plan.total_bytes()), total);
            assert!(plan.chunk(count).is_none());
            // Spot-check a few chunks: in range, non-empty, lengths consistent.
            for id in [0, count - 1, probe % count] {
                let c = plan.chunk(id).unwrap();
                assert!(c.blocks.0 < c.blocks.1 && c.blocks.1 <= blocks);
                assert!(c.layers.0 < c.layers.1 && c.layers.1 <= layers);
                let len = u128::from(c.blocks.1 - c.blocks.0)
                    * u128::from(c.layers.1 - c.layers.0)
                    * u128::from(bpbl);
                assert_eq!(u128::from(c.len), len);
            }
            let _ = plan.total_bytes();
        },
    );
}
