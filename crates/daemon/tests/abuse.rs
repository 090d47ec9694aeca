//! Regression tests for the attacks of issue 15, each against real daemons (started in this
//! process, on loopback and Unix sockets in a temp dir) with real clients: raw sockets, raw
//! HTTP/2 (a zero flow-control window), tonic, the reference engine's pool sharing. Each test
//! names the row it closes.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvferry_daemon::Config;
use kvferry_daemon::config::Peer;
use kvferry_engine_node::daemon::{EventSink, Registration, register, share_pool};
use kvferry_engine_sdk::ShmPool;
use kvferry_proto::v1::engine_event::Event;
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::{
    BlockStored, EngineEvent, GetLinksRequest, LookupRequest, MigrateSessionRequest, PolicyMode,
    PoolLayoutSpec, PublishRequest, ShmAccess, register_pool_request,
};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint};

mod common;

use common::abuse::*;

/// The tests count this process's fds and memfd mappings: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Row "idle client on pool.sock": one silent client must not block other offers, and is
/// itself closed after `limits.pool_offer_timeout_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_pool_socket_client_blocks_no_other_offer() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), "region-a");
    cfg.limits.pool_offer_timeout_ms = 1_000;
    let _d = common::start(&cfg).await;
    let mut idle = StdUnixStream::connect(cfg.pool_socket()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let (_pool, _stream, _lease) = register_shm(&cfg, "e0", common::spec()).await;
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "an offer waited {:?} behind a silent client",
        t0.elapsed()
    );
    idle.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t1 = Instant::now();
    let mut reply = String::new();
    let _ = idle.read_to_string(&mut reply);
    assert!(t1.elapsed() < Duration::from_secs(5), "the silent client was held {:?}", t1.elapsed());
    assert!(reply.starts_with("error:"), "the silent client is told why: {reply:?}");
}

/// Row "shm offers never claimed": offers expire after `limits.pool_offer_ttl_ms` (fds closed,
/// mappings unmapped), and at most `limits.max_pending_pool_offers` wait at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unclaimed_shm_offers_expire_closing_their_fds_and_mappings() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), "region-a");
    (cfg.limits.pool_offer_ttl_ms, cfg.limits.max_pending_pool_offers) = (1_000, 8);
    let d = common::start(&cfg).await;
    let (fds0, maps0) = (fds(), memfd_maps());
    let layout = kvferry_daemon::engine_api::layout_of(&common::spec()).unwrap();
    let mut tokens = Vec::new();
    for i in 0..9 {
        // The engine side shares its pool and goes away: only the daemon's copy stays.
        let pool = ShmPool::create(layout.clone()).unwrap();
        let r = tokio::task::block_in_place(|| share_pool(&cfg.run_dir, &pool, "m", Duration::from_secs(5)));
        match r {
            Ok((token, _stream)) => tokens.push(token),
            Err(e) => {
                assert_eq!(i, 8, "offer {i} refused: {e}");
                assert!(e.to_string().contains("waiting for RegisterPool"), "{e}");
            }
        }
    }
    assert_eq!(tokens.len(), 8, "the ninth offer is refused");
    assert_eq!(d.shared.registry.pending_pools(), 8);
    assert!(fds() >= fds0 + 8 && memfd_maps() >= maps0 + 8, "the daemon holds the offers");
    let t0 = Instant::now();
    while d.shared.registry.pending_pools() > 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "offers never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(t0.elapsed() >= Duration::from_millis(500), "offers expired early: {:?}", t0.elapsed());
    assert_eq!((fds(), memfd_maps()), (fds0, maps0), "every fd closed and mapping unmapped");
    let mut client = common::engine_client(&cfg).await;
    let reg = Registration {
        engine_id: "late".into(),
        model_id: "m".into(),
        layout: common::spec(),
        access: register_pool_request::Access::Shm(ShmAccess { pool_token: tokens[0].clone() }),
        profile: Some(common::profile()),
    };
    assert_eq!(register(&mut client, &reg).await.unwrap_err().code(), tonic::Code::NotFound);
}

/// Row "second Attach on a live lease": refused with FAILED_PRECONDITION; the engine holding
/// the lease keeps its stream and its commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_attach_on_a_live_lease_is_refused_and_the_first_untouched() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), "region-a");
    let d = common::start(&cfg).await;
    let (_pool, _stream, lease) = register_shm(&cfg, "e0", common::spec()).await;
    let (_events, first) = answering_engine(&cfg, &lease).await;
    let mut client = common::engine_client(&cfg).await;
    let (intruder, rx) = EventSink::new(lease.clone());
    intruder.load(0, 0.0, None);
    let e = client.attach(UnboundedReceiverStream::new(rx)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("already has a live Attach stream"), "{e}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!first.is_finished(), "the first engine's command stream must stay open");
    assert!(d.shared.registry.by_lease(&lease).is_some_and(|e| e.attached()));
    // The first engine still gets (and answers) commands.
    let mut r = router(d.grpc_addr).await;
    let rc =
        receipt(&mut r, request("s-attach", kvferry_engine_node::prompt(64, 512, 1), PolicyMode::Recompute))
            .await
            .unwrap();
    assert_eq!(rc.tokens_ready, 64);
}

