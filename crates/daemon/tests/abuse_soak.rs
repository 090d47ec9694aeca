//! The fault-and-abuse soak (skeleton of issue 15's suite): one real daemon (in this test
//! process, alone in it, so the process's fd and RSS figures are the daemon's plus the
//! test's own bounded clients), attacked round after round on every stream listener — idle,
//! half-open and flooding connections on the router port, the Engine API socket, `pool.sock`
//! and HTTP; unclaimed shm offers; oversized, malformed and forged requests; a second Attach;
//! out-of-range blocks — while a legitimate router and engine keep migrating. Every round's
//! legitimate calls must succeed; at the end the attackers' connections must have been closed
//! by the daemon's bounds and fds and RSS must be back near their warm level.
//!
//! Prints one headline line, `abuse cases N, legitimate calls M (failed 0), daemon serving
//! yes, fds growth X, RSS growth Y MiB, over S s`. Runs `KVFERRY_ABUSE_SECS` seconds (default
//! 20; CI); longer on demand: `KVFERRY_ABUSE_SECS=600 cargo test -p kvferry-daemon --test
//! abuse_soak -- --nocapture`.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::time::{Duration, Instant};

use kvferry_engine_node::daemon::{EventSink, share_pool};
use kvferry_engine_sdk::ShmPool;
use kvferry_proto::v1::{BlockStored, GetLinksRequest, LookupRequest, PolicyMode, PublishRequest};
use tokio_stream::wrappers::UnboundedReceiverStream;

mod common;

use common::abuse::*;

