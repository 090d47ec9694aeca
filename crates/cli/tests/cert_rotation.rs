//! Certificate rotation without a restart, with real processes (two `kvferry daemon`s, two
//! `kvferry engine`s), real QUIC and mutual TLS, and identity files rotated the way the kubelet
//! rotates a cert-manager Secret (an atomic `..data` symlink swap, [`write_secret`]).
//!
//! B polls its files (`tls.reload_poll_ms`); A polls never and is told with SIGHUP. B moves to a
//! new CA while a fetch from A is running: the fetch finishes on its connection, and the next
//! migration cannot reach A (A's certificate is from the CA B dropped) and recomputes. A then
//! rotates too, and fetches work again. A broken certificate written into B's Secret is refused
//! with an error log line; B keeps its identity and keeps accepting new peer connections.
//! The router listener's files rotate as well: a router with the old client CA is refused, one
//! with the new CA is served.

mod common;

use std::time::Duration;

use common::*;
use kvferry_proto::v1::{Decision, MigrateSessionRequest, PolicyMode, Receipt, migration_event};
use tonic::transport::Channel;

async fn migrate(
    cl: &Cluster,
    router: &mut kvferry_proto::v1::migration_client::MigrationClient<Channel>,
    req: MigrateSessionRequest,
    target: usize,
) -> (Decision, Receipt, bool) {
    let mut stream = router.migrate_session(req).await.unwrap().into_inner();
    let (mut decision, mut receipt, mut moving) = (None, None, false);
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(40), stream.message())
        .await
        .expect("the migration stream stalled")
        .unwrap_or_else(|e| panic!("MigrateSession failed: {e}\n--- daemon:\n{}", cl.log(target, "daemon")))
    {
        match ev.event {
            Some(migration_event::Event::Decision(d)) => decision = Some(d),
            Some(migration_event::Event::Progress(p)) if p.bytes_done > 0 && p.bytes_done < p.bytes_total => {
                moving = true
            }
            Some(migration_event::Event::Receipt(r)) => receipt = Some(r),
            _ => {}
        }
    }
    (decision.expect("a decision"), receipt.expect("a receipt"), moving)
}

