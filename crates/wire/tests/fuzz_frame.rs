//! Fuzz targets for the frame codec (`frame::decode` / `frame::encode`).
//!
//! Under `cargo test` these run bolero's bounded random engine (a few seconds in a debug
//! build); the same targets run under a real fuzzing engine with cargo-bolero:
//!
//! ```text
//! cargo install cargo-bolero
//! cargo +nightly bolero test -p kvferry-wire --test fuzz_frame decode_never_panics_and_round_trips \
//!     --engine libfuzzer          # or: --engine afl, --engine honggfuzz
//! # a longer run of the random engine on stable:
//! BOLERO_RANDOM_ITERATIONS=10000000 BOLERO_RANDOM_TEST_TIME_MS=600000 \
//!     cargo test --release -p kvferry-wire --test fuzz_frame
//! ```
//!
//! A failure prints `BOLERO_RANDOM_SEED=…`; set that variable to replay it exactly.
//!
//! Properties: decoding any byte string never panics and never allocates past the limits; a
//! decoded frame re-encodes to exactly the bytes it was decoded from (the encoding is
//! canonical) and decodes again to the same frame; every strict prefix of a valid frame is
//! "need more bytes"; any frame built from structured input survives encode → decode.

use std::time::Duration;

use bolero::{TypeGenerator, check, produce};
use kvferry_wire::frame::{
    self, Cancel, ChunkHeader, Complete, DecodeError, Done, FetchRequest, Frame, MAX_STRING, Manifest,
    PREFIX_LEN, Probe, Refusal, RefusalCode, Retransmit,
};

/// Per-target bound for CI's debug `cargo test`; env vars (`BOLERO_RANDOM_*`) override it.
const ITERATIONS: usize = 200_000;
const TIME: Duration = Duration::from_secs(3);

/// Checks one input; returns the decoded frame, if any.
fn check_bytes(bytes: &[u8]) -> Option<Frame> {
    match frame::decode(bytes) {
        Ok(Some((f, used))) => {
            assert!((PREFIX_LEN..=bytes.len()).contains(&used), "consumed {used} of {}", bytes.len());
            let enc = frame::encode_to_vec(&f);
            assert_eq!(&enc[..], &bytes[..used], "encoding is not canonical for {f:?}");
            assert_eq!(frame::decode(&enc), Ok(Some((f.clone(), enc.len()))));
            Some(f)
        }
        Ok(None) => {
            // "Need more" only while the declared frame is not complete yet.
            if bytes.len() >= PREFIX_LEN {
                let len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
                assert!(bytes.len() < PREFIX_LEN + len, "a complete frame was reported incomplete");
            }
            None
        }
        Err(e) => {
            // Every error formats (no panic in Display either).
            let _ = e.to_string();
            None
        }
    }
}

#[test]
fn decode_never_panics_and_round_trips() {
    check!().with_iterations(ITERATIONS).with_test_time(TIME).for_each(|bytes: &[u8]| {
        check_bytes(bytes);
    });
}

/// Random bytes rarely carry a valid prefix; this target always does, so the body parsers of
/// every frame type see arbitrary bodies (with the declared length right, or arbitrary).
#[derive(Debug, TypeGenerator)]
struct Framed {
    #[generator(0u8..=12)]
    kind: u8,
    body: Vec<u8>,
    declared_len: Option<u32>,
    extra: Vec<u8>,
}

#[test]
fn bodies_of_every_type_never_panic() {
    check!().with_type::<Framed>().with_iterations(ITERATIONS).with_test_time(TIME).for_each(|f| {
        let mut b = Vec::with_capacity(PREFIX_LEN + f.body.len() + f.extra.len());
        b.extend_from_slice(&frame::MAGIC.to_le_bytes());
        b.push(frame::VERSION);
        b.push(f.kind);
        b.extend_from_slice(&f.declared_len.unwrap_or(f.body.len() as u32).to_le_bytes());
        b.extend_from_slice(&f.body);
        b.extend_from_slice(&f.extra);
        if let Some(fr) = check_bytes(&b) {
            assert_eq!(kind_of(&fr), f.kind);
        }
    });
}

fn kind_of(f: &Frame) -> u8 {
    frame::encode_to_vec(f)[3]
}

