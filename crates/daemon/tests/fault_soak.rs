//! The faulty-migration soak of issue 15's suite: two real daemons in this process (region A
//! holds the sessions, region B migrates them), B's peer traffic to A through a loopback UDP
//! relay (`kvferry_wanem::relay`), and concurrent routers migrating sessions from A to B while
//! a fault task keeps hitting the path: freezes, cuts longer than the idle timeout, random
//! loss, A's connections killed (owner), B's connections killed (requester), and routers that
//! hang up mid-migration. A's egress toward B is capped so every fetch is in flight long
//! enough to be hit.
//!
//! Checked on every migration: it ends (receipt, or the router hung up) before its deadline
//! plus [`GRACE`]; every token is ready (fetched, or recomputed after a failed fetch: nothing
//! lost); B's landing zone holds each session's blocks all or none, byte-identical to A's pool
//! (0 partially valid); a `fetch` receipt without fallback has every block landed. Then: a
//! forged fetch of every session under every other tenant is refused (cross-tenant pairs), a
//! clean migration per tenant fetches again, the process's fds and RSS are back near their
//! warm level, and no thread panicked.
//!
//! Prints `fault-suite:` lines for the suite's headline (`.ci/fault-suite`). Runs
//! `KVFERRY_FAULT_SECS` seconds (default 20; CI 60): `KVFERRY_FAULT_SECS=600 cargo test -p
//! kvferry-daemon --test fault_soak -- --nocapture`. Seeded by `KVFERRY_FAULT_SEED`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_peer::{BoxFut, ChunkError, ChunkSink, FetchSpec, PeerNode};
use kvferry_proto::v1::{PolicyMode, PoolLayoutSpec};
use kvferry_wanem::relay::Relay;
use kvferry_wanem::rng::Rng;
use kvferry_wire::ChunkSpec;
use kvferry_wire::frame::RefusalCode;

mod common;

use common::abuse::*;
use common::landed;

const TENANTS: [&str; 4] = ["tenant-f0", "tenant-f1", "tenant-f2", "tenant-f3"];
/// Sessions of 16 blocks (256 tokens, 256 KiB) each, 4 per tenant.
const SESSIONS: usize = 16;
const SESSION_BLOCKS: usize = 16;
const DEADLINE_MS: u64 = 4_000;
/// How late past its deadline a migration may end (scheduling on a loaded CI machine).
const GRACE: Duration = Duration::from_millis(1_500);
const WORKERS: usize = 4;

/// A session held in A; its `bytes` are A's bytes of each block (one block, all layers,
/// staging order).
type Session = common::HeldSession;

#[derive(Default)]
struct Tally {
    migrations: u64,
    fetched: u64,
    fell_back: u64,
    router_gone: u64,
    lost: Vec<String>,
    partial_valid: Vec<String>,
    late: Vec<String>,
    faults: BTreeMap<&'static str, u64>,
    mid_transfer: u64,
}

/// Counts what a forged fetch lands (it must land nothing).
#[derive(Default)]
struct CountingSink(AtomicU64);

impl ChunkSink for CountingSink {
    fn land<'a>(&'a self, spec: ChunkSpec, _payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>> {
        self.0.fetch_add(spec.len, Ordering::Relaxed);
        Box::pin(async { Ok(()) })
    }
}

