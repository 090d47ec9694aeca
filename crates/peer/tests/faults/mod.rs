//! The real-network half of issue 15's fault suite (feature `fault-injection`): real QUIC,
//! real mutual TLS and real shm pools, as in the rest of `transfer.rs`, with
//!
//! - a lying owner: the `fault-injection` hooks corrupt served payloads after their checksum
//!   and lie in chunk headers (wrong checksum, chunk id out of range, blocks not requested,
//!   another transfer's id); no landed byte may differ from the owner's, and a fetch that
//!   returns `Ok` has every chunk;
//! - mid-transfer faults of either side through a loopback UDP relay
//!   (`kvferry_wanem::relay`): freezes, cuts longer than the idle timeout, random loss, the
//!   requester's connection killed, the owner's connections killed, the requester killed
//!   (its fetch dropped); every fetch must end before its deadline plus [`GRACE`], none may
//!   return `Ok` with a partially landed transfer, the owner must drop every abandoned
//!   transfer, and a clean fetch must succeed afterwards on every lane;
//! - the mutual-TLS negatives in one matrix, each refused before the owner reads a KV byte.
//!
//! Each test prints a `fault-suite:` line for the suite's headline (`.ci/fault-suite`).
//! Counts are set by `KVFERRY_NET_CORRUPTIONS` (default 400) and `KVFERRY_FAULT_KILLS`
//! (default 1,000); seeds by `KVFERRY_FAULT_SEED`, printed with every failure.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use kvferry_peer::TransportChoice;
use kvferry_wanem::relay::Relay;
use kvferry_wanem::rng::Rng;
use kvferry_wire::{ChunkHeader, ChunkPlan};

use super::*;
use crate::common::config;

/// How late past its deadline a fetch may end (a loaded 2-core CI machine's scheduling).
const GRACE: Duration = Duration::from_secs(1);
/// The deadline of every faulted fetch.
const DEADLINE: Duration = Duration::from_secs(3);
/// Chunk size asked for: one block × one layer (64 KiB) per chunk, 32 chunks per fetch.
const CHUNK: u32 = 64 << 10;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn seed() -> u64 {
    env("KVFERRY_FAULT_SEED", 0x15)
}

/// A requester endpoint for the fault tests: 1 s idle timeout (so a stalled connection is
/// given up after 1 s), 64 KiB chunks, a 100 ms retransmit grace.
fn fault_node(s: &Setup) -> Arc<PeerNode> {
    let mut c = config(TransportChoice::Quic, s.pki.issue("dst").unwrap(), &s.pki, &["src"], 16 << 20);
    c.tuning.idle_timeout = Duration::from_secs(1);
    c.chunk_target_bytes = CHUNK;
    c.fetch.missing_grace = Duration::from_millis(100);
    c.fetch.reconnect_backoff = Duration::from_millis(20);
    PeerNode::start(c, s.catalog.clone()).unwrap()
}

/// Where a fetch lands: chunk by chunk in memory, each compared with the owner's real bytes
/// as it lands (a landed chunk that differs is a corruption accepted as verified).
struct MemSink {
    honest: Arc<dyn ChunkSource>,
    delay: Duration,
    landed: Mutex<HashMap<u32, ()>>,
    count: AtomicU64,
    wrong: AtomicU64,
}

impl MemSink {
    fn new(honest: Arc<dyn ChunkSource>, delay: Duration) -> Arc<Self> {
        Arc::new(Self {
            honest,
            delay,
            landed: Mutex::new(HashMap::new()),
            count: AtomicU64::new(0),
            wrong: AtomicU64::new(0),
        })
    }
    /// Whether every chunk of `plan` landed.
    fn complete(&self, plan: &ChunkPlan) -> bool {
        let landed = self.landed.lock().unwrap();
        plan.chunks().all(|c| landed.contains_key(&c.id))
    }
}

