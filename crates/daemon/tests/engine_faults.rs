//! Engine-stream faults of issue 15's suite: the connection between an ENGINE and its daemon
//! cut or frozen at random moments, while migrations run. Two real daemons in this process
//! (region A holds the sessions, region B migrates them) and two real reference engines
//! (`kvferry_engine_node::EngineNode`, the tiny model, in-process), each talking to its
//! daemon's `engine.sock` through a Unix-socket relay ([`common::uds_cut`]) that a fault task
//! cuts (every connection closed: the Attach stream, RegisterPool, Lookup/Load) or freezes.
//! Cuts land during recomputes the daemon asked B's engine for, during fetches from A (A's
//! engine detached under its own blocks), during B's engine loading fetched blocks into its
//! pool (Generate), and during the engine's re-registration (a cut right after the relay
//! accepted the engine's new connection).
//!
//! Checked on every migration: it ends before its deadline plus [`GRACE`], with a receipt or a
//! typed error (a gRPC status the daemon mapped, carrying `kvferry-origin`; never INTERNAL or
//! UNKNOWN); B's landing zone holds each session's blocks all or none, byte-identical to a
//! clean fetch taken before the faults (0 partially valid); a `fetch` receipt without fallback
//! has every block landed; and every Generate on B's engine (which loads the landed blocks
//! into its pool through the cut connection) is bit-identical to A's computing the same
//! prompt. Then the relays heal: both engines must be registered and attached again, A's
//! blocks republished, a clean fetch of every session lands A's bytes, and a recompute runs.
//!
//! Prints a `fault-suite: engine stream cuts` line for the suite's headline
//! (`.ci/fault-suite`). Runs until `KVFERRY_ENGINE_FAULTS` faults were injected
//! (default 100; the suite's CI run 300) or `KVFERRY_ENGINE_FAULT_SECS` passed (default 120); seeded by `KVFERRY_FAULT_SEED`:
//! `KVFERRY_ENGINE_FAULTS=1000 cargo test -p kvferry-daemon --test engine_faults -- --nocapture`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_engine::{ModelConfig, ProfileOptions};
use kvferry_engine_node::{EngineNode, NodeConfig, ReconnectPolicy};
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{GenerateRequest, PolicyMode};
use kvferry_wanem::rng::Rng;
use tonic::transport::Channel;

mod common;

use common::abuse::{receipt, request, router};
use common::landed;
use common::uds_cut::{UdsCut, engine_run_dir};

const TENANTS: [&str; 3] = ["tenant-e0", "tenant-e1", "tenant-e2"];
const MODEL: &str = "tiny-engine-faults";
/// Sessions held in A: 6 of 24 blocks (384 tokens, 192 KiB of KV) each.
const SESSIONS: usize = 6;
const SESSION_BLOCKS: usize = 24;
const DEADLINE_MS: u64 = 3_000;
/// How late past its deadline a migration may end (scheduling on a loaded CI machine).
const GRACE: Duration = Duration::from_millis(1_500);
const WORKERS: usize = 3;

/// A session held in A; `extra` is A's answer to the prompt (1 new token), which B's engine
/// must answer too. Its `bytes` are the landed bytes of each block after a clean fetch.
type Session = common::HeldSession<(Vec<u32>, Vec<u8>)>;

#[derive(Default)]
struct Tally {
    migrations: u64,
    ok: u64,
    typed: BTreeMap<String, u64>,
    untyped: Vec<String>,
    partial_valid: Vec<String>,
    late: Vec<String>,
    generates: u64,
    cuts: BTreeMap<&'static str, u64>,
    mid_migration: u64,
    mid_recompute: u64,
    mid_fetch: u64,
    in_registration: u64,
    freezes: u64,
    idle_cuts: u64,
}

