//! [`EngineNode`]: start-up (build the model and the shared pool, measure the prefill
//! profile, share the pool's fd or its NIXL descriptor, RegisterPool, Attach, serve the control socket), the
//! supervisor that dispatches daemon commands to the worker and notices the daemon going
//! away, clean shutdown, and [`run`], the `kvferry engine` entry point (adds SIGTERM/Ctrl-C).

use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvferry_engine::{Engine, KvLayout, PrefillProfile as CoreProfile};
use kvferry_engine_sdk::PoolShare;
use kvferry_layout::BlockHash;
use kvferry_proto::v1::daemon_command::Command;
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::reference_engine_server::ReferenceEngineServer;
use kvferry_proto::v1::{
    DaemonCommand, NixlAccess, PoolLayoutSpec, RegisterPoolResponse, ShmAccess, register_pool_request,
};
use tokio::net::UnixListener;
use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{UnboundedReceiverStream, UnixListenerStream};
use tonic::Streaming;
use tonic::transport::Channel;

use crate::config::{EngineArgs, NodeConfig, PoolAccess};
use crate::daemon::{EventSink, Registration, connect_uds, engine_socket, profile_msg, register, share_pool};
use crate::error::NodeError;
use crate::memory::{ShmKvMemory, layout_spec};
use crate::service::ControlService;
use crate::worker::{DaemonLink, Job, JobQueue, Shared, Worker};

/// What a started node is.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    /// Engine id.
    pub engine_id: String,
    /// Model id registered with the daemon.
    pub model_id: String,
    /// The daemon's lease.
    pub lease_id: String,
    /// Layout fingerprint the daemon returned.
    pub layout_fingerprint: Vec<u8>,
    /// Our own layout fingerprint digest (`LayoutFingerprint::digest`, 32 bytes).
    pub local_fingerprint: Vec<u8>,
    /// The control socket.
    pub control: PathBuf,
    /// The measured prefill profile.
    pub profile: Option<CoreProfile>,
}

/// A running reference engine. Stop it with [`EngineNode::shutdown`] and [`EngineNode::wait`].
/// When the daemon goes away (its Attach stream ends) the node keeps serving and registers
/// again once the daemon is back (`NodeConfig::reconnect`): new pool offer, new lease, a new
/// Attach stream, and every cached block published again. `wait` returns
/// [`NodeError::DaemonGone`] only when the daemon stays away past the policy's bound.
#[derive(Debug)]
pub struct EngineNode {
    info: NodeInfo,
    events: EventSink,
    reconnects: Arc<AtomicU64>,
    reconnect_error: Arc<std::sync::Mutex<Option<String>>>,
    stop: watch::Sender<bool>,
    main: Option<JoinHandle<Result<(), NodeError>>>,
}

/// What the worker thread hands back after building the engine and sharing the pool.
#[derive(Debug)]
struct Built {
    access: register_pool_request::Access,
    /// The `pool.sock` connection (shm pools only), kept open while the daemon may map the pool.
    pool_stream: Option<StdUnixStream>,
    /// What sharing the pool again needs (shm pools only), usable off the worker thread.
    pool_share: Option<Arc<PoolShare>>,
    layout: PoolLayoutSpec,
    profile: Option<CoreProfile>,
    local_fingerprint: Vec<u8>,
}

/// The engine's NIXL agent name: unique per engine id and process.
pub fn nixl_agent_name(cfg: &NodeConfig) -> String {
    format!("kvferry-engine-{}-{}", cfg.engine_id, std::process::id())
}

