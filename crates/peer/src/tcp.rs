//! The TCP transport: TLS 1.3 over TCP with the same mutual-TLS identities and trust policy as
//! QUIC (the same `rustls` configurations from [`crate::tls`]), for paths where UDP is blocked.
//!
//! A job (fetch, query, probe) runs on one *session*: the requester dials a control connection
//! and, for a fetch, N data connections ([`LinkTuning::tcp_connections`]: one per 250 Mbit/s of
//! the link's rate, at most the `streams` tuning) at once, each opening with a 24-byte
//! [`Preamble`] that names the session and the connection's role. The owner serves the
//! control connection exactly like a QUIC bidirectional stream and writes the transfer's chunks
//! round-robin on the data connections it is handed by the [`Rendezvous`] (the data connections
//! of a session must come from the region that opened its control connection). A session ends
//! with its job; nothing is cached between jobs (a handshake per job: 1 RTT for TCP, 1 for TLS
//! 1.3, paid once per job since all connections of a session are dialled in parallel).
//!
//! Every socket gets `TCP_NODELAY`, BBR (`TCP_CONGESTION`) where the kernel has it (else the
//! kernel default, reported in the receipt), and send/receive buffers sized from the
//! bandwidth-delay product over the connections (`SO_*BUFFORCE` lifts the sysctl caps as root).
//! Crypto runs in userspace (rustls): kTLS would move it into the kernel and save one copy per
//! byte; this module does not depend on it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvferry_wire::{LocalError, WireError};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::link::{Link, io_err};
use crate::node::PeerNode;
use crate::tls::{PeerSide, RegionId, chain_still_trusted, client_crypto, identity_of, server_crypto};
use crate::transport::{LinkTuning, force_buffer};
use kvferry_pool::sync::LockExt;

/// A TLS stream over TCP, either side.
pub(crate) type TlsTcp = tokio_rustls::TlsStream<TcpStream>;

const MAGIC: [u8; 4] = *b"KVFT";
const VERSION: u8 = 1;
/// Bytes of the preamble every TCP connection of a session starts with.
pub(crate) const PREAMBLE_LEN: usize = 24;
/// The most data connections one session may ask for.
pub(crate) const MAX_DATA_CHANNELS: u8 = 64;
/// How long a handshake, a preamble or a data connection's arrival may take.
const SETUP_BOUND: Duration = Duration::from_secs(10);

/// A connection's role in its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The job's control channel, announcing how many data connections follow.
    Control { data: u8 },
    /// Data connection `index` of the session.
    Data { index: u8 },
}

/// What a TCP connection of a session says first (after the TLS handshake).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Preamble {
    pub(crate) session: u128,
    pub(crate) role: Role,
}

impl Preamble {
    pub(crate) fn encode(&self) -> [u8; PREAMBLE_LEN] {
        let mut b = [0u8; PREAMBLE_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        (b[5], b[6]) = match self.role {
            Role::Control { data } => (0, data),
            Role::Data { index } => (1, index),
        };
        b[8..].copy_from_slice(&self.session.to_le_bytes());
        b
    }

    /// A typed error for anything but a well-formed preamble of this version.
    pub(crate) fn decode(b: &[u8; PREAMBLE_LEN]) -> Result<Self, WireError> {
        if b[..4] != MAGIC {
            return Err(WireError::Protocol("not a kvferry TCP channel (bad magic)".into()));
        }
        if b[4] != VERSION {
            return Err(WireError::Protocol(format!("TCP channel version {} (want {VERSION})", b[4])));
        }
        let role = match (b[5], b[6]) {
            (0, data) if data <= MAX_DATA_CHANNELS => Role::Control { data },
            (0, data) => {
                return Err(WireError::Protocol(format!(
                    "{data} data connections asked (at most {MAX_DATA_CHANNELS})"
                )));
            }
            (1, index) if index < MAX_DATA_CHANNELS => Role::Data { index },
            (kind, n) => return Err(WireError::Protocol(format!("bad TCP channel role {kind}/{n}"))),
        };
        if b[7] != 0 {
            return Err(WireError::Protocol("reserved preamble byte set".into()));
        }
        let mut id = [0u8; 16];
        id.copy_from_slice(&b[8..]);
        Ok(Self { session: u128::from_le_bytes(id), role })
    }
}

/// One job's TCP connections and what the rotation and diagnostics need of them.
pub(crate) struct Session {
    /// Local number (in-use counts, the live registry).
    pub(crate) id: u64,
    /// The session id both sides know (from the preamble).
    pub(crate) session: u128,
    side: PeerSide,
    chain: Vec<CertificateDer<'static>>,
    /// Duplicates of every socket of the session: shut down to cut it, read for `TCP_INFO`.
    sockets: Mutex<Vec<socket2::Socket>>,
    control: Mutex<Option<TlsTcp>>,
    data: Mutex<Vec<TlsTcp>>,
    /// Data connections of this session.
    pub(crate) data_channels: u32,
    /// The congestion controller the kernel runs on the session's sockets.
    pub(crate) congestion: String,
    retired: AtomicBool,
}

impl Session {
    pub(crate) fn take_control(&self) -> Option<TlsTcp> {
        self.control.locked().take()
    }

