//! Done criteria 1–4 of the reference engine on random configs and prompts: migrated blocks
//! are byte-identical, logits after a migrated prefix or a split are bit-identical to a full
//! recompute, one flipped byte changes the logits, a fingerprint mismatch is refused and
//! recomputed.

mod common;

use common::{bits, occupy, random_case, random_config, random_prompt, token_rows};
use kvferry_engine::detmath::SplitMix64;
use kvferry_engine::{
    BLOCK_SIZE, BlockOffer, Engine, EngineError, FingerprintMismatch, PrefixOutcome, SliceMemory,
    matchable_tokens,
};

const CASES: u64 = 6;
const POOL_BLOCKS: u32 = 40;

#[test]
fn migrated_prefix_is_byte_and_bit_identical() {
    for case in 0..CASES {
        let (mut rng, cfg, prompt) = random_case(0xA11CE + case, 20, 201);
        let t = prompt.len();
        let ctx = format!("case {case}: {cfg:?}, {t} tokens");

        // Source engine A computes the whole prompt.
        let mut a = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        let mut sa = a.start(&prompt).unwrap();
        let logits_a = a.prefill(&mut sa).unwrap();
        let full_blocks = t / BLOCK_SIZE;
        let offer = BlockOffer {
            fingerprint: a.fingerprint(),
            first_block: 0,
            payloads: a.export_blocks(&sa, 0..full_blocks).unwrap(),
        };

        // Destination B: other block ids, loads A's blocks, computes only the remainder.
        let mut b = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        let _held = occupy(&mut b, rng.range(1, 5) as usize);
        let mut sb = b.start(&prompt).unwrap();
        assert_ne!(sa.table().blocks(), sb.table().blocks(), "{ctx}");
        let (outcome, logits_b) = b.prefill_with_offer(&mut sb, &offer).unwrap();
        let cached = matchable_tokens(t, full_blocks);
        assert_eq!(outcome, PrefixOutcome::Loaded { tokens: cached }, "{ctx}");

        // 1. Migrated blocks byte-identical (and the whole prompt's KV too).
        assert_eq!(b.export_blocks(&sb, 0..full_blocks).unwrap(), offer.payloads, "{ctx}");
        assert!(token_rows(&a, &sa, t) == token_rows(&b, &sb, t), "{ctx}: KV differs");

        // 2. Logits bit-identical to a full local recompute on a fresh engine B'.
        let mut b2 = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        let mut sb2 = b2.start(&prompt).unwrap();
        let logits_full = b2.prefill(&mut sb2).unwrap();
        assert_eq!(bits(&logits_b), bits(&logits_full), "{ctx}");
        assert_eq!(bits(&logits_a), bits(&logits_full), "{ctx}");

        // Greedy continuation agrees too.
        let steps = 3;
        let gen_b = b.decode(&mut sb, steps).unwrap();
        let gen_full = b2.decode(&mut sb2, steps).unwrap();
        assert_eq!(gen_b, gen_full, "{ctx}");
        assert_eq!(bits(sb.logits().unwrap()), bits(sb2.logits().unwrap()), "{ctx}");

        // Published blocks: A's full blocks under their chained keys.
        let pub_a = a.published_blocks(&sa, b"tenant");
        assert_eq!(pub_a.len(), full_blocks, "{ctx}");
        assert!(pub_a.iter().zip(sa.table().blocks()).all(|(p, &id)| p.block_id == id));
        let pub_b = b.published_blocks(&sb, b"tenant");
        assert!(pub_a.iter().zip(&pub_b).all(|(x, y)| x.hash == y.hash), "{ctx}");
    }
}

#[test]
fn split_prefill_is_bit_identical() {
    for case in 0..CASES {
        let (mut rng, cfg, prompt) = random_case(0x5B117 + case, 33, 201);
        let t = prompt.len();
        let full_blocks = t / BLOCK_SIZE;
        // Split point: block-aligned on even cases, anywhere on odd ones.
        let k = if case % 2 == 0 {
            rng.range(1, full_blocks as u64) as usize * BLOCK_SIZE
        } else {
            rng.range(1, (full_blocks * BLOCK_SIZE) as u64) as usize
        };
        let ctx = format!("case {case}: {cfg:?}, {t} tokens, split at {k}");

        let mut src = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        let mut ss = src.start(&prompt).unwrap();
        let logits_src = src.prefill(&mut ss).unwrap();

        // Destination computes [0, k) locally while [k, T) "arrives" from the source.
        let mut dst = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        let _held = occupy(&mut dst, 2);
        let mut sd = dst.start(&prompt).unwrap();
        dst.prefill_to(&mut sd, k).unwrap();
        let first = k / BLOCK_SIZE;
        let offer = BlockOffer {
            fingerprint: src.fingerprint(),
            first_block: first,
            payloads: src.export_blocks(&ss, first..full_blocks).unwrap(),
        };
        dst.import_blocks(&sd, &offer).unwrap();
        dst.mark_loaded(&mut sd, matchable_tokens(t, full_blocks)).unwrap();
        let logits_split = dst.prefill(&mut sd).unwrap();

        assert_eq!(bits(&logits_split), bits(&logits_src), "{ctx}");
        assert!(token_rows(&src, &ss, t) == token_rows(&dst, &sd, t), "{ctx}: KV differs");

        // Chunked prefill at random boundaries is also identical to one shot.
        let mut ch = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        let mut sc = ch.start(&prompt).unwrap();
        while sc.computed() < t {
            let end = (sc.computed() + rng.range(1, 40) as usize).min(t);
            ch.prefill_to(&mut sc, end).unwrap();
        }
        assert_eq!(bits(sc.logits().unwrap()), bits(&logits_src), "{ctx}: chunked");
    }
}

