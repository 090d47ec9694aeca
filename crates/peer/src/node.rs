//! A region's peer endpoint: serves fetches to other regions and fetches from them.
//!
//! One quinn endpoint per daemon, both server and client. Owns connections (one cached per
//! peer), the two staging budgets (serving and fetching, each bounded in bytes whatever the
//! session size), and the async plumbing around the sans-IO cores of `kvferry-wire`:
//!
//! - **owner**: a producer reads chunk i+1 from the [`ChunkSource`] while writer tasks send
//!   chunk i on several unidirectional streams; control frames (retransmit, complete) arrive
//!   on the request's bidirectional stream.
//! - **requester**: reader tasks pull chunks off the streams into staging; one task owns the
//!   [`Requester`] core, verifies each chunk and lands it through the [`ChunkSink`]; a lost
//!   connection resumes on a new one from the verified chunks, within the deadline.
//!
//! A fetch that returns `Ok` has landed every byte of every held block, each verified; the
//! caller may mark those blocks valid then and only then. On `Err`, nothing is valid.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvferry_wire::frame::{BlockHash, Cancel, FetchRequest, Frame, Refusal, RefusalCode};
use kvferry_wire::plan::MAX_CHUNK;
use kvferry_wire::{ChunkVerdict, Owner, Requester, RequesterConfig, State, WireError, Work};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, EndpointConfig, RecvStream, SendStream, TokioRuntime, VarInt};
use rustls::pki_types::CertificateDer;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::io::{
    ChunkBytes, ChunkSink, ChunkSource, conn_err, from_conn_error, read_err, read_frame, write_frame,
};
use crate::tls::{RegionId, TlsIdentity, TrustPolicy, client_crypto, identity_of, server_crypto};
use crate::transport::{LinkTuning, bind_udp};

/// What the owner serves for an accepted request.
#[allow(missing_debug_implementations)]
pub struct Served {
    /// The first `blocks_held` requested blocks are held here.
    pub blocks_held: u32,
    /// Layers per block.
    pub layers: u32,
    /// Bytes of one block in one layer.
    pub bytes_per_block_layer: u64,
    /// Where the chunk bytes come from.
    pub source: Arc<dyn ChunkSource>,
}

/// Decides what a peer may fetch: tenant, fingerprint, and which blocks are held.
pub trait BlockCatalog: Send + Sync {
    /// Accepts (with what is held) or refuses a request from `peer`. Runs before any KV byte
    /// is read.
    fn open(&self, peer: &RegionId, req: &FetchRequest) -> Result<Served, (RefusalCode, String)>;
}

/// Configuration of a peer endpoint.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    pub identity: TlsIdentity,
    pub policy: TrustPolicy,
    pub listen: SocketAddr,
    pub tuning: LinkTuning,
    /// Bound on chunk bytes held in staging, per direction (serving, fetching).
    pub staging_bytes: usize,
    /// Chunk size asked for.
    pub chunk_target_bytes: u32,
}

/// One fetch's parameters.
#[derive(Debug, Clone)]
pub struct FetchSpec {
    pub tenant: String,
    pub fingerprint: [u8; 32],
    pub hashes: Vec<BlockHash>,
    pub layers: u32,
    pub bytes_per_block_layer: u64,
    pub deadline: Instant,
}

/// What a completed fetch did.
#[derive(Debug, Clone, PartialEq)]
pub struct FetchReceipt {
    /// Blocks landed and verified (a prefix of the requested ones).
    pub blocks: u32,
    /// Payload bytes landed.
    pub bytes: u64,
    /// From the call to the last landed byte.
    pub wall: Duration,
    /// Time until every chunk of the first layer group had verified.
    pub first_layer: Option<Duration>,
    /// Payload bits per second over the wall time.
    pub goodput_bps: f64,
    /// Connection RTT at the end.
    pub rtt: Duration,
    /// Connections lost and resumed.
    pub reconnects: u32,
    /// Chunks that failed verification and were fetched again.
    pub chunks_refetched: u32,
}

/// Staging budget in KiB permits, with a high-water mark.
struct Budget {
    sem: Arc<Semaphore>,
    total_kib: u32,
    in_use_kib: AtomicU64,
    high_water_kib: AtomicU64,
}