/// HTTP GET `path` on `addr`: the status code.
async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes()).await?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out)).await??;
    out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| std::io::Error::other(out))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_soak_every_listener_while_legitimate_calls_keep_working() {
    let secs: u64 = std::env::var("KVFERRY_ABUSE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), "region-a");
    cfg.auth.bearer_token = "soak-token".into();
    (cfg.listeners.max_connections, cfg.listeners.handshake_timeout_ms, cfg.listeners.idle_timeout_ms) =
        (32, 500, 2_000);
    (cfg.limits.pool_offer_timeout_ms, cfg.limits.pool_offer_ttl_ms, cfg.limits.max_pending_pool_offers) =
        (500, 1_000, 8);
    cfg.limits.stream_stall_ms = 1_000;
    let d = common::start(&cfg).await;
    let (_pool, _pool_stream, lease) = register_shm(&cfg, "e0", common::spec()).await;
    let (_events, _engine) = answering_engine(&cfg, &lease).await;
    let mut engine_api = common::engine_client(&cfg).await;
    let layout = kvferry_daemon::engine_api::layout_of(&common::spec()).unwrap();

    let (mut cases, mut legit, mut failed) = (0u64, 0u64, Vec::<String>::new());
    let mut warm: Option<(usize, u64)> = None;
    let t0 = Instant::now();
    let mut round = 0u64;
    while t0.elapsed() < Duration::from_secs(secs) || round < 2 {
        round += 1;
        // --- attacks ---
        let idle_tcp: Vec<std::net::TcpStream> =
            (0..64).filter_map(|_| std::net::TcpStream::connect(d.grpc_addr).ok()).collect();
        let mut half_open: Vec<std::net::TcpStream> =
            (0..8).filter_map(|_| std::net::TcpStream::connect(d.grpc_addr).ok()).collect();
        for s in &mut half_open {
            let _ = s.write_all(b"PRI * HTTP/2.0\r\n"); // half a preface, then silence
        }
        let idle_uds: Vec<StdUnixStream> =
            (0..64).filter_map(|_| StdUnixStream::connect(cfg.engine_socket()).ok()).collect();
        let idle_pool: Vec<StdUnixStream> =
            (0..4).filter_map(|_| StdUnixStream::connect(cfg.pool_socket()).ok()).collect();
        let mut slow_http: Vec<std::net::TcpStream> =
            (0..16).filter_map(|_| std::net::TcpStream::connect(d.http_addr).ok()).collect();
        for s in &mut slow_http {
            let _ = s.write_all(b"GET /metr"); // never finished
        }
        cases += 6;
        // Unclaimed shm offers.
        for _ in 0..2 {
            let p = ShmPool::create(layout.clone()).unwrap();
            let _ = tokio::task::block_in_place(|| {
                share_pool(&cfg.run_dir, &p.share_handle().unwrap(), "m", Duration::from_secs(5))
            });
            cases += 1;
        }
        let mut r = router(d.grpc_addr).await;
        // Oversized, unauthenticated, oversized id, forged log line.
        let mut big = tonic::Request::new(request("big", vec![1 << 21; 1_200_000], PolicyMode::Recompute));
        bearer(&mut big);
        let c = r.plan_migration(big).await.err().map(|e| e.code());
        expect(&mut failed, "oversized", c == Some(tonic::Code::ResourceExhausted), &c);
        let c = r.get_links(GetLinksRequest {}).await.err().map(|e| e.code());
        expect(&mut failed, "no token", c == Some(tonic::Code::Unauthenticated), &c);
        let mut long = tonic::Request::new(request(&"x".repeat(4096), vec![1; 32], PolicyMode::Recompute));
        bearer(&mut long);
        let c = r.plan_migration(long).await.err().map(|e| e.code());
        expect(&mut failed, "long session id", c == Some(tonic::Code::InvalidArgument), &c);
        cases += 3;
        // Out-of-range blocks, a second Attach.
        let bad =
            BlockStored { tenant: TENANT.into(), block_hashes: vec![vec![7; 32]], block_ids: vec![1 << 20] };
        let c = engine_api
            .publish(PublishRequest { lease_id: lease.clone(), stored: vec![bad], ..Default::default() })
            .await
            .err()
            .map(|e| e.code());
        expect(&mut failed, "out-of-range block", c == Some(tonic::Code::InvalidArgument), &c);
        let (intruder, rx) = EventSink::new(lease.clone());
        intruder.load(0, 0.0, None);
        let c = engine_api.attach(UnboundedReceiverStream::new(rx)).await.err().map(|e| e.code());
        expect(&mut failed, "second attach", c == Some(tonic::Code::FailedPrecondition), &c);
        cases += 2;

        // --- legitimate calls, with every attack above still in place ---
        let mut links = tonic::Request::new(GetLinksRequest {});
        bearer(&mut links);
        let ok = r.get_links(links).await.is_ok();
        expect(&mut failed, "GetLinks", ok, &round);
        let tokens = kvferry_engine_node::prompt(32, 512, round);
        let ok = engine_api
            .lookup(LookupRequest {
                lease_id: lease.clone(),
                tenant: TENANT.into(),
                token_ids: tokens.clone(),
            })
            .await
            .is_ok();
        expect(&mut failed, "Lookup", ok, &round);
        let mut m = tonic::Request::new(request(&format!("soak-{round}"), tokens, PolicyMode::Recompute));
        bearer(&mut m);
        let rc = async {
            let mut s = r.migrate_session(m).await?.into_inner();
            while let Some(ev) = s.message().await? {
                if let Some(kvferry_proto::v1::migration_event::Event::Receipt(rc)) = ev.event {
                    return Ok(rc);
                }
            }
            Err(tonic::Status::unknown("no receipt"))
        }
        .await;
        expect(&mut failed, "MigrateSession", rc.as_ref().is_ok_and(|rc| rc.tokens_ready == 32), &rc);
        let code = http_get(d.http_addr, "/healthz").await.ok();
        expect(&mut failed, "/healthz", code == Some(200), &code);
        legit += 4;

        // The attackers give up; the next round starts fresh. Their daemon-side fds must go.
        drop((idle_tcp, half_open, idle_uds, idle_pool, slow_http));
        if round == 1 {
            tokio::time::sleep(Duration::from_secs(2)).await;
            warm = Some((fds(), rss_bytes()));
        }
    }
    // Let every bound expire (handshake, pool offers, their TTL), then measure.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let (fds0, rss0) = warm.unwrap();
    let (fds1, rss1) = (fds(), rss_bytes());
    let fd_growth = fds1 as i64 - fds0 as i64;
    let rss_growth_mib = (rss1 as f64 - rss0 as f64) / f64::from(1 << 20);
    let serving = router(d.grpc_addr).await.get_links(GetLinksRequest {}).await.err().map(|e| e.code())
        == Some(tonic::Code::Unauthenticated);
    println!(
        "abuse cases {cases}, legitimate calls {legit} (failed {}), daemon serving {}, fds growth {fd_growth}, \
         RSS growth {rss_growth_mib:.1} MiB, over {:.0} s",
        failed.len(),
        if serving { "yes" } else { "no" },
        t0.elapsed().as_secs_f64()
    );
    assert!(failed.is_empty(), "failed: {failed:#?}");
    assert!(serving, "the daemon stopped serving");
    assert!(fd_growth <= 4, "fds grew by {fd_growth} ({fds0} -> {fds1})");
    assert!(rss_growth_mib < 64.0, "RSS grew by {rss_growth_mib:.1} MiB");
    assert_eq!(d.shared.registry.pending_pools(), 0, "unclaimed offers outlived their TTL");
}

fn bearer<T>(req: &mut tonic::Request<T>) {
    req.metadata_mut().insert("authorization", "Bearer soak-token".parse().unwrap());
}

fn expect(failed: &mut Vec<String>, what: &str, ok: bool, detail: &dyn std::fmt::Debug) {
    if !ok {
        failed.push(format!("{what}: {detail:?}"));
    }
}
