//! What crosses the WAN to a peer (real processes: two `kvferry daemon`s over real QUIC +
//! mutual TLS, two `kvferry engine`s):
//! - concurrent migrations of one prefix share one fetch: the owner serves the bytes once,
//!   every migration succeeds, and the blocks are valid (B's next turn equals a recompute);
//! - per-peer tenant allow-lists (`peers[].tenants`): a tenant off the owner's list is refused
//!   by the owner, one off the requester's list is never asked for; both before any KV byte
//!   (the owner's served-bytes counter does not move), as PERMISSION_DENIED with the reason in
//!   `kvferry-reason`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{GenerateRequest, MigrateSessionRequest, PolicyMode};
use tonic::Code;
use tonic::transport::Channel;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_of_one_prefix_cross_the_wan_once() {
    // A's egress to B is capped (500 kB/s), so the first fetch lasts about 1.6 s and the
    // others are asked for while it is in flight.
    let a = RegionSpec { configure: Some(|c| c.peers[0].max_egress_gbps = 0.004), ..Default::default() };
    let b = RegionSpec { configure: Some(|c| c.transfer.chunk_bytes = 65_536), ..Default::default() };
    let cl = Cluster::start([a, b]);
    let (mut eng_a, mut eng_b) = (cl.engine(0).await, cl.engine(1).await);
    let mut router_b = cl.router(1).await;
    let convo = tokens(800, 31); // 50 full blocks once 4 tokens are generated
    let full = 50 * 16;
    generate(&mut eng_a, &convo, true).await;
    wait_for_source(&mut router_b, &request("s-probe", &convo, PolicyMode::Fetch)).await;
    let served_before = metric(&cl.metrics(0).await, "kvferry_served_bytes_total");

    const N: usize = 8;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..N {
        let (mut router, req) =
            (router_b.clone(), request(&format!("s-shared-{i}"), &convo, PolicyMode::Fetch));
        calls.spawn(async move { migrate(&mut router, req).await });
    }
    let results = calls.join_all().await;
    for (d, r) in &results {
        assert!(r.fallback.is_empty(), "{d:?} {r:?}");
        assert!(matches!(r.action.as_str(), "fetch" | "already_local"), "{r:?}");
        assert_eq!(r.tokens_ready, full, "{r:?}");
    }
    let leaders: Vec<_> = results.iter().filter(|(_, r)| r.action == "fetch" && !r.shared_fetch).collect();
    let joined = results.iter().filter(|(_, r)| r.shared_fetch).count();
    let local = results.iter().filter(|(_, r)| r.action == "already_local").count();
    assert_eq!(leaders.len(), 1, "exactly one migration moved the bytes: {results:?}");
    assert!(joined >= 1, "no migration joined the in-flight fetch: {results:?}");
    assert_eq!(leaders.len() + joined + local, N);
    for (_, r) in results.iter().filter(|(_, r)| r.shared_fetch) {
        assert_eq!((r.action.as_str(), r.bytes_moved), ("fetch", 0), "{r:?}");
        assert!(r.path.starts_with("joined an in-flight fetch"), "{r:?}");
    }
    let prefix_bytes = leaders[0].1.bytes_moved;
    assert!(prefix_bytes > 0);
    // The owner read the prefix once for the peer; the requester fetched it once.
    let ma = cl.metrics(0).await;
    assert_eq!(metric(&ma, "kvferry_served_bytes_total") - served_before, prefix_bytes as f64, "{ma}");
    let mb = cl.metrics(1).await;
    assert_eq!(metric(&mb, "kvferry_fetched_bytes_total"), prefix_bytes as f64, "{mb}");
    assert_eq!(metric(&mb, "kvferry_fetches_joined_total"), joined as f64, "{mb}");
    // The shared blocks are valid: B's next turn on them equals a full recompute.
    assert_warm_equals_cold(&mut eng_b, &convo, full).await;
    println!(
        "{N} concurrent migrations of one {prefix_bytes}-byte prefix: 1 fetched, {joined} joined, {local} already local; owner served {prefix_bytes} bytes"
    );
}