struct Lease {
    _permit: OwnedSemaphorePermit,
    kib: u32,
    budget: Arc<Budget>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.in_use_kib.fetch_sub(u64::from(self.kib), Ordering::Relaxed);
    }
}

impl Budget {
    fn new(bytes: usize) -> Arc<Self> {
        let kib = (bytes / 1024).clamp(1, u32::MAX as usize / 2) as u32;
        Arc::new(Self {
            sem: Arc::new(Semaphore::new(kib as usize)),
            total_kib: kib,
            in_use_kib: AtomicU64::new(0),
            high_water_kib: AtomicU64::new(0),
        })
    }

    async fn lease(self: &Arc<Self>, bytes: u64) -> Result<Lease, WireError> {
        let kib = (bytes.div_ceil(1024) as u32).clamp(1, self.total_kib);
        let permit = self
            .sem
            .clone()
            .acquire_many_owned(kib)
            .await
            .map_err(|_| WireError::Local("staging closed".into()))?;
        let now = self.in_use_kib.fetch_add(u64::from(kib), Ordering::Relaxed) + u64::from(kib);
        self.high_water_kib.fetch_max(now, Ordering::Relaxed);
        Ok(Lease { _permit: permit, kib, budget: self.clone() })
    }
}

/// Chunk bytes kept alive (with their staging lease) until quinn no longer needs them.
struct Leased {
    bytes: ChunkBytes,
    _lease: Lease,
}

impl AsRef<[u8]> for Leased {
    fn as_ref(&self) -> &[u8] {
        (*self.bytes).as_ref()
    }
}

/// A region's peer endpoint.
pub struct PeerNode {
    endpoint: Endpoint,
    cfg: PeerConfig,
    catalog: Arc<dyn BlockCatalog>,
    serve_budget: Arc<Budget>,
    fetch_budget: Arc<Budget>,
    conns: Mutex<HashMap<RegionId, Connection>>,
    incoming: Mutex<Vec<Connection>>,
    /// Per outgoing connection: routes incoming chunk streams to their transfer.
    routers: Mutex<HashMap<usize, Arc<StreamRouter>>>,
    /// Transfers being served now.
    serving: std::sync::atomic::AtomicU32,
    /// Chunks fetched from peers that failed verification (each was refetched or ended its
    /// transfer; none was landed).
    verify_failures: std::sync::atomic::AtomicU64,
}

/// Routes a connection's incoming chunk streams to the transfer they belong to, so that
/// concurrent fetches over one cached connection never read each other's streams.
#[derive(Default)]
struct StreamRouter {
    transfers: Mutex<HashMap<u128, mpsc::Sender<ChunkItem>>>,
}

impl StreamRouter {
    fn get(&self, id: u128) -> Option<mpsc::Sender<ChunkItem>> {
        self.transfers.lock().ok()?.get(&id).cloned()
    }

    fn register(self: &Arc<Self>, id: u128) -> (mpsc::Receiver<ChunkItem>, Registration) {
        let (tx, rx) = mpsc::channel(8);
        if let Ok(mut m) = self.transfers.lock() {
            m.insert(id, tx);
        }
        (rx, Registration { router: self.clone(), id })
    }

    async fn fail_all(&self, e: WireError) {
        let all: Vec<_> = self.transfers.lock().map(|m| m.values().cloned().collect()).unwrap_or_default();
        for tx in all {
            let _ = tx.send(Err(e.clone())).await;
        }
    }
}

/// Unregisters a transfer from its connection's router on drop.
struct Registration {
    router: Arc<StreamRouter>,
    id: u128,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut m) = self.router.transfers.lock() {
            m.remove(&self.id);
        }
    }
}

impl std::fmt::Debug for PeerNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerNode").field("id", &self.cfg.identity.id).finish_non_exhaustive()
    }
}

