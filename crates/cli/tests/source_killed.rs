//! The source region dies in the middle of a fetch (real processes: two `kvferry daemon`s and
//! two `kvferry engine`s). Region A caps its egress to B (`peers[].max_egress_gbps`) so the
//! fetch takes seconds; once progress events show verified bytes landing in B, A's daemon is
//! SIGKILLed. B must answer within the deadline with a recompute (the fallback), its engine
//! must have run the recompute, its landing zone must hold nothing of the aborted transfer,
//! and it must keep serving.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvferry_proto::v1::{GetLinksRequest, PolicyMode, migration_event};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn source_killed_mid_fetch_falls_back_to_recompute() {
    let a = RegionSpec { configure: Some(|c| c.peers[0].max_egress_gbps = 0.002), ..Default::default() };
    let b = RegionSpec {
        configure: Some(|c| (c.transfer.chunk_bytes, c.transfer.idle_timeout_ms) = (65_536, 1_000)),
        ..Default::default()
    };
    let mut cl = Cluster::start([a, b]);
    let (mut eng_a, mut eng_b) = (cl.engine(0).await, cl.engine(1).await);
    let mut router_b = cl.router(1).await;

    // 800 tokens = 50 full blocks, 800 KiB of KV; at A's 250 kB/s egress cap, about 3 s. (Kept
    // small: the fallback recompute must fit the deadline in a debug build too.)
    let convo = tokens(800, 7);
    let full = 50 * 16;
    generate(&mut eng_a, &convo, true).await;
    let mut req = request("s-killed", &convo, PolicyMode::Fetch);
    wait_for_source(&mut router_b, &req).await;
    let deadline = Duration::from_secs(20);
    req.deadline_ms = deadline.as_millis() as u64;

    let t0 = Instant::now();
    let mut stream = router_b.migrate_session(req).await.unwrap().into_inner();
    let (mut decision, mut receipt, mut killed_at) = (None, None, None);
    let mut progress_at_kill = (0, 0);
    while let Some(ev) = tokio::time::timeout(deadline + Duration::from_secs(5), stream.message())
        .await
        .expect("the migration stream stalled past the deadline")
        .unwrap_or_else(|e| {
            panic!(
                "MigrateSession ended in an error instead of a fallback: {e}\n--- B daemon:\n{}\n--- B engine:\n{}",
                cl.log(1, "daemon"),
                cl.log(1, "engine")
            )
        })
    {
        match ev.event {
            Some(migration_event::Event::Decision(d)) => decision = Some(d),
            Some(migration_event::Event::Progress(p)) if killed_at.is_none() && p.bytes_done > 0 => {
                assert!(p.bytes_done < p.bytes_total, "the fetch finished before the kill: {p:?}");
                progress_at_kill = (p.bytes_done, p.bytes_total);
                cl.kill("daemon region-a");
                killed_at = Some(Instant::now());
            }
            Some(migration_event::Event::Receipt(r)) => receipt = Some(r),
            _ => {}
        }
    }
    let answered = Instant::now();
    let (d, r) = (decision.expect("a decision"), receipt.expect("a receipt"));
    let killed_at = killed_at.expect("no progress event showed bytes moving before the answer");
    println!(
        "killed after {:.2} s at {} of {} bytes; recompute answer {:.2} s after the kill ({:.2} s after the request); receipt: {r:?}",
        (killed_at - t0).as_secs_f64(),
        progress_at_kill.0,
        progress_at_kill.1,
        (answered - killed_at).as_secs_f64(),
        (answered - t0).as_secs_f64()
    );
    assert_eq!(d.action, "fetch", "{d:?}");
    assert!(answered - t0 < deadline, "answered after the deadline: {:?}", answered - t0);
    assert_eq!(r.action, "recompute", "{r:?}");
    assert!(r.fallback.contains("fetch failed"), "{r:?}");
    assert_eq!(r.bytes_moved, 0, "{r:?}");
    assert!(r.tokens_ready >= full, "{r:?}");

    // Nothing of the aborted transfer is visible: B's landing zone holds no byte, reserves none.
    let m = cl.metrics(1).await;
    assert_eq!(metric(&m, "kvferry_landing_zone_bytes{state=\"used\"}"), 0.0, "{m}");
    assert_eq!(metric(&m, "kvferry_landing_zone_bytes{state=\"reserved\"}"), 0.0, "{m}");
    assert_eq!(metric(&m, "kvferry_fallbacks_total"), 1.0, "{m}");
    assert_eq!(metric(&m, "kvferry_fetched_bytes_total"), 0.0, "{m}");

    // B's engine ran the recompute: the prefix is in its own pool, and the next turn (warm) is
    // bit-identical to a full recompute.
    assert!(cl.log(1, "engine").contains("recompute done"), "{}", cl.log(1, "engine"));
    assert_warm_equals_cold(&mut eng_b, &convo, full).await;

    // B keeps serving: links (A now disconnected) and a fresh plan, which recomputes.
    let links = router_b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    assert_eq!(links.links.len(), 1, "{links:?}");
    let other = tokens(400, 8);
    let t = Instant::now();
    let plan =
        router_b.plan_migration(request("s-after", &other, PolicyMode::Auto)).await.unwrap().into_inner();
    assert_eq!(plan.action, "recompute", "{plan:?}");
    assert!(t.elapsed() < Duration::from_secs(12), "PlanMigration took {:?}", t.elapsed());
}
