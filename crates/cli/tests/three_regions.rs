//! Three regions of real processes (three `kvferry daemon`s, three `kvferry engine`s, real QUIC
//! and mutual TLS on loopback): a session whose prefix is held in A and B is fetched by C.
//!
//! C's links differ: A's egress to C is capped at 2 Mbit/s (A reports the cap in its answers,
//! so C prices it), B is expected at 0.5 Mbit/s (C's configured figure until measured; its
//! real link is loopback); RTTs are measured live by the queries. So A is the better link as C
//! knows it, and a fetch from A takes seconds. With `source_region` empty, C asks both, ranks the holders by when
//! each would make the prefix ready (`kvferry_model::rank_sources`), fetches from A and says
//! why in the decision; a router naming `source_regions` narrows the candidates; A killed in
//! the middle of a fetch makes C fetch from B instead (not recompute); and with A down before
//! the plan, C skips it within the deadline and fetches from B.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::{Decision, MigrateSessionRequest, PolicyMode, Receipt, migration_event};
use tonic::transport::Channel;

/// Waits until `region`'s engine has published the prefix, as C's plan sees it.
async fn wait_held_in(router: &mut MigrationClient<Channel>, req: &MigrateSessionRequest, region: &str) {
    let mut r = req.clone();
    r.source_region = region.into();
    wait_for_source(router, &r).await;
}

