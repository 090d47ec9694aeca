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
    // This test counts the process's fds: no host-CPU sampler opening /proc files meanwhile.
    cfg.policy.split_cpu_floor = false;
    let d = common::start(&cfg).await;
    // Only memfds are counted: the offers are memfds; sockets that other work opens meanwhile
    // are not this test's to count.
    let (fds0, maps0) = (memfd_fds(), memfd_maps());
    let layout = kvferry_daemon::engine_api::layout_of(&common::spec()).unwrap();
    let mut tokens = Vec::new();
    for i in 0..9 {
        // The engine side shares its pool and goes away: only the daemon's copy stays.
        let pool = ShmPool::create(layout.clone()).unwrap();
        let r = tokio::task::block_in_place(|| {
            share_pool(&cfg.run_dir, &pool.share_handle().unwrap(), "m", Duration::from_secs(5))
        });
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
    assert!(memfd_fds() >= fds0 + 8 && memfd_maps() >= maps0 + 8, "the daemon holds the offers");
    let t0 = Instant::now();
    while d.shared.registry.pending_pools() > 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "offers never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(t0.elapsed() >= Duration::from_millis(500), "offers expired early: {:?}", t0.elapsed());
    assert_eq!((memfd_fds(), memfd_maps()), (fds0, maps0), "every memfd closed and mapping unmapped");
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

/// One region (default limits) with one shm engine `e0` attached that answers every
/// Recompute at once; holds the tests' serial lock while it lives.
struct EngineRegion {
    lease: String,
    /// The engine's task reading its commands (it ends when its Attach stream does).
    engine: tokio::task::JoinHandle<()>,
    _keep: (EventSink, StdUnixStream, ShmPool),
    d: kvferry_daemon::Daemon,
    cfg: Config,
    _dir: tempfile::TempDir,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

async fn engine_region() -> EngineRegion {
    let serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), "region-a");
    let d = common::start(&cfg).await;
    let (pool, stream, lease) = register_shm(&cfg, "e0", common::spec()).await;
    let (events, engine) = answering_engine(&cfg, &lease).await;
    EngineRegion { lease, engine, _keep: (events, stream, pool), d, cfg, _dir: dir, _serial: serial }
}

