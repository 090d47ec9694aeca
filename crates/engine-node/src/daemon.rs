//! The engine's side of the daemon's Engine API: connecting a tonic channel over a Unix
//! socket ([`connect_uds`]), handing the pool's memfd over `pool.sock` and reading back the
//! pool token ([`share_pool`]), `RegisterPool` (shm token or NIXL descriptor), and the `Attach` stream (an [`EventSink`]
//! for engine → daemon events; the daemon → engine commands are read by the node).

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use kvferry_engine::PrefillProfile as CoreProfile;
use kvferry_engine_sdk::PoolShare;
use kvferry_layout::BlockHash;
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::engine_event::Event;
use kvferry_proto::v1::{
    BlockRemoved, BlockStored, EngineEvent, LoadReport, PrefillProfile, RecomputeDone, RegisterPoolRequest,
    RegisterPoolResponse, register_pool_request,
};
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

use crate::error::NodeError;

/// `<run_dir>/pool.sock`: the daemon's fd-passing socket.
pub fn pool_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("pool.sock")
}

/// `<run_dir>/engine.sock`: the daemon's gRPC Engine API.
pub fn engine_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("engine.sock")
}

/// A tonic channel to a gRPC server on the Unix socket `path` (connects now).
pub async fn connect_uds(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_owned();
    // The URI is ignored by the connector; tonic needs a syntactically valid one.
    Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Shares `pool` with the daemon over `<run_dir>/pool.sock` (blocking; the offer's write and
/// the token's read each bounded by `timeout`): sends the memfd and the offer, then reads one
/// line, the pool token. Returns the token and the stream, which must stay open while the
/// daemon may use the pool.
pub fn share_pool(
    run_dir: &Path,
    pool: &PoolShare,
    model_id: &str,
    timeout: Duration,
) -> Result<(String, StdUnixStream), NodeError> {
    let path = pool_socket(run_dir);
    let err = |detail: String| NodeError::Register { run_dir: run_dir.display().to_string(), detail };
    let stream =
        StdUnixStream::connect(&path).map_err(|e| err(format!("connect {}: {e}", path.display())))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| err(format!("set timeouts: {e}")))?;
    pool.share(&stream, model_id).map_err(|e| err(format!("share the pool: {e}")))?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .map_err(|e| err(format!("read the pool token from {}: {e}", path.display())))?;
    stream
        .set_read_timeout(None)
        .and_then(|()| stream.set_write_timeout(None))
        .map_err(|e| err(format!("clear timeouts: {e}")))?;
    let token = line.trim_end_matches(['\n', '\r']).to_owned();
    if !line.ends_with('\n') {
        return Err(err(format!("{} closed before sending a pool token", path.display())));
    }
    if let Some(msg) = token.strip_prefix("error:") {
        return Err(err(format!("the daemon refused the pool: {}", msg.trim())));
    }
    if token.is_empty() {
        return Err(err("empty pool token".into()));
    }
    Ok((token, stream))
}

/// The API's profile message for the core's profile, both coefficients multiplied by `scale`
/// ([`NodeConfig::profile_scale`](crate::config::NodeConfig::profile_scale)).
pub fn profile_msg(p: Option<&CoreProfile>, scale: f64) -> Option<PrefillProfile> {
    p.map(|p| PrefillProfile {
        linear_s_per_token: p.a_linear_s_per_token * scale,
        attention_s_per_pair: p.b_attention_s_per_pair * scale,
        samples: u32::try_from(p.points.len() as u64 + p.observations).unwrap_or(u32::MAX),
        // The reference engine times its prefill on the thread's CPU clock, per request, with
        // no loop around it: it measures no fixed cost per step.
        fixed_s: 0.0,
    })
}

/// What registration needs besides the client.
#[derive(Debug, Clone)]
pub struct Registration {
    /// Engine id.
    pub engine_id: String,
    /// Model id.
    pub model_id: String,
    /// Pool layout.
    pub layout: kvferry_proto::v1::PoolLayoutSpec,
    /// How the daemon reaches the pool: a token from `pool.sock`, or a NIXL descriptor.
    pub access: register_pool_request::Access,
    /// Measured profile.
    pub profile: Option<PrefillProfile>,
}

/// `Engine.RegisterPool`.
pub async fn register(
    client: &mut EngineClient<Channel>,
    reg: &Registration,
) -> Result<RegisterPoolResponse, tonic::Status> {
    let req = RegisterPoolRequest {
        engine_id: reg.engine_id.clone(),
        model_id: reg.model_id.clone(),
        layout: Some(reg.layout.clone()),
        access: Some(reg.access.clone()),
        profile: reg.profile,
    };
    Ok(client.register_pool(req).await?.into_inner())
}

/// Engine → daemon events on the Attach stream; every event names the lease. Sending never
/// blocks (the stream is unbounded); after the stream is gone events are dropped. Clones share
/// one binding: [`EventSink::rebind`] moves every clone onto a new lease and stream at once
/// (after the daemon restarted and the engine registered again).
#[derive(Debug, Clone)]
pub struct EventSink {
    bound: Arc<Mutex<Bound>>,
}

#[derive(Debug)]
struct Bound {
    lease_id: String,
    tx: mpsc::UnboundedSender<EngineEvent>,
}

impl EventSink {
    /// A sink for `lease_id` and the receiving end to pass to `Engine.Attach`.
    pub fn new(lease_id: String) -> (Self, mpsc::UnboundedReceiver<EngineEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (EventSink { bound: Arc::new(Mutex::new(Bound { lease_id, tx })) }, rx)
    }

    /// Binds every clone to `lease_id` and a fresh stream, returned for the new `Attach`; the
    /// old stream ends (its sender is dropped).
    pub fn rebind(&self, lease_id: String) -> mpsc::UnboundedReceiver<EngineEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        *self.bound.lock().unwrap_or_else(|p| p.into_inner()) = Bound { lease_id, tx };
        rx
    }

    /// The lease the sink is bound to now.
    pub fn lease_id(&self) -> String {
        self.bound.lock().unwrap_or_else(|p| p.into_inner()).lease_id.clone()
    }

    fn send(&self, event: Event) {
        let b = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        let _ = b.tx.send(EngineEvent { lease_id: b.lease_id.clone(), event: Some(event) });
    }

    /// Full blocks now held in the engine's pool.
    pub fn stored(&self, tenant: &str, blocks: &[(BlockHash, u32)]) {
        if blocks.is_empty() {
            return;
        }
        self.send(Event::Stored(BlockStored {
            tenant: tenant.to_owned(),
            block_hashes: blocks.iter().map(|(h, _)| h.to_vec()).collect(),
            block_ids: blocks.iter().map(|&(_, b)| b).collect(),
        }));
    }

    /// Blocks evicted from the engine's pool.
    pub fn removed(&self, hashes: &[BlockHash]) {
        if hashes.is_empty() {
            return;
        }
        self.send(Event::Removed(BlockRemoved { block_hashes: hashes.iter().map(|h| h.to_vec()).collect() }));
    }

    /// A load report.
    pub fn load(&self, queue_depth: u32, utilization: f64, profile: Option<PrefillProfile>) {
        self.send(Event::Load(LoadReport { queue_depth, utilization, profile }));
    }

    /// The answer to a Recompute command (`cancelled`: it stopped early on a CancelRecompute).
    pub fn recompute_done(
        &self,
        session_id: String,
        tokens: u64,
        seconds: f64,
        error: String,
        cancelled: bool,
    ) {
        self.send(Event::RecomputeDone(RecomputeDone { session_id, tokens, seconds, error, cancelled }));
    }
}