/// Runs a migration; kills `kill` (a process name) once bytes are moving, if given.
async fn migrate(
    cl: &mut Cluster,
    router: &mut MigrationClient<Channel>,
    req: MigrateSessionRequest,
    kill: Option<&str>,
) -> (Decision, Receipt) {
    let mut stream = router.migrate_session(req).await.unwrap().into_inner();
    let (mut decision, mut receipt, mut killed) = (None, None, false);
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(40), stream.message())
        .await
        .expect("the migration stream stalled")
        .unwrap_or_else(|e| panic!("MigrateSession failed: {e}\n--- C daemon:\n{}", cl.log(2, "daemon")))
    {
        match ev.event {
            Some(migration_event::Event::Decision(d)) => decision = Some(d),
            Some(migration_event::Event::Progress(p)) if p.bytes_done > 0 && !killed => {
                if let Some(name) = kill {
                    assert!(p.bytes_done < p.bytes_total, "the fetch finished before the kill: {p:?}");
                    cl.kill(name);
                    killed = true;
                }
            }
            Some(migration_event::Event::Receipt(r)) => receipt = Some(r),
            _ => {}
        }
    }
    assert!(kill.is_none() || killed, "no progress showed bytes moving before the answer");
    (decision.expect("a decision"), receipt.expect("a receipt"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_third_region_fetches_from_the_better_holder_and_falls_back_to_the_other() {
    let a = RegionSpec { configure: Some(|c| c.peers[1].max_egress_gbps = 0.002), ..Default::default() };
    let b = RegionSpec::default();
    let c = RegionSpec {
        configure: Some(|c| {
            // peers: [region-a, region-b]
            c.peers[1].gbps = 0.0005;
            // Small chunks, so progress shows bytes landing while A is still sending. The idle
            // timeout stays above the requester's 2 s re-ask of missing chunks (a 1 s one stalls a
            // fetch whose last chunk needed the re-ask before it is asked).
            (c.transfer.chunk_bytes, c.transfer.idle_timeout_ms) = (65_536, 3_000);
        }),
        ..Default::default()
    };
    let mut cl = Cluster::start_regions(&[a, b, c]);
    let (mut eng_a, mut eng_b) = (cl.engine(0).await, cl.engine(1).await);
    let mut router_c = cl.router(2).await;
    let ask_all = |session: &str, t: &[u32]| {
        let mut r = request(session, t, PolicyMode::Fetch);
        r.source_region.clear();
        r
    };
    let convos: Vec<Vec<u32>> =
        [(160, 11), (160, 12), (640, 13), (160, 14)].iter().map(|&(n, seed)| tokens(n, seed)).collect();
    for t in &convos {
        generate(&mut eng_a, t, true).await;
        generate(&mut eng_b, t, true).await;
    }
    for (i, t) in convos.iter().enumerate() {
        let req = ask_all(&format!("s-wait-{i}"), t);
        wait_held_in(&mut router_c, &req, "region-a").await;
        wait_held_in(&mut router_c, &req, "region-b").await;
    }

    // The residency view: C holds nothing yet, A and B the whole prefix (A first: C's better
    // source).
    let view = residency(&mut router_c, TENANT, &convos[0], &[]).await;
    let held: Vec<(&str, u64, bool)> =
        view.holdings.iter().map(|h| (h.region.as_str(), h.tokens, h.reachable)).collect();
    assert_eq!(
        (view.prefix_tokens, held),
        (160, vec![("region-c", 0, true), ("region-a", 160, true), ("region-b", 160, true)]),
        "{view:?}"
    );

    // 1. Both hold it; the better link (A) is chosen, and the decision says why.
    let (d, r) = migrate(&mut cl, &mut router_c, ask_all("s3-1", &convos[0]), None).await;
    println!("decision: {d:?}\nreceipt: {r:?}");
    assert_eq!((d.action.as_str(), d.source_region.as_str()), ("fetch", "region-a"), "{d:?}");
    let regions: Vec<(&str, u64, bool)> =
        d.holdings.iter().map(|h| (h.region.as_str(), h.tokens, h.reachable)).collect();
    assert_eq!(regions, vec![("region-a", 160, true), ("region-b", 160, true)], "{d:?}");
    assert!(d.holdings[0].predicted_s < d.holdings[1].predicted_s, "{d:?}");
    assert!(d.reason.contains("source region-a of 2 holders"), "{d:?}");
    assert!(r.path.starts_with("region-a pool"), "{r:?}");
    assert_eq!((r.action.as_str(), r.bytes_moved), ("fetch", 160 * 1024), "{r:?}");

    // 2. A router that names its candidates gets one of them.
    let mut req = ask_all("s3-2", &convos[1]);
    req.source_regions = vec!["region-b".into()];
    let (d, r) = migrate(&mut cl, &mut router_c, req, None).await;
    assert_eq!(d.source_region, "region-b", "{d:?}");
    assert_eq!(d.holdings.len(), 1, "only the named candidate is asked: {d:?}");
    assert!(
        r.path.starts_with("region-b pool"),
        "{r:?}\n--- B daemon:\n{}\n--- C daemon:\n{}",
        cl.log(1, "daemon"),
        cl.log(2, "daemon")
    );

    // 3. A dies in the middle of the fetch: C fetches the prefix from B, not recompute.
    let t0 = Instant::now();
    let (d, r) = migrate(&mut cl, &mut router_c, ask_all("s3-3", &convos[2]), Some("daemon region-a")).await;
    println!("failover after {:.2} s: {r:?}", t0.elapsed().as_secs_f64());
    assert_eq!(d.source_region, "region-a", "{d:?}");
    assert_eq!(r.action, "fetch", "{r:?}");
    assert!(r.fallback.contains("fetched from region-b"), "{r:?}");
    assert!(r.path.starts_with("region-b pool"), "{r:?}");
    assert_eq!(r.bytes_moved, 640 * 1024, "{r:?}");

    // 4. With A down before the plan, C skips it within the deadline and fetches from B.
    let t0 = Instant::now();
    let (d, r) = migrate(&mut cl, &mut router_c, ask_all("s3-4", &convos[3]), None).await;
    println!("with A down: {:.2} s: {d:?}", t0.elapsed().as_secs_f64());
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    assert_eq!(d.source_region, "region-b", "{d:?}");
    let a = d.holdings.iter().find(|h| h.region == "region-a").expect("A is listed");
    assert!(!a.reachable && !a.note.is_empty(), "{d:?}");
    assert_eq!((r.action.as_str(), r.bytes_moved), ("fetch", 160 * 1024), "{r:?}");

    // The residency view now: C holds the fetched prefix, A is unreachable.
    let view = residency(&mut router_c, TENANT, &convos[3], &[]).await;
    let c = &view.holdings[0];
    assert_eq!((c.region.as_str(), c.tokens), ("region-c", 160), "{view:?}");
    assert!(view.holdings.iter().any(|h| h.region == "region-a" && !h.reachable), "{view:?}");

    // The fetched prefix is usable in C: its engine's next turn loads it.
    let mut eng_c = cl.engine(2).await;
    let mut next = convos[2].clone();
    next.extend(tokens(5, 99));
    let warm = generate(&mut eng_c, &next, true).await;
    let cold = generate(&mut eng_c, &next, false).await;
    assert!(warm.loaded_tokens >= 640, "{warm:?}");
    assert_eq!((warm.new_tokens, warm.logits_digest), (cold.new_tokens, cold.logits_digest));
}