#[test]
fn one_flipped_byte_changes_the_logits() {
    for case in 0..CASES {
        let (mut rng, cfg, prompt) = random_case(0xF11B + case, 20, 201);
        let t = prompt.len();
        let full_blocks = t / BLOCK_SIZE;
        let cached = matchable_tokens(t, full_blocks);

        let mut a = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        let mut sa = a.start(&prompt).unwrap();
        let clean = a.prefill(&mut sa).unwrap();
        let mut payloads = a.export_blocks(&sa, 0..full_blocks).unwrap();

        // One byte of one loaded (not recomputed) token row, any layer, K or V.
        let layout = *a.layout();
        let blk = rng.range(0, full_blocks as u64) as usize;
        let valid_rows = (cached - blk * BLOCK_SIZE).min(BLOCK_SIZE);
        let layer = rng.range(0, layout.layers as u64) as usize;
        let plane = rng.range(0, 2) as usize;
        let in_block = rng.range(0, (valid_rows * layout.row_bytes()) as u64) as usize;
        let at = (2 * layer + plane) * layout.block_bytes() + in_block;
        payloads[blk][at] ^= 0xFF;
        let ctx = format!(
            "case {case}: {cfg:?}, {t} tokens, block {blk} layer {layer} plane {plane} byte {in_block}"
        );

        let mut b = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        let mut sb = b.start(&prompt).unwrap();
        let offer = BlockOffer { fingerprint: a.fingerprint(), first_block: 0, payloads };
        let (_, dirty) = b.prefill_with_offer(&mut sb, &offer).unwrap();
        assert_ne!(bits(&dirty), bits(&clean), "{ctx}");
    }
}

#[test]
fn fingerprint_mismatch_is_refused_and_recomputed() {
    let mut rng = SplitMix64::new(0xFEED);
    for case in 0..3u64 {
        let cfg = random_config(&mut rng);
        let prompt = random_prompt(&mut rng, cfg.vocab, 40, 120);
        let full_blocks = prompt.len() / BLOCK_SIZE;

        // A source with another seed (model mismatch), then a tampered layout fingerprint.
        let mut other = cfg.clone();
        other.seed ^= 1;
        let mut a = Engine::with_heap_pool(other, POOL_BLOCKS).unwrap();
        let mut sa = a.start(&prompt).unwrap();
        a.prefill(&mut sa).unwrap();
        let mut offer = BlockOffer {
            fingerprint: a.fingerprint(),
            first_block: 0,
            payloads: a.export_blocks(&sa, 0..full_blocks).unwrap(),
        };

        let mut b = Engine::with_heap_pool(cfg.clone(), POOL_BLOCKS).unwrap();
        if case == 2 {
            offer.fingerprint.model = b.fingerprint().model;
            offer.fingerprint.layout[0] ^= 1;
        }
        let mut sb = b.start(&prompt).unwrap();
        let (outcome, logits) = b.prefill_with_offer(&mut sb, &offer).unwrap();
        match (&outcome, case) {
            (PrefixOutcome::Refused(FingerprintMismatch::Layout { .. }), 2) => {}
            (PrefixOutcome::Refused(FingerprintMismatch::Model { .. }), 0 | 1) => {}
            _ => panic!("case {case}: unexpected outcome {outcome:?}"),
        }
        assert!(matches!(b.import_blocks(&sb, &offer), Err(EngineError::Refused(_))));

        let mut b2 = Engine::with_heap_pool(cfg, POOL_BLOCKS).unwrap();
        let mut sb2 = b2.start(&prompt).unwrap();
        assert_eq!(bits(&logits), bits(&b2.prefill(&mut sb2).unwrap()), "case {case}");
    }
}

#[test]
fn external_memory_matches_heap_memory() {
    let (_, cfg, prompt) = random_case(0xE77, 20, 80);
    let layout = kvferry_engine::KvLayout::for_model(&cfg, 16).unwrap();
    // One big "mapping", carved into per-layer regions, like a shm memfd pool would be.
    let mut mapping = vec![0u8; layout.region_len() * layout.layers];
    let regions: Vec<&mut [u8]> = mapping.chunks_mut(layout.region_len()).collect();
    let mut ext = Engine::new(cfg.clone(), 16, SliceMemory(regions)).unwrap();
    let mut se = ext.start(&prompt).unwrap();
    let le = ext.prefill(&mut se).unwrap();
    let mut heap = Engine::with_heap_pool(cfg, 16).unwrap();
    let mut sh = heap.start(&prompt).unwrap();
    assert_eq!(bits(&le), bits(&heap.prefill(&mut sh).unwrap()));
    assert!(token_rows(&ext, &se, prompt.len()) == token_rows(&heap, &sh, prompt.len()));
}

#[test]
fn engine_errors_are_typed() {
    let cfg = kvferry_engine::ModelConfig::tiny(3);
    let mut e = Engine::with_heap_pool(cfg, 4).unwrap();
    assert!(matches!(e.start(&[]), Err(EngineError::EmptyPrompt)));
    assert!(matches!(e.start(&[1, 999]), Err(EngineError::TokenOutOfRange { token: 999, position: 1, .. })));
    assert!(matches!(e.start(&[1; 100]), Err(EngineError::OutOfBlocks(_))));
    let mut s = e.start(&[1, 2, 3]).unwrap();
    assert!(matches!(e.prefill_from(&mut s, 3), Err(EngineError::Range(_))));
    assert!(matches!(e.decode(&mut s, 1), Err(EngineError::Range(_))));
    e.prefill(&mut s).unwrap();
    // Decoding past the first block allocates more.
    let before = e.free_blocks();
    e.decode(&mut s, 14).unwrap();
    assert_eq!(e.free_blocks(), before - 1);
    e.free(s);
    assert_eq!(e.free_blocks(), 4);
}
