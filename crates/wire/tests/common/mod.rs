//! What the wire crate's integration tests share: one seedable RNG, so a failing seed replays
//! exactly in every test that uses it; the requester configuration of the simulated
//! transfers; and how a verified chunk lands in a test's memory.

#![allow(dead_code)] // each test binary uses a part

use kvferry_wire::{ChunkSpec, RequesterConfig};

/// A requester configuration for `layers` layers of `bpbl`-byte block-layers in 64 KiB chunks,
/// `retries` retransmissions per chunk, and the test clock's `(deadline, missing grace, stall
/// timeout)` in its nanoseconds.
pub fn requester_config(layers: u32, bpbl: u64, retries: u32, clock: (u64, u64, u64)) -> RequesterConfig {
    let (deadline_ns, missing_grace_ns, stall_timeout_ns) = clock;
    RequesterConfig {
        layers,
        bytes_per_block_layer: bpbl,
        chunk_target_bytes: 64 << 10,
        max_retries_per_chunk: retries,
        deadline_ns,
        missing_grace_ns,
        stall_timeout_ns,
    }
}

/// The small transfer of the timer and early-chunk tests: 4 layers of 32 KiB block-layers, 3
/// retransmissions per chunk, a 10 s deadline, a 200 ms missing grace and a 1 s stall timeout.
pub fn small_requester_config() -> RequesterConfig {
    const MS: u64 = 1_000_000;
    requester_config(4, 32 << 10, 3, (10_000 * MS, 200 * MS, 1_000 * MS))
}

/// Lands a verified chunk: its payload is layer-major (for each layer of the chunk, each
/// block's `bpbl` bytes), `landed` holds one buffer per (layer, block) of `held` blocks.
pub fn land(landed: &mut [Vec<u8>], held: u32, bpbl: u64, spec: &ChunkSpec, payload: &[u8]) {
    let bpbl = bpbl as usize;
    let mut off = 0;
    for l in spec.layers.0..spec.layers.1 {
        for b in spec.blocks.0..spec.blocks.1 {
            landed[(l * held + b) as usize].copy_from_slice(&payload[off..off + bpbl]);
            off += bpbl;
        }
    }
}

/// SplitMix64: tiny, seedable, deterministic everywhere.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }

    /// Uniform in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}