#[allow(clippy::too_many_arguments)]
async fn worker(
    w: usize,
    b: Arc<kvferry_daemon::Daemon>,
    sessions: Arc<Vec<Session>>,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
    seed: u64,
) {
    let mut rng = Rng::new(seed ^ (w as u64) << 40);
    let mut r = router(b.grpc_addr).await;
    let mine: Vec<usize> = (w..SESSIONS).step_by(WORKERS).collect();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let s = &sessions[mine[n as usize % mine.len()]];
        n += 1;
        let ctx = format!("worker {w} migration {n} ({}, seed {seed:#x})", s.tenant);
        // What an earlier migration of this session left must be whole and A's bytes.
        let (present, wrong, _) = landed(&b, s);
        if wrong > 0 || (present != 0 && present != s.hashes.len()) {
            tally
                .lock()
                .unwrap()
                .partial_valid
                .push(format!("{ctx}: before: {present} visible, {wrong} wrong"));
        }
        b.shared.landing.remove(&s.hashes);
        let mut req = request(&format!("fault-{w}-{n}"), s.prompt.clone(), PolicyMode::Fetch);
        (req.tenant, req.source_region, req.deadline_ms) = (s.tenant.into(), "region-a".into(), DEADLINE_MS);
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_millis(DEADLINE_MS);
        // Now and then the router hangs up mid-migration.
        let hang_up = rng.next_f64() < 0.05;
        let rc = if hang_up {
            let after = Duration::from_millis(20 + rng.next_u64() % 400);
            tokio::time::timeout(after, receipt(&mut r, req)).await.ok()
        } else {
            Some(receipt(&mut r, req).await)
        };
        let ended = Instant::now();
        let hung_up = record(&b, s, &ctx, deadline, ended, rc, &mut tally.lock().unwrap());
        if hung_up {
            // The router hung up; the work goes on without it. Let it end before looking again.
            tokio::time::sleep((deadline + GRACE).saturating_duration_since(Instant::now())).await;
        }
    }
}

/// Books one migration's outcome; `true` when its router hung up before the receipt.
fn record(
    b: &kvferry_daemon::Daemon,
    s: &Session,
    ctx: &str,
    deadline: Instant,
    ended: Instant,
    rc: Option<Result<kvferry_proto::v1::Receipt, tonic::Status>>,
    t: &mut Tally,
) -> bool {
    t.migrations += 1;
    if ended > deadline + GRACE {
        t.late.push(format!("{ctx}: ended {:?} past its deadline", ended - deadline));
    }
    let n_tokens = s.prompt.len() as u64;
    match rc {
        None => {
            t.router_gone += 1;
            return true;
        }
        Some(Err(e)) => t.lost.push(format!("{ctx}: {e}")),
        Some(Ok(rc)) => {
            if rc.tokens_ready != n_tokens {
                t.lost.push(format!("{ctx}: {} of {n_tokens} tokens ready: {rc:?}", rc.tokens_ready));
            }
            let (present, wrong, _) = landed(b, s);
            if wrong > 0 || (present != 0 && present != s.hashes.len()) {
                t.partial_valid.push(format!("{ctx}: {present} visible, {wrong} wrong: {rc:?}"));
            }
            if rc.action == "fetch" && rc.fallback.is_empty() {
                t.fetched += 1;
                if present != s.hashes.len() {
                    t.lost.push(format!("{ctx}: fetched, yet {present} blocks visible"));
                }
            } else {
                t.fell_back += 1;
            }
        }
    }
    false
}