impl ChunkSink for MemSink {
    fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>> {
        Box::pin(async move {
            if !self.delay.is_zero() {
                tokio::time::sleep(self.delay).await;
            }
            let real = self.honest.read(spec).await?;
            if (*real).as_ref() != payload {
                self.wrong.fetch_add(1, Ordering::Relaxed);
            }
            self.landed.lock().unwrap().insert(spec.id, ());
            self.count.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }
}

/// The lying owner's source: the real bytes, then (through the `fault-injection` hooks) a
/// flipped payload bit after the checksum, or a lie in the header.
struct Lying {
    honest: Arc<dyn ChunkSource>,
    rng: Mutex<Rng>,
    p: f64,
    injected: Mutex<BTreeMap<&'static str, u64>>,
}

impl Lying {
    fn count(&self, what: &'static str) {
        *self.injected.lock().unwrap().entry(what).or_default() += 1;
    }
    fn total(&self) -> u64 {
        self.injected.lock().unwrap().values().sum()
    }
}

impl ChunkSource for Lying {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        self.honest.read(spec)
    }

    fn corrupt_after_checksum(&self, _spec: &ChunkSpec) -> bool {
        let hit = self.rng.lock().unwrap().next_f64() < self.p / 2.0;
        if hit {
            self.count("payload bit flip");
        }
        hit
    }

    fn tamper_header(&self, spec: &ChunkSpec, h: &mut ChunkHeader) {
        let mut rng = self.rng.lock().unwrap();
        if rng.next_f64() >= self.p / 2.0 {
            return;
        }
        let what = match rng.next_u64() % 4 {
            0 => {
                h.checksum ^= 1 << (rng.next_u64() % 128);
                "wrong checksum"
            }
            1 => {
                h.chunk_id = 1_000 + spec.id;
                "chunk id out of range"
            }
            2 => {
                h.blocks = (h.blocks.0 + 1_000, h.blocks.1 + 1_000);
                "blocks not requested"
            }
            _ => {
                h.transfer_id ^= 1 << 100;
                "another transfer's chunk"
            }
        };
        drop(rng);
        self.count(what);
    }
}

/// An error's kind, with the detail of a cancel (whose reason says who gave up and why).
fn variant(e: &WireError) -> String {
    match e {
        WireError::Cancelled(why) => format!("Cancelled: {}", why.chars().take(60).collect::<String>()),
        e => format!("{e:?}").split(['(', ' ', '{']).next().unwrap_or_default().to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lying_owner_over_quic_gets_nothing_accepted() {
    let want = env("KVFERRY_NET_CORRUPTIONS", 400);
    let seed = seed();
    let lying: Arc<Mutex<Option<Arc<Lying>>>> = Arc::new(Mutex::new(None));
    let keep = lying.clone();
    let s = setup(TransportChoice::Quic, 4, 8, move |honest| {
        let l = Arc::new(Lying {
            honest,
            rng: Mutex::new(Rng::new(seed)),
            p: 0.3,
            injected: Mutex::new(BTreeMap::new()),
        });
        *keep.lock().unwrap() = Some(l.clone());
        l
    });
    let lying = lying.lock().unwrap().clone().unwrap();
    let dst = fault_node(&s);
    let plan = ChunkPlan::new(8, 4, s.layout.bytes_per_block(0..1).unwrap(), CHUNK.into()).unwrap();
    let (mut fetches, mut ok, mut accepted) = (0u64, 0u64, Vec::<String>::new());
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    while lying.total() < want {
        fetches += 1;
        let sink = MemSink::new(lying.honest.clone(), Duration::ZERO);
        let r =
            dst.fetch(&s.src_id(), s.owner.local_addr(), s.spec(Duration::from_secs(20)), sink.clone()).await;
        let wrong = sink.wrong.load(Ordering::Relaxed);
        if wrong > 0 {
            accepted.push(format!("fetch {fetches}: {wrong} chunks landed with bytes not the owner's"));
        }
        match r {
            Ok(r) => {
                ok += 1;
                if r.blocks != 8 || !sink.complete(&plan) {
                    accepted.push(format!(
                        "fetch {fetches}: Ok with {} blocks, complete {}",
                        r.blocks,
                        sink.complete(&plan)
                    ));
                }
            }
            Err(e) => *errors.entry(variant(&e)).or_default() += 1,
        }
        assert!(
            fetches < 10 * want,
            "seed {seed}: the lies stopped being injected: {} in {fetches} fetches ({ok} Ok), failures {errors:?}",
            lying.total()
        );
    }
    let injected = lying.injected.lock().unwrap().clone();
    println!(
        "fault-suite: corruptions injected {} (QUIC+TLS, lying owner), accepted {} ({fetches} fetches, {ok} Ok, \
         seed {seed:#x})",
        lying.total(),
        accepted.len()
    );
    println!("  by kind: {injected:?}; failed fetches: {errors:?}");
    assert!(accepted.is_empty(), "seed {seed}: accepted as valid: {accepted:#?}");
    assert_eq!(injected.len(), 5, "seed {seed}: every lie injected: {injected:?}");
    assert!(ok > 0, "seed {seed}: no fetch survived the lies");
    // The owner let go of every transfer, the failed ones included (bounded).
    let t = Instant::now();
    while s.owner.load_report(0).active_transfers > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the owner kept transfers: {:?}",
            s.owner.load_report(0)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a lane did to its fetch mid-transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    /// Every packet of the lane dropped for 100–600 ms (less than the idle timeout).
    Freeze,
    /// Every packet dropped for 1.2–2 s (longer than the idle timeout: the connection dies).
    Cut,
    /// 20 % of the lane's packets dropped until the fetch ends.
    Loss,
    /// The requester closes its connection.
    RequesterConnKilled,
    /// The owner closes every connection it has.
    OwnerConnsKilled,
    /// The requester is killed: its fetch is dropped mid-transfer.
    RequesterKilled,
}

const FAULTS: [(Fault, u64); 6] = [
    (Fault::Freeze, 25),
    (Fault::Cut, 12),
    (Fault::Loss, 13),
    (Fault::RequesterConnKilled, 20),
    (Fault::OwnerConnsKilled, 5),
    (Fault::RequesterKilled, 25),
];

fn pick(rng: &mut Rng) -> Fault {
    let total: u64 = FAULTS.iter().map(|f| f.1).sum();
    let mut x = rng.next_u64() % total;
    for (f, w) in FAULTS {
        if x < w {
            return f;
        }
        x -= w;
    }
    unreachable!()
}

#[derive(Default)]
struct KillTally {
    faults: BTreeMap<Fault, u64>,
    clean: u64,
    ok: u64,
    partial_valid: Vec<String>,
    late: Vec<String>,
    errors: BTreeMap<String, u64>,
}

async fn lane(
    i: u64,
    s: Arc<Setup>,
    relay: Arc<Relay>,
    target: u64,
    stop_at: Instant,
    done: Arc<AtomicU64>,
    tally: Arc<Mutex<KillTally>>,
) -> Arc<PeerNode> {
    let seed = seed() ^ (i << 32);
    let mut rng = Rng::new(seed);
    let node = fault_node(&s);
    let me = Some(node.local_addr());
    let honest = s.counting.inner.clone();
    let plan = ChunkPlan::new(8, 4, s.layout.bytes_per_block(0..1).unwrap(), CHUNK.into()).unwrap();
    let mut n = 0u64;
    while done.load(Ordering::Relaxed) < target && Instant::now() < stop_at {
        n += 1;
        let ctx = format!("lane {i} fetch {n} (seed {seed:#x})");
        let sink = MemSink::new(honest.clone(), Duration::from_millis(3));
        let spec = s.spec(DEADLINE);
        let deadline = spec.deadline;
        let fetch = {
            let (node, id, addr, sink) = (node.clone(), s.src_id(), relay.addr(), sink.clone());
            tokio::spawn(async move { node.fetch(&id, addr, spec, sink).await })
        };
        let at = 1 + rng.next_u64() % u64::from(plan.count() - 2);
        while sink.count.load(Ordering::Relaxed) < at && !fetch.is_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let fault =
            (!fetch.is_finished() && sink.count.load(Ordering::Relaxed) >= at).then(|| pick(&mut rng));
        let ms = |lo: u64, hi: u64, rng: &mut Rng| Duration::from_millis(lo + rng.next_u64() % (hi - lo));
        match fault {
            Some(Fault::Freeze) => relay.blackhole(me, ms(100, 600, &mut rng)),
            Some(Fault::Cut) => relay.blackhole(me, ms(1_200, 2_000, &mut rng)),
            Some(Fault::Loss) => relay.set_loss(me, 0.2),
            Some(Fault::RequesterConnKilled) => node.close_connections(),
            Some(Fault::OwnerConnsKilled) => s.owner.close_connections(),
            Some(Fault::RequesterKilled) => fetch.abort(),
            None => {}
        }
        let r = fetch.await;
        let ended = Instant::now();
        relay.set_loss(me, 0.0);
        relay.heal(me);
        let mut t = tally.lock().unwrap();
        match fault {
            Some(f) => {
                *t.faults.entry(f).or_default() += 1;
                done.fetch_add(1, Ordering::Relaxed);
            }
            None => t.clean += 1,
        }
        if ended > deadline + GRACE {
            t.late.push(format!("{ctx}: {fault:?} ended {:?} past its deadline", ended - deadline));
        }
        if sink.wrong.load(Ordering::Relaxed) > 0 {
            t.partial_valid.push(format!("{ctx}: {fault:?} landed bytes that are not the owner's"));
        }
        match r {
            Ok(Ok(rc)) => {
                t.ok += 1;
                if rc.blocks != 8 || !sink.complete(&plan) {
                    t.partial_valid.push(format!(
                        "{ctx}: {fault:?} returned Ok with {} blocks, partly landed",
                        rc.blocks
                    ));
                }
            }
            Ok(Err(e)) => *t.errors.entry(variant(&e)).or_default() += 1,
            Err(j) if j.is_cancelled() => *t.errors.entry("requester killed".into()).or_default() += 1,
            Err(j) => panic!("{ctx}: the fetch task panicked: {j}"),
        }
    }
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_mid_transfer_faults_end_in_time_with_nothing_partially_valid() {
    let target = env("KVFERRY_FAULT_KILLS", 1_000);
    let lanes = env("KVFERRY_FAULT_LANES", 12);
    let s = Arc::new(setup(TransportChoice::Quic, 4, 8, |x| x)); // 8 blocks × 4 layers, 2 MiB in 32 chunks
    let relay = Arc::new(Relay::start(s.owner.local_addr(), seed()).unwrap());
    let t0 = Instant::now();
    // Bounded however slow the machine: a run that cannot reach the target fails.
    let stop_at = t0 + Duration::from_secs(env("KVFERRY_FAULT_CAP_SECS", 240).max(target / 4));
    let done = Arc::new(AtomicU64::new(0));
    let tally = Arc::new(Mutex::new(KillTally::default()));
    let mut tasks = Vec::new();
    for i in 0..lanes {
        tasks.push(tokio::spawn(lane(
            i,
            s.clone(),
            relay.clone(),
            target,
            stop_at,
            done.clone(),
            tally.clone(),
        )));
    }
    let mut nodes = Vec::new();
    for t in tasks {
        nodes.push(t.await.unwrap());
    }
    let faulted_s = t0.elapsed().as_secs_f64();
    // The owner drops every transfer its requesters abandoned (bounded by the idle timeout).
    let t = Instant::now();
    while s.owner.load_report(0).active_transfers > 0 || s.owner.load_report(0).staging_used > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the owner kept abandoned transfers: {:?}",
            s.owner.load_report(0)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The regions work again: a clean fetch on every lane, through the relay, byte-identical.
    let plan = ChunkPlan::new(8, 4, s.layout.bytes_per_block(0..1).unwrap(), CHUNK.into()).unwrap();
    let mut recovered = 0;
    for node in &nodes {
        let sink = MemSink::new(s.counting.inner.clone(), Duration::ZERO);
        let r = node.fetch(&s.src_id(), relay.addr(), s.spec(Duration::from_secs(20)), sink.clone()).await;
        let r = r.unwrap_or_else(|e| panic!("a clean fetch after the faults failed: {e}"));
        assert_eq!(r.blocks, 8);
        assert!(sink.complete(&plan) && sink.wrong.load(Ordering::Relaxed) == 0);
        recovered += 1;
    }
    let t = tally.lock().unwrap();
    let kills: u64 = t.faults.values().sum();
    let rs = relay.stats();
    println!(
        "fault-suite: mid-transfer kills {kills}, partial-valid {}, late answers {} (QUIC+TLS through a relay, {lanes} \
         lanes, deadline {} s + grace {} s, {:.0} s; {} Ok, {} clean, {recovered}/{} lanes fetch again; seed {:#x})",
        t.partial_valid.len(),
        t.late.len(),
        DEADLINE.as_secs(),
        GRACE.as_secs(),
        faulted_s,
        t.ok,
        t.clean,
        nodes.len(),
        seed()
    );
    println!("  by fault: {:?}; ends: {:?}; relay {rs:?}", t.faults, t.errors);
    assert!(t.partial_valid.is_empty(), "partially valid: {:#?}", t.partial_valid);
    assert!(t.late.is_empty(), "late: {:#?}", t.late);
    assert!(kills >= target, "only {kills} of {target} faults in {faulted_s:.0} s");
    for (f, _) in FAULTS {
        assert!(t.faults.get(&f).copied().unwrap_or(0) > 0, "{f:?} never injected");
    }
    assert!(t.ok > 0, "no faulted fetch ever recovered");
}

/// Every mutual-TLS negative in one matrix, each refused before the owner reads a KV byte (and,
/// for the requester's side, before its catalog is asked): the cases of the tests above, plus
/// a certificate of another trust domain from the trusted CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mtls_negative_is_refused_before_any_kv_byte() {
    let s = setup(TransportChoice::Quic, 4, 4, |x| x);
    let other = DevPki::generate(TD).unwrap();
    let mut cases: Vec<(&str, Arc<PeerNode>, RegionId)> = Vec::new();
    cases.push((
        "unknown CA",
        node(
            TransportChoice::Quic,
            other.issue("dst").unwrap(),
            &s.pki,
            &["src"],
            s.catalog.clone(),
            8 << 20,
        ),
        s.src_id(),
    ));
    cases.push(("region not on the allow-list", s.requester("rogue", 8 << 20), s.src_id()));
    let two = s
        .pki
        .issue_with_uris(RegionId::new(TD, "dst").unwrap(), &["spiffe://kvferry.test/region/src"])
        .unwrap();
    cases.push((
        "two URI SANs",
        node(TransportChoice::Quic, two, &s.pki, &["src"], s.catalog.clone(), 8 << 20),
        s.src_id(),
    ));
    let foreign_td = s.pki.issue_with_uris(RegionId::new("other.test", "dst").unwrap(), &[]).unwrap();
    cases.push((
        "another trust domain",
        node(TransportChoice::Quic, foreign_td, &s.pki, &["src"], s.catalog.clone(), 8 << 20),
        s.src_id(),
    ));
    cases.push((
        "the owner's own identity, presented by a requester",
        s.requester("src", 8 << 20),
        s.src_id(),
    ));
    cases.push((
        "server impersonating another region",
        s.requester("dst", 8 << 20),
        RegionId::new(TD, "eu").unwrap(),
    ));
    let n = cases.len();
    let mut refused_before = 0;
    for (what, dst, expect) in &cases {
        let e = dst.fetch(expect, s.owner.local_addr(), s.spec(Duration::from_secs(10)), s.sink()).await;
        let reads = s.counting.bytes.load(Ordering::Relaxed);
        let opened = s.catalog.opened.load(Ordering::Relaxed);
        match e {
            Err(WireError::NotAuthorised(_)) if reads == 0 && opened == 0 => refused_before += 1,
            other => panic!("{what}: {other:?}, {reads} KV bytes read, catalog opened {opened}×"),
        }
    }
    println!("fault-suite: mTLS negatives {refused_before}/{n} refused before any KV byte");
    assert_eq!(refused_before, n);
    // And the allowed requester is served (the negatives are not a broken owner).
    let ok = s.requester("dst", 8 << 20);
    ok.fetch(&s.src_id(), s.owner.local_addr(), s.spec(Duration::from_secs(10)), s.sink()).await.unwrap();
    s.assert_identical();
}