/// Row "lease without Attach": a registration never attached expires after its announced
/// `lease_ttl_ms` (never 0), releasing its pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_never_attached_expires_as_announced() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), "region-a");
    cfg.limits.attach_grace_ms = 500;
    assert!(Config::parse("[limits]\nattach_grace_ms = 0").is_err(), "0 must not mean forever");
    let d = common::start(&cfg).await;
    let maps0 = memfd_maps();
    let layout = kvferry_daemon::engine_api::layout_of(&common::spec()).unwrap();
    let pool = ShmPool::create(layout).unwrap();
    let (token, stream) =
        tokio::task::block_in_place(|| share_pool(&cfg.run_dir, &pool, "m", Duration::from_secs(5))).unwrap();
    let mut client = common::engine_client(&cfg).await;
    let reg = Registration {
        engine_id: "e0".into(),
        model_id: "m".into(),
        layout: common::spec(),
        access: register_pool_request::Access::Shm(ShmAccess { pool_token: token }),
        profile: Some(common::profile()),
    };
    let resp = register(&mut client, &reg).await.unwrap();
    assert_eq!(resp.lease_ttl_ms, 500);
    drop((pool, stream));
    let t0 = Instant::now();
    while d.shared.registry.by_lease(&resp.lease_id).is_some() {
        assert!(t0.elapsed() < Duration::from_secs(5), "the unattached lease never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let e = client
        .lookup(LookupRequest { lease_id: resp.lease_id, tenant: TENANT.into(), token_ids: vec![1; 16] })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert_eq!(memfd_maps(), maps0, "the expired lease's pool is unmapped");
}

/// Row "out-of-range block ids in BlockStored": refused at ingest with INVALID_ARGUMENT, on
/// Publish and on the Attach stream; nothing of a refused batch is indexed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_block_ids_are_refused_at_ingest() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), "region-a");
    let d = common::start(&cfg).await;
    let (_pool, _stream, lease) = register_shm(&cfg, "e0", common::spec()).await;
    let (_events, _task) = answering_engine(&cfg, &lease).await;
    let tokens = kvferry_engine_node::prompt(32, 512, 2);
    let hashes = kvferry_daemon::engine_api::hashes_for(TENANT, &tokens, 16);
    let mut client = common::engine_client(&cfg).await;
    // Block id 8 of an 8-block pool, beside a valid one: the whole batch is refused.
    let bad = BlockStored {
        tenant: TENANT.into(),
        block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
        block_ids: vec![1, 8],
    };
    let e = client
        .publish(PublishRequest { lease_id: lease.clone(), stored: vec![bad.clone()], ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("block id 8 is past the pool's 8 blocks"), "{e}");
    let engine = d.shared.registry.by_lease(&lease).unwrap();
    assert!(engine.blocks.lock().unwrap().is_empty(), "nothing of the refused batch is indexed");
    let l = client
        .lookup(LookupRequest { lease_id: lease.clone(), tenant: TENANT.into(), token_ids: tokens.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(l.ready_tokens, 0);

    // The same batch on an Attach stream (a second engine): refused, the stream ends with
    // INVALID_ARGUMENT, nothing is indexed.
    let (_pool2, _stream2, lease2) = register_shm(&cfg, "e1", common::spec()).await;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(EngineEvent { lease_id: lease2.clone(), event: Some(Event::Stored(bad)) }).unwrap();
    let engine2 = d.shared.registry.by_lease(&lease2).unwrap();
    let mut commands = client.attach(UnboundedReceiverStream::new(rx)).await.unwrap().into_inner();
    let ended = tokio::time::timeout(Duration::from_secs(5), commands.message())
        .await
        .expect("the stream never ended");
    let e = ended.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(engine2.blocks.lock().unwrap().is_empty());
    assert!(d.shared.registry.by_lease(&lease2).is_none(), "the lease ended with its stream");
    drop(tx);
}

/// Captured log output of this test binary (one global subscriber, installed once).
fn captured_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        #[derive(Clone)]
        struct W(Arc<Mutex<Vec<u8>>>);
        impl Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let w = W(buf.clone());
        let sub = tracing_subscriber::fmt().with_ansi(false).with_writer(move || w.clone()).finish();
        tracing::subscriber::set_global_default(sub).unwrap();
        buf
    })
    .clone()
}

/// Row "session id size and content": ids longer than 256 bytes are refused with
/// INVALID_ARGUMENT; newlines and escape sequences in ids and tenants reach the log escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_ids_are_bounded_and_logged_escaped() {
    let _serial = SERIAL.lock().await;
    let log = captured_log();
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), "region-a");
    let d = common::start(&cfg).await;
    let (_pool, _stream, lease) = register_shm(&cfg, "e0", common::spec()).await;
    let (_events, _task) = answering_engine(&cfg, &lease).await;
    let mut r = router(d.grpc_addr).await;
    let tokens = kvferry_engine_node::prompt(32, 512, 3);
    for (len, refused) in [(3 << 20, true), (257, true), (256, false)] {
        let req = request(&"s".repeat(len), tokens.clone(), PolicyMode::Recompute);
        let res = r.plan_migration(req).await;
        assert_eq!(
            res.as_ref().err().map(|e| e.code()) == Some(tonic::Code::InvalidArgument),
            refused,
            "{len}: {res:?}"
        );
    }
    let forged = "s1\nERROR kvferry_daemon: forged line";
    let mut req = request(forged, tokens, PolicyMode::Recompute);
    req.tenant = "t\u{1b}[31mred\u{1b}[0m".into();
    let rc = receipt(&mut r, req).await.unwrap();
    assert_eq!(rc.tokens_ready, 32);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let text = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    assert!(text.contains("migration done"), "the migration was logged:\n{text}");
    assert!(
        text.contains(r#"s1\nERROR kvferry_daemon: forged line"#),
        "the session id is logged escaped:\n{text}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("ERROR kvferry_daemon: forged")),
        "a forged log line:\n{text}"
    );
    assert!(!text.contains('\u{1b}'), "a raw escape sequence reached the log");
}