/// Builds the core over a fresh shared pool (registered with the engine's NIXL agent when
/// `cfg.pool` is [`PoolAccess::Nixl`]) and measures its prefill profile.
pub fn build_engine(cfg: &NodeConfig) -> Result<Engine<ShmKvMemory>, NodeError> {
    let kv = KvLayout::for_model(&cfg.model, cfg.num_blocks).map_err(|e| NodeError::Config(e.to_string()))?;
    let mut mem = ShmKvMemory::create(&kv)?;
    if cfg.pool == PoolAccess::Nixl {
        mem.export_nixl(&nixl_agent_name(cfg))?;
    }
    let mut engine = Engine::new(cfg.model.clone(), cfg.num_blocks, mem)?;
    let t0 = Instant::now();
    let p = engine.measure_profile(&cfg.fitted_profile())?;
    tracing::info!(
        a_s_per_token = p.a_linear_s_per_token,
        b_s_per_pair = p.b_attention_s_per_pair,
        took_s = t0.elapsed().as_secs_f64(),
        "prefill profile measured"
    );
    Ok(engine)
}

type LinkRx = oneshot::Receiver<(DaemonLink, tokio::sync::mpsc::UnboundedReceiver<Job>)>;

fn worker_thread(
    cfg: NodeConfig,
    built_tx: oneshot::Sender<Result<Built, NodeError>>,
    link_rx: LinkRx,
    shared: Arc<Shared>,
) {
    let model_id = cfg.model_id();
    let built = build_engine(&cfg).and_then(|engine| {
        let mem = engine.pool().memory();
        let shm = mem.shm();
        let (access, pool_stream, pool_share) = match cfg.pool {
            PoolAccess::Shm => {
                let handle = shm.share_handle().map_err(|e| NodeError::Pool(e.to_string()))?;
                let (pool_token, stream) = share_pool(&cfg.run_dir, &handle, &model_id, cfg.rpc_timeout)?;
                let access = register_pool_request::Access::Shm(ShmAccess { pool_token });
                (access, Some(stream), Some(Arc::new(handle)))
            }
            PoolAccess::Nixl => {
                let export =
                    mem.nixl_export().ok_or_else(|| NodeError::Pool("the pool was not exported through NIXL".into()))?;
                let desc = export.descriptor().map_err(|e| NodeError::Pool(format!("NIXL: describe the pool: {e}")))?;
                tracing::info!(agent = %desc.agent_name, regions = desc.regions.len(), "pool registered with NIXL");
                let descriptor_json = desc.to_json().into_bytes();
                (register_pool_request::Access::Nixl(NixlAccess { descriptor_json }), None, None)
            }
        };
        let local_fingerprint = shm.fingerprint(&model_id).digest_bytes().to_vec();
        let b = Built {
            access,
            pool_stream,
            pool_share,
            layout: layout_spec(engine.layout()),
            profile: engine.profile().cloned(),
            local_fingerprint,
        };
        Ok((engine, b))
    });
    let engine = match built {
        Ok((engine, b)) => {
            if built_tx.send(Ok(b)).is_err() {
                return;
            }
            engine
        }
        Err(e) => {
            let _ = built_tx.send(Err(e));
            return;
        }
    };
    // Registration failed or the node was dropped: nothing to serve.
    let Ok((link, jobs)) = link_rx.blocking_recv() else { return };
    Worker::new(engine, link, shared).run(jobs);
}

fn bind_control(path: &Path) -> Result<UnixListener, NodeError> {
    let err = |detail: String| NodeError::Control { path: path.display().to_string(), detail };
    if path.exists() {
        if StdUnixStream::connect(path).is_ok() {
            return Err(err("another process is serving this socket".into()));
        }
        std::fs::remove_file(path).map_err(|e| err(format!("remove stale socket: {e}")))?;
    }
    UnixListener::bind(path).map_err(|e| err(format!("bind: {e}")))
}

async fn within<T, E: std::fmt::Display>(
    t: Duration,
    what: &str,
    f: impl Future<Output = Result<T, E>>,
    err: impl Fn(String) -> NodeError,
) -> Result<T, NodeError> {
    match tokio::time::timeout(t, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(err(format!("{what}: {e}"))),
        Err(_) => Err(err(format!("{what}: no answer within {t:?}"))),
    }
}

