//! One core's ceilings, measured in the bench's own process before the profiles run, so that
//! the daemons' CPU seconds per GiB are read against what the unavoidable work costs on the
//! same host in the same run: copying a GiB (memcpy), sealing it with AES-128-GCM (the cipher
//! both QUIC and TLS negotiate first; aws-lc-rs, the library the daemons link), and the
//! wire's chunk checksum (XXH3-128). A daemon that receives a chunk decrypts it, checksums it
//! and copies it at least once; one that sends reads, checksums and encrypts it: the sum of
//! the three is the floor of a side's CPU per GiB, everything above it is per-packet and
//! runtime cost.

use std::time::{Duration, Instant};

use aws_lc_rs::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use kvferry_bench_report::Ceilings;

const GIB: f64 = (1u64 << 30) as f64;
/// The buffer each ceiling works over: larger than the caches, like a chunk stream.
const BUF: usize = 64 << 20;
/// QUIC packets carry ~1.2–1.4 kB, TLS records 16 KiB: AES-GCM is timed on 16 KiB records
/// (per-packet overhead is what the daemons' figures add on top).
const RECORD: usize = 16 << 10;

/// Runs `f` over `bytes` per call until `min` has passed; CPU seconds of this thread per GiB.
fn per_gib(min: Duration, bytes: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm: page faults and caches out of the measurement
    let (t0, c0) = (Instant::now(), thread_cpu_s());
    let mut done = 0u64;
    while t0.elapsed() < min {
        f();
        done += bytes as u64;
    }
    (thread_cpu_s() - c0) / (done as f64 / GIB)
}

fn thread_cpu_s() -> f64 {
    kvferry_baselines::cpu_seconds(libc::RUSAGE_THREAD)
}

/// Measures the three ceilings, `min` of work each (0.3 s is enough for ±2 %).
pub fn measure(min: Duration) -> Ceilings {
    let src = vec![0x5au8; BUF];
    let mut dst = vec![0u8; BUF];
    let memcpy = per_gib(min, BUF, || {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
    });
    let key = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &[7u8; 16]).expect("a 16-byte AES-128 key"));
    let mut seq = 0u64;
    let aes = per_gib(min, BUF, || {
        for rec in dst.chunks_mut(RECORD) {
            seq += 1;
            let mut n = [0u8; 12];
            n[4..].copy_from_slice(&seq.to_be_bytes());
            let tag = key
                .seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::empty(), rec)
                .expect("sealing a 16 KiB record");
            let _ = std::hint::black_box(tag);
        }
    });
    let mut chunk = 0u32;
    let checksum = per_gib(min, BUF, || {
        chunk = chunk.wrapping_add(1);
        std::hint::black_box(kvferry_wire::checksum::chunk_checksum(1, chunk, &src));
    });
    Ceilings { memcpy_s_per_gib: memcpy, aes128gcm_s_per_gib: aes, checksum_s_per_gib: checksum }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_ceiling_is_a_positive_finite_cost_per_gib() {
        let c = measure(Duration::from_millis(20));
        for (what, v) in
            [("memcpy", c.memcpy_s_per_gib), ("aes", c.aes128gcm_s_per_gib), ("xxh3", c.checksum_s_per_gib)]
        {
            assert!(v.is_finite() && v > 0.0, "{what}: {v}");
        }
    }
}