    pub(crate) fn take_data(&self) -> Vec<TlsTcp> {
        std::mem::take(&mut *self.data.locked())
    }

    pub(crate) fn add_socket(&self, s: socket2::Socket) {
        self.sockets.locked().push(s);
    }

    /// Smoothed RTT of the control connection (kernel `TCP_INFO`).
    pub(crate) fn rtt(&self) -> Duration {
        self.sockets.locked().first().and_then(tcp_rtt).unwrap_or_default()
    }

    /// Cuts every connection of the session (both directions): its job sees a lost connection.
    pub(crate) fn shutdown(&self) {
        for s in self.sockets.locked().iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A data connection handed to the owner's transfer, with its socket's duplicate.
pub(crate) type Attached = (TlsTcp, socket2::Socket);

struct Slot {
    peer: RegionId,
    tx: mpsc::Sender<Attached>,
    rx: Option<mpsc::Receiver<Attached>>,
    at: Instant,
}

/// Meets a session's data connections with its control connection on the owner, whichever
/// arrives first; a data connection from another region than the control's is refused.
#[derive(Default)]
pub(crate) struct Rendezvous {
    slots: Mutex<HashMap<u128, Slot>>,
}

impl Rendezvous {
    fn slot<'a>(slots: &'a mut HashMap<u128, Slot>, session: u128, peer: &RegionId) -> &'a mut Slot {
        // Slots no control connection claimed in time are dropped (their connections close).
        slots.retain(|_, s| s.rx.is_none() || s.at.elapsed() < SETUP_BOUND);
        slots.entry(session).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(usize::from(MAX_DATA_CHANNELS));
            Slot { peer: peer.clone(), tx, rx: Some(rx), at: Instant::now() }
        })
    }

    /// Hands over a data connection; `false` (and the connection is dropped) when the session
    /// belongs to another region or has no room.
    fn offer(&self, session: u128, peer: &RegionId, conn: Attached) -> bool {
        let mut slots = self.slots.locked();
        let slot = Self::slot(&mut slots, session, peer);
        slot.peer == *peer && slot.tx.try_send(conn).is_ok()
    }

    /// The control side's receiver of its data connections (once per session).
    pub(crate) fn take(&self, session: u128, peer: &RegionId) -> Option<mpsc::Receiver<Attached>> {
        let mut slots = self.slots.locked();
        let slot = Self::slot(&mut slots, session, peer);
        if slot.peer != *peer {
            return None;
        }
        slot.rx.take()
    }

    pub(crate) fn remove(&self, session: u128) {
        self.slots.locked().remove(&session);
    }
}

/// The TCP side of a node: its listener address, live sessions, the rendezvous and the
/// transport choices per peer.
pub(crate) struct TcpState {
    pub(crate) local: SocketAddr,
    next_id: AtomicU64,
    live: Mutex<HashMap<u64, Weak<Session>>>,
    pub(crate) rendezvous: Rendezvous,
    /// The acceptor for the credentials of reload number `.0`.
    acceptor: Mutex<(u64, TlsAcceptor)>,
    /// Accepted connections not yet authenticated.
    pub(crate) pending: Mutex<Pending>,
}

impl TcpState {
    fn register(&self, s: &Arc<Session>) {
        let mut live = self.live.locked();
        live.retain(|_, w| w.strong_count() > 0);
        live.insert(s.id, Arc::downgrade(s));
    }

