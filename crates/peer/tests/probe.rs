//! The active link probe between two real peer endpoints on loopback: it measures goodput
//! with synthetic bytes, is capped with a typed refusal, needs the same mutual TLS as a fetch,
//! respects its deadline, and feeds the link estimator.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvferry_peer::{BlockCatalog, DevPki, MAX_PROBE_BYTES, PeerNode, RegionId, Served, TlsIdentity};
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

fn node(identity: TlsIdentity, pki: &DevPki, allowed: &[&str], catalog: Arc<NoBlocks>) -> Arc<PeerNode> {
    common::node(identity, pki, allowed, catalog, 8 << 20)
}

struct Pair {
    pki: DevPki,
    catalog: Arc<NoBlocks>,
    owner: Arc<PeerNode>,
    src: RegionId,
}

fn pair() -> Pair {
    let pki = DevPki::generate(TD).unwrap();
    let catalog = Arc::new(NoBlocks(AtomicU64::new(0)));
    let owner = node(pki.issue("src").unwrap(), &pki, &["dst"], catalog.clone());
    Pair { pki, catalog, owner, src: RegionId::new(TD, "src").unwrap() }
}

fn soon(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_measures_goodput_and_feeds_the_estimator() {
    let p = pair();
    let dst = node(p.pki.issue("dst").unwrap(), &p.pki, &["src"], p.catalog.clone());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_over_the_cap_is_a_typed_refusal() {
    let p = pair();
    let dst = node(p.pki.issue("dst").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let e = dst.probe(&p.src, p.owner.local_addr(), MAX_PROBE_BYTES + 1, soon(10)).await.unwrap_err();
    assert!(matches!(e, WireError::Refused { code: RefusalCode::BadRequest, .. }), "{e:?}");
    assert!(!e.retryable());
    // The connection is still good for the next probe.
    dst.probe(&p.src, p.owner.local_addr(), 1 << 20, soon(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_needs_the_same_mutual_tls_as_a_fetch() {
    let p = pair();
    // A region not on the owner's allow-list.
    let rogue = node(p.pki.issue("rogue").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let e = rogue.probe(&p.src, p.owner.local_addr(), 1 << 20, soon(10)).await.unwrap_err();
    assert!(matches!(e, WireError::NotAuthorised(_)), "{e:?}");
    // A certificate from another CA with the right name.
    let other = DevPki::generate(TD).unwrap();
    let forged = node(other.issue("dst").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let e = forged.probe(&p.src, p.owner.local_addr(), 1 << 20, soon(10)).await.unwrap_err();
    assert!(matches!(e, WireError::NotAuthorised(_)), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_ends_by_its_deadline() {
    let p = pair();
    let dst = node(p.pki.issue("dst").unwrap(), &p.pki, &["src"], p.catalog.clone());
    let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    let t = Instant::now();
    let e = dst.probe(&p.src, addr, 1 << 20, Instant::now() + Duration::from_millis(500)).await.unwrap_err();
    assert!(matches!(e, WireError::DeadlineExceeded), "{e:?}");
    assert!(t.elapsed() < Duration::from_millis(1500), "{:?}", t.elapsed());
}
