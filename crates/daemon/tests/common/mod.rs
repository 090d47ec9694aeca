//! What the daemon's integration tests share, one copy each: a small pool layout, a daemon
//! config on loopback in a temp dir, a peer entry and a free loopback UDP port for it, a
//! started daemon, and an Engine API client over the daemon's Unix socket
//! (kvferry-engine-node's connector, the one the reference engine uses); for the soaks, a
//! session held in region A, publishing its chain, its blocks' bytes, and what B's landing zone
//! holds of it.

#![allow(dead_code)] // each test binary uses a part

use std::net::SocketAddr;
use std::path::Path;

pub mod abuse;
pub mod nixl;
pub mod uds_cut;

use kvferry_daemon::config::Peer;
use kvferry_daemon::{Config, Daemon};
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::{BlockStored, PoolLayoutSpec, PrefillProfile, PublishRequest};
use tonic::transport::Channel;

/// A 2-layer, 8-block vLLM flash-attention pool in f32.
pub fn spec() -> PoolLayoutSpec {
    PoolLayoutSpec {
        kind: "vllm_flash_attn_nhd".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 32,
        block_size: 16,
        num_blocks: 8,
        dtype: "f32".into(),
    }
}

/// The region lengths of [`spec`]'s layout, bytes.
pub fn region_lens() -> Vec<u64> {
    kvferry_daemon::engine_api::layout_of(&spec()).unwrap().region_lens().to_vec()
}

/// A plausible measured profile.
pub fn profile() -> PrefillProfile {
    PrefillProfile { linear_s_per_token: 1e-4, attention_s_per_pair: 1e-9, samples: 1, fixed_s: 0.0 }
}

/// Region `region` on loopback (every port 0), its run dir and the dev CA under `dir` (daemons
/// started with the same `dir` trust each other).
pub fn config(dir: &Path, region: &str) -> Config {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut cfg = Config { region: region.into(), run_dir: dir.join(region), ..Config::default() };
    cfg.tls.dev_dir = dir.join("dev-ca");
    (cfg.listen.grpc, cfg.listen.http, cfg.listen.peer) = (any, any, any);
    cfg
}

/// Peer `region` at `addr`: a 1 Gbit/s, 1 ms link, served at most `max_egress_gbps` (0: no
/// cap), every tenant allowed, the default transport.
pub fn peer(region: &str, addr: SocketAddr, max_egress_gbps: f64) -> Peer {
    Peer {
        region: region.into(),
        addr,
        gbps: 1.0,
        rtt_ms: 1.0,
        max_egress_gbps,
        tenants: None,
        transport: Default::default(),
    }
}

/// A loopback UDP address free a moment ago (for a peer listener whose address must be known
/// before its daemon starts).
pub fn free_udp() -> SocketAddr {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// The number in environment variable `name`, else `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Counts every panic of this process from now on (the default hook still prints it).
pub fn count_panics() -> &'static std::sync::atomic::AtomicU64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static PANICS: AtomicU64 = AtomicU64::new(0);
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::Relaxed);
            default_hook(info);
        }));
    });
    &PANICS
}

/// Starts a daemon with `cfg`.
pub async fn start(cfg: &Config) -> Daemon {
    Daemon::start(cfg.clone()).await.unwrap()
}

/// An Engine API client on the daemon's `engine.sock`.
pub async fn engine_client(cfg: &Config) -> EngineClient<Channel> {
    EngineClient::new(kvferry_engine_node::daemon::connect_uds(&cfg.engine_socket()).await.unwrap())
}

/// A session held in region A by the soak tests (`fault_soak.rs`, `engine_faults.rs`): its
/// tenant, prompt and block hashes, the bytes B must land for each block (an empty entry is
/// not compared), and whatever else a test keeps beside it (`extra`).
pub struct HeldSession<X = ()> {
    pub tenant: &'static str,
    pub prompt: Vec<u32>,
    pub hashes: Vec<kvferry_layout::BlockHash>,
    pub bytes: Vec<Vec<u8>>,
    pub extra: X,
}

/// What B's landing zone holds of `s`: blocks present, how many of them differ from the bytes
/// expected, and whether the present ones run unbroken from the first of them to the
/// session's end (what a resumed or fallen-back fetch may leave: never a hole).
pub fn landed<X>(b: &Daemon, s: &HeldSession<X>) -> (usize, usize, bool) {
    let (mut present, mut wrong, mut first) = (0, 0, None);
    for (i, (h, want)) in s.hashes.iter().zip(&s.bytes).enumerate() {
        if let Some(l) = b.shared.landing.get(s.tenant, h) {
            present += 1;
            first.get_or_insert(i);
            if !want.is_empty() && *l.bytes != *want {
                wrong += 1;
            }
        }
    }
    (present, wrong, first.is_none_or(|f| f + present == s.hashes.len()))
}

/// Publishes `hashes` as `tenant`'s chain, held in blocks `ids`, for the engine holding
/// `lease_id`.
pub async fn publish_chain(
    engine: &mut EngineClient<Channel>,
    lease_id: &str,
    tenant: &str,
    hashes: &[[u8; 32]],
    ids: Vec<u32>,
) {
    engine
        .publish(PublishRequest {
            lease_id: lease_id.into(),
            stored: vec![BlockStored {
                tenant: tenant.into(),
                block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
                block_ids: ids,
            }],
            ..Default::default()
        })
        .await
        .unwrap();
}

/// Block `id`'s bytes in `pool`, every layer: what a fetch of that block lands.
pub fn block_bytes(pool: &kvferry_engine_sdk::ShmPool, id: u32) -> Vec<u8> {
    let layers = pool.layout().num_layers();
    let mut out = vec![0u8; pool.layout().staging_len(1, 0..layers).unwrap() as usize];
    pool.read_blocks(&[id], 0..layers, &mut out).unwrap();
    out
}