/// A's own residency count for `tenant`'s prefix reaches `want` tokens (bounded wait).
async fn wait_held_in_a(router_a: &mut MigrationClient<Channel>, tenant: &str, t: &[u32], want: u64) {
    let start = Instant::now();
    loop {
        let view = residency(router_a, tenant, t, &["region-b"]).await;
        if view.holdings.first().is_some_and(|h| h.region == "region-a" && h.tokens >= want) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "A never held {tenant}'s prefix: {view:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn generate_as(c: &mut ReferenceEngineClient<Channel>, tenant: &str, t: &[u32]) {
    let req =
        GenerateRequest { tenant: tenant.into(), token_ids: t.to_vec(), max_new_tokens: 4, use_cache: true };
    c.generate(req).await.unwrap();
}

fn as_tenant(tenant: &str, session: &str, t: &[u32], mode: PolicyMode) -> MigrateSessionRequest {
    MigrateSessionRequest { tenant: tenant.into(), ..request(session, t, mode) }
}

fn reason(s: &tonic::Status) -> Option<&str> {
    s.metadata().get("kvferry-reason").and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn peer_tenant_allow_lists_refuse_before_any_kv_byte_on_both_sides() {
    // A serves B only TENANT and "only-a-allows"; B exchanges only TENANT and "only-b-allows"
    // with A.
    let a = RegionSpec {
        configure: Some(|c| c.peers[0].tenants = Some(vec![TENANT.into(), "only-a-allows".into()])),
        ..Default::default()
    };
    let b = RegionSpec {
        configure: Some(|c| c.peers[0].tenants = Some(vec![TENANT.into(), "only-b-allows".into()])),
        ..Default::default()
    };
    let cl = Cluster::start([a, b]);
    let (mut eng_a, mut eng_b) = (cl.engine(0).await, cl.engine(1).await);
    let (mut router_a, mut router_b) = (cl.router(0).await, cl.router(1).await);
    let convo = tokens(320, 41); // 20 full blocks once 4 tokens are generated
    let full = 20 * 16;
    for tenant in [TENANT, "only-a-allows", "only-b-allows"] {
        generate_as(&mut eng_a, tenant, &convo).await;
        wait_held_in_a(&mut router_a, tenant, &convo, full).await;
    }

    // Allowed on both sides: fetched, valid.
    let (d, r) = migrate(&mut router_b, request("s-allowed", &convo, PolicyMode::Fetch)).await;
    assert_eq!((d.action.as_str(), r.action.as_str()), ("fetch", "fetch"), "{d:?} {r:?}");
    assert!(r.bytes_moved > 0 && r.tokens_ready == full, "{r:?}");
    assert_warm_equals_cold(&mut eng_b, &convo, full).await;
    let before = cl.metrics(0).await;
    let (served_bytes, served_requests) =
        (metric(&before, "kvferry_served_bytes_total"), metric(&before, "kvferry_served_requests_total"));

    // Off the owner's list: B asks, A refuses the query before reading anything.
    let Err(e) = router_b
        .migrate_session(as_tenant("only-b-allows", "s-owner-refuses", &convo, PolicyMode::Fetch))
        .await
    else {
        panic!("a tenant off the owner's list was served");
    };
    assert_eq!((e.code(), reason(&e)), (Code::PermissionDenied, Some("peer_refused_tenant")), "{e:?}");
    assert!(e.message().contains("region-a refused"), "{e:?}");
    let ma = cl.metrics(0).await;
    assert_eq!(metric(&ma, "kvferry_tenant_denied_total{side=\"serve\"}"), 1.0, "{ma}");

    // Off the requester's list: B refuses at once, A is never asked.
    let Err(e) = router_b
        .migrate_session(as_tenant("only-a-allows", "s-requester-refuses", &convo, PolicyMode::Fetch))
        .await
    else {
        panic!("a tenant off the requester's list was fetched");
    };
    assert_eq!(
        (e.code(), reason(&e)),
        (Code::PermissionDenied, Some("tenant_not_allowed_for_peer")),
        "{e:?}"
    );
    // Without a named source, A is not asked either: B recomputes, and says why.
    let auto = MigrateSessionRequest {
        source_region: String::new(),
        ..as_tenant("only-a-allows", "s-auto", &convo, PolicyMode::Auto)
    };
    let (d, r) = migrate(&mut router_b, auto).await;
    assert_eq!((d.action.as_str(), r.action.as_str(), r.bytes_moved), ("recompute", "recompute", 0), "{d:?}");
    assert!(
        d.holdings.iter().any(|h| h.region == "region-a" && !h.reachable && h.note.contains("not asked")),
        "{d:?}"
    );
    let mb = cl.metrics(1).await;
    assert_eq!(metric(&mb, "kvferry_tenant_denied_total{side=\"fetch\"}"), 2.0, "{mb}");

    // Not one KV byte left A for the refused tenants, and A saw no request of the second.
    let ma = cl.metrics(0).await;
    assert_eq!(metric(&ma, "kvferry_served_bytes_total"), served_bytes, "{ma}");
    assert_eq!(metric(&ma, "kvferry_served_requests_total"), served_requests, "{ma}");
    assert_eq!(metric(&ma, "kvferry_tenant_denied_total{side=\"serve\"}"), 1.0, "{ma}");
    println!(
        "allow-lists: 1 tenant fetched; 1 refused by the owner, 2 by the requester; 0 KV bytes served for them"
    );
}
