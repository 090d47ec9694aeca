//! NIXL read/write throughput across two processes vs. a plain memcpy in the same run.
//!
//! The engine (`kvferry-nixl-engine`) runs in a child process and registers one memfd-backed
//! region of 64 × 2 MiB; the daemon side (this process) moves all 64 blocks, in shuffled
//! order, with `NixlBackend::read` (gather into staging) and `write` (scatter from staging),
//! as one batch and as 64 single-block calls (each with its own 2 MiB staging). The baseline gathers the same blocks with
//! `copy_from_slice` between two buffers of this process. Prints a markdown table.
//!
//! Run: `source deploy/install-nixl.sh && cargo bench -p kvferry-pool-nixl --bench nixl_throughput`
//! (`NIXL_BENCH_ITERS` sets the iterations, default 10.)

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{EngineKind, start_engine};
use kvferry_pool::conformance::Rng;
use kvferry_pool::{Extent, MemoryBackend};
use kvferry_pool_nixl::{NixlBackend, ensure_nixl};

const BLOCK: usize = 2 << 20;
const BLOCKS: usize = 64;
const TOTAL: usize = BLOCK * BLOCKS;

fn gib_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / f64::from(1u32 << 30)
}

/// (median, best) GiB/s over `iters` runs of `f`, each moving `bytes`.
fn measure(iters: usize, bytes: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut v: Vec<f64> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            gib_s(bytes, t.elapsed())
        })
        .collect();
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1])
}

fn main() {
    if let Err(e) = ensure_nixl() {
        eprintln!("NIXL is not usable: {e}\nRun `source deploy/install-nixl.sh` first.");
        std::process::exit(1);
    }
    let iters: usize = std::env::var("NIXL_BENCH_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let engine = start_engine(EngineKind::Rust, &[TOTAL as u64]);
    let mut rng = Rng::new(0xBE7C);
    engine.maps[0].write(0, &rng.bytes(TOTAL)).expect("fill engine memory");
    let backend = NixlBackend::attach_with(
        &engine.process.descriptor,
        common::helper_opts(std::time::Duration::from_secs(60)),
    )
    .expect("attach");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");

    let mut order: Vec<usize> = (0..BLOCKS).collect();
    rng.shuffle(&mut order);
    let extents: Vec<Extent> =
        order.iter().map(|&b| Extent { region: 0, offset: (b * BLOCK) as u64, len: BLOCK as u64 }).collect();
    let mut staging = backend.staging(TOTAL).expect("staging");

    // Warm-up (the first transfer of a new pair pays connection set-up), then check bytes.
    for _ in 0..2 {
        rt.block_on(backend.read(&extents, &mut staging)).expect("read");
        rt.block_on(backend.write(&extents, &staging)).expect("write");
    }
    let engine_bytes = engine.maps[0].to_vec();
    for (i, &b) in order.iter().enumerate() {
        assert!(
            staging.as_slice()[i * BLOCK..(i + 1) * BLOCK] == engine_bytes[b * BLOCK..(b + 1) * BLOCK],
            "block {b} differs"
        );
    }

    let read_batch =
        measure(iters, TOTAL, || rt.block_on(backend.read(&extents, &mut staging)).expect("read"));
    let write_batch =
        measure(iters, TOTAL, || rt.block_on(backend.write(&extents, &staging)).expect("write"));
    // Single-block calls, each into its own 2 MiB staging buffer (as a daemon moving one block
    // at a time would).
    let mut singles: Vec<_> = (0..BLOCKS).map(|_| backend.staging(BLOCK).expect("staging")).collect();
    let read_single = measure(iters, TOTAL, || {
        rt.block_on(async {
            for (e, s) in extents.iter().zip(singles.iter_mut()) {
                backend.read(std::slice::from_ref(e), s).await.expect("read");
            }
        })
    });
    let write_single = measure(iters, TOTAL, || {
        rt.block_on(async {
            for (e, s) in extents.iter().zip(&singles) {
                backend.write(std::slice::from_ref(e), s).await.expect("write");
            }
        })
    });

    // Baseline: the same gather with memcpy inside this process.
    let src = engine_bytes;
    let mut dst = vec![0u8; TOTAL];
    let memcpy = measure(iters, TOTAL, || {
        for (i, &b) in order.iter().enumerate() {
            dst[i * BLOCK..(i + 1) * BLOCK].copy_from_slice(&src[b * BLOCK..(b + 1) * BLOCK]);
        }
        std::hint::black_box(&mut dst);
    });

    let tls = std::env::var("UCX_TLS").unwrap_or_else(|_| "default".into());
    println!(
        "NIXL pool backend, {BLOCKS} x 2 MiB blocks (128 MiB) across two processes, UCX_TLS={tls}, {iters} iterations"
    );
    println!();
    println!("| operation | median GiB/s | best GiB/s |");
    println!("|---|---|---|");
    for (name, (med, best)) in [
        ("NIXL READ, one batch of 64 blocks (engine -> staging)", read_batch),
        ("NIXL WRITE, one batch of 64 blocks (staging -> engine)", write_batch),
        ("NIXL READ, 64 sequential single-block calls", read_single),
        ("NIXL WRITE, 64 sequential single-block calls", write_single),
        ("memcpy gather of the same 64 blocks (one process)", memcpy),
    ] {
        println!("| {name} | {med:.2} | {best:.2} |");
    }
}
