//! Several NIXL pools attached at once and used in parallel, round after round: what crashed
//! `main`'s test binary (SIGSEGV) about two runs in three when every pool's NIXL agent and the
//! engines' untrusted metadata lived in the test process. Each pool's NIXL side is now its own
//! helper process; this checks that attaching `POOLS` pools concurrently and moving random
//! blocks through all of them in parallel (reads and writes, every byte checked against the
//! engine's memory as the engine process maps it) never crashes, hangs or corrupts.
//!
//! `stress_rounds_ci` runs 5 rounds (in `.ci/run`); `stress_rounds_50` (ignored) runs 50:
//! `cargo test -p kvferry-pool-nixl --test stress -- --ignored`.

mod common;

use std::time::{Duration, Instant};

use common::{EngineKind, helper_opts, nixl_available, serial, start_engine};
use kvferry_pool::conformance::Rng;
use kvferry_pool::{Extent, MemoryBackend};
use kvferry_pool_nixl::NixlBackend;

const POOLS: usize = 4;
const BLOCK: usize = 64 << 10;
const BLOCKS: usize = 32;

fn round(seed: u64) {
    // Engines start first (separate processes), then every pool attaches at the same time.
    let engines: Vec<_> =
        (0..POOLS).map(|_| start_engine(EngineKind::Rust, &[(BLOCK * BLOCKS) as u64])).collect();
    let backends: Vec<NixlBackend> = std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .iter()
            .map(|e| {
                s.spawn(|| {
                    NixlBackend::attach_with(&e.process.descriptor, helper_opts(Duration::from_secs(30)))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("attach thread").expect("attach")).collect()
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    rt.block_on(async {
        let mut tasks = Vec::new();
        for (i, (b, e)) in backends.iter().zip(&engines).enumerate() {
            tasks.push(async move {
                let mut rng = Rng::new(seed ^ (i as u64 * 0x9E37_79B9));
                // Engine-side truth, then READ a shuffled subset and compare.
                let truth = rng.bytes(BLOCK * BLOCKS);
                e.maps[0].write(0, &truth).expect("fill");
                let mut order: Vec<usize> = (0..BLOCKS).collect();
                rng.shuffle(&mut order);
                let pick = &order[..BLOCKS / 2];
                let ext: Vec<Extent> = pick
                    .iter()
                    .map(|&k| Extent { region: 0, offset: (k * BLOCK) as u64, len: BLOCK as u64 })
                    .collect();
                let mut st = b.staging(BLOCK * pick.len()).expect("staging");
                b.read(&ext, &mut st).await.expect("read");
                for (j, &k) in pick.iter().enumerate() {
                    assert!(
                        st.as_slice()[j * BLOCK..(j + 1) * BLOCK] == truth[k * BLOCK..(k + 1) * BLOCK],
                        "pool {i}: block {k} read back wrong"
                    );
                }
                // WRITE new bytes to the other half and check them from the engine's side.
                let rest = &order[BLOCKS / 2..];
                let ext: Vec<Extent> = rest
                    .iter()
                    .map(|&k| Extent { region: 0, offset: (k * BLOCK) as u64, len: BLOCK as u64 })
                    .collect();
                let mut st = b.staging(BLOCK * rest.len()).expect("staging");
                let fresh = rng.bytes(BLOCK * rest.len());
                st.as_mut_slice().copy_from_slice(&fresh);
                b.write(&ext, &st).await.expect("write");
                let mut got = vec![0u8; BLOCK];
                for (j, &k) in rest.iter().enumerate() {
                    e.maps[0].read(k * BLOCK, &mut got).expect("engine read");
                    assert!(got == fresh[j * BLOCK..(j + 1) * BLOCK], "pool {i}: block {k} written wrong");
                }
                for &k in pick {
                    e.maps[0].read(k * BLOCK, &mut got).expect("engine read");
                    assert!(
                        got == truth[k * BLOCK..(k + 1) * BLOCK],
                        "pool {i}: block {k} changed by a read"
                    );
                }
            });
        }
        futures_join_all(tasks).await;
    });
}

/// Polls all futures concurrently until every one is done (no extra dependency needed).
async fn futures_join_all<F: std::future::Future<Output = ()>>(fs: Vec<F>) {
    let mut set: Vec<Option<std::pin::Pin<Box<F>>>> = fs.into_iter().map(|f| Some(Box::pin(f))).collect();
    std::future::poll_fn(|cx| {
        for slot in set.iter_mut() {
            if let Some(f) = slot
                && f.as_mut().poll(cx).is_ready()
            {
                *slot = None;
            }
        }
        if set.iter().all(Option::is_none) { std::task::Poll::Ready(()) } else { std::task::Poll::Pending }
    })
    .await;
}

fn rounds(n: u64) {
    let _g = serial();
    assert!(nixl_available());
    let t = Instant::now();
    for r in 0..n {
        round(0x5EED_0000 + r);
    }
    eprintln!(
        "{n} rounds x {POOLS} pools attached concurrently, {BLOCKS} blocks each read+written: {:?}",
        t.elapsed()
    );
}

#[test]
fn stress_rounds_ci() {
    rounds(5);
}

#[test]
#[ignore = "long (50 rounds, ~2-3 min): run with --ignored"]
fn stress_rounds_50() {
    rounds(50);
}