/// Row "second Attach on a live lease": refused with FAILED_PRECONDITION; the engine holding
/// the lease keeps its stream and its commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_attach_on_a_live_lease_is_refused_and_the_first_untouched() {
    let region = engine_region().await;
    let (d, cfg, lease, first) = (&region.d, &region.cfg, &region.lease, &region.engine);
    let mut client = common::engine_client(cfg).await;
    let (intruder, rx) = EventSink::new(lease.clone());
    intruder.load(0, 0.0, None);
    let e = client.attach(UnboundedReceiverStream::new(rx)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("already has a live Attach stream"), "{e}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!first.is_finished(), "the first engine's command stream must stay open");
    assert!(d.shared.registry.by_lease(lease).is_some_and(|e| e.attached()));
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
    let (pool, stream, resp) = register_shm_answer(&cfg, "e0", common::spec()).await;
    let mut client = common::engine_client(&cfg).await;
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
    let region = engine_region().await;
    let (d, cfg, lease) = (&region.d, &region.cfg, &region.lease);
    let tokens = kvferry_engine_node::prompt(32, 512, 2);
    let hashes = kvferry_daemon::engine_api::hashes_for(TENANT, &tokens, 16);
    let mut client = common::engine_client(cfg).await;
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
    let engine = d.shared.registry.by_lease(lease).unwrap();
    assert!(engine.blocks.lock().unwrap().is_empty(), "nothing of the refused batch is indexed");
    let l = client
        .lookup(LookupRequest { lease_id: lease.clone(), tenant: TENANT.into(), token_ids: tokens.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(l.ready_tokens, 0);

    // The same batch on an Attach stream (a second engine): refused, the stream ends with
    // INVALID_ARGUMENT, nothing is indexed.
    let (_pool2, _stream2, lease2) = register_shm(cfg, "e1", common::spec()).await;
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
    let region = engine_region().await;
    let log = captured_log();
    let d = &region.d;
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

/// Row "oversized request": a message over the decoding limit is answered RESOURCE_EXHAUSTED,
/// as the proto documents (unary and server streaming).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_request_is_resource_exhausted() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), "region-a");
    let d = common::start(&cfg).await;
    let mut r = router(d.grpc_addr).await;
    // 1.2 M tokens of 4 varint bytes each: ~4.8 MB, over tonic's 4 MiB decoding limit.
    let req = request("big", vec![1 << 21; 1_200_000], PolicyMode::Recompute);
    let e = r.plan_migration(req.clone()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
    let e = r.migrate_session(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
    // And the daemon still answers.
    r.get_links(GetLinksRequest {}).await.unwrap();
}

/// Row "reflection with a bearer token": reflection needs the token too, and describes only
/// the Migration service (not Engine or ReferenceEngine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_is_behind_the_token_and_describes_only_the_router_port() {
    let _serial = SERIAL.lock().await;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), "region-a");
    cfg.auth.bearer_token = "s3cret".into();
    let d = common::start(&cfg).await;
    let ch = Endpoint::from_shared(format!("http://{}", d.grpc_addr)).unwrap().connect().await.unwrap();
    async fn ask(
        ch: &Channel,
        token: Option<&str>,
        q: MessageRequest,
    ) -> Result<ServerReflectionResponse, tonic::Status> {
        let mut req = tonic::Request::new(tokio_stream::iter([ServerReflectionRequest {
            host: String::new(),
            message_request: Some(q),
        }]));
        if let Some(t) = token {
            req.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        let mut s = ServerReflectionClient::new(ch.clone()).server_reflection_info(req).await?.into_inner();
        s.message().await?.ok_or_else(|| tonic::Status::unknown("no answer"))
    }
    let list = || MessageRequest::ListServices(String::new());
    for token in [None, Some("wrong")] {
        let e = ask(&ch, token, list()).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{token:?}: {e}");
    }
    let r = ask(&ch, Some("s3cret"), list()).await.unwrap();
    let Some(MessageResponse::ListServicesResponse(l)) = r.message_response else { panic!("{r:?}") };
    let mut names: Vec<String> = l.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(names, ["grpc.reflection.v1.ServerReflection", "kvferry.v1.Migration"]);
    for hidden in ["kvferry.v1.Engine", "kvferry.v1.ReferenceEngine"] {
        let r = ask(&ch, Some("s3cret"), MessageRequest::FileContainingSymbol(hidden.into())).await;
        let described = matches!(
            &r,
            Ok(ServerReflectionResponse {
                message_response: Some(MessageResponse::FileDescriptorResponse(_)),
                ..
            })
        );
        assert!(!described, "{hidden} is described: {r:?}");
    }
    let r = ask(&ch, Some("s3cret"), MessageRequest::FileContainingSymbol("kvferry.v1.Migration".into()))
        .await
        .unwrap();
    let Some(MessageResponse::FileDescriptorResponse(f)) = r.message_response else { panic!("{r:?}") };
    use prost::Message;
    let file = prost_types::FileDescriptorProto::decode(f.file_descriptor_proto[0].as_slice()).unwrap();
    assert_eq!(file.service.iter().map(|s| s.name()).collect::<Vec<_>>(), ["Migration"]);
}

/// Opens `n` TCP connections to `addr` that send nothing.
fn idle_tcp(addr: SocketAddr, n: usize) -> Vec<std::net::TcpStream> {
    (0..n).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect()
}

/// Waits until every stream in `conns` reads EOF or an error (the daemon closed it).
fn all_closed_by_peer(conns: &mut [std::net::TcpStream], within: Duration) -> bool {
    let t0 = Instant::now();
    conns.iter_mut().all(|c| {
        let left = within.saturating_sub(t0.elapsed()).max(Duration::from_millis(10));
        c.set_read_timeout(Some(left)).unwrap();
        let mut b = [0u8; 256];
        loop {
            match c.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue, // HTTP/2 settings the server sent first
                Err(e) => {
                    return !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    );
                }
            }
        }
    })
}