fn node_config(run_dir: &Path, id: &str, num_blocks: u32) -> NodeConfig {
    let mut cfg = NodeConfig::new(run_dir, id, run_dir.join(format!("{id}.ctl")));
    cfg.model = ModelConfig::tiny(15);
    cfg.model_id = Some(MODEL.into());
    cfg.num_blocks = num_blocks;
    cfg.profile =
        ProfileOptions { contexts: vec![0, 32], chunk: 16, repeats: 1, ..ProfileOptions::default() };
    cfg.load_report_interval = Duration::from_millis(200);
    // A frozen registration gives up quickly and tries again.
    cfg.rpc_timeout = Duration::from_secs(1);
    cfg.reconnect = ReconnectPolicy {
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(300),
        give_up_after: Duration::from_secs(600),
    };
    cfg
}

async fn control(node: &EngineNode) -> ReferenceEngineClient<Channel> {
    ReferenceEngineClient::new(kvferry_engine_node::daemon::connect_uds(&node.info().control).await.unwrap())
}

async fn generate(
    c: &mut ReferenceEngineClient<Channel>,
    tenant: &str,
    prompt: &[u32],
) -> Result<(Vec<u32>, Vec<u8>), tonic::Status> {
    let req = GenerateRequest {
        tenant: tenant.into(),
        token_ids: prompt.to_vec(),
        max_new_tokens: 1,
        use_cache: true,
    };
    let r = c.generate(req).await?.into_inner();
    Ok((r.new_tokens, r.logits_digest))
}

/// Whether `d` has an attached engine `id` holding at least `blocks` blocks.
fn attached(d: &kvferry_daemon::Daemon, id: &str, blocks: usize) -> bool {
    d.shared
        .registry
        .all()
        .iter()
        .any(|e| e.engine_id == id && e.attached() && e.blocks.lock().unwrap().len() >= blocks)
}

