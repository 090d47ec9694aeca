//! `/readyz` reports what it says: listeners serving; `/readyz/engines` an attached engine;
//! `/readyz/peers` every configured peer reachable. Real daemons, a real shm engine
//! registration and a real QUIC handshake between two daemons.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvferry_daemon::config::Peer;
use kvferry_daemon::{Config, Daemon};
use kvferry_engine_node::daemon::EventSink;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::UnboundedReceiverStream;

mod common;

fn config(dir: &std::path::Path, region: &str, peers: Vec<Peer>) -> Config {
    Config { peers, ..common::config(dir, region) }
}

/// GET `path`: (status code, body).
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let code = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, out.split_once("\r\n\r\n").unwrap().1.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_reports_listeners_engines_and_peers_separately() {
    let dir = tempfile::tempdir().unwrap();
    // B's peers: region-a (started later, at an address B never dials: it only needs to be on
    // B's allow-list) and region-c, a bound UDP port nobody answers on.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let peers = vec![
        common::peer("region-a", silent.local_addr().unwrap(), 0.0),
        common::peer("region-c", silent.local_addr().unwrap(), 0.0),
    ];
    let b = Daemon::start(config(dir.path(), "region-b", peers)).await.unwrap();

    let (code, body) = get(b.http_addr, "/readyz").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.starts_with("ready\nlisteners: serving\nengines: 0 registered, 0 attached\n"), "{body}");
    let (code, body) = get(b.http_addr, "/readyz/engines").await;
    assert_eq!(code, 503, "{body}");
    // No engine has registered yet (as after a daemon restart): a migration is told to retry
    // (UNAVAILABLE, origin engine), not that its model does not exist.
    let mut router = common::abuse::router(b.grpc_addr).await;
    let req = common::abuse::request("s-early", vec![1; 64], kvferry_proto::v1::PolicyMode::Recompute);
    let e = router.plan_migration(req.clone()).await.unwrap_err();
    let meta = |k: &str| e.metadata().get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    assert_eq!(
        (e.code(), meta("kvferry-origin").as_deref(), meta("kvferry-retryable").as_deref()),
        (tonic::Code::Unavailable, Some("engine"), Some("true")),
        "{e:?}"
    );
    assert!(e.message().contains("no engine has registered"), "{e:?}");
    let t0 = Instant::now();
    let (code, body) = get(b.http_addr, "/readyz/peers").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("peers: 0 of 2 reachable; region-a unreachable; region-c unreachable"), "{body}");
    assert!(t0.elapsed() < Duration::from_secs(5), "the dial is bounded: {:?}", t0.elapsed());

    // An engine registers a shm pool and attaches: the engines check passes.
    let (_pool, _pool_stream, lease) =
        common::abuse::register_shm(&b.shared.config, "e0", common::spec()).await;
    let mut client = common::engine_client(&b.shared.config).await;
    let (code, body) = get(b.http_addr, "/readyz/engines").await;
    assert_eq!((code, body.lines().nth(2)), (503, Some("engines: 1 registered, 0 attached")), "{body}");
    // With an engine registered, a model nobody serves here is NOT_FOUND.
    let e = router
        .plan_migration(kvferry_proto::v1::MigrateSessionRequest { model_id: "no-such-model".into(), ..req })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    let (events, rx) = EventSink::new(lease);
    events.load(0, 0.0, None);
    let _commands = client.attach(UnboundedReceiverStream::new(rx)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = get(b.http_addr, "/readyz/engines").await;
        if code == 200 {
            assert!(body.contains("engines: 1 registered, 1 attached"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "the engine never counted as attached: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A second daemon, B's peer, that does answer: the peers check passes from A's side.
    let a = Daemon::start(config(dir.path(), "region-a", vec![common::peer("region-b", b.peer_addr, 0.0)]))
        .await
        .unwrap();
    let (code, body) = get(a.http_addr, "/readyz/peers").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("peers: 1 of 1 reachable; region-b reachable"), "{body}");
}
