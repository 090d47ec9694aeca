//! Deterministic simulation of whole transfers between the two sans-IO cores, over a network
//! that drops, duplicates, reorders, delays and corrupts frames and sometimes kills the
//! connection — every fault drawn from a seeded RNG, so a failing seed replays exactly.
//!
//! Invariants checked on every run:
//! - every payload the requester tells us to land is byte-identical to the source's chunk
//!   (corrupt bytes never land);
//! - a committed transfer's landed bytes equal the source's, block for block;
//! - an aborted transfer reports zero valid blocks;
//! - with moderate fault rates and a generous deadline, the transfer commits.

use std::collections::BTreeMap;

mod common;

use common::Rng;

use kvferry_wire::frame::{self, Frame};
use kvferry_wire::{ChunkSpec, ChunkVerdict, Owner, Requester, State, WireError, Work};

#[derive(Clone, Copy, Debug)]
struct Faults {
    drop: f64,
    dup: f64,
    corrupt: f64,
    max_delay: u64,
    kill: f64,
}

const LAYERS: u32 = 6;
const BPBL: u64 = 4 << 10; // 4 KiB per block per layer
const TICK: u64 = 1_000_000; // 1 ms

/// The source region's bytes of (block, layer), a pure function of both.
fn source_bytes(block: u32, layer: u32) -> Vec<u8> {
    let mut r = Rng(u64::from(block) << 32 | u64::from(layer));
    (0..BPBL / 8).flat_map(|_| r.next().to_le_bytes()).collect()
}

/// A chunk's payload in staging order: for layer, for block.
fn chunk_payload(spec: &ChunkSpec) -> Vec<u8> {
    let mut v = Vec::with_capacity(spec.len as usize);
    for l in spec.layers.0..spec.layers.1 {
        for b in spec.blocks.0..spec.blocks.1 {
            v.extend(source_bytes(b, l));
        }
    }
    v
}

struct Wire {
    // deliver_at → frames (bytes); BTreeMap with a sequence number for stable order.
    queue: BTreeMap<(u64, u64), Vec<u8>>,
    seq: u64,
}

impl Wire {
    fn new() -> Self {
        Self { queue: BTreeMap::new(), seq: 0 }
    }
    fn send(&mut self, rng: &mut Rng, f: &Faults, now: u64, frame: &Frame, payload: Option<&[u8]>) {
        let mut bytes = frame::encode_to_vec(frame);
        if let Some(p) = payload {
            bytes.extend_from_slice(p);
        }
        if rng.chance(f.drop) {
            return;
        }
        let copies = if rng.chance(f.dup) { 2 } else { 1 };
        for _ in 0..copies {
            let mut b = bytes.clone();
            // Corrupt only chunk frames: control frames ride TLS-protected streams whose loss is
            // modelled by drops and kills.
            if matches!(frame, Frame::Chunk(_)) && rng.chance(f.corrupt) {
                let i = rng.below(b.len() as u64) as usize;
                b[i] ^= 1 << rng.below(8);
            }
            let at = now + TICK + rng.below(f.max_delay + 1);
            self.seq += 1;
            self.queue.insert((at, self.seq), b);
        }
    }
    fn due(&mut self, now: u64) -> Vec<Vec<u8>> {
        let later = self.queue.split_off(&(now + 1, 0));
        let due = std::mem::replace(&mut self.queue, later);
        due.into_values().collect()
    }
}

struct Outcome {
    result: Result<(), WireError>,
    reconnects: u32,
    /// Chunks that arrived before their manifest (held, then fed again).
    early: u32,
    /// Retransmit frames the owner received.
    retransmits: u32,
}