const PEER_OK: &str = "kvferry_tls_reloads_total{listener=\"peer\",result=\"ok\"}";
const PEER_REFUSED: &str = "kvferry_tls_reloads_total{listener=\"peer\",result=\"refused\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn peer_certificates_rotate_under_running_daemons() {
    let a = RegionSpec {
        configure: Some(|c| {
            peer_identity_from_files(c);
            c.tls.reload_poll_ms = 0; // SIGHUP only
            // A slow link out of A, so that B's first fetch is still running when B rotates.
            c.peers[0].max_egress_gbps = 0.002;
        }),
        ..Default::default()
    };
    let b = RegionSpec {
        configure: Some(|c| {
            peer_identity_from_files(c);
            c.tls.reload_poll_ms = 100;
            c.transfer.chunk_bytes = 65_536;
        }),
        ..Default::default()
    };
    let cl = Cluster::start([a, b]);
    let (mut eng_a, mut eng_b) = (cl.engine(0).await, cl.engine(1).await);
    let (mut router_a, mut router_b) = (cl.router(0).await, cl.router(1).await);

    // 1. B rotates to a new CA (bundle: the new CA only) while a fetch from A runs.
    let convo = tokens(640, 1); // 40 blocks, 640 KiB: ~2.5 s at A's 250 kB/s
    generate(&mut eng_a, &convo, true).await;
    let req = request("s-rotate-1", &convo, PolicyMode::Fetch);
    wait_for_source(&mut router_b, &req).await;
    let ca2 = tempfile::tempdir().unwrap();
    let pki2 = kvferry_peer::DevPki::load_or_create(ca2.path(), "kvferry.e2e").unwrap();
    let fetch = {
        let mut r = router_b.clone();
        tokio::spawn(async move {
            let mut s = r.migrate_session(req).await.unwrap().into_inner();
            let mut events = Vec::new();
            while let Some(ev) = s.message().await.unwrap() {
                events.push(ev);
            }
            events
        })
    };
    // Rotate once the transfer has started moving bytes (B's landing progress).
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!fetch.is_finished(), "the fetch ended before the rotation; make it slower");
    identity_secret(&cl.dir(1).join("peer-tls"), &pki2, "region-b");
    cl.wait_metric(1, PEER_OK, 1.0).await;
    let events = fetch.await.unwrap();
    let receipt = events
        .iter()
        .find_map(|e| match &e.event {
            Some(migration_event::Event::Receipt(r)) => Some(r.clone()),
            _ => None,
        })
        .expect("a receipt");
    assert_eq!(receipt.action, "fetch", "the established transfer was cut by the rotation: {receipt:?}");
    assert!(receipt.fallback.is_empty() && receipt.reconnects == 0, "{receipt:?}");
    assert_eq!(receipt.bytes_moved, 40 * 1024 * 16, "{receipt:?}");

    // 2. A new migration dials A again and refuses A's certificate (old CA): recompute.
    let convo2 = tokens(160, 2);
    generate(&mut eng_a, &convo2, true).await;
    let (d, r, _) = migrate(&cl, &mut router_b, request("s-rotate-2", &convo2, PolicyMode::Fetch), 1).await;
    assert_eq!((d.action.as_str(), r.bytes_moved), ("recompute", 0), "{d:?} {r:?}");
    assert!(d.reason.contains("region-a"), "the decision names the unreachable source: {d:?}");

    // 3. A rotates to the new CA too, told by SIGHUP; fetches work again, on new connections.
    identity_secret(&cl.dir(0).join("peer-tls"), &pki2, "region-a");
    cl.sighup("daemon region-a");
    cl.wait_metric(0, PEER_OK, 1.0).await;
    let convo2 = tokens(160, 5); // the last one is local now (recomputed)
    generate(&mut eng_a, &convo2, true).await;
    let req = request("s-rotate-3", &convo2, PolicyMode::Fetch);
    wait_for_source(&mut router_b, &req).await;
    let (d, r, _) = migrate(&cl, &mut router_b, req, 1).await;
    assert_eq!((d.action.as_str(), r.action.as_str()), ("fetch", "fetch"), "{d:?} {r:?}");
    assert_eq!(r.bytes_moved, 10 * 1024 * 16, "{r:?}");

    // 4. A broken certificate in B's Secret is refused; B keeps its (new-CA) identity.
    let (_, key) = pki2.issue("region-b").unwrap().to_pem();
    write_secret(
        &cl.dir(1).join("peer-tls"),
        &[
            ("ca.crt", &pki2.ca_pem()),
            ("tls.crt", "-----BEGIN CERTIFICATE-----\ngarbage\n"),
            ("tls.key", &key),
        ],
    );
    cl.wait_metric(1, PEER_REFUSED, 1.0).await;
    assert_eq!(metric(&cl.metrics(1).await, PEER_OK), 1.0);
    assert!(
        cl.log(1, "daemon").contains("refused the new TLS files"),
        "no error line for the refused files:\n{}",
        cl.log(1, "daemon")
    );
    // B still accepts new peer connections with the kept identity: A dials B for a session
    // that lives in B (A's connection cache has no connection to B yet).
    let convo3 = tokens(160, 3);
    generate(&mut eng_b, &convo3, true).await;
    let mut req = request("s-rotate-4", &convo3, PolicyMode::Fetch);
    req.source_region = "region-b".into();
    wait_for_source(&mut router_a, &req).await;
    let (d, r, _) = migrate(&cl, &mut router_a, req, 0).await;
    assert_eq!((d.action.as_str(), r.action.as_str()), ("fetch", "fetch"), "{d:?} {r:?}");
    // And B still fetches from A.
    let convo4 = tokens(160, 4);
    generate(&mut eng_a, &convo4, true).await;
    let req = request("s-rotate-5", &convo4, PolicyMode::Fetch);
    wait_for_source(&mut router_b, &req).await;
    let (_, r, _) = migrate(&cl, &mut router_b, req, 1).await;
    assert_eq!(r.action, "fetch", "{r:?}");
}
