//! Fuzz target for the requester core (`Requester`) driven by arbitrary event sequences.
//!
//! Events: manifests (consistent, consistent but with one field changed, or arbitrary), chunks
//! (correct, bit-flipped, wrong header, another transfer's, or arbitrary header and payload),
//! `Done` (right or wrong digest), timer ticks that may cross the deadline, refusals, cancels
//! and lost connections — in any order. Properties after every event:
//!
//! - nothing panics;
//! - `valid_blocks()` is non-zero only in `Committed`, and then equals the blocks held, with
//!   every chunk of the plan landed from a verified payload;
//! - a payload the requester says to land is byte-identical to the owner's chunk;
//! - a terminal state never changes, and every state change is a path through `TRANSITIONS`;
//! - every frame it emits belongs to its transfer and survives the codec.
//!
//! Bounded under `cargo test`; with a real engine:
//!
//! ```text
//! cargo +nightly bolero test -p kvferry-wire --test fuzz_requester arbitrary_event_sequences \
//!     --engine libfuzzer
//! ```

use std::collections::HashSet;
use std::time::Duration;

use bolero::{TypeGenerator, check};
use kvferry_wire::checksum::{chunk_checksum, transfer_digest};
use kvferry_wire::frame::{self, ChunkHeader, Done, Manifest, Refusal, RefusalCode};
use kvferry_wire::state::TRANSITIONS;
use kvferry_wire::{ChunkPlan, ChunkSpec, ChunkVerdict, Requester, RequesterConfig, State};

const ITERATIONS: usize = 15_000;
const TIME: Duration = Duration::from_secs(4);

const TRANSFER: u128 = 0x0123_4567_89AB_CDEF_FEDC_BA98_7654_3210;
const BPBL: [u64; 3] = [4 << 10, 16 << 10, 40 << 10];
const MS: u64 = 1_000_000;