impl PeerNode {
    /// Binds the endpoint and starts serving.
    pub fn start(cfg: PeerConfig, catalog: Arc<dyn BlockCatalog>) -> Result<Arc<Self>, WireError> {
        let tls = server_crypto(&cfg.identity, &cfg.policy).map_err(|e| WireError::Local(e.to_string()))?;
        let quic = QuicServerConfig::try_from(tls).map_err(|e| WireError::Local(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic));
        server.transport_config(Arc::new(cfg.tuning.transport()));
        let (socket, _, _) = bind_udp(cfg.listen, cfg.tuning.socket_buffer_bytes)
            .map_err(|e| WireError::Local(e.to_string()))?;
        let endpoint = Endpoint::new(EndpointConfig::default(), Some(server), socket, Arc::new(TokioRuntime))
            .map_err(|e| WireError::Local(e.to_string()))?;
        let node = Arc::new(Self {
            endpoint,
            serve_budget: Budget::new(cfg.staging_bytes),
            fetch_budget: Budget::new(cfg.staging_bytes),
            cfg,
            catalog,
            conns: Mutex::new(HashMap::new()),
            incoming: Mutex::new(Vec::new()),
            routers: Mutex::new(HashMap::new()),
            serving: std::sync::atomic::AtomicU32::new(0),
            verify_failures: std::sync::atomic::AtomicU64::new(0),
        });
        tokio::spawn(accept_loop(node.clone()));
        Ok(node)
    }

    /// This endpoint's serving load, as reported to peers that query it.
    /// Chunks fetched by this node that failed verification so far (none of them landed).
    pub fn verify_failures(&self) -> u64 {
        self.verify_failures.load(Ordering::Relaxed)
    }

