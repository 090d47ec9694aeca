//! Fixtures of the abuse tests (`abuse.rs`, `abuse_soak.rs`): this process's fd and memfd
//! counts, a router client, a registered shm pool, an engine that answers recomputes at once,
//! migration requests and their receipts.

use std::net::SocketAddr;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::time::Duration;

use kvferry_daemon::Config;
use kvferry_engine_node::daemon::{EventSink, Registration, register, share_pool};
use kvferry_engine_sdk::ShmPool;
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::{
    MigrateSessionRequest, Policy, PolicyMode, PoolLayoutSpec, RegisterPoolResponse, ShmAccess,
    daemon_command, migration_event, register_pool_request,
};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// The tenant of every abuse test's sessions.
pub const TENANT: &str = "tenant-abuse";

/// Resident memory of this process, bytes.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:").map(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
        })
        .flatten()
        .map_or(0, |kb| kb * 1024)
}

/// Open fds of this process.
pub fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Open memfds of this process (`/proc/self/fd` links named `/memfd:...`): the pools' fds,
/// and nothing a concurrent test's sockets or files add.
pub fn memfd_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// memfd mappings of this process.
pub fn memfd_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().filter(|l| l.contains("memfd:")).count())
        .unwrap_or(0)
}

pub async fn router(addr: SocketAddr) -> MigrationClient<Channel> {
    let ch = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .unwrap();
    MigrationClient::new(ch)
}

/// A shm pool of `spec` shared with the daemon and registered: (pool, its pool.sock stream,
/// lease id).
pub async fn register_shm(
    cfg: &Config,
    engine: &str,
    spec: PoolLayoutSpec,
) -> (ShmPool, StdUnixStream, String) {
    let (pool, stream, resp) = register_shm_answer(cfg, engine, spec).await;
    (pool, stream, resp.lease_id)
}

/// [`register_shm`] with the daemon's whole answer (lease id and TTL).
pub async fn register_shm_answer(
    cfg: &Config,
    engine: &str,
    spec: PoolLayoutSpec,
) -> (ShmPool, StdUnixStream, RegisterPoolResponse) {
    let layout = kvferry_daemon::engine_api::layout_of(&spec).unwrap();
    let pool = ShmPool::create(layout).unwrap();
    let run_dir = cfg.run_dir.clone();
    let (token, stream) = tokio::task::block_in_place(|| {
        share_pool(&run_dir, &pool.share_handle().unwrap(), "m", Duration::from_secs(5))
    })
    .unwrap();
    let mut client = super::engine_client(cfg).await;
    let reg = Registration {
        engine_id: engine.into(),
        model_id: "m".into(),
        layout: spec,
        access: register_pool_request::Access::Shm(ShmAccess { pool_token: token }),
        profile: Some(super::profile()),
    };
    let resp = register(&mut client, &reg).await.unwrap();
    (pool, stream, resp)
}

/// An engine attached to `lease` that answers each Recompute command at once (tokens all
/// ready). Returns its event sink and the task reading its commands.
pub async fn answering_engine(cfg: &Config, lease: &str) -> (EventSink, tokio::task::JoinHandle<()>) {
    let mut client = super::engine_client(cfg).await;
    let (events, rx) = EventSink::new(lease.to_owned());
    events.load(0, 0.0, None);
    let mut commands = client.attach(UnboundedReceiverStream::new(rx)).await.unwrap().into_inner();
    let sink = events.clone();
    let task = tokio::spawn(async move {
        while let Some(Ok(cmd)) = commands.next().await {
            if let Some(daemon_command::Command::Recompute(r)) = cmd.command {
                sink.recompute_done(r.session_id, r.token_ids.len() as u64, 0.0, String::new(), false);
            }
        }
    });
    (events, task)
}

pub fn request(session: &str, tokens: Vec<u32>, mode: PolicyMode) -> MigrateSessionRequest {
    MigrateSessionRequest {
        session_id: session.into(),
        tenant: TENANT.into(),
        model_id: "m".into(),
        token_ids: tokens,
        deadline_ms: 20_000,
        policy: Some(Policy { mode: mode as i32, ..Default::default() }),
        ..Default::default()
    }
}

/// The receipt of a MigrateSession stream, or its error.
pub async fn receipt(
    r: &mut MigrationClient<Channel>,
    req: MigrateSessionRequest,
) -> Result<kvferry_proto::v1::Receipt, tonic::Status> {
    let mut s = r.migrate_session(req).await?.into_inner();
    while let Some(ev) = s.message().await? {
        if let Some(migration_event::Event::Receipt(rc)) = ev.event {
            return Ok(rc);
        }
    }
    Err(tonic::Status::unknown("the stream ended without a receipt"))
}