/// Hits the path between B and A until `stop`.
async fn faults(
    relay: Arc<Relay>,
    a: Arc<PeerNode>,
    b: Arc<PeerNode>,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
    seed: u64,
) {
    let mut rng = Rng::new(seed ^ 0xFA17);
    let ms = |lo: u64, hi: u64, rng: &mut Rng| Duration::from_millis(lo + rng.next_u64() % (hi - lo));
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(ms(150, 900, &mut rng)).await;
        let mid = a.load_report(0).active_transfers > 0;
        let what = match rng.next_u64() % 10 {
            0..=2 => {
                relay.blackhole(None, ms(100, 500, &mut rng));
                "freeze"
            }
            3 | 4 => {
                relay.blackhole(None, ms(1_200, 2_400, &mut rng));
                "cut"
            }
            5 => {
                relay.set_loss(None, 0.15);
                tokio::time::sleep(Duration::from_secs(1)).await;
                relay.set_loss(None, 0.0);
                "loss"
            }
            6 | 7 => {
                a.close_connections();
                "owner connections killed"
            }
            _ => {
                b.close_connections();
                "requester connections killed"
            }
        };
        let mut t = tally.lock().unwrap();
        *t.faults.entry(what).or_default() += 1;
        t.mid_transfer += u64::from(mid);
    }
    relay.set_loss(None, 0.0);
    relay.heal(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faulty_migrations_lose_nothing_and_leave_nothing_partial() {
    let panics = common::count_panics();
    let secs = common::env_u64("KVFERRY_FAULT_SECS", 20);
    let seed = common::env_u64("KVFERRY_FAULT_SEED", 0x15);
    let dir = tempfile::tempdir().unwrap();
    let blocks = (SESSIONS * SESSION_BLOCKS) as u32;
    let spec = PoolLayoutSpec { num_blocks: blocks, ..common::spec() };
    let (pa, pb) = (common::free_udp(), common::free_udp());
    let relay = Arc::new(Relay::start(pa, seed).unwrap());
    let mut cfg_a = common::config(dir.path(), "region-a");
    // 16 Mbit/s toward B: a 256 KiB session takes ~130 ms alone, longer when they queue.
    (cfg_a.listen.peer, cfg_a.peers) = (pa, vec![common::peer("region-b", pb, 0.016)]);
    let mut cfg_b = common::config(dir.path(), "region-b");
    (cfg_b.listen.peer, cfg_b.peers) = (pb, vec![common::peer("region-a", relay.addr(), 0.0)]);
    for c in [&mut cfg_a, &mut cfg_b] {
        c.transfer.chunk_bytes = 65_536;
        c.transfer.idle_timeout_ms = 1_000;
        c.transfer.missing_grace_ms = 200;
    }
    let a = Arc::new(common::start(&cfg_a).await);
    let b = Arc::new(common::start(&cfg_b).await);
    let (pool_a, _sa, lease_a) = register_shm(&cfg_a, "ea", spec.clone()).await;
    let (_ea, _ta) = answering_engine(&cfg_a, &lease_a).await;
    let (_pool_b, _sb, lease_b) = register_shm(&cfg_b, "eb", spec).await;
    let (_eb, _tb) = answering_engine(&cfg_b, &lease_b).await;

    // A's pool: distinct bytes in every block; each session published under its tenant.
    let layers = pool_a.layout().num_layers();
    let ids: Vec<u32> = (0..blocks).collect();
    let len = pool_a.layout().staging_len(u64::from(blocks), 0..layers).unwrap() as usize;
    let mut rng = Rng::new(seed);
    let data: Vec<u8> = (0..len / 8).flat_map(|_| rng.next_u64().to_le_bytes()).collect();
    pool_a.write_blocks(&ids, 0..layers, &data).unwrap();
    let mut engine_a = common::engine_client(&cfg_a).await;
    let mut sessions = Vec::new();
    for i in 0..SESSIONS {
        let tenant = TENANTS[i % TENANTS.len()];
        let prompt = kvferry_engine_node::prompt(SESSION_BLOCKS * 16, 512, 1_000 + i as u64);
        let hashes = kvferry_daemon::engine_api::hashes_for(tenant, &prompt, 16);
        let ids: Vec<u32> = (0..SESSION_BLOCKS as u32).map(|k| (i * SESSION_BLOCKS) as u32 + k).collect();
        common::publish_chain(&mut engine_a, &lease_a, tenant, &hashes, ids.clone()).await;
        let bytes = ids.iter().map(|&id| common::block_bytes(&pool_a, id)).collect();
        sessions.push(Session { tenant, prompt, hashes, bytes, extra: () });
    }
    let sessions = Arc::new(sessions);

    // --- the soak ---
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        tasks.push(tokio::spawn(worker(w, b.clone(), sessions.clone(), stop.clone(), tally.clone(), seed)));
    }
    let fault_task = tokio::spawn(faults(
        relay.clone(),
        a.shared.node.clone(),
        b.shared.node.clone(),
        stop.clone(),
        tally.clone(),
        seed,
    ));
    // Warm: after the first few seconds of faulty migrations.
    tokio::time::sleep(Duration::from_secs(5.min(secs / 4).max(1))).await;
    let warm = (fds(), rss_bytes());
    tokio::time::sleep(Duration::from_secs(secs).saturating_sub(t0.elapsed())).await;
    stop.store(true, Ordering::Relaxed);
    fault_task.await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let soak_s = t0.elapsed().as_secs_f64();

    // --- cross-tenant: B forges fetches of each session under every other tenant ---
    let digest = b.shared.registry.all()[0].digest;
    let bpbl = pool_a.layout().bytes_per_block(0..1).unwrap();
    let (mut pairs, mut hits) = (0u64, Vec::<String>::new());
    for s in sessions.iter() {
        for other in TENANTS.iter().filter(|t| **t != s.tenant) {
            pairs += 1;
            let sink = Arc::new(CountingSink::default());
            let spec = FetchSpec {
                tenant: (*other).into(),
                fingerprint: digest,
                hashes: s.hashes.clone(),
                layers,
                bytes_per_block_layer: bpbl,
                deadline: Instant::now() + Duration::from_secs(5),
            };
            let r = b.shared.node.fetch(a.shared.node.id(), pa, spec, sink.clone()).await;
            let refused =
                matches!(&r, Err(kvferry_wire::WireError::Refused { code: RefusalCode::TenantMismatch, .. }));
            if !refused || sink.0.load(Ordering::Relaxed) > 0 {
                hits.push(format!(
                    "{other} asking for {}'s blocks: {r:?}, {} bytes",
                    s.tenant,
                    sink.0.load(Ordering::Relaxed)
                ));
            }
        }
    }

    // --- the regions work again: one clean migration per tenant fetches every block ---
    let mut r = router(b.grpc_addr).await;
    for s in sessions.iter().take(TENANTS.len()) {
        b.shared.landing.remove(&s.hashes);
        let mut req = request("after-faults", s.prompt.clone(), PolicyMode::Fetch);
        (req.tenant, req.source_region) = (s.tenant.into(), "region-a".into());
        let rc = receipt(&mut r, req).await.unwrap();
        assert_eq!((rc.action.as_str(), rc.fallback.as_str()), ("fetch", ""), "{rc:?}");
        assert_eq!(landed(&b, s), (s.hashes.len(), 0, true), "{rc:?}");
    }

    // Let every bound expire (idle connections, the abandoned transfers), then measure.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (fds1, rss1) = (fds(), rss_bytes());
    let fd_growth = fds1 as i64 - warm.0 as i64;
    let rss_growth_mib = (rss1 as f64 - warm.1 as f64) / f64::from(1 << 20);
    let panics = panics.load(Ordering::Relaxed);
    let t = tally.lock().unwrap();
    let faults: u64 = t.faults.values().sum();
    println!(
        "fault-suite: faulty migrations {} (fetched {}, fell back {}, router hung up {}), lost {}, partial-valid {}, \
         late answers {} (deadline {} s + grace {:.1} s); faults injected {faults} ({} mid-transfer) over {soak_s:.0} s, \
         seed {seed:#x}",
        t.migrations,
        t.fetched,
        t.fell_back,
        t.router_gone,
        t.lost.len(),
        t.partial_valid.len(),
        t.late.len(),
        DEADLINE_MS / 1000,
        GRACE.as_secs_f64(),
        t.mid_transfer
    );
    println!("  by fault: {:?}; relay {:?}", t.faults, relay.stats());
    println!("fault-suite: cross-tenant hits {} of {pairs} pairs", hits.len());
    println!(
        "fault-suite: daemon panics {panics}; under the faulty soak fds growth {fd_growth}, RSS growth {rss_growth_mib:.1} MiB"
    );
    assert!(t.lost.is_empty(), "lost: {:#?}", t.lost);
    assert!(t.partial_valid.is_empty(), "partially valid: {:#?}", t.partial_valid);
    assert!(t.late.is_empty(), "late: {:#?}", t.late);
    assert!(hits.is_empty(), "cross-tenant: {hits:#?}");
    assert_eq!(panics, 0, "a thread panicked");
    assert!(t.fetched > 0 && t.fell_back > 0, "the faults never made a fetch fall back, or nothing fetched");
    assert!(t.mid_transfer > 0, "no fault hit a transfer in flight");
    assert!(fd_growth <= 8, "fds grew by {fd_growth} ({} -> {fds1})", warm.0);
    assert!(rss_growth_mib < 64.0, "RSS grew by {rss_growth_mib:.1} MiB");
}