fn run(seed: u64, blocks: u32, held: u32, faults: Faults, deadline_ms: u64) -> Outcome {
    let mut rng = Rng(seed);
    let hashes: Vec<[u8; 32]> = (0..blocks).map(|i| [i as u8; 32]).collect();
    let cfg = common::requester_config(LAYERS, BPBL, 8, (deadline_ms * TICK, 20 * TICK, 200 * TICK));
    let mut req = Requester::new(u128::from(seed) << 1 | 1, "tenant".into(), [9; 32], hashes, cfg);
    let mut landed = vec![vec![0u8; BPBL as usize]; (held * LAYERS) as usize];
    let mut to_owner = Wire::new();
    let mut to_req = Wire::new();
    let mut owner: Option<Owner> = None;
    let mut reconnects = 0;
    let mut early: Vec<Vec<u8>> = Vec::new();
    let mut early_seen = 0;
    let mut retransmits = 0;
    let mut now = 0;
    let request = req.request();
    to_owner.send(&mut rng, &Faults { drop: 0.0, ..faults }, now, &Frame::Request(request), None);
    let result = 'outer: loop {
        now += TICK;
        if now > (deadline_ms + 50) * TICK {
            break Err(WireError::Protocol("simulation ran past the deadline without ending".into()));
        }
        // Connection loss: both directions lose what is in flight; the requester resumes.
        let stalled = req.stalled(now);
        if (stalled || rng.chance(faults.kill)) && !matches!(req.state(), State::Committed | State::Aborted) {
            to_owner = Wire::new();
            to_req = Wire::new();
            early.clear();
            owner = None;
            reconnects += 1;
            match req.on_connection_lost(now) {
                Ok(r) => {
                    to_owner.send(&mut rng, &Faults { drop: 0.0, ..faults }, now, &Frame::Request(r), None)
                }
                Err(e) => break Err(e),
            }
        }
        // Owner side.
        for bytes in to_owner.due(now) {
            let Ok(Some((f, _))) = frame::decode(&bytes) else { continue };
            match f {
                Frame::Request(r) if owner.as_ref().is_some_and(|o| o.transfer_id() == r.transfer_id) => {
                    // A duplicated request on the same connection: already being served.
                }
                Frame::Request(r) => match Owner::accept(&r, held, LAYERS, BPBL) {
                    Ok((o, m)) => {
                        owner = Some(o);
                        to_req.send(
                            &mut rng,
                            &Faults { drop: 0.0, ..faults },
                            now,
                            &Frame::Manifest(m),
                            None,
                        );
                    }
                    Err(refusal) => to_req.send(&mut rng, &faults, now, &Frame::Refusal(refusal), None),
                },
                Frame::Retransmit(r) => {
                    retransmits += 1;
                    if let Some(o) = owner.as_mut() {
                        let _ = o.on_retransmit(&r.chunk_ids);
                    }
                }
                Frame::Complete(_) => {
                    if let Some(o) = owner.as_mut() {
                        o.on_complete().unwrap();
                    }
                }
                other => panic!("owner got {other:?}"),
            }
        }
        if let Some(o) = owner.as_mut() {
            // Pipelining window: a few chunks per tick.
            for _ in 0..4 {
                let Some(work) = o.next_work() else { break };
                let payload = chunk_payload(&work.spec());
                if let Some(h) = o.chunk_ready(work, &payload).unwrap() {
                    to_req.send(&mut rng, &faults, now, &Frame::Chunk(h), Some(&payload));
                }
                if matches!(work, Work::ChecksumOnly(_)) {
                    continue;
                }
            }
            if let Some(d) = o.poll_done().unwrap() {
                to_req.send(&mut rng, &faults, now, &Frame::Done(d), None);
            }
        }
        // Requester side. Chunks that overtook the manifest are held and fed again after it,
        // as the driver does.
        let mut inbox: std::collections::VecDeque<Vec<u8>> = to_req.due(now).into();
        while let Some(bytes) = inbox.pop_front() {
            let (f, used) = match frame::decode(&bytes) {
                Ok(Some(x)) => x,
                _ => continue, // a corrupted prefix: the stream is dropped
            };
            let step = match f {
                Frame::Manifest(m) => {
                    let step = req.on_manifest(now, &m);
                    if step.is_ok() {
                        inbox.extend(early.drain(..));
                    }
                    step
                }
                Frame::Refusal(r) => Err(req.on_refusal(&r)),
                Frame::Chunk(h) => {
                    let payload = &bytes[used..];
                    match req.on_chunk(now, &h, payload) {
                        Ok(ChunkVerdict::Land(spec)) => {
                            assert_eq!(
                                payload,
                                &chunk_payload(&spec)[..],
                                "seed {seed}: corrupt bytes reached landing"
                            );
                            common::land(&mut landed, held, BPBL, &spec, payload);
                            Ok(())
                        }
                        Ok(ChunkVerdict::Early) => {
                            early_seen += 1;
                            early.push(bytes.clone());
                            Ok(())
                        }
                        Ok(_) => Ok(()),
                        Err(e) => Err(e),
                    }
                }
                Frame::Done(d) => req.on_done(now, &d),
                other => panic!("requester got {other:?}"),
            };
            if let Err(e) = step {
                break 'outer Err(e);
            }
        }
        if let Err(e) = req.on_timer(now) {
            break Err(e);
        }
        while let Some(f) = req.poll_transmit() {
            to_owner.send(&mut rng, &faults, now, &f, None);
        }
        if req.state() == State::Committed {
            break Ok(());
        }
    };
    match &result {
        Ok(()) => {
            assert_eq!(req.valid_blocks(), held);
            for l in 0..LAYERS {
                for b in 0..held {
                    assert_eq!(
                        landed[(l * held + b) as usize],
                        source_bytes(b, l),
                        "seed {seed}: block {b} layer {l}"
                    );
                }
            }
        }
        Err(_) => assert_eq!(req.valid_blocks(), 0, "seed {seed}: an aborted transfer left valid blocks"),
    }
    Outcome { result, reconnects, early: early_seen, retransmits }
}

