//! Chunk checksum candidates, single thread, on 4 MiB buffers: xxh3-128 (the wire's choice),
//! crc32c (hardware CRC32 instruction where available) and BLAKE3 (SIMD, one thread).
//!
//! `cargo bench -p kvferry-wire --bench checksum` (set `CHECKSUM_ROUNDS` for more rounds).
//! Rounds interleave the algorithms so background load hits all of them alike; the median
//! round is reported, with the min and max to show the noise. Two placements: `hot` hashes the
//! same 4 MiB buffer again and again (it stays in cache), `cold` walks 64 distinct 4 MiB
//! buffers (256 MiB, far beyond the caches), as hashing freshly received chunks does.

use std::hint::black_box;
use std::time::Instant;

const BUF: usize = 4 << 20;

type Hasher = fn(&[u8]) -> u128;

fn xxh3_128(b: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128_with_seed(b, 0x9E37)
}

fn crc32c(b: &[u8]) -> u128 {
    u128::from(crc32c::crc32c(b))
}

fn blake3(b: &[u8]) -> u128 {
    let h = blake3::hash(b);
    u128::from_le_bytes(h.as_bytes()[..16].try_into().unwrap_or([0; 16]))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing: run once, quickly.
    let quick = !std::env::args().any(|a| a == "--bench");
    let rounds: usize = std::env::var("CHECKSUM_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(15);
    let rounds = if quick { 1 } else { rounds };
    let iters_per_round = if quick { 1 } else { 64 }; // 256 MiB per round per algorithm
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let nbufs = if quick { 1 } else { 64 };
    let bufs: Vec<Vec<u8>> = (0..nbufs)
        .map(|_| {
            (0..BUF)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        })
        .collect();
    let buf = &bufs[0];
    let algos: [(&str, Hasher); 3] = [("xxh3-128", xxh3_128), ("crc32c", crc32c), ("blake3", blake3)];
    let mut hot: Vec<Vec<f64>> = vec![Vec::new(); algos.len()];
    let mut cold: Vec<Vec<f64>> = vec![Vec::new(); algos.len()];
    for (_, f) in &algos {
        black_box(f(black_box(buf))); // warm-up: page in, detect CPU features
    }
    for _ in 0..rounds {
        for (i, (_, f)) in algos.iter().enumerate() {
            let t = Instant::now();
            for _ in 0..iters_per_round {
                black_box(f(black_box(buf)));
            }
            hot[i].push((BUF * iters_per_round) as f64 / t.elapsed().as_secs_f64() / 1e9);
            let t = Instant::now();
            for j in 0..iters_per_round {
                black_box(f(black_box(&bufs[j % nbufs])));
            }
            cold[i].push((BUF * iters_per_round) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    if quick {
        return;
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "buffer 4 MiB, {rounds} rounds x {iters_per_round} hashes, single thread; loadavg {}",
        load.trim()
    );
    #[cfg(target_arch = "x86_64")]
    println!(
        "cpu features: sse4.2={} avx2={} avx512f={} (xxhash-rust picks SIMD at compile time: {})",
        std::arch::is_x86_feature_detected!("sse4.2"),
        std::arch::is_x86_feature_detected!("avx2"),
        std::arch::is_x86_feature_detected!("avx512f"),
        if cfg!(target_feature = "avx2") { "avx2" } else { "sse2" },
    );
    println!("| algorithm | placement | median GB/s | min | max |");
    println!("|---|---|---:|---:|---:|");
    for (placement, table) in [("hot (in cache)", &mut hot), ("cold (256 MiB)", &mut cold)] {
        for (i, (name, _)) in algos.iter().enumerate() {
            let v = &mut table[i];
            let lo = v.iter().copied().fold(f64::MAX, f64::min);
            let hi = v.iter().copied().fold(0.0, f64::max);
            println!("| {name} | {placement} | {:.2} | {lo:.2} | {hi:.2} |", median(v));
        }
    }
}
