//! The one loopback endpoint the peer crate's integration tests start: mutual TLS with a dev
//! PKI, an allow-list, a 1 ms RTT hint and a 3 s idle timeout; it listens on QUIC and TCP and
//! dials peers over the transport a test asks for.

#![allow(dead_code)] // each test binary uses a part

use std::sync::Arc;
use std::time::Duration;

use kvferry_peer::{
    BlockCatalog, DevPki, LinkTuning, PeerConfig, PeerNode, TlsIdentity, TransportChoice, TrustPolicy,
};

/// The trust domain of every test identity.
pub const TD: &str = "kvferry.test";

/// How a test endpoint dials, and where its TCP side listens.
#[derive(Debug, Clone, Copy)]
pub struct Dial {
    /// The transport toward peers.
    pub transport: TransportChoice,
    /// Where TCP listens (`None`: the QUIC port number).
    pub tcp_listen: Option<std::net::SocketAddr>,
}

impl From<TransportChoice> for Dial {
    fn from(transport: TransportChoice) -> Self {
        Self { transport, tcp_listen: None }
    }
}

/// Starts an endpoint on 127.0.0.1 (any port) with `identity`, trusting `pki`'s roots and
/// admitting `allowed` regions, serving `catalog`, with `staging` bytes of staging per direction,
/// dialling peers as `dial` says.
pub fn node(
    dial: impl Into<Dial>,
    identity: TlsIdentity,
    pki: &DevPki,
    allowed: &[&str],
    catalog: Arc<dyn BlockCatalog>,
    staging: usize,
) -> Arc<PeerNode> {
    PeerNode::start(config(dial, identity, pki, allowed, staging), catalog).unwrap()
}

/// The configuration [`node`] starts with, for a test that changes it before starting (the
/// fault tests' short idle timeout, small chunks and short retransmit grace).
pub fn config(
    dial: impl Into<Dial>,
    identity: TlsIdentity,
    pki: &DevPki,
    allowed: &[&str],
    staging: usize,
) -> PeerConfig {
    let Dial { transport, tcp_listen } = dial.into();
    PeerConfig {
        identity,
        policy: TrustPolicy {
            roots: pki.roots(),
            trust_domain: TD.into(),
            allowed_regions: allowed.iter().map(|s| s.to_string()).collect(),
        },
        listen: "127.0.0.1:0".parse().unwrap(),
        tuning: LinkTuning {
            // Long enough that the QUIC socket coalesces receives (kvferry_peer::transport::
            // MIN_RTT_FOR_COALESCING), as on a WAN: every QUIC test runs through that path.
            rtt: Duration::from_millis(20),
            idle_timeout: Duration::from_secs(3),
            ..LinkTuning::default()
        },
        staging_bytes: staging,
        chunk_target_bytes: 4 << 20,
        fetch: kvferry_peer::FetchPolicy::default(),
        transport,
        tcp_listen,
        auto_fallback: Duration::from_millis(300),
    }
}

/// Runs each listed case — an `async fn(TransportChoice)` of the test file — over QUIC
/// (`quic::name`) and over TCP (`tcp::name`).
macro_rules! over_both_transports {
    ($($name:ident),* $(,)?) => {
        mod quic {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name(kvferry_peer::TransportChoice::Quic).await
            })*
        }
        mod tcp {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name(kvferry_peer::TransportChoice::Tcp).await
            })*
        }
    };
}