    pub fn load_report(&self, transfer_id: u128) -> kvferry_wire::frame::LoadReport {
        kvferry_wire::frame::LoadReport {
            transfer_id,
            active_transfers: self.serving.load(Ordering::Relaxed),
            staging_used: self.serve_budget.in_use_kib.load(Ordering::Relaxed) * 1024,
            staging_bound: self.staging_bound(),
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr().unwrap_or(self.cfg.listen)
    }

    /// This region's identity.
    pub fn id(&self) -> &RegionId {
        &self.cfg.identity.id
    }

    /// Highest staging use so far, bytes: (serving, fetching).
    pub fn staging_high_water(&self) -> (u64, u64) {
        (
            self.serve_budget.high_water_kib.load(Ordering::Relaxed) * 1024,
            self.fetch_budget.high_water_kib.load(Ordering::Relaxed) * 1024,
        )
    }

    /// The configured staging bound per direction, bytes.
    pub fn staging_bound(&self) -> u64 {
        u64::from(self.serve_budget.total_kib) * 1024
    }

    /// Closes every connection (drain or fault injection); in-flight transfers see a lost
    /// connection.
    pub fn close_connections(&self) {
        for c in
            self.conns.lock().map(|mut m| m.drain().map(|(_, c)| c).collect::<Vec<_>>()).unwrap_or_default()
        {
            c.close(VarInt::from_u32(1), b"closed by operator");
        }
        for c in self.incoming.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default() {
            c.close(VarInt::from_u32(1), b"closed by operator");
        }
    }

    /// Statistics of every live connection, outgoing (cached per peer) and incoming, for
    /// diagnostics (`udp_tx.datagrams / udp_tx.ios` = GSO batching; `frame_rx`/`frame_tx`
    /// `stream_data_blocked` and `data_blocked` = flow-control windows as the limit).
    pub fn connection_stats(&self) -> Vec<quinn::ConnectionStats> {
        let mut out: Vec<quinn::ConnectionStats> =
            self.conns.lock().map(|m| m.values().map(Connection::stats).collect()).unwrap_or_default();
        if let Ok(v) = self.incoming.lock() {
            out.extend(v.iter().filter(|c| c.close_reason().is_none()).map(Connection::stats));
        }
        out
    }

    /// Current RTT to `peer`, if connected.
    pub fn rtt_to(&self, peer: &RegionId) -> Option<Duration> {
        self.conns.lock().ok()?.get(peer).filter(|c| c.close_reason().is_none()).map(Connection::rtt)
    }

    /// Connects to `peer` (or reuses the cached connection).
    pub async fn connect(&self, peer: &RegionId, addr: SocketAddr) -> Result<Connection, WireError> {
        if let Some(c) = self.conns.lock().ok().and_then(|m| m.get(peer).cloned())
            && c.close_reason().is_none()
        {
            return Ok(c);
        }
        let tls = client_crypto(&self.cfg.identity, self.cfg.policy.roots.clone(), peer)
            .map_err(|e| WireError::Local(e.to_string()))?;
        let quic = QuicClientConfig::try_from(tls).map_err(|e| WireError::Local(e.to_string()))?;
        let mut client = quinn::ClientConfig::new(Arc::new(quic));
        client.transport_config(Arc::new(self.cfg.tuning.transport()));
        let connecting = self.endpoint.connect_with(client, addr, "kvferry-peer").map_err(conn_err)?;
        let conn = connecting.await.map_err(|e| from_conn_error(&e))?;
        let router = Arc::new(StreamRouter::default());
        if let Ok(mut r) = self.routers.lock() {
            r.retain(|_, router| Arc::strong_count(router) > 1);
            r.insert(conn.stable_id(), router.clone());
        }
        tokio::spawn(route_streams(conn.clone(), self.fetch_budget.clone(), router));
        if let Ok(mut m) = self.conns.lock() {
            m.insert(peer.clone(), conn.clone());
        }
        Ok(conn)
    }

    /// Fetches blocks from `peer` into `sink`. `Ok` means every held block landed verified.
    pub async fn fetch(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        spec: FetchSpec,
        sink: Arc<dyn ChunkSink>,
    ) -> Result<FetchReceipt, WireError> {
        let t0 = Instant::now();
        let deadline_ns = spec.deadline.saturating_duration_since(t0).as_nanos() as u64;
        let cfg = RequesterConfig {
            layers: spec.layers,
            bytes_per_block_layer: spec.bytes_per_block_layer,
            chunk_target_bytes: self.cfg.chunk_target_bytes,
            max_retries_per_chunk: 3,
            deadline_ns,
            missing_grace_ns: 2_000_000_000,
            stall_timeout_ns: (self.cfg.tuning.idle_timeout.as_nanos() as u64).max(1_000_000_000),
        };
        let mut core = Requester::new(rand::random(), spec.tenant, spec.fingerprint, spec.hashes, cfg);
        let mut stats = RunStats { t0, deadline: spec.deadline, ..RunStats::default() };
        let mut request = core.request();
        loop {
            match self.run_fetch(peer, addr, &mut core, request, &sink, &mut stats).await {
                Ok(conn) => {
                    let wall = t0.elapsed();
                    let bytes = core.verified_bytes();
                    return Ok(FetchReceipt {
                        blocks: core.valid_blocks(),
                        bytes,
                        wall,
                        first_layer: stats.first_layer,
                        goodput_bps: bytes as f64 * 8.0 / wall.as_secs_f64().max(1e-9),
                        rtt: conn.rtt(),
                        reconnects: stats.reconnects,
                        chunks_refetched: stats.refetched,
                    });
                }
                Err(e @ WireError::Connection(_)) => {
                    tracing::info!(peer = %peer, error = %e, "connection lost mid-fetch; resuming");
                    if let Ok(mut m) = self.conns.lock() {
                        m.remove(peer);
                    }
                    request = core.on_connection_lost(ns_since(t0))?;
                    stats.reconnects += 1;
                    let backoff = Duration::from_millis(50 * u64::from(stats.reconnects.min(20)));
                    tokio::time::sleep(backoff.min(spec.deadline.saturating_duration_since(Instant::now())))
                        .await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn run_fetch(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        core: &mut Requester,
        request: FetchRequest,
        sink: &Arc<dyn ChunkSink>,
        stats: &mut RunStats,
    ) -> Result<Connection, WireError> {
        let t0 = stats.t0;
        let remaining = stats.deadline.saturating_duration_since(Instant::now());
        let conn = tokio::time::timeout(remaining, self.connect(peer, addr))
            .await
            .map_err(|_| WireError::DeadlineExceeded)??;
        let (mut ctl_send, ctl_recv) = conn.open_bi().await.map_err(|e| from_conn_error(&e))?;

        let (ctl_tx, mut ctl_rx) = mpsc::channel::<Result<Frame, WireError>>(16);
        let ctl_task = tokio::spawn(control_reader(ctl_recv, ctl_tx));
        let router = self
            .routers
            .lock()
            .ok()
            .and_then(|r| r.get(&conn.stable_id()).cloned())
            .ok_or_else(|| WireError::Connection("connection has no stream router".into()))?;
        // Register before asking, so the first chunk always finds its transfer.
        let (mut chunk_rx, _registration) = router.register(core.transfer_id());
        write_frame(&mut ctl_send, &Frame::Request(request)).await?;
        let _guard = AbortOnDrop(vec![ctl_task.abort_handle()]);

        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tokio::select! {
                msg = ctl_rx.recv() => match msg {
                    Some(Ok(Frame::Manifest(m))) => core.on_manifest(ns_since(t0), &m)?,
                    Some(Ok(Frame::Refusal(r))) => return Err(core.on_refusal(&r)),
                    Some(Ok(Frame::Done(d))) => core.on_done(ns_since(t0), &d)?,
                    Some(Ok(Frame::Cancel(c))) => return Err(core.cancel(&c.detail)),
                    Some(Ok(other)) => return Err(core.cancel(&format!("unexpected frame {other:?}"))),
                    Some(Err(e)) => return Err(e),
                    None => return Err(WireError::Connection("control stream closed".into())),
                },
                chunk = chunk_rx.recv() => match chunk {
                    Some(Ok((h, payload, lease))) => {
                        let verdict = core.on_chunk(ns_since(t0), &h, &payload);
                        if let Err(WireError::TooManyRetries { .. }) = verdict {
                            self.verify_failures.fetch_add(1, Ordering::Relaxed);
                        }
                        match verdict? {
                            ChunkVerdict::Land(spec) => {
                                if let Err(e) = sink.land(spec, &payload).await {
                                    return Err(core.cancel(&format!("landing failed: {e}")))
                                        .map_err(|_| WireError::Local(e));
                                }
                                if stats.first_layer.is_none() && core.first_layer_verified() {
                                    stats.first_layer = Some(t0.elapsed());
                                }
                            }
                            ChunkVerdict::Corrupt { chunk } => {
                                stats.refetched += 1;
                                self.verify_failures.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(chunk, "chunk failed verification; refetching");
                            }
                            ChunkVerdict::Duplicate | ChunkVerdict::Ignored => {}
                        }
                        drop(lease);
                    }
                    Some(Err(e)) => return Err(e),
                    None => return Err(WireError::Connection("chunk streams closed".into())),
                },
                _ = tick.tick() => {
                    core.on_timer(ns_since(t0))?;
                    if core.stalled(ns_since(t0)) {
                        conn.close(VarInt::from_u32(2), b"stalled");
                        return Err(WireError::Connection("transfer stalled".into()));
                    }
                }
            }
            while let Some(f) = core.poll_transmit() {
                write_frame(&mut ctl_send, &f).await?;
            }
            if core.state() == State::Committed {
                let _ = ctl_send.finish();
                return Ok(conn);
            }
        }
    }
}

struct RunStats {
    t0: Instant,
    deadline: Instant,
    first_layer: Option<Duration>,
    reconnects: u32,
    refetched: u32,
}

impl Default for RunStats {
    fn default() -> Self {
        let now = Instant::now();
        Self { t0: now, deadline: now, first_layer: None, reconnects: 0, refetched: 0 }
    }
}

struct ServingGuard<'a>(&'a std::sync::atomic::AtomicU32);

impl Drop for ServingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

fn ns_since(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}

async fn control_reader(mut recv: RecvStream, tx: mpsc::Sender<Result<Frame, WireError>>) {
    loop {
        let item = match read_frame(&mut recv).await {
            Ok(Some(f)) => Ok(f),
            Ok(None) => return,
            Err(e) => Err(e),
        };
        let stop = item.is_err();
        if tx.send(item).await.is_err() || stop {
            return;
        }
    }
}

type ChunkItem = Result<(kvferry_wire::ChunkHeader, Vec<u8>, Lease), WireError>;

/// Accepts a connection's chunk streams for as long as it lives and routes each to its
/// transfer; a connection failure reaches every transfer on it.
async fn route_streams(conn: Connection, budget: Arc<Budget>, router: Arc<StreamRouter>) {
    loop {
        match conn.accept_uni().await {
            Ok(recv) => {
                tokio::spawn(read_chunks(recv, budget.clone(), router.clone()));
            }
            Err(e) => {
                router.fail_all(from_conn_error(&e)).await;
                return;
            }
        }
    }
}

async fn read_chunks(mut recv: RecvStream, budget: Arc<Budget>, router: Arc<StreamRouter>) {
    let mut last: Option<mpsc::Sender<ChunkItem>> = None;
    loop {
        let frame = read_frame(&mut recv).await;
        let tx = match &frame {
            Ok(Some(Frame::Chunk(h))) => match router.get(h.transfer_id) {
                Some(tx) => tx,
                None => {
                    // A transfer that already ended (or never existed here): not ours to read.
                    let _ = recv.stop(VarInt::from_u32(0));
                    return;
                }
            },
            _ => match last.clone() {
                Some(tx) => tx,
                None => return,
            },
        };
        last = Some(tx.clone());
        let item = match frame {
            Ok(None) => return,
            Ok(Some(Frame::Chunk(h))) if h.len > MAX_CHUNK => {
                Err(WireError::Protocol(format!("chunk of {} bytes exceeds {MAX_CHUNK}", h.len)))
            }
            Ok(Some(Frame::Chunk(h))) => match budget.lease(h.len).await {
                Ok(lease) => {
                    let mut buf = vec![0u8; h.len as usize];
                    match recv.read_exact(&mut buf).await {
                        Ok(()) => Ok((h, buf, lease)),
                        Err(e) => Err(read_err(e)),
                    }
                }
                Err(e) => Err(e),
            },
            Ok(Some(other)) => {
                Err(WireError::Protocol(format!("unexpected frame on a chunk stream: {other:?}")))
            }
            Err(e) => Err(e),
        };
        let stop = item.is_err();
        if tx.send(item).await.is_err() || stop {
            return;
        }
    }
}

async fn accept_loop(node: Arc<PeerNode>) {
    while let Some(incoming) = node.endpoint.accept().await {
        let node = node.clone();
        tokio::spawn(async move {
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    tracing::info!(error = %e, "incoming peer connection failed");
                    return;
                }
            };
            let peer = match conn
                .peer_identity()
                .and_then(|a| a.downcast::<Vec<CertificateDer<'static>>>().ok())
                .and_then(|chain| chain.first().map(identity_of))
            {
                Some(Ok(id)) => id,
                _ => {
                    conn.close(VarInt::from_u32(3), b"no identity");
                    return;
                }
            };
            if let Ok(mut v) = node.incoming.lock() {
                v.retain(|c| c.close_reason().is_none());
                v.push(conn.clone());
            }
            while let Ok((send, recv)) = conn.accept_bi().await {
                let node = node.clone();
                let conn = conn.clone();
                let peer = peer.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve_transfer(&node, &conn, &peer, send, recv).await {
                        tracing::info!(peer = %peer, error = %e, "serving a transfer ended with an error");
                    }
                });
            }
        });
    }
}

