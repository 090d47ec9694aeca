//! Two regions, end to end, with every component a real separate process: two `kvferry
//! daemon`s and two `kvferry engine`s on loopback (real QUIC + mutual TLS between the daemons,
//! real shared-memory pools, real gRPC). One cluster serves the phases in order; each phase
//! states what it proves. A second cluster runs region B's engine with a NIXL-registered pool.
//! The cluster is `tests/common` (the one fixture the CLI's process tests share).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Cluster, RegionSpec, TENANT, assert_warm_equals_cold, generate, migrate, request, tokens};
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{
    Action, Decision, GetLinksRequest, MigrateSessionRequest, Policy, PolicyMode, Receipt,
};
use tonic::transport::Channel;

/// Region A's engine and region B's router and engine: what a migration into B is driven
/// and checked with.
struct IntoB<'a> {
    a: &'a mut ReferenceEngineClient<Channel>,
    router_b: &'a mut MigrationClient<Channel>,
    b: &'a mut ReferenceEngineClient<Channel>,
}

impl IntoB<'_> {
    /// The fetch path: a 600-token conversation (`seed`) in A, migrated to B as `session`
    /// with policy fetch once A's daemon holds it (an engine reports its blocks
    /// asynchronously): every full block but the one with the last token fetched, verified
    /// bytes moved, no fallback, and B's next turn warm and bit-identical to a full
    /// recompute. Returns the conversation, the decision and the receipt.
    async fn fetch(&mut self, session: &str, seed: u64) -> (Vec<u32>, Decision, Receipt) {
        let convo = tokens(600, seed);
        generate(self.a, &convo, true).await;
        let req = request(session, &convo, PolicyMode::Fetch);
        wait_for_fetch_plan(self.router_b, &req).await;
        let (d, r) = migrate(self.router_b, req).await;
        assert_eq!((d.action.as_str(), r.action.as_str()), ("fetch", "fetch"), "{d:?} {r:?}");
        assert!(r.bytes_moved > 0 && r.fallback.is_empty(), "{r:?}");
        assert_eq!(r.tokens_ready, 592);
        assert_warm_equals_cold(self.b, &convo, 592).await;
        (convo, d, r)
    }

    /// The recompute path: a 300-token conversation (`seed`) in A, migrated to B as
    /// `session` with policy recompute: no byte moves, B's engine computes the prefix on the
    /// daemon's instruction, and B's next turn is warm and bit-identical to a full recompute.
    async fn recompute(&mut self, session: &str, seed: u64) {
        let convo = tokens(300, seed);
        generate(self.a, &convo, true).await;
        let (d, r) = migrate(self.router_b, request(session, &convo, PolicyMode::Recompute)).await;
        assert_eq!((d.action.as_str(), r.action.as_str()), ("recompute", "recompute"));
        assert!(r.tokens_ready >= 288 && r.bytes_moved == 0, "{r:?}");
        assert_warm_equals_cold(self.b, &convo, 288).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_regions_end_to_end() {
    let mut cl = Cluster::start(Default::default());
    let (mut a, mut b) = (cl.engine(0).await, cl.engine(1).await);
    let mut router_b = cl.router(1).await;

    // 1. Fetch path: a conversation in A; B fetches its prefix; B's next turn is exact.
    let (convo, d, r) = IntoB { a: &mut a, router_b: &mut router_b, b: &mut b }.fetch("s-fetch", 1).await;
    assert_eq!((d.kind(), r.kind()), (Action::Fetch, Action::Fetch), "the typed action agrees");
    assert_eq!(d.source_tokens, 592, "A holds every full block but the one with the last token");
    assert!(r.goodput_gbps > 0.0, "{r:?}");
    // Migrating again: already local.
    let (d, _) = migrate(&mut router_b, request("s-fetch-2", &convo, PolicyMode::Auto)).await;
    assert_eq!(d.action, "already_local");

    // 2. Recompute path: the engine receives and runs the instruction, so the next turn is warm.
    IntoB { a: &mut a, router_b: &mut router_b, b: &mut b }.recompute("s-recompute", 2).await;

    // 3. Split: an egress cap forbids a full fetch; the split recomputes the head and fetches the tail.
    let convo3 = tokens(640, 3);
    generate(&mut a, &convo3, true).await;
    wait_for_fetch_plan(&mut router_b, &request("s-plan", &convo3, PolicyMode::Auto)).await;
    let plan =
        router_b.plan_migration(request("s-plan", &convo3, PolicyMode::Auto)).await.unwrap().into_inner();
    let bytes_per_token = plan.bytes_per_token;
    assert!(bytes_per_token > 0.0, "{plan:?}");
    let mut req = request("s-split", &convo3, PolicyMode::Auto);
    // Cap egress at a quarter of the prefix: a full fetch is infeasible, and recomputing the head
    // while fetching the tail beats recomputing everything on any plausible link.
    req.policy = Some(Policy {
        mode: PolicyMode::Auto as i32,
        allow_split: true,
        max_egress_bytes: (bytes_per_token * 160.0) as u64,
        allow_hedge: false,
    });
    let (d, r) = migrate(&mut router_b, req).await;
    assert_eq!(d.action, "split", "{d:?}");
    assert!(d.split_recompute_tokens >= 480 && d.split_recompute_tokens % 16 == 0, "{d:?}");
    assert_eq!(r.action, "split");
    assert!(r.bytes_moved > 0 && r.bytes_moved as f64 <= bytes_per_token * 160.0 + 1.0, "{r:?}");
    assert_warm_equals_cold(&mut b, &convo3, 624).await;

    // 3b. Block hashes only, under an egress cap that forbids the fetch: only a recompute could
    // serve it, and a recompute needs the tokens, so both calls fail their precondition with
    // that reason (they used to plan a recompute of an empty token list).
    let convo3b = tokens(330, 31);
    generate(&mut a, &convo3b, true).await;
    wait_for_fetch_plan(&mut router_b, &request("s-hashes", &convo3b, PolicyMode::Auto)).await;
    let mut req = request("s-hashes-capped", &convo3b, PolicyMode::Auto);
    req.block_hashes = kvferry_daemon::engine_api::hashes_for(TENANT, &convo3b, 16)
        .into_iter()
        .map(|h| h.to_vec())
        .collect();
    req.token_ids.clear();
    req.policy = Some(Policy {
        mode: PolicyMode::Auto as i32,
        allow_split: false,
        max_egress_bytes: 1,
        allow_hedge: false,
    });
    for e in [
        router_b.plan_migration(req.clone()).await.unwrap_err(),
        router_b.migrate_session(req.clone()).await.unwrap_err(),
    ] {
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{}", e.message());
        assert!(e.message().contains("egress cap") && e.message().contains("cannot be recomputed"), "{e:?}");
        assert_eq!(e.metadata().get("kvferry-retryable").unwrap(), "false");
    }

    // 4. Bad requests get the right status, and the daemon keeps serving.
    use tonic::Code;
    let bad = |f: &dyn Fn(&mut MigrateSessionRequest)| {
        let mut r = request("s-bad", &convo, PolicyMode::Auto);
        f(&mut r);
        r
    };
    let cases: Vec<(MigrateSessionRequest, Code)> = vec![
        (bad(&|r| r.token_ids.clear()), Code::InvalidArgument),
        (bad(&|r| r.session_id.clear()), Code::InvalidArgument),
        (bad(&|r| r.tenant.clear()), Code::InvalidArgument),
        (bad(&|r| r.token_ids = vec![1; 70_000]), Code::ResourceExhausted),
        (bad(&|r| r.source_region = "region-x".into()), Code::NotFound),
        (bad(&|r| r.model_id = "no-such-model".into()), Code::NotFound),
        (bad(&|r| r.layout_fingerprint = vec![7; 32]), Code::FailedPrecondition),
        (bad(&|r| r.layout_fingerprint = vec![7; 5]), Code::InvalidArgument),
        (bad(&|r| r.token_ids.truncate(10)), Code::InvalidArgument),
    ];
    for (req, code) in cases {
        let e =
            router_b.migrate_session(req.clone()).await.err().unwrap_or_else(|| panic!("accepted {req:?}"));
        assert_eq!(e.code(), code, "{}", e.message());
        assert!(!e.message().is_empty());
    }
    // An absolute deadline already in the past: refused by the daemon.
    let mut expired = request("s-expired", &convo, PolicyMode::Auto);
    let now_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    expired.deadline_unix_ms = now_ms - 1_000;
    let e = router_b.migrate_session(expired.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{}", e.message());
    assert_eq!(router_b.plan_migration(expired).await.unwrap_err().code(), Code::DeadlineExceeded);
    // A transport deadline (grpc-timeout) that expires in flight: whichever fires first answers,
    // the daemon (DEADLINE_EXCEEDED) or tonic's own deadline layer (which reports CANCELLED).
    let mut in_flight = tonic::Request::new(request("s-expired-2", &convo, PolicyMode::Auto));
    in_flight.metadata_mut().insert("grpc-timeout", "1n".parse().unwrap());
    let code = router_b.plan_migration(in_flight).await.unwrap_err().code();
    assert!(matches!(code, Code::DeadlineExceeded | Code::Cancelled), "{code:?}");
    let links = router_b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    assert_eq!(links.links.len(), 1);
    assert!(links.links[0].connected && links.links[0].rtt_ms > 0.0, "live link figures: {links:?}");

    // 5. 64 concurrent migrations (fresh sessions) all complete correctly.
    let mut sessions = Vec::new();
    for i in 0..8u64 {
        let t = tokens(160, 100 + i);
        generate(&mut a, &t, true).await;
        wait_for_fetch_plan(&mut router_b, &request("s-wait", &t, PolicyMode::Auto)).await;
        sessions.push(t);
    }
    let mut tasks = Vec::new();
    for i in 0..64usize {
        let mut c = router_b.clone();
        let t = sessions[i % 8].clone();
        tasks.push(tokio::spawn(async move {
            let mode = if i % 2 == 0 { PolicyMode::Fetch } else { PolicyMode::Auto };
            migrate(&mut c, request(&format!("s-c{i}"), &t, mode)).await
        }));
    }
    for t in tasks {
        let (d, r) = t.await.unwrap();
        assert!(["fetch", "already_local", "recompute"].contains(&d.action.as_str()), "{d:?}");
        assert!(r.fallback.is_empty(), "{r:?}");
        assert_eq!(r.tokens_ready, 160, "{r:?}");
    }
    for t in &sessions {
        assert_warm_equals_cold(&mut b, t, 144).await;
    }

    // 6. An independent client: Python grpcio with stubs generated from proto/ at test time.
    let convo5 = tokens(200, 5);
    generate(&mut a, &convo5, true).await;
    wait_for_fetch_plan(&mut router_b, &request("s-python", &convo5, PolicyMode::Auto)).await;
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let toks: Vec<String> = convo5.iter().map(u32::to_string).collect();
    let out = Command::new("python3")
        .arg(format!("{root}/tests/python/router_client.py"))
        .args([
            &format!("{root}/proto"),
            &cl.grpc[1].to_string(),
            "s-python",
            TENANT,
            "region-a",
            &toks.join(","),
        ])
        .output()
        .expect("python3 (grpcio and grpcio-tools are installed by .ci/run)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "python client failed: {text} {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    // The action follows the live link estimate; either way the prefix is ready afterwards.
    assert!(v["plan_action"] == "fetch" || v["plan_action"] == "recompute", "{v}");
    assert_eq!(v["receipt_action"], v["plan_action"], "{v}");
    assert_eq!(v["tokens_ready"], 192, "{v}");
    assert_eq!(v["events"][0], "decision", "{v}");
    assert_eq!(v["bad_request_code"], "INVALID_ARGUMENT", "{v}");

    // 7. The source region dies: a recompute answer within the deadline, nothing half-valid.
    let convo4 = tokens(400, 4);
    generate(&mut a, &convo4, true).await;
    cl.kill("daemon region-a");
    let mut req = request("s-dead", &convo4, PolicyMode::Auto);
    req.deadline_ms = 8_000;
    let t = Instant::now();
    let (d, r) = migrate(&mut router_b, req).await;
    assert!(t.elapsed() < Duration::from_secs(8), "took {:?}", t.elapsed());
    assert_eq!(r.action, "recompute", "{d:?} {r:?}");
    assert_warm_equals_cold(&mut b, &convo4, 384).await;
}

/// Waits until the source region's daemon knows its engine's blocks for this prefix (engines
/// report stored blocks asynchronously). Decisions are not asserted here: they follow the live
/// link estimate.
async fn wait_for_fetch_plan(router: &mut MigrationClient<Channel>, req: &MigrateSessionRequest) {
    let t = Instant::now();
    let full_blocks = (req.token_ids.len() / 16 * 16) as u64;
    loop {
        let plan = router.plan_migration(req.clone()).await.unwrap().into_inner();
        if plan.source_tokens >= full_blocks || plan.action == "already_local" {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the source's blocks never became visible: {plan:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Region B's engine hands its pool to the daemon through NIXL (`--pool nixl`: regions
/// registered with the engine's own NIXL agent, no memfd on pool.sock), so B's daemon writes
/// fetched blocks into the engine (Load) and reads them out for a peer (serving a fetch) only
/// with NIXL WRITE/READ. Needs NIXL's environment (`source deploy/install-nixl.sh`; .ci/run
/// does); without it the test fails, it does not skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nixl_pool_end_to_end() {
    if let Err(e) = kvferry_pool_nixl::ensure_nixl() {
        panic!("this test needs NIXL: run `source deploy/install-nixl.sh` first ({e})");
    }
    let cl = Cluster::start([
        RegionSpec::default(),
        RegionSpec { engine_args: vec!["--pool".into(), "nixl".into()], ..Default::default() },
    ]);
    let (mut a, mut b) = (cl.engine(0).await, cl.engine(1).await);
    let (mut router_a, mut router_b) = (cl.router(0).await, cl.router(1).await);
    let log = std::fs::read_to_string(cl.dir(1).join("daemon.log")).unwrap();
    assert!(log.contains("NIXL pool attached"), "region B's pool did not come through NIXL:\n{log}");

    // Fetch into B: the landed blocks are written into B's engine with NIXL WRITE.
    IntoB { a: &mut a, router_b: &mut router_b, b: &mut b }.fetch("s-nixl-fetch", 21).await;

    // Recompute in B.
    IntoB { a: &mut a, router_b: &mut router_b, b: &mut b }.recompute("s-nixl-recompute", 22).await;

    // The other way: A fetches from B, whose daemon reads B's blocks with NIXL READ.
    let convo3 = tokens(390, 23);
    generate(&mut b, &convo3, true).await;
    let mut req = request("s-nixl-serve", &convo3, PolicyMode::Fetch);
    req.source_region = "region-b".into();
    wait_for_fetch_plan(&mut router_a, &req).await;
    let (d, r) = migrate(&mut router_a, req).await;
    assert_eq!((d.action.as_str(), r.action.as_str()), ("fetch", "fetch"), "{d:?} {r:?}");
    assert!(r.bytes_moved > 0 && r.fallback.is_empty(), "{r:?}");
    assert_eq!(r.tokens_ready, 384, "{r:?}");
    assert_warm_equals_cold(&mut a, &convo3, 384).await;
}

/// Every peer entry on `transport = "tcp"`: the daemons' queries and fetches ride TLS 1.3 over
/// TCP (the same mutual TLS, chunks, checksums and digest), the next turn is exact, and the
/// receipt and `GetLinks` say TCP carried it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fetch_over_tcp_lands_exact_and_says_so() {
    let tcp = RegionSpec {
        configure: Some(|c| {
            for p in &mut c.peers {
                p.transport = kvferry_peer::TransportChoice::Tcp;
            }
        }),
        ..Default::default()
    };
    let cl = Cluster::start([tcp.clone(), tcp]);
    let (mut a, mut b) = (cl.engine(0).await, cl.engine(1).await);
    let mut router_b = cl.router(1).await;
    let (_, _, r) = IntoB { a: &mut a, router_b: &mut router_b, b: &mut b }.fetch("s-tcp", 41).await;
    assert_eq!(r.transport, "tcp", "{r:?}");
    assert!(r.path.contains("TCP (TLS 1.3") && !r.congestion.is_empty(), "{r:?}");
    let links = router_b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let l = links.links.iter().find(|l| l.region == "region-a").expect("region-a in GetLinks");
    assert_eq!((l.transport_setting.as_str(), l.transport.as_str()), ("tcp", "tcp"), "{l:?}");
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// PlanMigration latency as a router sees it (not asserted: printed, and recorded in
/// bench/results/daemon-plan-latency.md). Run:
/// `cargo test --release -p kvferry --test e2e -- --ignored plan_migration_latency --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a benchmark; run explicitly"]
async fn plan_migration_latency() {
    let cl = Cluster::start(Default::default());
    let mut a = cl.engine(0).await;
    let mut b = cl.engine(1).await;
    let mut router = cl.router(1).await;
    let remote = tokens(2000, 11);
    generate(&mut a, &remote, true).await;
    let local = tokens(2000, 12);
    generate(&mut b, &local, true).await;
    for (label, convo) in [
        ("source in region-a (includes the QUIC query round trip)", &remote),
        ("prefix already local", &local),
    ] {
        let req = request("s-lat", convo, PolicyMode::Auto);
        for _ in 0..50 {
            router.plan_migration(req.clone()).await.unwrap();
        }
        let mut lat = Vec::with_capacity(2000);
        for _ in 0..2000 {
            let t = Instant::now();
            router.plan_migration(req.clone()).await.unwrap();
            lat.push(t.elapsed());
        }
        lat.sort();
        println!(
            "PlanMigration, {} tokens, {label}: p50 {:?}  p99 {:?}  max {:?}  (n = {})",
            convo.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            lat[lat.len() - 1],
            lat.len()
        );
    }
}

/// A fetch is priced until the engine can use it: once the target engine has loaded fetched
/// blocks into its pool (`Engine.Load`), the daemon knows its load rate (`Decision.
/// load_s_per_token`, 0 before) from what that load took, and every later fetch candidate
/// includes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fetch_is_priced_with_the_engines_load_once_it_has_loaded() {
    let cl = Cluster::start([RegionSpec::default(), RegionSpec::default()]);
    let (mut a, mut eb) = (cl.engine(0).await, cl.engine(1).await);
    let mut router_b = cl.router(1).await;
    let (first, second) = (tokens(3_000, 31), tokens(3_000, 32));
    generate(&mut a, &first, true).await;
    generate(&mut a, &second, true).await;
    let req = request("s-load-price", &first, PolicyMode::Fetch);
    wait_for_fetch_plan(&mut router_b, &req).await;
    let before = router_b.plan_migration(req.clone()).await.unwrap().into_inner();
    assert_eq!(before.load_s_per_token, 0.0, "no load measured yet: {before:?}");
    let (d, r) = migrate(&mut router_b, req).await;
    assert_eq!((d.action.as_str(), r.action.as_str()), ("fetch", "fetch"), "{d:?} {r:?}");
    // B's next turn loads the ~3 MiB it fetched.
    assert_warm_equals_cold(&mut eb, &first, 2_992).await;
    let m = cl.metrics(1).await;
    let sample = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("{name} missing from\n{m}"))
    };
    let (us, bytes) =
        (sample("kvferry_engine_load_microseconds_total"), sample("kvferry_engine_loaded_bytes_total"));
    assert!(us > 0.0 && bytes >= r.bytes_moved as f64, "{m}");
    let req = request("s-load-price-2", &second, PolicyMode::Auto);
    wait_for_fetch_plan(&mut router_b, &req).await;
    let after = router_b.plan_migration(req).await.unwrap().into_inner();
    let measured = us * 1e-6 / bytes * after.bytes_per_token;
    assert!(
        after.load_s_per_token > measured / 2.0 && after.load_s_per_token < measured * 2.0,
        "learnt {} s/token, the metrics say {measured}: {after:?}",
        after.load_s_per_token
    );
    let fetch = after.candidates.iter().find(|c| c.action == "fetch").expect("a fetch candidate");
    let load = after.load_s_per_token * after.source_tokens as f64;
    assert!(fetch.seconds > load, "the fetch's {} s include the {load} s load: {after:?}", fetch.seconds);
    // GetLinks exports the same learnt rate, per byte, for the engine that loaded.
    let links = router_b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let e = links.engines.iter().find(|e| e.load_samples >= 1).unwrap_or_else(|| panic!("{links:?}"));
    assert!(
        (e.load_s_per_byte * after.bytes_per_token - after.load_s_per_token).abs()
            <= 1e-9 + after.load_s_per_token * 1e-6,
        "GetLinks {} s/byte against the plan's {} s/token: {links:?}",
        e.load_s_per_byte,
        after.load_s_per_token
    );
    // `kvferry links` shows it in its engines table.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["links", "--daemon", &format!("http://{}", cl.grpc[1])])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let row =
        text.lines().find(|l| l.trim_start().starts_with(&e.engine_id)).unwrap_or_else(|| panic!("{text}"));
    // The load is the last column but one (its sample count last).
    let load_gib: f64 =
        row.split_whitespace().rev().nth(1).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{row}"));
    let want = e.load_s_per_byte * f64::from(1u32 << 30);
    assert!((load_gib - want).abs() <= 0.0005 + want * 1e-3, "{row}: {want} s/GiB");
}

/// A fetched prefix larger than one staging batch: region B's daemon runs with the smallest
/// `limits.staging_bytes` (8 MiB), and its engine hands over its pool through NIXL (a pool the
/// daemon does not map, so `Load` goes through staging), so the engine's `Load` of a
/// 9,000-token prefix (~8.8 MiB at 1 KiB a token) writes its blocks in two batches through one
/// reused staging buffer. B's next turn is warm for the whole prefix and bit-identical to a
/// full recompute, and the daemon's load metrics count the call and every byte it wrote. Needs
/// NIXL's environment, as `nixl_pool_end_to_end`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_of_several_staging_batches_is_exact() {
    if let Err(e) = kvferry_pool_nixl::ensure_nixl() {
        panic!("this test needs NIXL: run `source deploy/install-nixl.sh` first ({e})");
    }
    let b = RegionSpec {
        configure: Some(|c| c.limits.staging_bytes = 8 << 20),
        engine_args: vec!["--pool".into(), "nixl".into()],
        ..Default::default()
    };
    load_of_a_large_prefix_is_exact(b).await;
}

/// The same prefix into an shm pool, which the daemon maps: `Load` writes each landed block
/// straight into it (`MemoryBackend::write_host`), no staging buffer whatever its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_into_a_mapped_pool_is_exact_without_staging() {
    let b = RegionSpec { configure: Some(|c| c.limits.staging_bytes = 8 << 20), ..Default::default() };
    load_of_a_large_prefix_is_exact(b).await;
}

async fn load_of_a_large_prefix_is_exact(b: RegionSpec) {
    let cl = Cluster::start([RegionSpec::default(), b]);
    let (mut a, mut eb) = (cl.engine(0).await, cl.engine(1).await);
    let mut router_b = cl.router(1).await;
    let convo = tokens(9_000, 21);
    generate(&mut a, &convo, true).await;
    let req = request("s-big-load", &convo, PolicyMode::Fetch);
    wait_for_fetch_plan(&mut router_b, &req).await;
    let (d, r) = migrate(&mut router_b, req).await;
    assert_eq!((d.action.as_str(), r.action.as_str()), ("fetch", "fetch"), "{d:?} {r:?}");
    assert_eq!(r.tokens_ready, 8_992, "{r:?}");
    assert!(r.bytes_moved > 8 << 20, "more than one batch moved: {r:?}");
    assert_warm_equals_cold(&mut eb, &convo, 8_992).await;
    let m = cl.metrics(1).await;
    let sample = |name: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("{name} missing from\n{m}"))
    };
    assert_eq!(sample("kvferry_engine_loads_total{result=\"failed\"}"), 0);
    assert!(sample("kvferry_engine_loads_total{result=\"ok\"}") >= 1);
    assert!(sample("kvferry_engine_loaded_bytes_total") >= r.bytes_moved, "{m}");
    assert!(sample("kvferry_engine_load_microseconds_total") > 0);
}
