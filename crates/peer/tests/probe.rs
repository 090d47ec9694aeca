//! The active link probe between two real peer endpoints on loopback: it measures goodput
//! with synthetic bytes, is capped with a typed refusal, needs the same mutual TLS as a fetch,
//! respects its deadline, and feeds the link estimator; over QUIC and over TCP.

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvferry_peer::{
    BlockCatalog, DevPki, MAX_PROBE_BYTES, PeerNode, RegionId, Served, TlsIdentity, TransportChoice,
};
use kvferry_wire::frame::{FetchRequest, RefusalCode};
use kvferry_wire::{LinkEstimator, WireError};

use common::TD;

/// Refuses every fetch and counts how often it was asked: a probe must never consult it.
struct NoBlocks(AtomicU64);

impl BlockCatalog for NoBlocks {
    fn open(&self, _peer: &RegionId, _req: &FetchRequest) -> Result<Served, (RefusalCode, String)> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Err((RefusalCode::UnknownBlocks, "no blocks here".into()))
    }
}

fn node(
    t: TransportChoice,
    identity: TlsIdentity,
    pki: &DevPki,
    allowed: &[&str],
    catalog: Arc<NoBlocks>,
) -> Arc<PeerNode> {
    common::node(t, identity, pki, allowed, catalog, 8 << 20)
}

struct Pair {
    pki: DevPki,
    catalog: Arc<NoBlocks>,
    owner: Arc<PeerNode>,
    src: RegionId,
}

fn pair(t: TransportChoice) -> Pair {
    let pki = DevPki::generate(TD).unwrap();
    let catalog = Arc::new(NoBlocks(AtomicU64::new(0)));
    let owner = node(t, pki.issue("src").unwrap(), &pki, &["dst"], catalog.clone());
    Pair { pki, catalog, owner, src: RegionId::new(TD, "src").unwrap() }
}

fn soon(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

async fn a_probe_measures_goodput_and_feeds_the_estimator(t: TransportChoice) {
    let p = pair(t);
    let dst = node(t, p.pki.issue("dst").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let mut est = LinkEstimator::default();
    let t0 = Instant::now();
    for bytes in [1u64 << 20, 8 << 20, MAX_PROBE_BYTES] {
        let r = dst.probe(&p.src, p.owner.local_addr(), bytes, soon(30)).await.unwrap();
        assert_eq!(r.bytes, bytes);
        assert!(r.goodput_bps > 0.0 && r.goodput_bps.is_finite(), "{r:?}");
        let now = t0.elapsed().as_nanos() as u64;
        est.record_goodput(now, r.bytes, r.wall.as_secs_f64()).unwrap();
        est.record_rtt(now, r.rtt.as_secs_f64().max(1e-6)).unwrap();
        eprintln!("probe {} MiB: {:.2} Gbit/s, rtt {:?}", bytes >> 20, r.goodput_bps / 1e9, r.rtt);
    }
    let e = est.estimate(t0.elapsed().as_nanos() as u64);
    assert_eq!(e.samples, 3);
    assert!(e.goodput_bps.unwrap() > 0.0 && e.confidence > 0.0 && e.confidence <= 1.0, "{e:?}");
    // A zero-byte probe is legal (an RTT-only ping over the same path).
    let r = dst.probe(&p.src, p.owner.local_addr(), 0, soon(10)).await.unwrap();
    assert_eq!(r.bytes, 0);
    assert_eq!(p.catalog.0.load(Ordering::Relaxed), 0, "a probe consulted the block catalog");
}

async fn a_probe_over_the_cap_is_a_typed_refusal(t: TransportChoice) {
    let p = pair(t);
    let dst = node(t, p.pki.issue("dst").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let e = dst.probe(&p.src, p.owner.local_addr(), MAX_PROBE_BYTES + 1, soon(10)).await.unwrap_err();
    assert!(matches!(e, WireError::Refused { code: RefusalCode::BadRequest, .. }), "{e:?}");
    assert!(!e.retryable());
    // The connection is still good for the next probe.
    dst.probe(&p.src, p.owner.local_addr(), 1 << 20, soon(10)).await.unwrap();
}

async fn a_probe_needs_the_same_mutual_tls_as_a_fetch(t: TransportChoice) {
    let p = pair(t);
    // A region not on the owner's allow-list.
    let rogue = node(t, p.pki.issue("rogue").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let e = rogue.probe(&p.src, p.owner.local_addr(), 1 << 20, soon(10)).await.unwrap_err();
    assert!(matches!(e, WireError::NotAuthorised(_)), "{e:?}");
    // A certificate from another CA with the right name.
    let other = DevPki::generate(TD).unwrap();
    let forged = node(t, other.issue("dst").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let e = forged.probe(&p.src, p.owner.local_addr(), 1 << 20, soon(10)).await.unwrap_err();
    assert!(matches!(e, WireError::NotAuthorised(_)), "{e:?}");
}

async fn a_probe_ends_by_its_deadline(tr: TransportChoice) {
    let p = pair(tr);
    let dst = node(tr, p.pki.issue("dst").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    let t = Instant::now();
    let e = dst.probe(&p.src, addr, 1 << 20, Instant::now() + Duration::from_millis(500)).await.unwrap_err();
    // QUIC waits for an answer that never comes; TCP is refused at once (nothing listens).
    match tr {
        TransportChoice::Tcp => assert!(matches!(e, WireError::Connection(_)), "{e:?}"),
        _ => assert!(matches!(e, WireError::DeadlineExceeded), "{e:?}"),
    }
    assert!(t.elapsed() < Duration::from_millis(1500), "{:?}", t.elapsed());
}

// Every case above, over QUIC and over TCP.
over_both_transports!(
    a_probe_measures_goodput_and_feeds_the_estimator,
    a_probe_over_the_cap_is_a_typed_refusal,
    a_probe_needs_the_same_mutual_tls_as_a_fetch,
    a_probe_ends_by_its_deadline,
);