impl EngineNode {
    /// Starts the engine: builds the model and shared pool, measures the profile, registers
    /// with the daemon in `cfg.run_dir`, attaches, and serves the control socket. Returns once
    /// Generate calls can be served.
    pub async fn start(cfg: NodeConfig) -> Result<EngineNode, NodeError> {
        cfg.validate()?;
        let model_id = cfg.model_id();
        let shared = Arc::new(Shared::default());
        let (built_tx, built_rx) = oneshot::channel();
        let (link_tx, link_rx) = oneshot::channel();
        let (thread_cfg, thread_shared) = (cfg.clone(), shared.clone());
        let worker = std::thread::Builder::new()
            .name(format!("kvferry-engine:{}", cfg.engine_id))
            .spawn(move || worker_thread(thread_cfg, built_tx, link_rx, thread_shared))
            .map_err(|e| NodeError::WorkerGone(format!("spawn the worker thread: {e}")))?;
        let built =
            built_rx.await.map_err(|_| NodeError::WorkerGone("the worker died while starting".into()))??;

        let reg = Registration {
            engine_id: cfg.engine_id.clone(),
            model_id: model_id.clone(),
            layout: built.layout,
            access: built.access,
            profile: profile_msg(built.profile.as_ref(), cfg.profile_scale),
        };
        let (client, resp) = connect_and_register(&cfg, &reg).await?;
        if resp.layout_fingerprint.len() == 32 && resp.layout_fingerprint != built.local_fingerprint {
            tracing::warn!("the daemon's layout fingerprint differs from our digest of the same layout");
        }
        let (events, events_rx) = EventSink::new(resp.lease_id.clone());
        let commands = attach(&cfg, &client, &events, events_rx, reg.profile).await?;
        let (jobs, jobs_rx) = JobQueue::new(shared.clone());
        let link = DaemonLink {
            client: Arc::new(std::sync::Mutex::new(client)),
            events: events.clone(),
            handle: Handle::current(),
            timeout: cfg.rpc_timeout,
        };
        link_tx
            .send((link.clone(), jobs_rx))
            .map_err(|_| NodeError::WorkerGone("the worker died while starting".into()))?;

        let listener = bind_control(&cfg.control)?;
        let (server_stop_tx, server_stop_rx) = oneshot::channel::<()>();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(ReferenceEngineServer::new(ControlService::new(jobs.clone())))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = server_stop_rx.await;
                }),
        );
        let reporter = tokio::spawn(report_load(
            events.clone(),
            shared.clone(),
            cfg.load_report_interval,
            cfg.profile_scale,
        ));
        let info = NodeInfo {
            engine_id: cfg.engine_id.clone(),
            model_id,
            lease_id: resp.lease_id,
            layout_fingerprint: resp.layout_fingerprint,
            local_fingerprint: built.local_fingerprint,
            control: cfg.control.clone(),
            profile: built.profile,
        };
        tracing::info!(engine = %info.engine_id, lease = %info.lease_id, control = %info.control.display(), "engine ready");
        let (stop, stop_rx) = watch::channel(false);
        let reconnects = Arc::new(AtomicU64::new(0));
        let reconnect_error = Arc::new(std::sync::Mutex::new(None));
        let parts = Parts {
            cfg: cfg.clone(),
            reg,
            link,
            shared,
            reconnects: reconnects.clone(),
            stop_rx,
            commands,
            jobs,
            server,
            server_stop: server_stop_tx,
            reporter,
            worker,
            pool_stream: built.pool_stream,
            pool_share: built.pool_share,
            reconnect_error: reconnect_error.clone(),
            control: cfg.control,
        };
        Ok(EngineNode {
            info,
            events,
            reconnects,
            reconnect_error,
            stop,
            main: Some(tokio::spawn(supervise(parts))),
        })
    }

    /// What this node registered as at start (its first lease; see [`EngineNode::lease_id`]).
    pub fn info(&self) -> &NodeInfo {
        &self.info
    }

    /// The lease held now: a new one after each re-registration with a restarted daemon.
    pub fn lease_id(&self) -> String {
        self.events.lease_id()
    }

    /// How many times the node registered again after its daemon went away.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Why the last attempt to register again failed, while the node is away from its daemon
    /// (`None` once registered again, and before any attempt).
    pub fn reconnect_error(&self) -> Option<String> {
        self.reconnect_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Asks the node to stop (in-flight Generate calls finish first).
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
    }

    /// Waits until the node has stopped: `Ok` after [`EngineNode::shutdown`],
    /// [`NodeError::DaemonGone`] when the daemon went away, another error when the control
    /// server failed. Cancel-safe; after it returned once, later calls return `Ok`.
    pub async fn wait(&mut self) -> Result<(), NodeError> {
        let Some(main) = self.main.as_mut() else { return Ok(()) };
        let r = main.await;
        self.main = None;
        r.map_err(|e| NodeError::WorkerGone(format!("supervisor: {e}")))?
    }
}

