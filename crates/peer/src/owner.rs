//! The owner driver: `PeerNode::start` binds the endpoint and accepts peers; each request on a
//! connection is served by one `kvferry_wire::Owner` core: a producer reads chunk i+1 from the
//! [`ChunkSource`] (within the serving staging budget) while writer tasks send chunk i on
//! several data channels; control frames (retransmit, complete) arrive on the request's
//! control channel. The same code serves both transports ([`crate::link`]): QUIC (control = a
//! bidirectional stream, data = unidirectional streams this side opens) and TCP (control and
//! data = the TLS connections of one session, [`crate::tcp`]). A `Query` is answered with the
//! manifest and this endpoint's load, a `Probe` by [`crate::probe`]; no KV byte is read for
//! either.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvferry_wire::frame::{Cancel, Frame, Refusal};
use kvferry_wire::{LocalError, Owner, WireError, Work};
use quinn::{Connection, Endpoint, EndpointConfig, TokioRuntime, VarInt};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;

use crate::link::{Link, RecvHalf, SendHalf};

use crate::budget::{Budget, Leased};
use crate::io::{AbortOnDrop, control_reader, read_frame, write_frame};
use crate::node::{BlockCatalog, Credentials, PeerConfig, PeerNode};
use crate::tls::{RegionId, identity_of};
use crate::transport::{bind_udp, quic_server_config};
use kvferry_pool::sync::LockExt;

/// The node's QUIC endpoint on `socket`, reading it in batches when `hold` is non-zero (see
/// `coalesce`).
fn quic_endpoint(
    server: quinn::ServerConfig,
    socket: std::net::UdpSocket,
    hold: std::time::Duration,
) -> std::io::Result<Endpoint> {
    let runtime = Arc::new(TokioRuntime);
    let socket: Arc<dyn quinn::AsyncUdpSocket> = if hold.is_zero() {
        quinn::Runtime::wrap_udp_socket(&*runtime, socket)?
    } else {
        Arc::new(crate::coalesce::CoalescingSocket::new(socket, hold)?)
    };
    Endpoint::new_with_abstract_socket(EndpointConfig::default(), Some(server), socket, runtime)
}

impl PeerNode {
    /// Binds the endpoint and starts serving.
    pub fn start(cfg: PeerConfig, catalog: Arc<dyn BlockCatalog>) -> Result<Arc<Self>, WireError> {
        let server = quic_server_config(&cfg.identity, &cfg.policy, &cfg.tuning)
            .map_err(|e| LocalError::Setup(e.to_string()))?;
        let (socket, listener) =
            bind_both(&cfg).map_err(|e| LocalError::Setup(format!("peer sockets on {}: {e}", cfg.listen)))?;
        let endpoint = quic_endpoint(server, socket, cfg.tuning.recv_hold())
            .map_err(|e| LocalError::Setup(e.to_string()))?;
        let tcp_local = listener.local_addr().map_err(|e| LocalError::Setup(e.to_string()))?;
        let tcp =
            crate::tcp::TcpState::new(tcp_local, crate::tcp::first_acceptor(&cfg.identity, &cfg.policy)?);
        let creds = Arc::new(Credentials { identity: cfg.identity.clone(), roots: cfg.policy.roots.clone() });
        let node = Arc::new(Self {
            endpoint,
            creds: Mutex::new(creds),
            uses: Mutex::new(HashMap::new()),
            retiring: Mutex::new(Vec::new()),
            reaping: AtomicBool::new(false),
            reloads: AtomicU64::new(0),
            serve_budget: Budget::new(cfg.staging_bytes),
            fetch_budget: Budget::new(cfg.staging_bytes),
            cfg,
            catalog,
            conns: Mutex::new(HashMap::new()),
            incoming: Mutex::new(Vec::new()),
            routers: Mutex::new(HashMap::new()),
            serving: AtomicU32::new(0),
            verify_failures: AtomicU64::new(0),
            tcp,
            choices: Mutex::new(HashMap::new()),
            fallen_back: Mutex::new(HashMap::new()),
            last_link: Mutex::new(HashMap::new()),
        });
        tokio::spawn(accept_loop(node.clone()));
        tokio::spawn(crate::tcp::accept_loop(node.clone(), listener));
        Ok(node)
    }
}

