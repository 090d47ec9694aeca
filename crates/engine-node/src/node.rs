//! [`EngineNode`]: start-up (build the model and the shared pool, measure the prefill
//! profile, share the pool's fd or its NIXL descriptor, RegisterPool, Attach, serve the control socket), the
//! supervisor that dispatches daemon commands to the worker and notices the daemon going
//! away, clean shutdown, and [`run`], the `kvferry engine` entry point (adds SIGTERM/Ctrl-C).

use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_engine::{Engine, KvLayout, PrefillProfile as CoreProfile};
use kvferry_layout::BlockHash;
use kvferry_proto::v1::daemon_command::Command;
use kvferry_proto::v1::engine_client::EngineClient;
use kvferry_proto::v1::reference_engine_server::ReferenceEngineServer;
use kvferry_proto::v1::{DaemonCommand, NixlAccess, PoolLayoutSpec, ShmAccess, register_pool_request};
use tokio::net::UnixListener;
use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{UnboundedReceiverStream, UnixListenerStream};
use tonic::Streaming;

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

/// A running reference engine. Stop it with [`EngineNode::shutdown`] and [`EngineNode::wait`];
/// `wait` also returns (with [`NodeError::DaemonGone`]) when the daemon goes away.
#[derive(Debug)]
pub struct EngineNode {
    info: NodeInfo,
    stop: watch::Sender<bool>,
    main: Option<JoinHandle<Result<(), NodeError>>>,
}

/// What the worker thread hands back after building the engine and sharing the pool.
#[derive(Debug)]
struct Built {
    access: register_pool_request::Access,
    /// The `pool.sock` connection (shm pools only), kept open while the daemon may map the pool.
    pool_stream: Option<StdUnixStream>,
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
        let (access, pool_stream) = match cfg.pool {
            PoolAccess::Shm => {
                let (pool_token, stream) = share_pool(&cfg.run_dir, shm, &model_id, cfg.rpc_timeout)?;
                (register_pool_request::Access::Shm(ShmAccess { pool_token }), Some(stream))
            }
            PoolAccess::Nixl => {
                let export =
                    mem.nixl_export().ok_or_else(|| NodeError::Pool("the pool was not exported through NIXL".into()))?;
                let desc = export.descriptor().map_err(|e| NodeError::Pool(format!("NIXL: describe the pool: {e}")))?;
                tracing::info!(agent = %desc.agent_name, regions = desc.regions.len(), "pool registered with NIXL");
                let descriptor_json = desc.to_json().into_bytes();
                (register_pool_request::Access::Nixl(NixlAccess { descriptor_json }), None)
            }
        };
        let local_fingerprint = shm.fingerprint(&model_id).digest_bytes().to_vec();
        let b = Built {
            access,
            pool_stream,
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

        let run_dir = cfg.run_dir.display().to_string();
        let reg_err = |detail: String| NodeError::Register { run_dir: run_dir.clone(), detail };
        let sock = engine_socket(&cfg.run_dir);
        let channel =
            within(cfg.rpc_timeout, &format!("connect {}", sock.display()), connect_uds(&sock), reg_err)
                .await?;
        let mut client = EngineClient::new(channel);
        let reg = Registration {
            engine_id: cfg.engine_id.clone(),
            model_id: model_id.clone(),
            layout: built.layout,
            access: built.access,
            profile: profile_msg(built.profile.as_ref(), cfg.profile_scale),
        };
        let resp = within(cfg.rpc_timeout, "RegisterPool", register(&mut client, &reg), reg_err).await?;
        if resp.layout_fingerprint.len() == 32 && resp.layout_fingerprint != built.local_fingerprint {
            tracing::warn!("the daemon's layout fingerprint differs from our digest of the same layout");
        }
        let (events, events_rx) = EventSink::new(resp.lease_id.clone());
        // The first event names the lease.
        events.load(0, 0.0, reg.profile);
        let attach = client.attach(UnboundedReceiverStream::new(events_rx));
        let commands = within(cfg.rpc_timeout, "Attach", attach, reg_err).await?.into_inner();
        let (jobs, jobs_rx) = JobQueue::new(shared.clone());
        let link = DaemonLink {
            client,
            events: events.clone(),
            handle: Handle::current(),
            timeout: cfg.rpc_timeout,
        };
        link_tx
            .send((link, jobs_rx))
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
        let reporter = tokio::spawn(report_load(events, shared, cfg.load_report_interval, cfg.profile_scale));
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
        let parts = Parts {
            stop_rx,
            commands,
            jobs,
            server,
            server_stop: server_stop_tx,
            reporter,
            worker,
            pool_stream: built.pool_stream,
            control: cfg.control,
        };
        Ok(EngineNode { info, stop, main: Some(tokio::spawn(supervise(parts))) })
    }

    /// What this node registered as.
    pub fn info(&self) -> &NodeInfo {
        &self.info
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
    stop_rx: watch::Receiver<bool>,
    commands: Streaming<DaemonCommand>,
    jobs: JobQueue,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    server_stop: oneshot::Sender<()>,
    reporter: JoinHandle<()>,
    worker: std::thread::JoinHandle<()>,
    pool_stream: Option<StdUnixStream>,
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
                        Some(Command::Recompute(r)) => Job::Recompute(r),
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
                Ok(None) => break Err(NodeError::DaemonGone("it closed the Attach stream".into())),
                Err(status) => break Err(NodeError::DaemonGone(format!("Attach stream failed: {status}"))),
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
        let busy = shared.busy.lock().expect("busy lock").busy_at(now);
        let span = now.saturating_duration_since(last.0).as_secs_f64();
        let util = if span > 0.0 { ((busy - last.1).as_secs_f64() / span).clamp(0.0, 1.0) } else { 0.0 };
        last = (now, busy);
        let queued =
            u32::try_from(shared.queued.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(u32::MAX);
        let profile = profile_msg(shared.profile.lock().expect("profile lock").as_ref(), scale);
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
/// until the daemon goes away ([`NodeError::DaemonGone`], whose message says so).
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