impl Drop for EngineNode {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

struct Parts {
    cfg: NodeConfig,
    /// The registration, sent again (with a fresh pool token and profile) on reconnect.
    reg: Registration,
    /// The worker's link (its client is replaced on reconnect; its sink is rebound).
    link: DaemonLink,
    shared: Arc<Shared>,
    reconnects: Arc<AtomicU64>,
    stop_rx: watch::Receiver<bool>,
    commands: Streaming<DaemonCommand>,
    jobs: JobQueue,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    server_stop: oneshot::Sender<()>,
    reporter: JoinHandle<()>,
    worker: std::thread::JoinHandle<()>,
    pool_stream: Option<StdUnixStream>,
    pool_share: Option<Arc<PoolShare>>,
    /// Why the last re-registration attempt failed ([`EngineNode::reconnect_error`]).
    reconnect_error: Arc<std::sync::Mutex<Option<String>>>,
    control: PathBuf,
}

fn hash_of(bytes: &[u8]) -> Option<BlockHash> {
    bytes.try_into().ok()
}

async fn supervise(mut p: Parts) -> Result<(), NodeError> {
    let mut liveness = tokio::time::interval(Duration::from_millis(500));
    let outcome = loop {
        tokio::select! {
            _ = liveness.tick() => {
                if p.worker.is_finished() {
                    break Err(NodeError::WorkerGone("the engine worker thread stopped (panic?)".into()));
                }
            }
            changed = p.stop_rx.changed() => {
                if changed.is_err() || *p.stop_rx.borrow() {
                    break Ok(());
                }
            }
            msg = p.commands.message() => match msg {
                Ok(Some(cmd)) => {
                    let job = match cmd.command {
                        Some(Command::Recompute(r)) => {
                            p.jobs.recompute_queued(&r.session_id);
                            Job::Recompute(r)
                        }
                        Some(Command::Cancel(c)) => {
                            let known = p.jobs.cancel_recompute(&c.session_id);
                            tracing::info!(session = ?c.session_id, known, "the daemon cancelled a recompute");
                            continue;
                        }
                        Some(Command::Evict(h)) => {
                            // A hint: the worker evicts only cached blocks no request uses.
                            tracing::info!(blocks = h.block_hashes.len(), "eviction hint from the daemon");
                            Job::Evict(h.block_hashes.iter().filter_map(|b| hash_of(b)).collect())
                        }
                        None => continue,
                    };
                    if let Err(e) = p.jobs.submit(job) {
                        break Err(e);
                    }
                }
                Ok(None) => match reconnect(&mut p, "it closed the Attach stream".into()).await {
                    Ok(true) => continue,
                    Ok(false) => break Ok(()),
                    Err(e) => break Err(e),
                },
                Err(status) => match reconnect(&mut p, format!("Attach stream failed: {status}")).await {
                    Ok(true) => continue,
                    Ok(false) => break Ok(()),
                    Err(e) => break Err(e),
                },
            },
            r = &mut p.server => {
                let detail = match r {
                    Ok(Ok(())) => "the control server stopped".to_owned(),
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                };
                break Err(NodeError::Control { path: p.control.display().to_string(), detail });
            }
        }
    };
    match &outcome {
        Ok(()) => tracing::info!("engine shutting down"),
        Err(e) => tracing::error!(error = %e, "engine shutting down"),
    }
    // Stop accepting Generate calls; in-flight ones finish (bounded wait).
    let _ = p.server_stop.send(());
    if !p.server.is_finished() && tokio::time::timeout(Duration::from_secs(10), &mut p.server).await.is_err()
    {
        p.server.abort();
    }
    p.reporter.abort();
    drop(p.commands);
    // The worker exits when the last queue handle (ours; the server's went with it) is gone.
    drop(p.jobs);
    let _ = tokio::task::spawn_blocking(move || p.worker.join()).await;
    let _ = std::fs::remove_file(&p.control);
    drop(p.pool_stream);
    outcome
}

/// Connects to the daemon's Engine API and registers the pool (a shm pool is offered over
/// `pool.sock` first, by the caller at start and by [`reattach`] on reconnect).
async fn connect_and_register(
    cfg: &NodeConfig,
    reg: &Registration,
) -> Result<(EngineClient<Channel>, RegisterPoolResponse), NodeError> {
    let run_dir = cfg.run_dir.display().to_string();
    let reg_err = |detail: String| NodeError::Register { run_dir: run_dir.clone(), detail };
    let sock = engine_socket(&cfg.run_dir);
    let channel =
        within(cfg.rpc_timeout, &format!("connect {}", sock.display()), connect_uds(&sock), reg_err).await?;
    let mut client = EngineClient::new(channel);
    let resp = within(cfg.rpc_timeout, "RegisterPool", register(&mut client, reg), reg_err).await?;
    Ok((client, resp))
}

/// Opens the Attach stream for the lease `events` is bound to; its first event (a load
/// report) names the lease.
async fn attach(
    cfg: &NodeConfig,
    client: &EngineClient<Channel>,
    events: &EventSink,
    rx: tokio::sync::mpsc::UnboundedReceiver<kvferry_proto::v1::EngineEvent>,
    profile: Option<kvferry_proto::v1::PrefillProfile>,
) -> Result<Streaming<DaemonCommand>, NodeError> {
    let run_dir = cfg.run_dir.display().to_string();
    let reg_err = |detail: String| NodeError::Register { run_dir: run_dir.clone(), detail };
    events.load(0, 0.0, profile);
    let mut client = client.clone();
    let attach = client.attach(UnboundedReceiverStream::new(rx));
    Ok(within(cfg.rpc_timeout, "Attach", attach, reg_err).await?.into_inner())
}

/// The daemon went away (`why`): tries to register again with backoff
/// ([`ReconnectPolicy::backoff`]) until it succeeds (`Ok(true)`), the node is asked to stop
/// (`Ok(false)`), or the policy's bound passes ([`NodeError::DaemonGone`]). Generate calls are
/// served meanwhile (computed locally: Lookup and Load fail fast without a daemon).
async fn reconnect(p: &mut Parts, why: String) -> Result<bool, NodeError> {
    let policy = p.cfg.reconnect;
    if policy.give_up_after.is_zero() {
        return Err(NodeError::DaemonGone(why));
    }
    tracing::warn!(why, "the daemon went away; registering again when it is back");
    let t0 = Instant::now();
    let mut attempt = 0u32;
    loop {
        tokio::select! {
            () = tokio::time::sleep(policy.backoff(attempt)) => {}
            changed = p.stop_rx.changed() => {
                if changed.is_err() || *p.stop_rx.borrow() {
                    return Ok(false);
                }
            }
        }
        attempt = attempt.saturating_add(1);
        let result = reattach(p).await;
        *p.reconnect_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            result.as_ref().err().map(|e| format!("attempt {attempt}: {e}"));
        match result {
            Ok(()) => return Ok(true),
            Err(e) if t0.elapsed() >= policy.give_up_after => {
                return Err(NodeError::DaemonGone(format!(
                    "{why}; not back within {:?} ({attempt} attempts, last: {e})",
                    policy.give_up_after
                )));
            }
            // The first failure and every 20th after it are worth an operator's eye.
            Err(e) if attempt % 20 == 1 => {
                tracing::warn!(attempt, error = %e, "daemon not back yet; still trying")
            }
            Err(e) => tracing::debug!(attempt, error = %e, "daemon not back yet"),
        }
    }
}

/// One re-registration: the pool offered again (shm: on a blocking thread, not the worker's
/// queue, which may hold a long job) or its NIXL descriptor sent again,
/// `RegisterPool` (a new lease), the sink rebound to it, `Attach`, and every cached block
/// published again (queued behind the worker's current job, so the republished set is the
/// cache as of that point, and later events follow it on the same stream).
async fn reattach(p: &mut Parts) -> Result<(), NodeError> {
    let cfg = p.cfg.clone();
    let pool_stream = match cfg.pool {
        PoolAccess::Shm => {
            let run_dir = cfg.run_dir.display().to_string();
            let err = |detail: String| NodeError::Register { run_dir: run_dir.clone(), detail };
            let share = p.pool_share.clone().ok_or_else(|| err("no shm pool to share".into()))?;
            let (dir, model_id, t) = (cfg.run_dir.clone(), cfg.model_id(), cfg.rpc_timeout);
            // The offer's write and the token's read are bounded by `t` each; the wait for
            // them is bounded as a whole.
            let job = tokio::task::spawn_blocking(move || share_pool(&dir, &share, &model_id, t));
            let (pool_token, stream) =
                match tokio::time::timeout(2 * t + Duration::from_millis(500), job).await {
                    Ok(Ok(r)) => r?,
                    Ok(Err(e)) => return Err(err(format!("the pool offer's thread: {e}"))),
                    Err(_) => return Err(err(format!("pool offer: no token within {:?}", 2 * t))),
                };
            p.reg.access = register_pool_request::Access::Shm(ShmAccess { pool_token });
            Some(stream)
        }
        PoolAccess::Nixl => None,
    };
    p.reg.profile =
        profile_msg(p.shared.profile.lock().unwrap_or_else(|e| e.into_inner()).as_ref(), cfg.profile_scale);
    let (client, resp) = connect_and_register(&cfg, &p.reg).await?;
    let rx = p.link.events.rebind(resp.lease_id.clone());
    p.commands = attach(&cfg, &client, &p.link.events, rx, p.reg.profile).await?;
    p.link.set_client(client);
    if let Some(s) = pool_stream {
        p.pool_stream = Some(s);
    }
    p.jobs.submit(Job::Republish)?;
    let n = p.reconnects.fetch_add(1, Ordering::Relaxed) + 1;
    tracing::info!(lease = %resp.lease_id, reconnects = n, "registered again with the daemon");
    Ok(())
}

async fn report_load(events: EventSink, shared: Arc<Shared>, every: Duration, scale: f64) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut last = (Instant::now(), Duration::ZERO);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = shared.drained.notified() => {}
        }
        let now = Instant::now();
        let busy = shared.busy.lock().unwrap_or_else(std::sync::PoisonError::into_inner).busy_at(now);
        let span = now.saturating_duration_since(last.0).as_secs_f64();
        let util = if span > 0.0 { ((busy - last.1).as_secs_f64() / span).clamp(0.0, 1.0) } else { 0.0 };
        last = (now, busy);
        let queued =
            u32::try_from(shared.queued.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(u32::MAX);
        let profile = profile_msg(
            shared.profile.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref(),
            scale,
        );
        events.load(queued, util, profile);
    }
}

async fn shutdown_signal() -> &'static str {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "Ctrl-C",
        () = term => "SIGTERM",
    }
}

/// `kvferry engine`: starts the node from flags and runs it until SIGTERM/Ctrl-C (`Ok`) or
/// until the daemon stays away past `--daemon-reconnect-s` ([`NodeError::DaemonGone`], whose
/// message says so).
pub async fn run(args: EngineArgs) -> Result<(), NodeError> {
    let cfg = args.into_config()?;
    let mut node = EngineNode::start(cfg).await?;
    tokio::select! {
        r = node.wait() => r,
        sig = shutdown_signal() => {
            tracing::info!(signal = sig, "stopping the engine");
            node.shutdown();
            node.wait().await
        }
    }
}