/// Binds QUIC's UDP socket and TCP's listener. TCP listens on the QUIC port number unless
/// `tcp_listen` says otherwise; with an ephemeral QUIC port (port 0) a free TCP port is taken
/// first and UDP bound to the same number (TCP ports are the scarcer: every dialled TCP
/// connection holds one), retried a few times when that UDP port is taken.
fn bind_both(cfg: &PeerConfig) -> std::io::Result<(std::net::UdpSocket, tokio::net::TcpListener)> {
    let buffers = cfg.tuning.socket_buffer_bytes;
    if let Some(tcp) = cfg.tcp_listen {
        let (udp, _, _) = bind_udp(cfg.listen, buffers)?;
        return Ok((udp, crate::tcp::bind_listener(tcp, &cfg.tuning)?));
    }
    if cfg.listen.port() != 0 {
        let (udp, _, _) = bind_udp(cfg.listen, buffers)?;
        return Ok((udp, crate::tcp::bind_listener(cfg.listen, &cfg.tuning)?));
    }
    let mut last = None;
    for _ in 0..16 {
        let tcp = crate::tcp::bind_listener(cfg.listen, &cfg.tuning)?;
        let mut at = cfg.listen;
        at.set_port(tcp.local_addr()?.port());
        match bind_udp(at, buffers) {
            Ok((udp, _, _)) => return Ok((udp, tcp)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::AddrInUse)))
}

struct ServingGuard<'a>(&'a AtomicU32);

impl Drop for ServingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
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
            {
                let mut v = node.incoming.locked();
                v.retain(|c| c.close_reason().is_none());
                v.push(conn.clone());
            }
            while let Ok((send, recv)) = conn.accept_bi().await {
                let node = node.clone();
                let link = Link::Quic(conn.clone());
                let peer = peer.clone();
                tokio::spawn(async move {
                    let _in_use = node.in_use(&link);
                    let (send, recv) = (SendHalf::Quic(send), RecvHalf::Quic(recv));
                    if let Err(e) = serve_transfer(&node, &link, &peer, send, recv).await {
                        tracing::info!(peer = %peer, error = %e, "serving a transfer ended with an error");
                    }
                });
            }
        });
    }
}

