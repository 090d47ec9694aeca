//! Eviction hints end to end (real processes): region A's engine has a small pool; after B
//! fetched a whole conversation out of it while the pool was under pressure, A's daemon hints
//! A's engine to evict those blocks, and the engine does (its next turn finds nothing cached).
//! Below the pressure threshold no hint is sent.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvferry_proto::v1::{PolicyMode, migration_event};

async fn fetch(
    router: &mut kvferry_proto::v1::migration_client::MigrationClient<tonic::transport::Channel>,
    session: &str,
    t: &[u32],
) {
    let req = request(session, t, PolicyMode::Fetch);
    wait_for_source(router, &req).await;
    let mut s = router.migrate_session(req).await.unwrap().into_inner();
    let mut receipt = None;
    while let Some(ev) = s.message().await.unwrap() {
        if let Some(migration_event::Event::Receipt(r)) = ev.event {
            receipt = Some(r);
        }
    }
    let r = receipt.expect("a receipt");
    assert_eq!(r.action, "fetch", "{r:?}");
    assert!(r.fallback.is_empty(), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chain_served_in_full_under_pool_pressure_is_hinted_for_eviction() {
    let a = RegionSpec {
        configure: Some(|c| c.policy.eviction_hint_pool_use = 0.5),
        engine_args: vec!["--num-blocks".into(), "64".into()],
        ..Default::default()
    };
    let cl = Cluster::start([a, RegionSpec::default()]);
    let mut eng_a = cl.engine(0).await;
    let mut router_b = cl.router(1).await;

    // 1. Pool use 9/64: served in full, but no pressure, so no hint; A keeps its cache.
    let small = tokens(160, 31);
    generate(&mut eng_a, &small, true).await;
    fetch(&mut router_b, "s-small", &small).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m = cl.metrics(0).await;
    assert_eq!(metric(&m, "kvferry_eviction_hint_blocks_total"), 0.0, "{m}");
    assert!(!cl.log(0, "engine").contains("eviction hint"));

    // 2. Pool use 9 + 37 of 64 >= 0.5: B takes the whole 37-block chain; A's engine is hinted.
    let big = tokens(600, 32);
    generate(&mut eng_a, &big, true).await;
    fetch(&mut router_b, "s-big", &big).await;
    let t = Instant::now();
    loop {
        let m = cl.metrics(0).await;
        if metric(&m, "kvferry_eviction_hint_blocks_total") == 37.0 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no eviction hint: {m}\n{}", cl.log(0, "daemon"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let t = Instant::now();
    while !cl.log(0, "engine").contains("eviction hint from the daemon") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the engine never got the hint: {}",
            cl.log(0, "engine")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The engine acted on it: the big chain is gone from A (its next turn computes it all),
    // the small one was not hinted and is still cached.
    let again = generate(&mut eng_a, &big, true).await;
    assert_eq!(again.loaded_tokens, 0, "A still had the hinted blocks cached: {again:?}");
    let kept = generate(&mut eng_a, &small, true).await;
    assert_eq!(kept.loaded_tokens, 144, "the unhinted chain should still be cached: {kept:?}");
}