async fn serve_transfer(
    node: &PeerNode,
    conn: &Connection,
    peer: &RegionId,
    mut ctl_send: SendStream,
    mut ctl_recv: RecvStream,
) -> Result<(), WireError> {
    let (req, query_only) = match read_frame(&mut ctl_recv).await? {
        Some(Frame::Request(r)) => (r, false),
        Some(Frame::Query(r)) => (r, true),
        Some(Frame::Probe(p)) => return crate::probe::serve_probe(ctl_send, p).await,
        other => return Err(WireError::Protocol(format!("expected a request, got {other:?}"))),
    };
    let refuse =
        |code, detail: String| Frame::Refusal(Refusal { transfer_id: req.transfer_id, code, detail });
    let served = match node.catalog.open(peer, &req) {
        Ok(s) => s,
        Err((code, detail)) => {
            write_frame(&mut ctl_send, &refuse(code, detail)).await?;
            let _ = ctl_send.finish();
            return Ok(());
        }
    };
    let (mut owner, manifest) =
        match Owner::accept(&req, served.blocks_held, served.layers, served.bytes_per_block_layer) {
            Ok(x) => x,
            Err(r) => {
                write_frame(&mut ctl_send, &Frame::Refusal(r)).await?;
                let _ = ctl_send.finish();
                return Ok(());
            }
        };
    if query_only {
        // A query learns what is held, and how loaded this fetch path is; no KV byte is read.
        // Both frames in one write, so they leave in one packet.
        let mut both = kvferry_wire::frame::encode_to_vec(&Frame::Manifest(manifest));
        kvferry_wire::frame::encode(&Frame::Load(node.load_report(req.transfer_id)), &mut both);
        ctl_send.write_all(&both).await.map_err(crate::io::write_err)?;
        let _ = ctl_send.finish();
        return Ok(());
    }
    write_frame(&mut ctl_send, &Frame::Manifest(manifest)).await?;
    node.serving.fetch_add(1, Ordering::Relaxed);
    let _serving = ServingGuard(&node.serving);

    // Writers: one unidirectional stream each, fed round-robin.
    let streams = node.cfg.tuning.streams.max(1) as usize;
    let mut writers = Vec::with_capacity(streams);
    let mut writer_tasks = Vec::with_capacity(streams);
    for _ in 0..streams {
        let (tx, rx) = mpsc::channel::<(kvferry_wire::ChunkHeader, Bytes)>(2);
        writers.push(tx);
        writer_tasks.push(tokio::spawn(chunk_writer(conn.clone(), rx)));
    }
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<Result<Frame, WireError>>(16);
    let reader = tokio::spawn(control_reader(ctl_recv, ctl_tx));
    let _guard = AbortOnDrop(vec![reader.abort_handle()]);

    let mut next_writer = 0;
    let result: Result<(), WireError> = async {
        loop {
            while let Ok(msg) = ctl_rx.try_recv() {
                if handle_owner_control(&mut owner, msg)? {
                    return Ok(());
                }
            }
            if let Some(work) = owner.next_work() {
                let spec = work.spec();
                let lease = node.serve_budget.lease(spec.len).await?;
                let bytes = served.source.read(spec).await.map_err(WireError::Local)?;
                let header = owner.chunk_ready(work, (*bytes).as_ref())?;
                if let (Some(h), Work::Send(_)) = (header, work) {
                    #[cfg(feature = "fault-injection")]
                    let bytes = crate::io::maybe_corrupt(&*served.source, &spec, bytes);
                    let payload = Bytes::from_owner(Leased { bytes, _lease: lease });
                    writers[next_writer % streams]
                        .send((h, payload))
                        .await
                        .map_err(|_| WireError::Connection("chunk writer ended".into()))?;
                    next_writer += 1;
                }
                continue;
            }
            if let Some(done) = owner.poll_done()? {
                write_frame(&mut ctl_send, &Frame::Done(done)).await?;
            }
            match ctl_rx.recv().await {
                Some(msg) => {
                    if handle_owner_control(&mut owner, msg)? {
                        return Ok(());
                    }
                }
                None => return Err(WireError::Connection("requester closed the control stream".into())),
            }
        }
    }
    .await;
    drop(writers);
    for t in writer_tasks {
        let _ = t.await;
    }
    if let Err(e) = &result {
        owner.cancel();
        let _ = write_frame(
            &mut ctl_send,
            &Frame::Cancel(Cancel { transfer_id: owner.transfer_id(), detail: e.to_string() }),
        )
        .await;
    }
    let _ = ctl_send.finish();
    result
}

