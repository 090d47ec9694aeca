//! The one loopback endpoint the peer crate's integration tests start: mutual TLS with a dev
//! PKI, an allow-list, a 1 ms RTT hint and a 3 s idle timeout; it listens on QUIC and TCP and
//! dials peers over the transport a test asks for.

use std::sync::Arc;
use std::time::Duration;

use kvferry_peer::{
    BlockCatalog, DevPki, LinkTuning, PeerConfig, PeerNode, TlsIdentity, TransportChoice, TrustPolicy,
};

/// The trust domain of every test identity.
pub const TD: &str = "kvferry.test";

/// Starts an endpoint on 127.0.0.1 (any port) with `identity`, trusting `pki`'s roots and
/// admitting `allowed` regions, serving `catalog`, with `staging` bytes of staging per direction,
/// dialling peers over `transport`.
pub fn node(
    transport: TransportChoice,
    identity: TlsIdentity,
    pki: &DevPki,
    allowed: &[&str],
    catalog: Arc<dyn BlockCatalog>,
    staging: usize,
) -> Arc<PeerNode> {
    node_on(transport, None, identity, pki, allowed, catalog, staging)
}

/// [`node`] with TCP listening on `tcp_listen` (`None`: the QUIC port number).
#[allow(dead_code)] // not every test binary needs it
pub fn node_on(
    transport: TransportChoice,
    tcp_listen: Option<std::net::SocketAddr>,
    identity: TlsIdentity,
    pki: &DevPki,
    allowed: &[&str],
    catalog: Arc<dyn BlockCatalog>,
    staging: usize,
) -> Arc<PeerNode> {
    let cfg = PeerConfig {
        identity,
        policy: TrustPolicy {
            roots: pki.roots(),
            trust_domain: TD.into(),
            allowed_regions: allowed.iter().map(|s| s.to_string()).collect(),
        },
        listen: "127.0.0.1:0".parse().unwrap(),
        tuning: LinkTuning {
            rtt: Duration::from_millis(1),
            idle_timeout: Duration::from_secs(3),
            ..LinkTuning::default()
        },
        staging_bytes: staging,
        chunk_target_bytes: 4 << 20,
        fetch: kvferry_peer::FetchPolicy::default(),
        transport,
        tcp_listen,
        auto_fallback: Duration::from_millis(300),
    };
    PeerNode::start(cfg, catalog).unwrap()
}