/// Row "idle TCP on the router port" (plaintext, and the Engine API socket): with N idle
/// connections held (N over the cap), legitimate calls keep working, the daemon's fds stay
/// bounded by the cap, and the idle connections are closed after the handshake bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_capped_and_closed_and_calls_keep_working() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), "region-a");
    (cfg.listeners.max_connections, cfg.listeners.handshake_timeout_ms, cfg.listeners.idle_timeout_ms) =
        (16, 1_500, 3_000);
    let d = common::start(&cfg).await;
    let (_pool, _stream, lease) = register_shm(&cfg, "e0", common::spec()).await;
    let fds0 = fds();
    let n = 100;
    let mut idle = idle_tcp(d.grpc_addr, n);
    let idle_uds: Vec<StdUnixStream> =
        (0..n).map(|_| StdUnixStream::connect(cfg.engine_socket()).unwrap()).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = fds() - fds0 - 2 * n;
    assert!(held <= 2 * 16 + 4, "the daemon holds {held} fds for {} idle connections (cap 16 each)", 2 * n);
    // Legitimate calls on new connections work at once (they evict the idle ones).
    let t0 = Instant::now();
    let mut r = router(d.grpc_addr).await;
    r.get_links(GetLinksRequest {}).await.unwrap();
    let mut e = common::engine_client(&cfg).await;
    e.lookup(LookupRequest { lease_id: lease.clone(), tenant: TENANT.into(), token_ids: vec![1; 16] })
        .await
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2), "legitimate calls took {:?}", t0.elapsed());
    // The silent connections are closed after the handshake bound.
    assert!(all_closed_by_peer(&mut idle, Duration::from_secs(5)), "idle router connections left open");
    assert!(d.shared.router_conns.open() <= 1, "{}", d.shared.router_conns.open());
    // A connection with no request in flight is closed after the idle bound; the client's
    // channel reconnects by itself for the next call.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert_eq!(d.shared.router_conns.open(), 0);
    r.get_links(GetLinksRequest {}).await.unwrap();
    drop(idle_uds);
}

/// Row "idle TCP on the router TLS port": silent connections that never finish a handshake are
/// capped and closed, and a router with a valid certificate is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_on_the_tls_port_are_capped_and_a_router_is_served() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), "region-a");
    cfg.router_tls.mode = kvferry_daemon::config::RouterTlsMode::Dev;
    (cfg.listeners.max_connections, cfg.listeners.handshake_timeout_ms) = (16, 1_500);
    let d = common::start(&cfg).await;
    let fds0 = fds();
    let n = 100;
    let mut idle = idle_tcp(d.grpc_addr, n);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = fds() - fds0 - n;
    assert!(held <= 16 + 4, "the daemon holds {held} fds for {n} idle connections (cap 16)");
    let t0 = Instant::now();
    let ch = tls_channel(&cfg, d.grpc_addr).await;
    MigrationClient::new(ch).get_links(GetLinksRequest {}).await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "the router waited {:?}", t0.elapsed());
    assert!(all_closed_by_peer(&mut idle, Duration::from_secs(5)), "idle TLS connections left open");
}

