//! The one loopback endpoint the peer crate's integration tests start: mutual TLS with a dev
//! PKI, an allow-list, a 1 ms RTT hint and a 3 s idle timeout.

#![allow(dead_code)] // each test binary uses a part

use std::sync::Arc;
use std::time::Duration;

use kvferry_peer::{BlockCatalog, DevPki, LinkTuning, PeerConfig, PeerNode, TlsIdentity, TrustPolicy};

/// The trust domain of every test identity.
pub const TD: &str = "kvferry.test";

/// Starts an endpoint on 127.0.0.1 (any port) with `identity`, trusting `pki`'s roots and
/// admitting `allowed` regions, serving `catalog`, with `staging` bytes of staging per direction.
pub fn node(
    identity: TlsIdentity,
    pki: &DevPki,
    allowed: &[&str],
    catalog: Arc<dyn BlockCatalog>,
    staging: usize,
) -> Arc<PeerNode> {
    node_with(identity, pki, allowed, catalog, staging, |_| {})
}

/// [`node`], with `tweak` applied to its configuration before it starts (the fault tests'
/// short idle timeout, small chunks and short retransmit grace).
pub fn node_with(
    identity: TlsIdentity,
    pki: &DevPki,
    allowed: &[&str],
    catalog: Arc<dyn BlockCatalog>,
    staging: usize,
    tweak: impl FnOnce(&mut PeerConfig),
) -> Arc<PeerNode> {
    let mut cfg = PeerConfig {
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
    };
    tweak(&mut cfg);
    PeerNode::start(cfg, catalog).unwrap()
}