pub(crate) async fn serve_transfer(
    node: &PeerNode,
    link: &Link,
    peer: &RegionId,
    mut ctl_send: SendHalf,
    mut ctl_recv: RecvHalf,
) -> Result<(), WireError> {
    let (req, query_only) = match read_frame(&mut ctl_recv).await? {
        Some(Frame::Request(r)) => (r, false),
        Some(Frame::Query(r)) => (r, true),
        Some(Frame::Probe(p)) => {
            let r = crate::probe::serve_probe(ctl_send, p).await;
            ctl_recv.linger().await;
            return r;
        }
        // A channel closed without a job (a readiness handshake).
        None => return Ok(()),
        other => return Err(WireError::Protocol(format!("expected a request, got {other:?}"))),
    };
    let refuse =
        |code, detail: String| Frame::Refusal(Refusal { transfer_id: req.transfer_id, code, detail });
    let served = match node.catalog.open(peer, &req) {
        Ok(s) => s,
        Err((code, detail)) => {
            write_frame(&mut ctl_send, &refuse(code, detail)).await?;
            ctl_send.finish().await;
            ctl_recv.linger().await;
            return Ok(());
        }
    };
    let (mut owner, manifest) =
        match Owner::accept(&req, served.blocks_held, served.layers, served.bytes_per_block_layer) {
            Ok(x) => x,
            Err(r) => {
                write_frame(&mut ctl_send, &Frame::Refusal(r)).await?;
                ctl_send.finish().await;
                ctl_recv.linger().await;
                return Ok(());
            }
        };
    if query_only {
        // A query learns what is held, and how loaded this fetch path is; no KV byte is read.
        // Both frames in one write, so they leave in one packet.
        let mut both = kvferry_wire::frame::encode_to_vec(&Frame::Manifest(manifest));
        let load = kvferry_wire::frame::LoadReport {
            egress_cap_bps: served.egress_cap_bps,
            ..node.load_report(req.transfer_id)
        };
        kvferry_wire::frame::encode(&Frame::Load(load), &mut both);
        ctl_send.write_all(&both).await?;
        ctl_send.finish().await;
        ctl_recv.linger().await;
        return Ok(());
    }
    write_frame(&mut ctl_send, &Frame::Manifest(manifest)).await?;
    node.serving.fetch_add(1, Ordering::Relaxed);
    let _serving = ServingGuard(&node.serving);

    // Writers: one data channel each, fed round-robin.
    let (opener, streams) = DataOpener::of(node, link, peer)?;
    let mut writers = Vec::with_capacity(streams);
    let mut writer_tasks = Vec::with_capacity(streams);
    for _ in 0..streams {
        let (tx, rx) = mpsc::channel::<(kvferry_wire::ChunkHeader, Bytes)>(2);
        writers.push(tx);
        writer_tasks.push(tokio::spawn(chunk_writer(opener.clone(), rx)));
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
                let (bytes, summed) =
                    crate::offload::read_and_sum(&served.source, spec, owner.transfer_id()).await?;
                let header = owner.chunk_ready_summed(work, &summed)?;
                if let (Some(h), Work::Send(_)) = (header, work) {
                    #[cfg(feature = "fault-injection")]
                    let bytes = crate::io::maybe_corrupt(&*served.source, &spec, bytes);
                    #[cfg(feature = "fault-injection")]
                    let h = {
                        let mut h = h;
                        served.source.tamper_header(&spec, &mut h);
                        h
                    };
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
    ctl_send.finish().await;
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

/// Where a transfer's writers get their data channels.
#[derive(Clone)]
enum DataOpener {
    /// QUIC: each writer opens a unidirectional stream.
    Quic(Connection),
    /// TCP: each writer takes one of the data connections the requester dialled.
    Tcp(Arc<tokio::sync::Mutex<mpsc::Receiver<crate::tcp::Attached>>>, Arc<crate::tcp::Session>),
}

impl DataOpener {
    /// The opener for `link`'s transfer and how many writers it feeds.
    fn of(node: &PeerNode, link: &Link, peer: &RegionId) -> Result<(Self, usize), WireError> {
        match link {
            Link::Quic(c) => Ok((Self::Quic(c.clone()), node.cfg.tuning.quic_streams() as usize)),
            Link::Tcp(s) => {
                let rx =
                    node.tcp.rendezvous.take(s.session, peer).ok_or_else(|| {
                        WireError::Protocol("the session's data connections are taken".into())
                    })?;
                if s.data_channels == 0 {
                    return Err(WireError::Protocol("a fetch session without data connections".into()));
                }
                Ok((Self::Tcp(Arc::new(tokio::sync::Mutex::new(rx)), s.clone()), s.data_channels as usize))
            }
        }
    }

    async fn open(&self) -> Result<SendHalf, WireError> {
        match self {
            Self::Quic(c) => {
                c.open_uni().await.map(SendHalf::Quic).map_err(|e| crate::io::from_conn_error(&e))
            }
            Self::Tcp(rx, session) => {
                let next = tokio::time::timeout(std::time::Duration::from_secs(10), async {
                    rx.lock().await.recv().await
                });
                match next.await {
                    Ok(Some((tls, socket))) => {
                        session.add_socket(socket);
                        Ok(SendHalf::Tcp(tokio::io::split(tls).1))
                    }
                    _ => Err(WireError::Connection("a data connection never arrived".into())),
                }
            }
        }
    }
}

async fn chunk_writer(opener: DataOpener, mut rx: mpsc::Receiver<(kvferry_wire::ChunkHeader, Bytes)>) {
    let mut stream: Option<SendHalf> = None;
    while let Some((h, payload)) = rx.recv().await {
        if stream.is_none() {
            match opener.open().await {
                Ok(s) => stream = Some(s),
                Err(e) => {
                    tracing::info!(error = %e, "no data channel for a chunk writer");
                    return;
                }
            }
        }
        let Some(s) = stream.as_mut() else { return };
        if write_frame(s, &Frame::Chunk(h)).await.is_err() || s.write_chunk(payload).await.is_err() {
            return;
        }
    }
    if let Some(mut s) = stream {
        s.finish().await;
    }
}