/// Structured frames: every field arbitrary within the codec's documented limits.
#[derive(Debug, Clone, TypeGenerator)]
enum AnyFrame {
    Request {
        transfer_id: u128,
        #[generator(produce::<String>().with().len(0usize..=40))]
        tenant: String,
        fingerprint: [u8; 32],
        #[generator(produce::<Vec<[u8; 32]>>().with().len(0usize..=20))]
        hashes: Vec<[u8; 32]>,
        have: Vec<u32>,
        target: u32,
        /// Encode as a `Query` (same body) rather than a `Request`.
        query: bool,
    },
    Manifest(u128, u32, u32, u64, u32, u64, u32),
    Refusal(u128, #[generator(1u8..=7)] u8, String),
    Chunk(u128, u32, u32, u32, u32, u32, #[generator(0..=frame::MAX_CHUNK_BYTES)] u64, u128),
    Done(u128, u128),
    Retransmit(u128, Vec<u32>),
    Cancel(u128, String),
    Complete(u128),
    Probe(u128, u64),
}

fn code(c: u8) -> RefusalCode {
    [
        RefusalCode::UnknownBlocks,
        RefusalCode::FingerprintMismatch,
        RefusalCode::TenantMismatch,
        RefusalCode::Overloaded,
        RefusalCode::NotAuthorized,
        RefusalCode::BadRequest,
        RefusalCode::Internal,
    ][usize::from(c.clamp(1, 7) - 1)]
}

/// Ranges must be non-empty for the codec; make an arbitrary pair one.
fn range(a: u32, b: u32) -> (u32, u32) {
    let (lo, hi) = (a.min(b), a.max(b));
    if lo == hi { (lo.saturating_sub(1), hi.max(1)) } else { (lo, hi) }
}

fn build(a: AnyFrame) -> Frame {
    match a {
        AnyFrame::Request { transfer_id, tenant, fingerprint, hashes, have, target, query } => {
            let r = FetchRequest {
                transfer_id,
                tenant,
                fingerprint,
                block_hashes: hashes,
                have_chunks: have,
                chunk_target_bytes: target,
            };
            if query { Frame::Query(r) } else { Frame::Request(r) }
        }
        AnyFrame::Manifest(transfer_id, blocks_held, layers, bpbl, target, total, count) => {
            Frame::Manifest(Manifest {
                transfer_id,
                blocks_held,
                layers,
                bytes_per_block_layer: bpbl,
                chunk_target_bytes: target,
                total_bytes: total,
                chunk_count: count,
            })
        }
        AnyFrame::Refusal(transfer_id, c, detail) => {
            Frame::Refusal(Refusal { transfer_id, code: code(c), detail })
        }
        AnyFrame::Chunk(transfer_id, chunk_id, b0, b1, l0, l1, len, checksum) => Frame::Chunk(ChunkHeader {
            transfer_id,
            chunk_id,
            blocks: range(b0, b1),
            layers: range(l0, l1),
            len,
            checksum,
        }),
        AnyFrame::Done(transfer_id, digest) => Frame::Done(Done { transfer_id, digest }),
        AnyFrame::Retransmit(transfer_id, chunk_ids) => {
            Frame::Retransmit(Retransmit { transfer_id, chunk_ids })
        }
        AnyFrame::Cancel(transfer_id, detail) => Frame::Cancel(Cancel { transfer_id, detail }),
        AnyFrame::Complete(transfer_id) => Frame::Complete(Complete { transfer_id }),
        AnyFrame::Probe(transfer_id, bytes) => Frame::Probe(Probe { transfer_id, bytes }),
    }
}

#[test]
fn structured_frames_round_trip() {
    check!().with_type::<AnyFrame>().with_iterations(ITERATIONS).with_test_time(TIME).for_each(|a| {
        let f = build(a.clone());
        let bytes = frame::encode_to_vec(&f);
        let (back, used) = frame::decode(&bytes).unwrap().unwrap();
        assert_eq!(used, bytes.len());
        // Strings past the limit are cut at a char boundary by the encoder; everything else
        // must come back unchanged.
        match (&f, &back) {
            (Frame::Refusal(a), Frame::Refusal(b)) if a.detail.len() > MAX_STRING => {
                assert!(a.detail.starts_with(&b.detail))
            }
            (Frame::Cancel(a), Frame::Cancel(b)) if a.detail.len() > MAX_STRING => {
                assert!(a.detail.starts_with(&b.detail))
            }
            _ => assert_eq!(back, f),
        }
        // Every strict prefix is "need more bytes"; a trailing byte inside the body is refused.
        for cut in [0, 1, PREFIX_LEN - 1, PREFIX_LEN, bytes.len() / 2, bytes.len() - 1] {
            assert_eq!(frame::decode(&bytes[..cut.min(bytes.len() - 1)]), Ok(None));
        }
        let mut longer = bytes.clone();
        longer.push(0);
        let len = (longer.len() - PREFIX_LEN) as u32;
        longer[4..8].copy_from_slice(&len.to_le_bytes());
        assert_eq!(frame::decode(&longer), Err(DecodeError::Trailing(1)));
    });
}
