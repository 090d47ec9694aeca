//! The corruption half of issue 15's fault suite, sans-IO: a real [`Owner`] core serves real
//! transfers to a real [`Requester`] core, and an adversary between them mutates what the
//! owner sends — bit flips in payloads and headers, truncated and padded frames, reordered,
//! duplicated and replayed chunks (from another transfer, and from an older version of the
//! same blocks), and a lying peer: valid-looking frames with wrong checksums, chunk ids out of
//! range, chunks for blocks not requested, a wrong digest, a `Done` for another transfer, a
//! manifest that lies or changes mid-transfer. No sockets, no clock: thousands per second.
//!
//! Every frame goes through the real codec (`frame::encode` → mutate bytes → `frame::decode`),
//! so a corrupted prefix is the decoder's to reject. "Accepted" is counted, never assumed:
//! a `Land` verdict for bytes that differ from the owner's chunk, a committed transfer whose
//! landed bytes differ from the owner's blocks, or an aborted transfer reporting valid blocks.
//! The test asserts 0 accepted, at least `KVFERRY_CORRUPTIONS` (default 12,000) injections,
//! every kind injected, and that transfers still commit through the faults. Seeds are
//! deterministic and printed with any failure; it prints one line for the suite's headline:
//! `fault-suite: corruptions injected N (sans-IO), accepted 0, ...`.

mod common;

use std::collections::BTreeMap;

use common::Rng;
use kvferry_wire::frame::{self, ChunkHeader, Done, Frame, Manifest};
use kvferry_wire::{ChunkSpec, ChunkVerdict, Owner, Requester, State, WireError, Work};

const LAYERS: u32 = 4;
/// 32 KiB per block-layer with the 64 KiB minimum chunk: two blocks × one layer per chunk once
/// a transfer holds more than two blocks, up to 16 chunks per transfer.
const BPBL: u64 = 32 << 10;
const MAX_BLOCKS: u32 = 8;
const FP: [u8; 32] = [5; 32];

/// Every way the adversary lies. Each is counted when it is injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    PayloadBitFlip,
    HeaderBitFlip,
    PayloadTruncated,
    FrameTruncated,
    PayloadPadded,
    WrongChecksum,
    SwappedChunk,
    ChunkIdOutOfRange,
    UnrequestedBlocks,
    ReplayOtherTransfer,
    ReplayOtherTransferRelabelled,
    ReplayOlderVersion,
    DuplicateMutated,
    Reordered,
    WrongDigest,
    DoneForOtherTransfer,
    ManifestChanged,
    ManifestLies,
}

const CHUNK_KINDS: [Kind; 13] = [
    Kind::PayloadBitFlip,
    Kind::HeaderBitFlip,
    Kind::PayloadTruncated,
    Kind::FrameTruncated,
    Kind::PayloadPadded,
    Kind::WrongChecksum,
    Kind::SwappedChunk,
    Kind::ChunkIdOutOfRange,
    Kind::UnrequestedBlocks,
    Kind::ReplayOtherTransfer,
    Kind::ReplayOtherTransferRelabelled,
    Kind::ReplayOlderVersion,
    Kind::DuplicateMutated,
];

/// The owner's bytes of (block, layer) at `version` of the blocks: a pure function.
fn source_bytes(version: u64, block: u32, layer: u32) -> Vec<u8> {
    let mut r = Rng(version << 40 ^ u64::from(block) << 20 ^ u64::from(layer));
    (0..BPBL / 8).flat_map(|_| r.next().to_le_bytes()).collect()
}

/// Precomputed source bytes per version, block, layer.
struct Source(Vec<Vec<Vec<Vec<u8>>>>);

impl Source {
    fn new(versions: u64) -> Self {
        Self(
            (0..versions)
                .map(|v| {
                    (0..MAX_BLOCKS).map(|b| (0..LAYERS).map(|l| source_bytes(v, b, l)).collect()).collect()
                })
                .collect(),
        )
    }
    /// A chunk's payload in staging order (for layer, for block).
    fn chunk(&self, version: u64, spec: &ChunkSpec) -> Vec<u8> {
        let mut v = Vec::with_capacity(spec.len as usize);
        for l in spec.layers.0..spec.layers.1 {
            for b in spec.blocks.0..spec.blocks.1 {
                v.extend_from_slice(&self.0[version as usize][b as usize][l as usize]);
            }
        }
        v
    }
}

