//! Shared helpers of the engine's integration tests: random small configs and prompts, and
//! bit-level comparisons of logits and pool rows.

#![allow(dead_code)]

use kvferry_engine::detmath::SplitMix64;
use kvferry_engine::{BLOCK_SIZE, Engine, KvDtype, KvMemory, ModelConfig, Plane, Sequence};

/// A random small config (2–4 layers, hidden 64–128, 4 heads, 1–4 KV heads, head dim
/// 16–32, vocab 256–1000, f32 or bf16 KV).
pub fn random_config(rng: &mut SplitMix64) -> ModelConfig {
    let hidden = [64, 96, 128][rng.range(0, 3) as usize];
    ModelConfig {
        layers: rng.range(2, 5) as usize,
        hidden,
        heads: 4,
        kv_heads: [1, 2, 4][rng.range(0, 3) as usize],
        head_dim: [16, 24, 32][rng.range(0, 3) as usize],
        ffn: hidden * 2,
        vocab: rng.range(256, 1001) as usize,
        rope_theta: [10_000.0, 500_000.0][rng.range(0, 2) as usize],
        seed: rng.next_u64(),
        kv_dtype: if rng.range(0, 2) == 0 { KvDtype::F32 } else { KvDtype::Bf16 },
    }
}

/// Case `seed` of a property test: its generator (for the case's further draws), a random
/// config and a random prompt of `lo..hi` tokens in its vocabulary.
pub fn random_case(seed: u64, lo: u64, hi: u64) -> (SplitMix64, ModelConfig, Vec<u32>) {
    let mut rng = SplitMix64::new(seed);
    let cfg = random_config(&mut rng);
    let prompt = random_prompt(&mut rng, cfg.vocab, lo, hi);
    (rng, cfg, prompt)
}

/// A random prompt of `lo..hi` tokens.
pub fn random_prompt(rng: &mut SplitMix64, vocab: usize, lo: u64, hi: u64) -> Vec<u32> {
    let n = rng.range(lo, hi);
    (0..n).map(|_| rng.range(0, vocab as u64) as u32).collect()
}

/// f32 bit patterns (so NaN == NaN and -0 != +0: a bit-identity check).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The pool bytes of positions `[0, upto)` of `seq`, per layer and plane, in order.
pub fn token_rows<M: KvMemory>(e: &Engine<M>, seq: &Sequence, upto: usize) -> Vec<u8> {
    let layout = *e.layout();
    let rb = layout.row_bytes();
    let mut out = Vec::new();
    for l in 0..layout.layers {
        for plane in [Plane::K, Plane::V] {
            for (i, &b) in seq.table().blocks().iter().enumerate() {
                let valid = upto.saturating_sub(i * BLOCK_SIZE).min(BLOCK_SIZE);
                out.extend_from_slice(&e.pool().block(l, plane, b).unwrap()[..valid * rb]);
            }
        }
    }
    out
}

/// Occupies `n` blocks of `e` with a throwaway sequence so later sequences get other ids.
pub fn occupy<M: KvMemory>(e: &mut Engine<M>, n: usize) -> Option<Sequence> {
    (n > 0).then(|| e.start(&vec![0u32; n * BLOCK_SIZE]).unwrap())
}