/// Applies one control frame; `true` when the transfer is complete.
fn handle_owner_control(owner: &mut Owner, msg: Result<Frame, WireError>) -> Result<bool, WireError> {
    match msg? {
        Frame::Retransmit(r) => {
            owner.on_retransmit(&r.chunk_ids)?;
            Ok(false)
        }
        Frame::Complete(_) => {
            owner.on_complete()?;
            Ok(true)
        }
        Frame::Cancel(c) => {
            owner.cancel();
            Err(WireError::Cancelled(c.detail))
        }
        other => Err(WireError::Protocol(format!("unexpected control frame {other:?}"))),
    }
}

async fn chunk_writer(conn: Connection, mut rx: mpsc::Receiver<(kvferry_wire::ChunkHeader, Bytes)>) {
    let mut stream: Option<SendStream> = None;
    while let Some((h, payload)) = rx.recv().await {
        if stream.is_none() {
            match conn.open_uni().await {
                Ok(s) => stream = Some(s),
                Err(_) => return,
            }
        }
        let Some(s) = stream.as_mut() else { return };
        if write_frame(s, &Frame::Chunk(h)).await.is_err() || s.write_chunk(payload).await.is_err() {
            return;
        }
    }
    if let Some(mut s) = stream {
        let _ = s.finish();
    }
}