/// Selectors (`u8` fields taken modulo a small number) keep the common, well-formed events
/// frequent: a uniformly drawn enum would abort almost every sequence in its first few events
/// and never reach a multi-chunk commit.
#[derive(Debug, TypeGenerator)]
enum Ev {
    /// `mode % 16`: 0 = consistent with one field (`field % 7`) replaced by `value`, 1 = every
    /// field arbitrary, else consistent; `held` is clamped into `1..=requested`.
    Manifest {
        held: u32,
        mode: u8,
        field: u8,
        value: u64,
        arbitrary: (u32, u32, u64, u32, u64, u32),
    },
    /// `kind % 16`: 0 = bit flip at `at`, 1 = wrong header field (`at % 4`), 2 = another
    /// transfer's, 3 = arbitrary header and payload, else correct. An even `id` picks the lowest
    /// chunk not landed yet, an odd one any chunk.
    Chunk {
        id: u32,
        kind: u8,
        at: u32,
        arbitrary: (u32, u32, u32, u32, u64, u128),
        payload_len: u8,
    },
    /// `kind % 12`: 0 = wrong digest, 1 = another transfer's, else the right digest.
    Done {
        kind: u8,
        digest: u128,
    },
    Timer(#[generator(0u32..3_000)] u32),
    /// `kind % 16`: 0 = refusal, 1 = cancel, 2 = a long wait (may pass the deadline), else a lost
    /// connection.
    Rare {
        kind: u8,
        wait_ms: u32,
    },
}

#[derive(Debug, TypeGenerator)]
struct Case {
    #[generator(1u32..=6)]
    requested: u32,
    #[generator(1u32..=6)]
    layers: u32,
    #[generator(0usize..3)]
    bpbl: usize,
    /// `target % 4`: 0 = the minimum chunk (64 KiB), 1 = 100 KiB, 2 = 256 KiB, 3 = arbitrary.
    target: u32,
    #[generator(0u32..=8)]
    max_retries: u32,
    #[generator(bolero::produce::<Vec<Ev>>().with().len(0usize..80))]
    events: Vec<Ev>,
}

/// The owner's bytes for a chunk: a fill keyed by the chunk id (checksums are seeded with the
/// id, so equal fills of different chunks still differ on the wire).
fn truth(spec: &ChunkSpec) -> Vec<u8> {
    vec![(spec.id as u8).wrapping_mul(37) ^ 0xA5; spec.len as usize]
}

fn good_header(spec: &ChunkSpec, payload: &[u8]) -> ChunkHeader {
    ChunkHeader {
        transfer_id: TRANSFER,
        chunk_id: spec.id,
        blocks: spec.blocks,
        layers: spec.layers,
        len: spec.len,
        checksum: chunk_checksum(TRANSFER, spec.id, payload),
    }
}

/// Whether `to` is reachable from `from` in at most `steps` rows (one call may apply up to
/// three events: chunk → all chunks → digest ok).
fn reachable(from: State, to: State, steps: u32) -> bool {
    from == to
        || (steps > 0 && TRANSITIONS.iter().any(|(f, _, t)| *f == from && reachable(*t, to, steps - 1)))
}

fn terminal(s: State) -> bool {
    matches!(s, State::Committed | State::Aborted)
}

fn run(case: &Case) {
    let bpbl = BPBL[case.bpbl];
    let hashes: Vec<[u8; 32]> = (0..case.requested).map(|i| [i as u8; 32]).collect();
    let target = match case.target % 4 {
        0 => 64 << 10,
        1 => 100 << 10,
        2 => 256 << 10,
        _ => case.target,
    };
    let cfg = RequesterConfig {
        layers: case.layers,
        bytes_per_block_layer: bpbl,
        chunk_target_bytes: target,
        max_retries_per_chunk: case.max_retries,
        deadline_ns: 60_000 * MS,
        missing_grace_ns: 100 * MS,
        stall_timeout_ns: 1_000 * MS,
    };
    let mut req = Requester::new(TRANSFER, "tenant".into(), [9; 32], hashes, cfg);
    let mut now = 0u64;
    let mut landed: HashSet<u32> = HashSet::new();
    for ev in &case.events {
        let before = req.state();
        let consistent = |held: u32| {
            let held = held.clamp(1, case.requested);
            let plan = ChunkPlan::new(held, case.layers, bpbl, u64::from(target)).unwrap();
            Manifest {
                transfer_id: TRANSFER,
                blocks_held: held,
                layers: case.layers,
                bytes_per_block_layer: bpbl,
                chunk_target_bytes: target,
                total_bytes: plan.total_bytes(),
                chunk_count: plan.count(),
            }
        };
        match ev {
            Ev::Manifest { held, mode, field, value, arbitrary } => {
                let m = match mode % 16 {
                    0 => {
                        let mut m = consistent(*held);
                        match field % 7 {
                            0 => m.transfer_id ^= u128::from(*value),
                            1 => m.blocks_held = *value as u32,
                            2 => m.layers = *value as u32,
                            3 => m.bytes_per_block_layer = *value,
                            4 => m.chunk_target_bytes = *value as u32,
                            5 => m.total_bytes = *value,
                            _ => m.chunk_count = *value as u32,
                        }
                        m
                    }
                    1 => {
                        let (held, layers, bpbl, target, total, count) = *arbitrary;
                        Manifest {
                            transfer_id: if value & 1 == 0 { TRANSFER } else { TRANSFER ^ 1 },
                            blocks_held: held,
                            layers,
                            bytes_per_block_layer: bpbl,
                            chunk_target_bytes: target,
                            total_bytes: total,
                            chunk_count: count,
                        }
                    }
                    _ => consistent(*held),
                };
                let _ = req.on_manifest(now, &m);
            }
            Ev::Chunk { id, kind, at, arbitrary, payload_len } => {
                // Even ids: the lowest chunk not yet landed (in-order delivery); odd: any chunk.
                let spec = req.plan().and_then(|p| match id % 2 {
                    0 => p.chunks().find(|c| !landed.contains(&c.id)).or_else(|| p.chunk(0)),
                    _ => p.chunk(id % p.count().max(1)),
                });
                let (h, payload) = match (kind % 16, spec) {
                    (3, _) => {
                        let (b0, b1, l0, l1, len, checksum) = *arbitrary;
                        let h = ChunkHeader {
                            transfer_id: TRANSFER,
                            chunk_id: *id,
                            blocks: (b0, b1),
                            layers: (l0, l1),
                            len,
                            checksum,
                        };
                        (h, vec![0x5A; usize::from(*payload_len)])
                    }
                    (_, None) => continue,
                    (k, Some(spec)) => {
                        let mut payload = truth(&spec);
                        let mut h = good_header(&spec, &payload);
                        match k {
                            0 => {
                                let i = *at as usize % payload.len();
                                payload[i] ^= 1 << (at % 8);
                            }
                            1 => match at % 4 {
                                0 => h.len += 1,
                                1 => h.blocks.1 += 1,
                                2 => h.layers.0 = h.layers.0.wrapping_add(1),
                                _ => h.checksum ^= 1,
                            },
                            2 => h.transfer_id ^= 1 << 100,
                            _ => {}
                        }
                        (h, payload)
                    }
                };
                if let Ok(ChunkVerdict::Land(spec)) = req.on_chunk(now, &h, &payload) {
                    assert_eq!(payload, truth(&spec), "unverified bytes were cleared to land");
                    assert_eq!(spec.id, h.chunk_id);
                    assert!(landed.insert(spec.id), "chunk {} landed twice", spec.id);
                }
            }
            Ev::Done { kind, digest } => {
                let digest = match req.plan() {
                    Some(p) if kind % 12 != 0 => {
                        let sums: Vec<u128> =
                            p.chunks().map(|s| chunk_checksum(TRANSFER, s.id, &truth(&s))).collect();
                        transfer_digest(TRANSFER, &sums)
                    }
                    _ => *digest,
                };
                let transfer_id = if kind % 12 == 1 { TRANSFER ^ 2 } else { TRANSFER };
                let _ = req.on_done(now, &Done { transfer_id, digest });
            }
            Ev::Timer(ms) => {
                now += u64::from(*ms) * MS;
                let _ = req.on_timer(now);
                let _ = req.stalled(now);
            }
            Ev::Rare { kind, wait_ms } => match kind % 16 {
                0 => {
                    let r = Refusal {
                        transfer_id: TRANSFER,
                        code: RefusalCode::Overloaded,
                        detail: "busy".into(),
                    };
                    let _ = req.on_refusal(&r);
                }
                1 => {
                    let _ = req.cancel("fuzz");
                }
                2 => {
                    now += u64::from(*wait_ms) * MS;
                    let _ = req.on_timer(now);
                }
                _ => {
                    if let Ok(r) = req.on_connection_lost(now) {
                        assert_eq!(r.transfer_id, TRANSFER);
                        let have: HashSet<u32> = r.have_chunks.iter().copied().collect();
                        assert_eq!(have, landed, "resume must list exactly the verified chunks");
                    }
                }
            },
        }
        let after = req.state();
        if terminal(before) {
            assert_eq!(after, before, "left terminal state {before:?}");
        }
        assert!(reachable(before, after, 3), "{before:?} -> {after:?} is not a path of the table");
        if req.valid_blocks() > 0 {
            assert_eq!(after, State::Committed, "blocks reported valid in {after:?}");
        }
        if after == State::Committed {
            let plan = req.plan().expect("committed without a plan");
            assert_eq!(req.valid_blocks(), req.blocks_held());
            assert_eq!(req.valid_blocks(), plan.blocks);
            assert!(plan.chunks().all(|c| landed.contains(&c.id)), "committed with chunks missing");
            assert_eq!(req.verified_bytes(), plan.total_bytes());
        }
        while let Some(f) = req.poll_transmit() {
            assert_eq!(f.transfer_id(), TRANSFER);
            let bytes = frame::encode_to_vec(&f);
            assert_eq!(frame::decode(&bytes).unwrap().unwrap().0, f);
        }
    }
}

#[test]
fn arbitrary_event_sequences() {
    check!().with_type::<Case>().with_iterations(ITERATIONS).with_test_time(TIME).for_each(run);
}