/// A captured chunk frame of some earlier transfer (for replays).
#[derive(Clone)]
struct Captured {
    header: ChunkHeader,
    payload: Vec<u8>,
    version: u64,
}

#[derive(Default)]
struct Tally {
    injected: BTreeMap<Kind, u64>,
    accepted: Vec<String>,
    /// Frames the decoder refused, verdicts other than `Land`, transfers ended by a fault.
    dropped_by_decoder: u64,
    verdicts: BTreeMap<&'static str, u64>,
    committed: u64,
    aborted: u64,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn inject(&mut self, k: Kind) {
        *self.injected.entry(k).or_default() += 1;
    }
    fn total(&self) -> u64 {
        self.injected.values().sum()
    }
}

fn flip_bit(rng: &mut Rng, b: &mut [u8], range: std::ops::Range<usize>) {
    let i = range.start + rng.below((range.end - range.start) as u64) as usize;
    b[i] ^= 1 << rng.below(8);
}

/// One transfer under attack. `version` is the owner's current version of the blocks (older
/// versions' frames are in `captured`). `p` is the chance that a frame is tampered with.
fn transfer(seed: u64, version: u64, p: f64, src: &Source, captured: &mut Vec<Captured>, t: &mut Tally) {
    let mut rng = Rng(seed);
    let requested = 1 + rng.below(u64::from(MAX_BLOCKS)) as u32;
    let held = 1 + rng.below(u64::from(requested)) as u32;
    let tid = u128::from(rng.next()) << 64 | u128::from(seed);
    let hashes: Vec<[u8; 32]> = (0..requested).map(|i| [i as u8; 32]).collect();
    let cfg = common::requester_config(LAYERS, BPBL, 6, (u64::MAX / 2, 60, u64::MAX / 4));
    let mut req = Requester::new(tid, "tenant".into(), FP, hashes, cfg);
    let (mut owner, manifest) = Owner::accept(&req.request(), held, LAYERS, BPBL).unwrap();
    let mut landed = vec![vec![0u8; BPBL as usize]; (held * LAYERS) as usize];
    let mut now = 1u64;
    let ctx = |what: &str| format!("seed {seed} (version {version}): {what}");

    // The manifest: a lie now and then (it must end the transfer, or be harmless).
    let mut m = manifest;
    if rng.chance(p / 4.0) {
        t.inject(Kind::ManifestLies);
        match rng.below(5) {
            0 => m.blocks_held = requested + 1 + rng.below(4) as u32,
            1 => m.total_bytes ^= 1 << rng.below(20),
            2 => m.layers += 1,
            3 => m.bytes_per_block_layer *= 2,
            _ => m.chunk_count += 1 + rng.below(3) as u32,
        }
    }
    let mut result = deliver_manifest(&mut req, now, &m);

    let mut sent_ok: Vec<Captured> = Vec::new(); // this transfer's honest frames, for duplicates
    let mut steps = 0u32;
    while result.is_ok() && !matches!(req.state(), State::Committed | State::Aborted) {
        steps += 1;
        assert!(steps < 10_000, "{}", ctx("the transfer never ended"));
        now += 1;
        // A burst of chunks from the owner, possibly delivered out of order.
        let mut burst: Vec<(Vec<u8>, Option<Kind>, ChunkSpec)> = Vec::new();
        for _ in 0..1 + rng.below(8) {
            let Some(work) = owner.next_work() else { break };
            let spec = work.spec();
            let payload = src.chunk(version, &spec);
            let Some(h) = owner.chunk_ready(work, &payload).unwrap() else { continue };
            assert!(matches!(work, Work::Send(_)));
            let honest = Captured { header: h, payload: payload.clone(), version };
            let kind = rng.chance(p).then(|| CHUNK_KINDS[rng.below(CHUNK_KINDS.len() as u64) as usize]);
            let bytes = match kind {
                Some(k) => tamper(&mut rng, k, &honest, &manifest, captured, &sent_ok, req.plan()),
                None => encode_chunk(&h, &payload),
            };
            if let Some(k) = kind {
                t.inject(k);
            }
            sent_ok.push(honest);
            burst.push((bytes, kind, spec));
        }
        // Honest duplicates of already-sent chunks now and then (not counted: not a lie).
        if rng.chance(0.05)
            && let Some(c) = sent_ok.get(rng.below(sent_ok.len() as u64) as usize)
        {
            let spec = req.plan().and_then(|p| p.chunk(c.header.chunk_id)).unwrap();
            burst.push((encode_chunk(&c.header, &c.payload), None, spec));
        }
        if burst.len() > 1 && rng.chance(p) {
            rng.shuffle(&mut burst);
            t.inject(Kind::Reordered);
        }
        for (bytes, _kind, _spec) in &burst {
            let decoded = match frame::decode(bytes) {
                Ok(Some((Frame::Chunk(h), used))) => Some((h, &bytes[used..])),
                // A frame the decoder refuses or cannot finish: the stream is dropped, as the
                // driver does; the chunk is missing and asked for again after the grace.
                Ok(Some(_)) | Ok(None) | Err(_) => None,
            };
            let Some((h, payload)) = decoded else {
                t.dropped_by_decoder += 1;
                continue;
            };
            match req.on_chunk(now, &h, payload) {
                Ok(ChunkVerdict::Land(spec)) => {
                    *t.verdicts.entry("land").or_default() += 1;
                    if payload != src.chunk(version, &spec) {
                        t.accepted.push(ctx(&format!(
                            "chunk {} landed with bytes that are not the owner's",
                            spec.id
                        )));
                    }
                    common::land(&mut landed, held, BPBL, &spec, payload);
                }
                Ok(ChunkVerdict::Duplicate) => *t.verdicts.entry("duplicate").or_default() += 1,
                Ok(ChunkVerdict::Corrupt { .. }) => *t.verdicts.entry("corrupt").or_default() += 1,
                Ok(ChunkVerdict::Ignored) => *t.verdicts.entry("ignored").or_default() += 1,
                // Chunks are fed only after the manifest here.
                Ok(ChunkVerdict::Early) => {
                    t.accepted.push(ctx("a chunk after the manifest was called early"))
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_err() {
            break;
        }
        // The owner's Done, possibly a lie; and a manifest that changes mid-transfer.
        if let Some(d) = owner.poll_done().unwrap() {
            let mut d = d;
            if rng.chance(p / 3.0) {
                if rng.chance(0.5) {
                    t.inject(Kind::WrongDigest);
                    d.digest ^= 1u128 << rng.below(128);
                } else {
                    t.inject(Kind::DoneForOtherTransfer);
                    d = Done { transfer_id: tid ^ (1 + u128::from(rng.next())), digest: d.digest };
                }
            }
            result = round_trip(&Frame::Done(d)).and_then(|f| match f {
                Frame::Done(d) => req.on_done(now, &d),
                _ => unreachable!(),
            });
        } else if rng.chance(p / 20.0) {
            let mut m2 = manifest;
            match rng.below(3) {
                0 => m2.chunk_target_bytes *= 2,
                1 => m2.blocks_held = (m2.blocks_held % requested) + 1,
                _ => m2.layers -= 1,
            }
            if let Some(plan) =
                kvferry_wire::ChunkPlan::new(m2.blocks_held, m2.layers, BPBL, m2.chunk_target_bytes.into())
            {
                (m2.chunk_count, m2.total_bytes) = (plan.count(), plan.total_bytes());
            }
            if m2 != manifest {
                t.inject(Kind::ManifestChanged);
                result = deliver_manifest(&mut req, now, &m2);
            }
        }
        if result.is_err() {
            break;
        }
        // Timers: missing chunks are asked for again.
        now += 20;
        if let Err(e) = req.on_timer(now) {
            result = Err(e);
            break;
        }
        while let Some(f) = req.poll_transmit() {
            match f {
                Frame::Retransmit(r) => {
                    if let Err(e) = owner.on_retransmit(&r.chunk_ids) {
                        result = Err(e);
                    }
                }
                Frame::Complete(_) => owner.on_complete().unwrap(),
                other => panic!("{}", ctx(&format!("requester sent {other:?}"))),
            }
        }
    }
    // The verdict on the whole transfer.
    match req.state() {
        State::Committed => {
            t.committed += 1;
            if req.valid_blocks() != held {
                t.accepted.push(ctx(&format!("committed {} of {held} blocks", req.valid_blocks())));
            }
            for l in 0..LAYERS {
                for b in 0..held {
                    if landed[(l * held + b) as usize] != src.0[version as usize][b as usize][l as usize] {
                        t.accepted
                            .push(ctx(&format!("committed block {b} layer {l} differs from the owner's")));
                    }
                }
            }
        }
        _ => {
            t.aborted += 1;
            if req.valid_blocks() != 0 {
                t.accepted
                    .push(ctx(&format!("an aborted transfer reports {} valid blocks", req.valid_blocks())));
            }
            let e = result.err().map_or("aborted without an error".into(), |e| variant(&e));
            *t.errors.entry(e).or_default() += 1;
        }
    }
    // This transfer's frames become replay material for later ones (bounded).
    for c in sent_ok.into_iter().step_by(3) {
        if captured.len() >= 256 {
            let i = rng.below(256) as usize;
            captured[i] = c;
        } else {
            captured.push(c);
        }
    }
}

fn variant(e: &WireError) -> String {
    format!("{e:?}").split(['(', ' ', '{']).next().unwrap_or_default().to_owned()
}

fn round_trip(f: &Frame) -> Result<Frame, WireError> {
    let bytes = frame::encode_to_vec(f);
    match frame::decode(&bytes) {
        Ok(Some((f, _))) => Ok(f),
        other => panic!("a clean frame did not decode: {other:?}"),
    }
}

fn deliver_manifest(req: &mut Requester, now: u64, m: &Manifest) -> Result<(), WireError> {
    match round_trip(&Frame::Manifest(*m))? {
        Frame::Manifest(m) => req.on_manifest(now, &m),
        _ => unreachable!(),
    }
}

fn encode_chunk(h: &ChunkHeader, payload: &[u8]) -> Vec<u8> {
    let mut b = frame::encode_to_vec(&Frame::Chunk(*h));
    b.extend_from_slice(payload);
    b
}

/// The adversary: the bytes sent in place of `honest` (header + payload, one frame).
fn tamper(
    rng: &mut Rng,
    kind: Kind,
    honest: &Captured,
    manifest: &Manifest,
    captured: &[Captured],
    sent: &[Captured],
    plan: Option<&kvferry_wire::ChunkPlan>,
) -> Vec<u8> {
    let (h, payload) = (honest.header, &honest.payload);
    let header_len = frame::encode_to_vec(&Frame::Chunk(h)).len();
    match kind {
        Kind::PayloadBitFlip => {
            let mut b = encode_chunk(&h, payload);
            let len = b.len();
            flip_bit(rng, &mut b, header_len..len);
            b
        }
        Kind::HeaderBitFlip => {
            let mut b = encode_chunk(&h, payload);
            flip_bit(rng, &mut b, 0..header_len);
            b
        }
        Kind::PayloadTruncated => {
            let cut = 1 + rng.below(payload.len() as u64 - 1) as usize;
            encode_chunk(&h, &payload[..payload.len() - cut])
        }
        Kind::FrameTruncated => {
            let b = encode_chunk(&h, payload);
            b[..rng.below(header_len as u64) as usize].to_vec()
        }
        Kind::PayloadPadded => {
            let mut p = payload.clone();
            p.extend((0..1 + rng.below(64)).map(|_| rng.next() as u8));
            encode_chunk(&h, &p)
        }
        Kind::WrongChecksum => {
            let mut h = h;
            h.checksum = if rng.chance(0.5) {
                u128::from(rng.next()) << 64 | u128::from(rng.next())
            } else {
                h.checksum ^ 1
            };
            encode_chunk(&h, payload)
        }
        Kind::SwappedChunk => {
            // Another chunk's bytes and checksum under this chunk's id (and place).
            let other = plan.and_then(|p| p.chunks().find(|c| c.id != h.chunk_id && c.len == h.len));
            match sent.iter().find(|c| Some(c.header.chunk_id) == other.map(|o| o.id)) {
                Some(o) => encode_chunk(&ChunkHeader { checksum: o.header.checksum, ..h }, &o.payload),
                None => {
                    // No same-sized sibling sent yet: its bytes reversed with this checksum.
                    let mut p = payload.clone();
                    p.reverse();
                    if p == *payload {
                        p[0] ^= 0xFF;
                    }
                    encode_chunk(&h, &p)
                }
            }
        }
        Kind::ChunkIdOutOfRange => {
            let count = manifest.chunk_count;
            let id = count + rng.below(1 << 20) as u32;
            encode_chunk(&ChunkHeader { chunk_id: id, ..h }, payload)
        }
        Kind::UnrequestedBlocks => {
            // The same chunk id and checksum, claiming blocks past what was requested.
            let shift = manifest.blocks_held + rng.below(4) as u32;
            let blocks = (h.blocks.0 + shift, h.blocks.1 + shift);
            encode_chunk(&ChunkHeader { blocks, ..h }, payload)
        }
        Kind::ReplayOtherTransfer | Kind::ReplayOtherTransferRelabelled | Kind::ReplayOlderVersion => {
            let pick = |rng: &mut Rng, want_old: bool| {
                let pool: Vec<&Captured> = captured
                    .iter()
                    .filter(
                        |c| if want_old { c.version < honest.version } else { c.version == honest.version },
                    )
                    .collect();
                (!pool.is_empty()).then(|| pool[rng.below(pool.len() as u64) as usize].clone())
            };
            let old = kind == Kind::ReplayOlderVersion;
            let Some(c) = pick(rng, old).or_else(|| pick(rng, !old)) else {
                // Nothing captured yet (the very first transfers): a replay of this transfer's
                // chunk under a foreign transfer id.
                let mut h = h;
                h.transfer_id ^= 1 << 77;
                return encode_chunk(&h, payload);
            };
            if kind == Kind::ReplayOtherTransfer {
                encode_chunk(&c.header, &c.payload)
            } else {
                // Relabelled to this transfer and, where the plan has it, this chunk's place.
                let mut rh = c.header;
                rh.transfer_id = h.transfer_id;
                if rng.chance(0.5) {
                    rh.chunk_id = h.chunk_id;
                    if c.header.len == h.len {
                        (rh.blocks, rh.layers) = (h.blocks, h.layers);
                    }
                }
                encode_chunk(&rh, &c.payload)
            }
        }
        Kind::DuplicateMutated => {
            // The honest chunk, then (later in the burst) a mutated copy with the honest header.
            // Here: a copy of an earlier verified chunk, its bytes changed, its header intact.
            match sent.get(rng.below(sent.len().max(1) as u64) as usize) {
                Some(c) => {
                    let mut p = c.payload.clone();
                    let n = p.len();
                    flip_bit(rng, &mut p, 0..n);
                    encode_chunk(&c.header, &p)
                }
                None => {
                    let mut b = encode_chunk(&h, payload);
                    let len = b.len();
                    flip_bit(rng, &mut b, header_len..len);
                    b
                }
            }
        }
        Kind::Reordered
        | Kind::WrongDigest
        | Kind::DoneForOtherTransfer
        | Kind::ManifestChanged
        | Kind::ManifestLies => {
            unreachable!("not a chunk-frame lie")
        }
    }
}

#[test]
fn ten_thousand_corruptions_none_accepted() {
    let want: u64 = std::env::var("KVFERRY_CORRUPTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(12_000);
    let base: u64 =
        std::env::var("KVFERRY_CORRUPTION_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x15_F0);
    let src = Source::new(3);
    let mut t = Tally::default();
    let mut captured = Vec::new();
    let mut i = 0u64;
    let start = std::time::Instant::now();
    while t.total() < want {
        // Three versions of the same blocks over the run: the owner's bytes change, and older
        // versions' frames are replayed against newer transfers.
        let version = (i * 3 / (want / 4).max(1)).min(2);
        // Most transfers see some lies; some see a lie in almost every frame.
        let p = if i % 10 == 9 { 0.9 } else { 0.35 };
        transfer(base ^ i.wrapping_mul(0x9E37_79B9), version, p, &src, &mut captured, &mut t);
        i += 1;
    }
    let total = t.total();
    println!(
        "fault-suite: corruptions injected {total} (sans-IO), accepted {} ({} transfers: {} committed, {} aborted, \
         base seed {base:#x}, {:.1} s)",
        t.accepted.len(),
        i,
        t.committed,
        t.aborted,
        start.elapsed().as_secs_f64()
    );
    println!("  by kind: {:?}", t.injected);
    println!("  verdicts: {:?}, dropped by the decoder {}", t.verdicts, t.dropped_by_decoder);
    println!("  aborts: {:?}", t.errors);
    assert!(t.accepted.is_empty(), "accepted as valid (base seed {base:#x}): {:#?}", t.accepted);
    assert!(total >= want);
    for k in CHUNK_KINDS.iter().chain(&[
        Kind::Reordered,
        Kind::WrongDigest,
        Kind::DoneForOtherTransfer,
        Kind::ManifestChanged,
        Kind::ManifestLies,
    ]) {
        assert!(t.injected.get(k).copied().unwrap_or(0) > 0, "{k:?} was never injected");
    }
    // The faults are survivable: most transfers still commit, byte-identical.
    assert!(t.committed * 2 > i, "only {} of {i} transfers committed", t.committed);
    assert!(t.aborted > 0, "no lie ever ended a transfer");
}