async fn wait_attached(d: &kvferry_daemon::Daemon, node: &EngineNode, blocks: usize, what: &str) {
    let id = node.info().engine_id.as_str();
    let t = Instant::now();
    while !attached(d, id, blocks) {
        if t.elapsed() >= Duration::from_secs(30) {
            // What each side saw, for a failure that cannot be rerun at will.
            let leases: Vec<String> = d
                .shared
                .registry
                .all()
                .iter()
                .filter(|e| e.engine_id == id)
                .map(|e| {
                    format!(
                        "{} attached={} blocks={}",
                        e.lease_id,
                        e.attached(),
                        e.blocks.lock().unwrap().len()
                    )
                })
                .collect();
            panic!(
                "{what}: engine {id} never attached with {blocks} blocks; the engine: lease {}, {} \
                 reconnects, last failed attempt: {:?}; the daemon: leases {leases:?}, {} pool offers pending",
                node.lease_id(),
                node.reconnects(),
                node.reconnect_error(),
                d.shared.registry.pending_pools(),
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A status the daemon mapped: a known code with its origin attached.
fn typed(e: &tonic::Status) -> bool {
    use tonic::Code::*;
    matches!(
        e.code(),
        Unavailable | DeadlineExceeded | ResourceExhausted | FailedPrecondition | NotFound | Aborted
    ) && e.metadata().get("kvferry-origin").is_some()
}

struct World {
    b: Arc<kvferry_daemon::Daemon>,
    sessions: Arc<Vec<Session>>,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
    in_flight: Arc<AtomicI64>,
    seed: u64,
}

async fn worker(w: usize, world: Arc<World>, engine_b: ReferenceEngineClient<Channel>) {
    let (b, sessions) = (&world.b, &world.sessions);
    let mut eng = engine_b;
    let mut rng = Rng::new(world.seed ^ (w as u64) << 40);
    let mut r = router(b.grpc_addr).await;
    let mut n = 0u64;
    while !world.stop.load(Ordering::Relaxed) {
        n += 1;
        let ctx = format!("worker {w} migration {n} (seed {:#x})", world.seed);
        // A quarter: a recompute of a prompt nobody holds (a recompute the daemon asks B's
        // engine for); the rest: a fetch of a session A holds.
        let fresh = rng.next_u64().is_multiple_of(4);
        let (tenant, prompt, s) = if fresh {
            let len = 256 + (rng.next_u64() % 256) as usize;
            let t = TENANTS[(rng.next_u64() % 3) as usize];
            (t, kvferry_engine_node::prompt(len, 256, rng.next_u64()), None)
        } else {
            // Each worker migrates sessions of its own: what lands is this migration's doing.
            let mine: Vec<usize> = (w..SESSIONS).step_by(WORKERS).collect();
            let s = &sessions[mine[(rng.next_u64() % mine.len() as u64) as usize]];
            let (_, wrong, _) = landed(b, s);
            if wrong > 0 {
                world
                    .tally
                    .lock()
                    .unwrap()
                    .partial_valid
                    .push(format!("{ctx}: before: {wrong} blocks wrong"));
            }
            b.shared.landing.remove(&s.hashes);
            (s.tenant, s.prompt.clone(), Some(s))
        };
        let mode = if fresh { PolicyMode::Recompute } else { PolicyMode::Fetch };
        let mut req = request(&format!("eng-fault-{w}-{n}"), prompt.clone(), mode);
        (req.tenant, req.source_region, req.deadline_ms, req.model_id) =
            (tenant.into(), "region-a".into(), DEADLINE_MS, MODEL.into());
        let deadline = Instant::now() + Duration::from_millis(DEADLINE_MS);
        world.in_flight.fetch_add(1, Ordering::Relaxed);
        let rc = receipt(&mut r, req).await;
        world.in_flight.fetch_sub(1, Ordering::Relaxed);
        let ended = Instant::now();
        let mut load_after = false;
        {
            let mut t = world.tally.lock().unwrap();
            t.migrations += 1;
            if ended > deadline + GRACE {
                t.late.push(format!("{ctx}: ended {:?} past its deadline", ended - deadline));
            }
            match &rc {
                Ok(rc) => {
                    t.ok += 1;
                    if let Some(s) = s {
                        // Every visible block is A's bytes; a fetch that fell back landed
                        // nothing; a fetch that succeeded landed every block it moved, as one
                        // run up to the session's end (the blocks B's engine lacked).
                        let (present, wrong, run) = landed(b, s);
                        let fetched = rc.action == "fetch" && rc.fallback.is_empty();
                        let moved = rc.bytes_moved / s.bytes[0].len() as u64;
                        if wrong > 0
                            || !run
                            || (!fetched && present > 0)
                            || (moved > 0 && moved != present as u64)
                        {
                            t.partial_valid.push(format!("{ctx}: {present} visible, {wrong} wrong: {rc:?}"));
                        }
                        load_after = fetched && rng.next_u64().is_multiple_of(2);
                    }
                }
                Err(_) if s.is_some_and(|s| landed(b, s).0 > 0) => {
                    t.partial_valid.push(format!("{ctx}: failed ({rc:?}), yet blocks landed"));
                }
                Err(e) if typed(e) => {
                    let why: String = e.message().chars().take(48).collect();
                    *t.typed.entry(format!("{:?}: {why}", e.code())).or_default() += 1;
                }
                Err(e) => t.untyped.push(format!("{ctx}: {e:?}")),
            }
        }
        if rc.is_err() {
            // Typically the target engine is away (cut, registering again): do not spin.
            tokio::time::sleep(Duration::from_millis(20 + rng.next_u64() % 40)).await;
        }
        // Half the fetched sessions: B's engine loads them into its pool (Lookup + Load over
        // the relay, cut or not); its answer must be A's, bit for bit.
        if let (true, Some(s)) = (load_after, s) {
            world.in_flight.fetch_add(1, Ordering::Relaxed);
            let got = generate(&mut eng, s.tenant, &s.prompt).await;
            world.in_flight.fetch_sub(1, Ordering::Relaxed);
            let mut t = world.tally.lock().unwrap();
            t.generates += 1;
            match got {
                Ok(a) if a == s.extra => {}
                Ok(a) => {
                    t.partial_valid.push(format!("{ctx}: B's engine answered {:?}, A {:?}", a.0, s.extra.0))
                }
                Err(e) => t.untyped.push(format!("{ctx}: Generate on B: {e:?}")),
            }
        }
    }
}

/// Cuts or freezes the engines' relays until `n` faults or `stop`.
async fn faults(world: Arc<World>, a: Arc<kvferry_daemon::Daemon>, cuts: [Arc<UdsCut>; 2], n: u64) {
    let mut rng = Rng::new(world.seed ^ 0xE461);
    let ms = |lo: u64, hi: u64, rng: &mut Rng| Duration::from_millis(lo + rng.next_u64() % (hi - lo));
    let mut injected = 0;
    while injected < n && !world.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(ms(40, 250, &mut rng)).await;
        // B's engine two times in three (the migrations' target), A's the third (the owner's).
        let which = usize::from(rng.next_u64().is_multiple_of(3));
        let relay = &cuts[which];
        let mid = world.in_flight.load(Ordering::Relaxed) > 0;
        let recomputing = which == 0
            && world.b.shared.registry.all().iter().any(|e| !e.recompute_waiters.lock().unwrap().is_empty());
        let fetching = a.shared.node.load_report(0).active_transfers > 0;
        let kind = rng.next_u64() % 10;
        let (what, closed) = match kind {
            0 | 1 => {
                let open = relay.open();
                relay.freeze(true);
                tokio::time::sleep(ms(100, 1_200, &mut rng)).await;
                relay.freeze(false);
                ("freeze", open)
            }
            2..=4 => {
                // In registration: wait for the engine's next connection to the daemon (it
                // reconnects after a cut), then cut it a moment later.
                let before = relay.accepted();
                let closed = relay.cut();
                let t = Instant::now();
                while relay.accepted() == before && t.elapsed() < Duration::from_secs(3) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                tokio::time::sleep(ms(1, 30, &mut rng)).await;
                let again = relay.cut();
                let mut t = world.tally.lock().unwrap();
                if again > 0 {
                    t.in_registration += 1;
                    *t.cuts.entry("cut in registration").or_default() += 1;
                    injected += 1;
                }
                ("cut", closed)
            }
            _ => ("cut", relay.cut()),
        };
        let mut t = world.tally.lock().unwrap();
        if closed == 0 {
            // The engine was between connections: nothing to cut or freeze.
            t.idle_cuts += 1;
            continue;
        }
        injected += 1;
        if what == "freeze" {
            t.freezes += 1;
        }
        *t.cuts.entry(if which == 0 { "B's engine" } else { "A's engine" }).or_default() += 1;
        t.mid_migration += u64::from(mid);
        t.mid_recompute += u64::from(recomputing);
        t.mid_fetch += u64::from(fetching);
    }
    for c in &cuts {
        c.freeze(false);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engine_stream_cuts_end_every_migration_typed_and_leave_nothing_partial() {
    let panics = common::count_panics();
    let n_faults = common::env_u64("KVFERRY_ENGINE_FAULTS", 100);
    let max_secs = common::env_u64("KVFERRY_ENGINE_FAULT_SECS", 120);
    let seed = common::env_u64("KVFERRY_FAULT_SEED", 0x15);
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (common::free_udp(), common::free_udp());
    let peer = common::peer;
    let mut cfg_a = common::config(dir.path(), "region-a");
    // 8 Mbit/s toward B: a 192 KiB session takes ~200 ms alone, longer when they queue.
    (cfg_a.listen.peer, cfg_a.peers) = (pa, vec![peer("region-b", pb, 0.008)]);
    let mut cfg_b = common::config(dir.path(), "region-b");
    (cfg_b.listen.peer, cfg_b.peers) = (pb, vec![peer("region-a", pa, 0.0)]);
    for c in [&mut cfg_a, &mut cfg_b] {
        c.transfer.chunk_bytes = 65_536;
        // A registration cut between RegisterPool and Attach, or between the pool offer and
        // RegisterPool, leaves a lease or an offer behind: they expire within a second.
        c.limits.attach_grace_ms = 1_000;
        c.limits.pool_offer_ttl_ms = 1_000;
    }
    let a = Arc::new(common::start(&cfg_a).await);
    let b = Arc::new(common::start(&cfg_b).await);
    let cut_a = engine_run_dir(&dir.path().join("engine-a-run"), &cfg_a.run_dir);
    let cut_b = engine_run_dir(&dir.path().join("engine-b-run"), &cfg_b.run_dir);
    let node_a =
        EngineNode::start(node_config(&dir.path().join("engine-a-run"), "engine-a", 256)).await.unwrap();
    // B's pool holds three sessions: what it recomputed or loaded is soon evicted again, so
    // later migrations of a session fetch it anew.
    let node_b =
        EngineNode::start(node_config(&dir.path().join("engine-b-run"), "engine-b", 80)).await.unwrap();
    let mut ctl_a = control(&node_a).await;

    // A's sessions: computed by A's engine (published to A's daemon under their tenants).
    let mut sessions = Vec::new();
    for i in 0..SESSIONS {
        let tenant = TENANTS[i % TENANTS.len()];
        let prompt = kvferry_engine_node::prompt(SESSION_BLOCKS * 16 + 5, 256, 500 + i as u64);
        let answer = generate(&mut ctl_a, tenant, &prompt).await.unwrap();
        let hashes = kvferry_daemon::engine_api::hashes_for(tenant, &prompt, 16);
        assert_eq!(hashes.len(), SESSION_BLOCKS);
        sessions.push(Session { tenant, prompt, hashes, bytes: Vec::new(), extra: answer });
    }
    wait_attached(&a, &node_a, SESSIONS * SESSION_BLOCKS, "A's sessions published").await;
    wait_attached(&b, &node_b, 0, "B's engine").await;

    // Before any fault: one clean fetch per session gives the bytes every later landing must
    // match, and B's engine answers as A's from them.
    let mut r = router(b.grpc_addr).await;
    let mut ctl_b = control(&node_b).await;
    for (i, s) in sessions.iter_mut().enumerate() {
        let mut req = request(&format!("clean-{i}"), s.prompt.clone(), PolicyMode::Fetch);
        (req.tenant, req.source_region, req.model_id) = (s.tenant.into(), "region-a".into(), MODEL.into());
        let rc = receipt(&mut r, req).await.unwrap();
        assert_eq!((rc.action.as_str(), rc.fallback.as_str()), ("fetch", ""), "{rc:?}");
        s.bytes =
            s.hashes.iter().map(|h| b.shared.landing.get(s.tenant, h).unwrap().bytes.to_vec()).collect();
        assert_eq!(generate(&mut ctl_b, s.tenant, &s.prompt).await.unwrap(), s.extra, "session {i}");
        b.shared.landing.remove(&s.hashes);
    }

    // --- the faults ---
    let world = Arc::new(World {
        b: b.clone(),
        sessions: Arc::new(sessions),
        stop: Arc::new(AtomicBool::new(false)),
        tally: Arc::new(Mutex::new(Tally::default())),
        in_flight: Arc::new(AtomicI64::new(0)),
        seed,
    });
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        tasks.push(tokio::spawn(worker(w, world.clone(), control(&node_b).await)));
    }
    let fault_task = tokio::spawn(faults(world.clone(), a.clone(), [cut_b.clone(), cut_a.clone()], n_faults));
    let stop_at = t0 + Duration::from_secs(max_secs);
    while !fault_task.is_finished() && Instant::now() < stop_at {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    world.stop.store(true, Ordering::Relaxed);
    fault_task.await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let soak_s = t0.elapsed().as_secs_f64();

    // --- the regions work again: both engines back, A's blocks republished ---
    let blocks = SESSIONS * SESSION_BLOCKS;
    wait_attached(&a, &node_a, blocks, "after the faults, A's engine republished").await;
    wait_attached(&b, &node_b, 0, "after the faults, B's engine").await;
    // B's engine may hold sessions it loaded during the soak: fresh prompts push them out of
    // its pool (80 blocks), so each session below is fetched again.
    for k in 0..4 {
        generate(&mut ctl_b, TENANTS[0], &kvferry_engine_node::prompt(SESSION_BLOCKS * 16, 256, 9_000 + k))
            .await
            .unwrap();
    }
    let mut r = router(b.grpc_addr).await;
    for (i, s) in world.sessions.iter().enumerate() {
        b.shared.landing.remove(&s.hashes);
        let mut req = request(&format!("after-{i}"), s.prompt.clone(), PolicyMode::Fetch);
        (req.tenant, req.source_region, req.model_id) = (s.tenant.into(), "region-a".into(), MODEL.into());
        let rc = receipt(&mut r, req).await.unwrap();
        assert!(rc.action == "fetch" && rc.fallback.is_empty() && rc.bytes_moved > 0, "{rc:?}");
        let (present, wrong, _) = landed(&b, s);
        assert_eq!((present, wrong), (s.hashes.len(), 0), "session {i} after the faults: {rc:?}");
    }
    let s0 = &world.sessions[0];
    assert_eq!(generate(&mut ctl_b, s0.tenant, &s0.prompt).await.unwrap(), s0.extra);
    let fresh = kvferry_engine_node::prompt(300, 256, seed ^ 0xAF7E);
    let mut req = request("after-recompute", fresh, PolicyMode::Recompute);
    (req.tenant, req.model_id) = (TENANTS[0].into(), MODEL.into());
    let rc = receipt(&mut r, req).await.unwrap();
    assert_eq!(rc.action, "recompute", "{rc:?}");
    assert!(rc.tokens_ready >= 288, "{rc:?}");

    let reconnects = (node_a.reconnects(), node_b.reconnects());
    let m = &b.shared.metrics;
    let cancels = (m.recompute_cancels.get(), m.recompute_cancels_acked.get());
    let panics = panics.load(Ordering::Relaxed);
    let t = world.tally.lock().unwrap();
    let cuts: u64 = t.cuts.values().sum();
    let typed_n: u64 = t.typed.values().sum();
    println!(
        "fault-suite: engine stream cuts {cuts} ({} mid-migration: {} mid-recompute, {} mid-fetch, {} in registration; \
         {} of them freezes), migrations {} (ok {}, typed errors {typed_n}, untyped errors {}), partial-valid {}, \
         late answers {} (deadline {} s + grace {:.1} s); engine reconnects {} (A) + {} (B), over {soak_s:.0} s, seed {seed:#x}",
        t.mid_migration,
        t.mid_recompute,
        t.mid_fetch,
        t.in_registration,
        t.freezes,
        t.migrations,
        t.ok,
        t.untyped.len(),
        t.partial_valid.len(),
        t.late.len(),
        DEADLINE_MS / 1000,
        GRACE.as_secs_f64(),
        reconnects.0,
        reconnects.1,
    );
    println!(
        "  by relay: {:?}; typed errors {:?}; Generate on B {}; cuts with nothing open {}; recompute cancels sent {} acked {}",
        t.cuts, t.typed, t.generates, t.idle_cuts, cancels.0, cancels.1
    );
    assert!(t.partial_valid.is_empty(), "partially valid: {:#?}", t.partial_valid);
    assert!(t.untyped.is_empty(), "untyped: {:#?}", t.untyped);
    assert!(t.late.is_empty(), "late: {:#?}", t.late);
    assert_eq!(panics, 0, "a thread panicked");
    assert!(t.ok > 0 && typed_n > 0, "no migration succeeded, or no fault ever failed one");
    assert!(
        t.mid_recompute > 0 && t.mid_fetch > 0 && t.in_registration > 0,
        "a fault kind never hit: {:?}",
        *t
    );
    assert!(reconnects.0 > 0 && reconnects.1 > 0, "an engine never reconnected: {reconnects:?}");
    drop(t);
    drop((node_a, node_b));
}

impl std::fmt::Debug for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuts {:?}, mid-migration {}, mid-recompute {}, mid-fetch {}, in registration {}",
            self.cuts, self.mid_migration, self.mid_recompute, self.mid_fetch, self.in_registration
        )
    }
}