/// A tonic channel over mutual TLS with the dev router client identity.
async fn tls_channel(cfg: &Config, addr: SocketAddr) -> Channel {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let dev = &cfg.tls.dev_dir;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(dev.join("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(dev.join("router-client.pem")).unwrap().map(|c| c.unwrap()).collect();
    let key = PrivateKeyDer::from_pem_file(dev.join("router-client.key")).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(kvferry_peer::tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let connector = connector.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let s = connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .unwrap()
}

/// A raw HTTP/2 MigrateSession whose client never opens its flow-control window: the server
/// can send it nothing. Returns the connection task (ends when the daemon closes it).
async fn zero_window_migration(addr: SocketAddr, req: &MigrateSessionRequest) -> tokio::task::JoinHandle<()> {
    use prost::Message;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut client, conn) = h2::client::Builder::new().initial_window_size(0).handshake(tcp).await.unwrap();
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let http_req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/kvferry.v1.Migration/MigrateSession"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut body) = client.send_request(http_req, false).unwrap();
    let msg = req.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    frame.extend_from_slice(&msg);
    body.send_data(prost::bytes::Bytes::from(frame), true).unwrap();
    // The response headers arrive (HEADERS frames are not flow-controlled); DATA never can.
    let resp = tokio::time::timeout(Duration::from_secs(10), resp).await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    // Keep the response (and the client) alive with the connection.
    tokio::spawn(async move {
        let _keep = (resp, client);
        std::future::pending::<()>().await;
    });
    task
}

/// Two regions for the zero-window rows: A holds a 1 MiB prefix (64 blocks of 16 KiB) and
/// serves B at most 4 Mbit/s, so each fetch takes ~2 s and sends progress events all along;
/// B allows 2 concurrent migrations and closes stalled streams after `stall_ms`. Holds the
/// tests' serial lock while it lives. Returns the daemons, what must stay alive, and B's
/// fetch request.
struct FetchRegions {
    _a: kvferry_daemon::Daemon,
    b: kvferry_daemon::Daemon,
    _keep: Vec<Box<dyn std::any::Any + Send>>,
    fetch: MigrateSessionRequest,
    /// The regions' run dirs, removed once the daemons above stopped.
    _dir: tempfile::TempDir,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

impl FetchRegions {
    /// Two routers that migrate [`FetchRegions::fetch`] in B and never read their streams.
    async fn zero_window_pair(&self) -> [tokio::task::JoinHandle<()>; 2] {
        [
            zero_window_migration(self.b.grpc_addr, &self.fetch).await,
            zero_window_migration(self.b.grpc_addr, &self.fetch).await,
        ]
    }
}

async fn fetch_regions(stall_ms: u64) -> FetchRegions {
    let serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let spec = PoolLayoutSpec { num_blocks: 64, ..common::spec() };
    // B's peer address is only known once A runs, and A's allow-list needs B's: start B once
    // for its address... both listen on fixed free ports instead.
    let (pa, pb) = (common::free_udp(), common::free_udp());
    let mut cfg_a = common::config(dir, "region-a");
    (cfg_a.listen.peer, cfg_a.peers) = (pa, vec![common::peer("region-b", pb, 0.004)]);
    let mut cfg_b = common::config(dir, "region-b");
    (cfg_b.listen.peer, cfg_b.peers) = (pb, vec![common::peer("region-a", pa, 0.0)]);
    (cfg_b.limits.max_concurrent_migrations, cfg_b.limits.stream_stall_ms) = (2, stall_ms);
    // Small chunks, so the pacing spreads each fetch out (one 4 MiB chunk would leave at once).
    (cfg_a.transfer.chunk_bytes, cfg_b.transfer.chunk_bytes) = (65_536, 65_536);
    let a = common::start(&cfg_a).await;
    let b = common::start(&cfg_b).await;
    let (pool_a, sa, lease_a) = register_shm(&cfg_a, "ea", spec.clone()).await;
    let (ea, ta) = answering_engine(&cfg_a, &lease_a).await;
    let (pool_b, sb, lease_b) = register_shm(&cfg_b, "eb", spec).await;
    let (eb, tb) = answering_engine(&cfg_b, &lease_b).await;
    let prompt = kvferry_engine_node::prompt(64 * 16, 512, 100);
    let hashes = kvferry_daemon::engine_api::hashes_for(TENANT, &prompt, 16);
    common::publish_chain(
        &mut common::engine_client(&cfg_a).await,
        &lease_a,
        TENANT,
        &hashes,
        (0..64).collect(),
    )
    .await;
    let mut fetch = request("zw", prompt, PolicyMode::Fetch);
    fetch.source_region = "region-a".into();
    let plan = router(b.grpc_addr).await.plan_migration(fetch.clone()).await.unwrap().into_inner();
    assert_eq!((plan.action.as_str(), plan.source_tokens), ("fetch", 64 * 16), "{plan:?}");
    let keep: Vec<Box<dyn std::any::Any + Send>> = vec![
        Box::new(pool_a),
        Box::new(sa),
        Box::new(ea),
        Box::new(ta),
        Box::new(pool_b),
        Box::new(sb),
        Box::new(eb),
        Box::new(tb),
    ];
    FetchRegions { _a: a, b, _keep: keep, fetch, _dir: tmp, _serial: serial }
}

/// Row "zero-window HTTP/2 client", first half: the migration slot belongs to the work. Two
/// routers that never read (zero receive window) take both slots; their streams are never
/// drained (the stall bound is far away), yet once their fetches end a reading router gets
/// its migration.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zero_window_clients_hold_no_migration_slot_past_the_work() {
    let f = fetch_regions(120_000).await;
    let t0 = Instant::now();
    let zw = f.zero_window_pair().await;
    let mut r = router(f.b.grpc_addr).await;
    let mut busy = 0;
    let rc = loop {
        match receipt(&mut r, f.fetch.clone()).await {
            Ok(rc) => break rc,
            Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                busy += 1;
                assert!(t0.elapsed() < Duration::from_secs(20), "the slots were never freed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(
        busy > 0,
        "the zero-window migrations held both slots while they worked: {rc:?} after {:?}",
        t0.elapsed()
    );
    assert_eq!(rc.tokens_ready, 64 * 16, "{rc:?}");
    assert!(zw.iter().all(|c| !c.is_finished()), "the zero-window connections are still open");
    while f.b.shared.migrations.available_permits() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(20), "a slot stayed held past its work");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Row "zero-window HTTP/2 client", second half: a stream that cannot take its events is
/// dropped after `limits.stream_stall_ms` (its connection closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_that_cannot_take_its_events_is_dropped_after_the_bound() {
    let f = fetch_regions(1_000).await;
    let t0 = Instant::now();
    let zw = f.zero_window_pair().await;
    for c in zw {
        tokio::time::timeout(Duration::from_secs(10), c)
            .await
            .expect("a stalled stream's connection stayed open")
            .unwrap();
    }
    assert!(t0.elapsed() >= Duration::from_millis(900), "closed before the bound: {:?}", t0.elapsed());
    assert_eq!(f.b.shared.router_conns.closed(kvferry_daemon::conn::CloseReason::Stalled), 2);
    // A router that reads is served as usual.
    let rc = receipt(&mut router(f.b.grpc_addr).await, f.fetch.clone()).await;
    assert!(rc.is_ok() || rc.as_ref().is_err_and(|e| e.code() == tonic::Code::ResourceExhausted), "{rc:?}");
}

/// Row "abandoned recompute": a recompute the daemon gives up on at its deadline is cancelled
/// in the engine (the real reference engine, in this process), which acknowledges it and is
/// free for other work at once instead of finishing the abandoned prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abandoned_recompute_is_cancelled_in_the_engine() {
    let _serial = SERIAL.lock().await;
    use kvferry_engine_node::config::NodeConfig;
    use kvferry_engine_node::node::EngineNode;
    use kvferry_proto::v1::GenerateRequest;
    use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), "region-a");
    let d = common::start(&cfg).await;
    let mut ncfg = NodeConfig::new(&cfg.run_dir, "e0", cfg.run_dir.join("e0.ctl"));
    ncfg.num_blocks = 512;
    (ncfg.profile.contexts, ncfg.profile.chunk, ncfg.profile.repeats) = (vec![0, 32], 16, 1);
    let node = EngineNode::start(ncfg).await.unwrap();
    let model = node.info().model_id.clone();
    let mut ctl = ReferenceEngineClient::new(
        kvferry_engine_node::daemon::connect_uds(&cfg.run_dir.join("e0.ctl")).await.unwrap(),
    );
    // How long a full prefill of the prompt takes here.
    let prompt = kvferry_engine_node::prompt(4096, 1024, 9);
    let t = Instant::now();
    ctl.generate(GenerateRequest {
        tenant: "probe".into(),
        token_ids: prompt.clone(),
        max_new_tokens: 1,
        use_cache: false,
    })
    .await
    .unwrap();
    let full = t.elapsed();
    let mut r = router(d.grpc_addr).await;
    let mut req = request("abandoned", prompt.clone(), PolicyMode::Recompute);
    req.model_id = model;
    req.deadline_ms = (full.as_millis() as u64 / 5).max(50);
    let t0 = Instant::now();
    let e = receipt(&mut r, req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e}");
    // The engine acknowledges the cancel well before the prefill would have ended.
    loop {
        let m = &d.shared.metrics;
        if m.recompute_cancels_acked.get() == 1 {
            break;
        }
        assert!(
            t0.elapsed() < full,
            "no acknowledged cancel after {:?} (a full prefill takes {full:?})",
            t0.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(d.shared.metrics.recompute_cancels.get(), 1);
    // And it is free: a short Generate is not queued behind the abandoned prefill.
    let t1 = Instant::now();
    ctl.generate(GenerateRequest {
        tenant: "next".into(),
        token_ids: prompt[..32].to_vec(),
        max_new_tokens: 1,
        use_cache: false,
    })
    .await
    .unwrap();
    assert!(t0.elapsed() < full, "the engine stayed busy: {:?} (+{:?})", t0.elapsed(), t1.elapsed());
    node.shutdown();
}
