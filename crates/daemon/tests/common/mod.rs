//! What the daemon's integration tests share, one copy each: a small pool layout, a daemon
//! config on loopback in a temp dir, a started daemon, and an Engine API client over the
//! daemon's Unix socket (kvferry-engine-node's connector, the one the reference engine uses).

#![allow(dead_code)] // each test binary uses a part

use std::net::SocketAddr;
use std::path::Path;

pub mod abuse;
pub mod nixl;

use kvferry_daemon::{Config, Daemon};
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::{PoolLayoutSpec, PrefillProfile};
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
    PrefillProfile { linear_s_per_token: 1e-4, attention_s_per_pair: 1e-9, samples: 1 }
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

/// Starts a daemon with `cfg`.
pub async fn start(cfg: &Config) -> Daemon {
    Daemon::start(cfg.clone()).await.unwrap()
}

/// An Engine API client on the daemon's `engine.sock`.
pub async fn engine_client(cfg: &Config) -> EngineClient<Channel> {
    EngineClient::new(kvferry_engine_node::daemon::connect_uds(&cfg.engine_socket()).await.unwrap())
}