    pub(crate) fn sessions(&self) -> Vec<Arc<Session>> {
        self.live.locked().values().filter_map(Weak::upgrade).collect()
    }

    /// Open sessions retired by a reload (they end with their job).
    pub(crate) fn retiring(&self) -> usize {
        self.sessions().iter().filter(|s| s.retired.load(Ordering::Relaxed)).count()
    }

    /// After a reload to `roots`: counts the open sessions whose peer still verifies (kept)
    /// and marks the others retired. Returns (kept, retired).
    pub(crate) fn rotate(&self, roots: &Arc<rustls::RootCertStore>) -> (usize, usize) {
        let now = UnixTime::now();
        let (mut kept, mut retired) = (0, 0);
        for s in self.sessions() {
            if chain_still_trusted(&s.chain, roots, s.side, now) {
                kept += 1;
            } else {
                s.retired.store(true, Ordering::Relaxed);
                retired += 1;
            }
        }
        (kept, retired)
    }

    pub(crate) fn close_all(&self) {
        for s in self.sessions() {
            s.shutdown();
        }
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// Buffer size of one TCP connection: 2 × BDP shared by the connections, at least 4 MiB, at
/// most the configured socket buffer (0 there: leave the kernel's autotuning alone).
pub(crate) fn tcp_buffer(t: &LinkTuning, connections: u32) -> usize {
    if t.socket_buffer_bytes == 0 {
        return 0;
    }
    let per = (2 * t.bdp_bytes() / u64::from(connections.max(1))) as usize;
    per.clamp(4 << 20, t.socket_buffer_bytes.max(4 << 20))
}

fn new_socket(addr: SocketAddr, buffer: usize) -> std::io::Result<TcpSocket> {
    let s = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    s.set_nodelay(true)?;
    if buffer > 0 {
        let _ = s.set_recv_buffer_size(buffer as u32);
        let _ = s.set_send_buffer_size(buffer as u32);
        force_buffer(&socket2::SockRef::from(&s), buffer);
    }
    Ok(s)
}

/// Asks for BBR; returns the controller in effect (the kernel default when BBR is absent).
fn set_congestion(s: &socket2::SockRef<'_>) -> String {
    let _ = s.set_tcp_congestion(b"bbr");
    s.tcp_congestion()
        .map(|v| String::from_utf8_lossy(&v).trim_end_matches('\0').to_owned())
        .unwrap_or_else(|_| "unknown".into())
}

/// Bytes of ciphertext rustls may hold unread while a read waits on the socket: one whole TLS
/// record (16 KiB of plaintext, its header and tag) with room to spare. A read that still needs
/// `n` plaintext bytes can count on at least `n − LOW_WATER_SLACK` more bytes reaching the
/// socket.
const LOW_WATER_SLACK: usize = 32 * 1024;
/// The most a receive low-water mark asks the kernel to gather before it wakes the reader.
const LOW_WATER_MAX: usize = 128 * 1024;

/// The receive low-water mark (`SO_RCVLOWAT`) for a read that still needs `remaining`
/// plaintext bytes, on a socket whose marks are capped at `cap`: as many bytes as are certain
/// to arrive, at most `cap`; 1 (wake on any byte, the kernel's default) where that is under a
/// TLS record. Pure.
pub(crate) fn low_water(remaining: usize, cap: usize) -> usize {
    if remaining <= LOW_WATER_SLACK + 16 * 1024 || cap <= 1 {
        return 1;
    }
    (remaining - LOW_WATER_SLACK).min(cap).max(1)
}

/// A TCP connection's receive low-water mark, moved by its reads.
///
/// A bulk reader woken as each segment arrives pays a thread switch and an `epoll_wait` per
/// few kilobytes: profiled at 1 Gbit/s × 50 ms, the switch alone was a third of the receiving
/// thread's samples (`bench/results/tcp-lowat-2026-12-07/`). While a read still needs more
/// than a TLS record, the kernel is asked not to report the socket readable until
/// [`low_water`] bytes have queued; every read sets the mark first (so a cancelled read
/// leaves nothing behind that the next one keeps), and a read's last record is awaited with
/// the default mark of 1, so no read waits for bytes that are not coming.
pub(crate) struct LowWater {
    sock: socket2::Socket,
    cap: usize,
    set: usize,
}

impl LowWater {
    /// For `tls`'s socket, or `None` where it cannot be set up (no duplicate descriptor, or a
    /// receive buffer too small for marks to help).
    pub(crate) fn of(tls: &TlsTcp) -> Option<Self> {
        let tcp: &TcpStream = match tls {
            tokio_rustls::TlsStream::Client(c) => c.get_ref().0,
            tokio_rustls::TlsStream::Server(s) => s.get_ref().0,
        };
        let sock = socket2::SockRef::from(tcp).try_clone().ok()?;
        // A quarter of the buffer, so that the window stays open while the mark fills.
        let cap = (sock.recv_buffer_size().ok()? / 4).min(LOW_WATER_MAX);
        (low_water(usize::MAX, cap) > 1).then_some(LowWater { sock, cap, set: 1 })
    }

    /// Sets the mark for a read that still needs `remaining` bytes (0: the default mark).
    pub(crate) fn before_read(&mut self, remaining: usize) {
        let want = low_water(remaining, self.cap);
        if want != self.set && set_rcvlowat(&self.sock, want) {
            self.set = want;
        }
    }
}

/// `SO_RCVLOWAT` of `s`; false where the kernel refused it.
fn set_rcvlowat(s: &socket2::Socket, bytes: usize) -> bool {
    use std::os::fd::AsRawFd;
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: `s` owns a live socket for the duration of the call; we pass a pointer to a local
    // `c_int` and its exact size, as setsockopt(2) requires for SO_RCVLOWAT; the kernel only
    // reads those bytes.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    rc == 0
}

/// The kernel's smoothed RTT of a TCP socket.
fn tcp_rtt(s: &socket2::Socket) -> Option<Duration> {
    use std::os::fd::AsRawFd;
    // SAFETY: `tcp_info` is plain old data (integers only), so all-zero bytes are a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `s` owns a live socket for the duration of the call; we pass a pointer to a local
    // `tcp_info` and its exact size in `len`, as getsockopt(2) requires; the kernel writes at
    // most `len` bytes and updates `len`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    (rc == 0).then(|| Duration::from_micros(u64::from(info.tcpi_rtt)))
}

/// Binds the owner's TCP listener (buffers set before `listen`, so accepted sockets inherit
/// them and window scaling covers them).
pub(crate) fn bind_listener(addr: SocketAddr, tuning: &LinkTuning) -> std::io::Result<TcpListener> {
    let s = new_socket(addr, tcp_buffer(tuning, tuning.tcp_connections()))?;
    s.set_reuseaddr(true)?;
    s.bind(addr)?;
    s.listen(1024)
}

impl TcpState {
    pub(crate) fn new(local: SocketAddr, node_acceptor: TlsAcceptor) -> Self {
        Self {
            local,
            next_id: AtomicU64::new(1),
            live: Mutex::new(HashMap::new()),
            rendezvous: Rendezvous::default(),
            acceptor: Mutex::new((0, node_acceptor)),
            pending: Mutex::new(Pending::default()),
        }
    }
}

/// The acceptor for a node's current credentials (rebuilt after each reload).
fn acceptor(node: &PeerNode) -> Result<TlsAcceptor, WireError> {
    let reloads = node.tls_reloads();
    {
        let a = node.tcp.acceptor.locked();
        if a.0 == reloads {
            return Ok(a.1.clone());
        }
    }
    let creds = node.credentials();
    let policy = crate::tls::TrustPolicy { roots: creds.roots.clone(), ..node.cfg.policy.clone() };
    let cfg = server_crypto(&creds.identity, &policy).map_err(|e| LocalError::Setup(e.to_string()))?;
    let a = TlsAcceptor::from(Arc::new(cfg));
    *node.tcp.acceptor.locked() = (reloads, a.clone());
    Ok(a)
}

/// The TLS acceptor at start.
pub(crate) fn first_acceptor(
    identity: &crate::tls::TlsIdentity,
    policy: &crate::tls::TrustPolicy,
) -> Result<TlsAcceptor, WireError> {
    let cfg = server_crypto(identity, policy).map_err(|e| LocalError::Setup(e.to_string()))?;
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// One dialled connection of a session.
async fn dial_one(
    connector: TlsConnector,
    addr: SocketAddr,
    buffer: usize,
    preamble: Preamble,
) -> Result<(TlsTcp, socket2::Socket, String, Vec<CertificateDer<'static>>), WireError> {
    let sock = new_socket(addr, buffer).map_err(|e| LocalError::Setup(e.to_string()))?;
    let stream = sock.connect(addr).await.map_err(|e| io_err(&e))?;
    let (dup, congestion) = {
        let r = socket2::SockRef::from(&stream);
        (r.try_clone().map_err(|e| LocalError::Setup(e.to_string()))?, set_congestion(&r))
    };
    let name = ServerName::try_from("kvferry-peer").map_err(|e| LocalError::Setup(e.to_string()))?;
    let mut tls = connector.connect(name, stream).await.map_err(|e| io_err(&e))?;
    let chain = tls.get_ref().1.peer_certificates().map(<[_]>::to_vec).unwrap_or_default();
    tls.write_all(&preamble.encode()).await.map_err(|e| io_err(&e))?;
    Ok((TlsTcp::Client(tls), dup, congestion, chain))
}

impl PeerNode {
    /// Dials a TCP session to `peer`: a control connection and `data` data connections, all
    /// at once. Every handshake verifies the peer exactly as a QUIC one would.
    pub(crate) async fn dial_tcp(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        data: u32,
    ) -> Result<Link, WireError> {
        let data = data.min(u32::from(MAX_DATA_CHANNELS)) as u8;
        let creds = self.credentials();
        let tls = client_crypto(&creds.identity, creds.roots.clone(), peer)
            .map_err(|e| LocalError::Setup(e.to_string()))?;
        let connector = TlsConnector::from(Arc::new(tls));
        let session: u128 = rand::random();
        let buffer = tcp_buffer(&self.cfg.tuning, u32::from(data).max(1));
        let data_dials: Vec<_> = (0..data)
            .map(|index| {
                let p = Preamble { session, role: Role::Data { index } };
                tokio::spawn(dial_one(connector.clone(), addr, buffer, p))
            })
            .collect();
        let control =
            dial_one(connector, addr, buffer, Preamble { session, role: Role::Control { data } }).await;
        let mut datas = Vec::with_capacity(data_dials.len());
        let mut failed = None;
        for d in data_dials {
            match d.await {
                Ok(Ok(c)) => datas.push(c),
                Ok(Err(e)) => failed = failed.or(Some(e)),
                Err(e) => failed = failed.or(Some(WireError::Connection(e.to_string()))),
            }
        }
        let (control, dup, congestion, chain) = control?;
        if let Some(e) = failed {
            return Err(e);
        }
        let mut sockets = vec![dup];
        let mut streams = Vec::with_capacity(datas.len());
        for (s, d, _, _) in datas {
            sockets.push(d);
            streams.push(s);
        }
        let s = Arc::new(Session {
            id: self.tcp.next_id(),
            session,
            side: PeerSide::Server,
            chain,
            sockets: Mutex::new(sockets),
            control: Mutex::new(Some(control)),
            data: Mutex::new(streams),
            data_channels: u32::from(data),
            congestion,
            retired: AtomicBool::new(false),
        });
        self.tcp.register(&s);
        Ok(Link::Tcp(s))
    }
}

/// At most this many accepted TCP connections may be in their unauthenticated phase (TLS
/// handshake and preamble, each bounded by `SETUP_BOUND`) at once; a new one beyond it
/// closes the one that has waited longest, so a flood of silent connections neither grows
/// without bound nor locks a real peer out for longer than the flood outpaces its handshake.
pub const MAX_PENDING: usize = 64;

/// The connections in their unauthenticated phase, oldest first, each with the sender that
/// ends it.
#[derive(Default)]
pub(crate) struct Pending {
    next: u64,
    by_age: std::collections::BTreeMap<u64, tokio::sync::oneshot::Sender<()>>,
    evicted: u64,
}

impl Pending {
    /// Admits a new connection, evicting the oldest beyond `cap`; returns its id and the
    /// receiver that fires if it is evicted.
    fn admit(&mut self, cap: usize) -> (u64, tokio::sync::oneshot::Receiver<()>) {
        while self.by_age.len() >= cap.max(1) {
            let Some((_, oldest)) = self.by_age.pop_first() else { break };
            let _ = oldest.send(());
            self.evicted += 1;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.next += 1;
        self.by_age.insert(self.next, tx);
        (self.next, rx)
    }

    fn done(&mut self, id: u64) {
        self.by_age.remove(&id);
    }
}

/// Accepts TCP connections for as long as the node lives.
pub(crate) async fn accept_loop(node: Arc<PeerNode>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let (id, evicted) = node.tcp.pending.locked().admit(MAX_PENDING);
                tokio::spawn(serve_connection(node.clone(), stream, id, evicted));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a TCP peer connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_connection(
    node: Arc<PeerNode>,
    stream: TcpStream,
    id: u64,
    evicted: tokio::sync::oneshot::Receiver<()>,
) {
    if let Err(e) = serve_connection_inner(&node, stream, id, evicted).await {
        tracing::info!(error = %e, "TCP peer connection ended with an error");
    }
}

/// Connections evicted from the unauthenticated phase so far (see [`MAX_PENDING`]).
pub(crate) fn evicted_pending(node: &PeerNode) -> u64 {
    node.tcp.pending.locked().evicted
}

async fn serve_connection_inner(
    node: &Arc<PeerNode>,
    stream: TcpStream,
    id: u64,
    evicted: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), WireError> {
    let setup = async {
        let (dup, congestion) = {
            let r = socket2::SockRef::from(&stream);
            (r.try_clone().map_err(|e| LocalError::Setup(e.to_string()))?, set_congestion(&r))
        };
        let accept = acceptor(node)?.accept(stream).into_fallible();
        let mut tls = match tokio::time::timeout(SETUP_BOUND, accept).await {
            Ok(Ok(tls)) => tls,
            Ok(Err((e, mut io))) => {
                // The alert is queued; close gracefully (FIN after it, and read what the client
                // already sent) so that a reset does not overtake the alert on its way.
                let _ = io.shutdown().await;
                let mut sink = [0u8; 4096];
                let drain = async { while matches!(io.read(&mut sink).await, Ok(n) if n > 0) {} };
                let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
                return Err(io_err(&e));
            }
            Err(_) => return Err(WireError::Connection("TLS handshake timed out".into())),
        };
        let chain = tls.get_ref().1.peer_certificates().map(<[_]>::to_vec).unwrap_or_default();
        let Some(Ok(peer)) = chain.first().map(identity_of) else {
            return Err(WireError::NotAuthorised("no peer identity".into()));
        };
        let mut b = [0u8; PREAMBLE_LEN];
        match tokio::time::timeout(SETUP_BOUND, tls.read_exact(&mut b)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(io_err(&e)),
            Err(_) => return Err(WireError::Connection("no preamble".into())),
        }
        Ok::<_, WireError>((tls, chain, peer, b, dup, congestion))
    };
    let r = tokio::select! {
        r = setup => r,
        Ok(()) = evicted => Err(WireError::Connection(format!(
            "closed unauthenticated: more than {MAX_PENDING} connections in their handshake"
        ))),
    };
    node.tcp.pending.locked().done(id);
    let (tls, chain, peer, b, dup, congestion) = r?;
    let p = Preamble::decode(&b)?;
    let tls = TlsTcp::Server(tls);
    match p.role {
        Role::Data { .. } => {
            if !node.tcp.rendezvous.offer(p.session, &peer, (tls, dup)) {
                return Err(WireError::Protocol("a data connection for another region's session".into()));
            }
            Ok(())
        }
        Role::Control { data } => {
            let s = Arc::new(Session {
                id: node.tcp.next_id(),
                session: p.session,
                side: PeerSide::Client,
                chain,
                sockets: Mutex::new(vec![dup]),
                control: Mutex::new(Some(tls)),
                data: Mutex::new(Vec::new()),
                data_channels: u32::from(data),
                congestion,
                retired: AtomicBool::new(false),
            });
            node.tcp.register(&s);
            let _gone = Forget(node, p.session);
            let link = Link::Tcp(s);
            let _in_use = node.in_use(&link);
            let (send, recv) = link.open_control().await?;
            crate::owner::serve_transfer(node, &link, &peer, send, recv).await
        }
    }
}

/// Drops a session's rendezvous slot when its control connection ends.
struct Forget<'a>(&'a PeerNode, u128);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0.tcp.rendezvous.remove(self.1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preambles_round_trip_and_bad_ones_are_typed_errors() {
        for role in [Role::Control { data: 4 }, Role::Control { data: 0 }, Role::Data { index: 63 }] {
            let p = Preamble { session: 0x0123_4567_89ab_cdef_0011_2233_4455_6677, role };
            assert_eq!(Preamble::decode(&p.encode()).unwrap(), p);
        }
        let good = Preamble { session: 7, role: Role::Data { index: 1 } }.encode();
        let mut bad = good;
        bad[0] = b'X';
        assert!(matches!(Preamble::decode(&bad), Err(WireError::Protocol(_))));
        let mut bad = good;
        bad[4] = 9;
        assert!(matches!(Preamble::decode(&bad), Err(WireError::Protocol(_))));
        let mut bad = good;
        bad[5] = 2;
        assert!(matches!(Preamble::decode(&bad), Err(WireError::Protocol(_))));
        let mut bad = good;
        bad[6] = MAX_DATA_CHANNELS;
        assert!(matches!(Preamble::decode(&bad), Err(WireError::Protocol(_))));
        let mut bad = Preamble { session: 7, role: Role::Control { data: 0 } }.encode();
        bad[6] = MAX_DATA_CHANNELS + 1;
        assert!(matches!(Preamble::decode(&bad), Err(WireError::Protocol(_))));
    }

    #[test]
    fn the_low_water_mark_never_waits_for_bytes_that_are_not_coming() {
        let cap = LOW_WATER_MAX;
        // Under a TLS record and its slack still to come: the default mark.
        for remaining in [0, 1, 4096, 16 * 1024, LOW_WATER_SLACK, LOW_WATER_SLACK + 16 * 1024] {
            assert_eq!(low_water(remaining, cap), 1, "{remaining}");
        }
        // A 4 MiB chunk's payload: the cap, until the end is near.
        assert_eq!(low_water(4 << 20, cap), cap);
        let mut last = 1;
        for remaining in (0..(1usize << 20)).step_by(997).chain([usize::MAX]) {
            let m = low_water(remaining, cap);
            // At least one byte, at most the cap, never more than is certain to arrive.
            assert!(m >= 1 && m <= cap, "{remaining}: {m}");
            assert!(m == 1 || m <= remaining - LOW_WATER_SLACK, "{remaining}: {m}");
            // More still to come never lowers the mark.
            assert!(m >= last, "{remaining}: {m} < {last}");
            last = m;
        }
        // A socket whose buffer leaves no room for a mark gets none.
        assert_eq!(low_water(4 << 20, 1), 1);
        assert_eq!(low_water(4 << 20, 0), 1);
    }

    #[test]
    fn the_kernel_takes_the_low_water_mark() {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        assert!(set_rcvlowat(&s, 65_536));
        assert_eq!(s.recv_lowat_for_test(), 65_536);
        assert!(set_rcvlowat(&s, 1));
        assert_eq!(s.recv_lowat_for_test(), 1);
    }

    /// `SO_RCVLOWAT` as the kernel reports it.
    trait RecvLowat {
        fn recv_lowat_for_test(&self) -> libc::c_int;
    }

    impl RecvLowat for socket2::Socket {
        fn recv_lowat_for_test(&self) -> libc::c_int {
            use std::os::fd::AsRawFd;
            let mut v: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: `self` owns a live socket for the call; a pointer to a local `c_int` and
            // its size, as getsockopt(2) requires; the kernel writes at most `len` bytes.
            let rc = unsafe {
                libc::getsockopt(
                    self.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVLOWAT,
                    (&mut v as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            assert_eq!(rc, 0);
            v
        }
    }

    #[test]
    fn buffers_follow_the_bdp_over_the_connections() {
        let t = LinkTuning { bandwidth_bps: 10e9, rtt: Duration::from_millis(100), ..LinkTuning::default() };
        // 125 MB BDP, 2× over 4 connections = 62.5 MB, capped at the 32 MiB socket buffer.
        assert_eq!(tcp_buffer(&t, 4), 32 << 20);
        let t = LinkTuning { bandwidth_bps: 1e9, rtt: Duration::from_millis(50), ..LinkTuning::default() };
        // 6.25 MB BDP, 2× over 2 = 6.25 MB.
        assert_eq!(tcp_buffer(&t, 2), 6_250_000);
        assert_eq!(tcp_buffer(&t, 16), 4 << 20);
        assert_eq!(tcp_buffer(&LinkTuning::quinn_defaults(), 4), 0);
    }
}