const CLEAN: Faults = Faults { drop: 0.0, dup: 0.0, corrupt: 0.0, max_delay: 0, kill: 0.0 };

#[test]
fn clean_network_commits() {
    let o = run(1, 40, 40, CLEAN, 5_000);
    assert_eq!(o.result, Ok(()));
}

#[test]
fn partial_prefix_commits_what_is_held() {
    let o = run(2, 40, 17, CLEAN, 5_000);
    assert_eq!(o.result, Ok(()));
}

#[test]
fn every_fault_kind_alone_and_together_over_many_seeds() {
    let profiles = [
        Faults { drop: 0.05, ..CLEAN },
        Faults { dup: 0.2, ..CLEAN },
        Faults { max_delay: 30 * TICK, ..CLEAN },
        Faults { corrupt: 0.1, ..CLEAN },
        Faults { kill: 0.01, ..CLEAN },
        Faults { drop: 0.03, dup: 0.05, corrupt: 0.05, max_delay: 10 * TICK, kill: 0.005 },
    ];
    let mut reconnects = 0;
    for (i, f) in profiles.iter().enumerate() {
        for seed in 0..40u64 {
            let seed = seed * 1000 + i as u64;
            let o = run(seed, 1 + (seed % 53) as u32, 1 + (seed % 53) as u32, *f, 60_000);
            assert_eq!(o.result, Ok(()), "profile {i} {f:?} seed {seed}");
            reconnects += o.reconnects;
        }
    }
    assert!(reconnects > 0, "the kill profile never killed a connection");
}

#[test]
fn chunks_that_overtake_the_manifest_are_not_fetched_twice() {
    // Delay alone reorders frames (chunks before their manifest) but loses nothing, and the
    // grace after Done (200 ms) outlasts the delay (30 ms): no chunk is ever asked for again.
    let mut early = 0;
    for seed in 0..40u64 {
        let o = run(
            seed,
            1 + (seed % 53) as u32,
            1 + (seed % 53) as u32,
            Faults { max_delay: 30 * TICK, ..CLEAN },
            60_000,
        );
        assert_eq!((o.result, o.retransmits), (Ok(()), 0), "seed {seed}");
        early += o.early;
    }
    assert!(early > 0, "the delay profile never let a chunk overtake its manifest");
}

#[test]
fn a_deadline_that_cannot_be_met_aborts_with_nothing_valid() {
    let slow = Faults { max_delay: 200 * TICK, ..CLEAN };
    let o = run(7, 60, 60, slow, 30);
    assert_eq!(o.result, Err(WireError::DeadlineExceeded));
}

#[test]
fn constant_corruption_exhausts_retries() {
    let awful = Faults { corrupt: 1.0, ..CLEAN };
    let o = run(8, 4, 4, awful, 60_000);
    assert!(
        matches!(o.result, Err(WireError::TooManyRetries { .. }) | Err(WireError::DeadlineExceeded)),
        "{:?}",
        o.result.err()
    );
}
