//! Bounds on the daemon's gRPC listeners (router API, plaintext or TLS; the Engine API
//! socket), so that idle, slow or flooding clients cannot hold the daemon's fds, tasks or
//! migration slots (`[listeners]`, `limits.stream_stall_ms`).
//!
//! - A [`ConnTable`] per listener admits each accepted connection ([`ConnTable::admit`]):
//!   at `listeners.max_connections` the connection idle longest (no request in flight) is
//!   closed to make room; when every connection is busy the new one is closed instead.
//! - [`Guarded`] wraps an admitted connection's byte stream: it notes the first byte read and
//!   fails every read and write once the table has closed the connection, which makes hyper
//!   drop the connection (and its fd) at once.
//! - [`EdgeLayer`] (a tower layer on the gRPC server) counts the requests in flight per
//!   connection, from the request's arrival until its response body is dropped, and watches
//!   each response body: a body that handed hyper a frame which hyper could not send (the
//!   client stopped reading, e.g. a zero flow-control window) for `limits.stream_stall_ms` is
//!   *stalled*. It also answers the decoder's oversized-message status as the proto documents
//!   (RESOURCE_EXHAUSTED, not tonic's OUT_OF_RANGE; no handler of ours returns OUT_OF_RANGE).
//! - [`ConnTable::sweep`], run periodically ([`sweeper`]), closes connections that sent no
//!   byte within `listeners.handshake_timeout_ms`, that had no request in flight for
//!   `listeners.idle_timeout_ms`, or that hold a stalled stream.
//!
//! HTTP/2 keepalive pings (set on the servers, [`KEEPALIVE_INTERVAL`]) close connections
//! whose peer stopped answering while a request is in flight. Owns no socket: the listeners
//! stay in `lib.rs` and `router_tls.rs`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use kvferry_pool::sync::LockExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// HTTP/2 keepalive: the servers ping every connection this often...
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// ...and close it when a ping is not answered within this.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Why a connection was closed by its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// At the connection cap, to make room for a new connection (it was idle longest).
    Evicted,
    /// At the connection cap with every connection busy: the new connection was closed.
    Refused,
    /// No byte (or no TLS handshake) within `listeners.handshake_timeout_ms`.
    Handshake,
    /// No request in flight for `listeners.idle_timeout_ms`.
    Idle,
    /// A response stream could not take its next frame for `limits.stream_stall_ms`.
    Stalled,
}

impl CloseReason {
    /// Every reason, in metric order.
    pub const ALL: [CloseReason; 5] =
        [Self::Evicted, Self::Refused, Self::Handshake, Self::Idle, Self::Stalled];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Evicted => "evicted",
            Self::Refused => "refused",
            Self::Handshake => "handshake",
            Self::Idle => "idle",
            Self::Stalled => "stalled",
        }
    }
}

/// The bounds a table enforces.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub handshake: Duration,
    pub idle: Duration,
    pub stall: Duration,
}

impl ConnLimits {
    /// The limits of `cfg`.
    pub fn of(cfg: &crate::Config) -> Self {
        let l = &cfg.listeners;
        Self {
            max_connections: l.max_connections as usize,
            handshake: Duration::from_millis(l.handshake_timeout_ms),
            idle: Duration::from_millis(l.idle_timeout_ms),
            stall: Duration::from_millis(cfg.limits.stream_stall_ms),
        }
    }

    /// How often [`sweeper`] checks: a quarter of the shortest bound, 50 ms to 1 s.
    pub fn sweep_every(&self) -> Duration {
        (self.handshake.min(self.idle).min(self.stall) / 4)
            .clamp(Duration::from_millis(50), Duration::from_secs(1))
    }
}

/// One listener's live connections.
#[derive(Debug)]
pub struct ConnTable {
    /// The listener's name (metric label).
    pub name: &'static str,
    pub limits: ConnLimits,
    conns: Mutex<HashMap<u64, Arc<ConnState>>>,
    next_id: AtomicU64,
    closed: [AtomicU64; 5],
}

/// One connection's state, shared by its stream ([`Guarded`]), its requests ([`EdgeLayer`],
/// through the request's extensions as [`ConnInfo`]) and its table.
#[derive(Debug)]
pub struct ConnState {
    id: u64,
    opened: Instant,
    /// A byte was read (or the TLS handshake finished).
    seen: AtomicBool,
    /// Requests in flight.
    active: AtomicUsize,
    /// When the last request ended (or the connection opened).
    idle_since: Mutex<Instant>,
    /// Per request in flight: since when its response body has a frame hyper has not taken
    /// (None: it has none).
    bodies: Mutex<HashMap<u64, Option<Instant>>>,
    next_body: AtomicU64,
    closed: AtomicBool,
    waker: Mutex<Option<Waker>>,
    /// Notified when the table closes the connection (for a TLS handshake in progress).
    pub closing: tokio::sync::Notify,
    table: Weak<ConnTable>,
}

impl ConnState {
    /// Closes the connection: its stream's next read or write fails.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.closing.notify_waiters();
        if let Some(w) = self.waker.locked().take() {
            w.wake();
        }
    }

    /// Whether the table closed the connection.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Marks the handshake done (the TLS handshake finished; a plaintext byte arrived).
    pub fn mark_seen(&self) {
        self.seen.store(true, Ordering::Release);
    }

    fn begin(self: &Arc<Self>) -> RequestGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        let body = self.next_body.fetch_add(1, Ordering::Relaxed);
        self.bodies.locked().insert(body, None);
        RequestGuard { conn: self.clone(), body }
    }

    /// Why the connection should be closed now, if it should.
    fn verdict(&self, limits: &ConnLimits, now: Instant) -> Option<CloseReason> {
        if !self.seen.load(Ordering::Acquire) {
            return (now.saturating_duration_since(self.opened) >= limits.handshake)
                .then_some(CloseReason::Handshake);
        }
        let stalled = self
            .bodies
            .locked()
            .values()
            .any(|since| since.is_some_and(|s| now.saturating_duration_since(s) >= limits.stall));
        if stalled {
            return Some(CloseReason::Stalled);
        }
        let idle = self.active.load(Ordering::Acquire) == 0
            && now.saturating_duration_since(*self.idle_since.locked()) >= limits.idle;
        idle.then_some(CloseReason::Idle)
    }
}

/// What the gRPC server puts in each request's extensions: the request's connection, and the
/// process at its other end where the socket says (a Unix socket's peer credentials).
#[derive(Debug, Clone)]
pub struct ConnInfo(pub Arc<ConnState>, pub Option<u32>);

/// The process at the other end of a connection, where the socket can tell.
pub trait PeerProcess {
    /// Its pid (`None`: not a local socket, or not in this pid namespace).
    fn peer_pid(&self) -> Option<u32> {
        None
    }
}

impl PeerProcess for tokio::net::UnixStream {
    fn peer_pid(&self) -> Option<u32> {
        let pid = self.peer_cred().ok()?.pid()?;
        u32::try_from(pid).ok().filter(|p| *p > 0)
    }
}

impl PeerProcess for tokio::net::TcpStream {}

/// A request in flight; dropped with its response body.
#[derive(Debug)]
pub struct RequestGuard {
    conn: Arc<ConnState>,
    body: u64,
}

impl RequestGuard {
    fn frame_pending(&self, pending: bool) {
        // Each poll means hyper took the previous frame: a new frame restarts the clock.
        if let Some(since) = self.conn.bodies.locked().get_mut(&self.body) {
            *since = pending.then(Instant::now);
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.conn.bodies.locked().remove(&self.body);
        *self.conn.idle_since.locked() = Instant::now();
        self.conn.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection the table admitted; it leaves the table when dropped.
#[derive(Debug)]
pub struct Admission {
    pub state: Arc<ConnState>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(t) = self.state.table.upgrade() {
            t.conns.locked().remove(&self.state.id);
        }
    }
}

impl ConnTable {
    /// An empty table for the listener `name`.
    pub fn new(name: &'static str, limits: ConnLimits) -> Arc<Self> {
        Arc::new(Self {
            name,
            limits,
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            closed: Default::default(),
        })
    }

    fn count(&self, r: CloseReason) {
        let i = CloseReason::ALL.iter().position(|&x| x == r).unwrap_or(0);
        self.closed[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Connections closed by this table for `r` so far.
    pub fn closed(&self, r: CloseReason) -> u64 {
        let i = CloseReason::ALL.iter().position(|&x| x == r).unwrap_or(0);
        self.closed[i].load(Ordering::Relaxed)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.conns.locked().len()
    }

    /// Admits a new connection, closing the connection idle longest when at the cap; `None`
    /// (the caller drops the connection) when every connection is busy.
    pub fn admit(self: &Arc<Self>) -> Option<Admission> {
        let mut conns = self.conns.locked();
        if conns.len() >= self.limits.max_connections {
            let victim = conns
                .values()
                .filter(|c| c.active.load(Ordering::Acquire) == 0)
                .min_by_key(|c| *c.idle_since.locked())
                .map(|c| c.id);
            match victim.and_then(|id| conns.remove(&id)) {
                Some(v) => {
                    v.close();
                    self.count(CloseReason::Evicted);
                }
                None => {
                    self.count(CloseReason::Refused);
                    tracing::warn!(
                        listener = self.name,
                        max = self.limits.max_connections,
                        "connection refused: every connection is busy (listeners.max_connections)"
                    );
                    return None;
                }
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let state = Arc::new(ConnState {
            id,
            opened: now,
            seen: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            idle_since: Mutex::new(now),
            bodies: Mutex::new(HashMap::new()),
            next_body: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            waker: Mutex::new(None),
            closing: tokio::sync::Notify::new(),
            table: Arc::downgrade(self),
        });
        conns.insert(id, state.clone());
        Some(Admission { state })
    }

    /// Closes every connection past a bound; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let doomed: Vec<(Arc<ConnState>, CloseReason)> = {
            let mut conns = self.conns.locked();
            let ids: Vec<(u64, CloseReason)> =
                conns.values().filter_map(|c| Some((c.id, c.verdict(&self.limits, now)?))).collect();
            ids.into_iter().filter_map(|(id, r)| Some((conns.remove(&id)?, r))).collect()
        };
        for (c, r) in &doomed {
            self.count(*r);
            if *r == CloseReason::Stalled {
                tracing::warn!(
                    listener = self.name,
                    stall_ms = self.limits.stall.as_millis() as u64,
                    "closing a connection whose client stopped reading a response (limits.stream_stall_ms)"
                );
            } else {
                tracing::debug!(listener = self.name, reason = r.as_str(), "closing a connection");
            }
            c.close();
        }
        doomed.len()
    }

    /// Prometheus lines for this listener.
    pub fn render(&self) -> String {
        let mut out = format!("kvferry_connections_open{{listener=\"{}\"}} {}\n", self.name, self.open());
        for r in CloseReason::ALL {
            out += &format!(
                "kvferry_connections_closed_total{{listener=\"{}\",reason=\"{}\"}} {}\n",
                self.name,
                r.as_str(),
                self.closed(r)
            );
        }
        out
    }
}

/// Sweeps `tables` until aborted.
pub async fn sweeper(tables: Vec<Arc<ConnTable>>) {
    let every = tables.iter().map(|t| t.limits.sweep_every()).min().unwrap_or(Duration::from_secs(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        for t in &tables {
            t.sweep(now);
        }
    }
}

/// An admitted connection's byte stream.
#[derive(Debug)]
pub struct Guarded<IO> {
    io: IO,
    admission: Admission,
}

impl<IO> Guarded<IO> {
    /// Wraps `io`, admitted as `admission`.
    pub fn new(io: IO, admission: Admission) -> Self {
        Self { io, admission }
    }

    fn state(&self) -> &ConnState {
        &self.admission.state
    }

    fn check(&self, cx: &Context<'_>) -> std::io::Result<()> {
        let s = self.state();
        {
            let mut w = s.waker.locked();
            if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *w = Some(cx.waker().clone());
            }
        }
        if s.is_closed() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "closed by the listener's bounds",
            ));
        }
        Ok(())
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.check(cx)?;
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state().mark_seen();
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guarded<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.check(cx)?;
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.check(cx)?;
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: PeerProcess> tonic::transport::server::Connected for Guarded<IO> {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        ConnInfo(self.admission.state.clone(), self.io.peer_pid())
    }
}

/// Admits each connection of `incoming` into `table` (dropping those refused) and wraps it.
pub fn guard<S, IO>(
    incoming: S,
    table: Arc<ConnTable>,
) -> impl tokio_stream::Stream<Item = std::io::Result<Guarded<IO>>>
where
    S: tokio_stream::Stream<Item = std::io::Result<IO>>,
{
    use tokio_stream::StreamExt;
    incoming.filter_map(move |io| match io {
        Ok(io) => table.admit().map(|a| Ok(Guarded::new(io, a))),
        Err(e) => Some(Err(e)),
    })
}

/// The tower layer on the gRPC servers: per-request bookkeeping for [`ConnTable`], and the
/// documented status for oversized messages.
#[derive(Debug, Clone, Copy, Default)]
pub struct EdgeLayer;

impl<S> tower::Layer<S> for EdgeLayer {
    type Service = Edge<S>;
    fn layer(&self, inner: S) -> Edge<S> {
        Edge { inner }
    }
}

/// [`EdgeLayer`]'s service.
#[derive(Debug, Clone)]
pub struct Edge<S> {
    inner: S,
}

/// gRPC status codes the edge rewrites: tonic's decoder answers a message over the size limit
/// with OUT_OF_RANGE; the proto documents RESOURCE_EXHAUSTED for an oversized request.
const GRPC_OUT_OF_RANGE: &str = "11";
const GRPC_RESOURCE_EXHAUSTED: &str = "8";

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for Edge<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<EdgeBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let guard = req.extensions().get::<ConnInfo>().map(|c| c.0.begin());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            let h = resp.headers_mut();
            if h.get("grpc-status").is_some_and(|v| v == GRPC_OUT_OF_RANGE) {
                h.insert("grpc-status", http::HeaderValue::from_static(GRPC_RESOURCE_EXHAUSTED));
            }
            Ok(resp.map(|inner| EdgeBody { inner, guard }))
        })
    }
}

/// A response body that tells its connection whether it has a frame hyper has not taken.
#[derive(Debug)]
pub struct EdgeBody<B> {
    inner: B,
    guard: Option<RequestGuard>,
}

impl<B: http_body::Body + Unpin> http_body::Body for EdgeBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Some(g) = &self.guard {
            // A frame handed over is "pending" until hyper polls again (it polls again once
            // the frame is sent): a body not polled since is a client not reading.
            g.frame_pending(matches!(r, Poll::Ready(Some(Ok(_)))));
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize) -> ConnLimits {
        ConnLimits {
            max_connections: max,
            handshake: Duration::from_secs(1),
            idle: Duration::from_secs(10),
            stall: Duration::from_secs(5),
        }
    }

    #[test]
    fn at_the_cap_the_longest_idle_connection_makes_room_and_busy_ones_never_do() {
        let t = ConnTable::new("t", limits(2));
        let a = t.admit().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let b = t.admit().unwrap();
        let c = t.admit().unwrap();
        assert!(a.state.is_closed(), "the oldest idle connection is evicted");
        assert!(!b.state.is_closed());
        assert_eq!((t.open(), t.closed(CloseReason::Evicted)), (2, 1));
        let (_gb, _gc) = (b.state.begin(), c.state.begin());
        assert!(t.admit().is_none(), "every connection busy: the new one is refused");
        assert_eq!(t.closed(CloseReason::Refused), 1);
        drop((a, b, c));
        assert_eq!(t.open(), 0, "admissions leave the table when dropped");
    }

    #[test]
    fn the_sweep_closes_silent_idle_and_stalled_connections_only() {
        let t = ConnTable::new("t", limits(10));
        let t0 = Instant::now();
        let silent = t.admit().unwrap();
        let idle = t.admit().unwrap();
        idle.state.mark_seen();
        let busy = t.admit().unwrap();
        busy.state.mark_seen();
        let g = busy.state.begin();
        let stalled = t.admit().unwrap();
        stalled.state.mark_seen();
        let s = stalled.state.begin();
        s.frame_pending(true);
        assert_eq!(t.sweep(t0), 0);
        assert_eq!(t.sweep(t0 + Duration::from_secs(2)), 1, "no byte within the handshake bound");
        assert!(silent.state.is_closed());
        assert_eq!(t.sweep(t0 + Duration::from_secs(6)), 1, "a frame not taken for the stall bound");
        assert!(stalled.state.is_closed());
        assert_eq!(t.sweep(t0 + Duration::from_secs(11)), 1, "no request for the idle bound");
        assert!(idle.state.is_closed() && !busy.state.is_closed());
        g.frame_pending(true);
        g.frame_pending(false);
        assert_eq!(t.sweep(t0 + Duration::from_secs(100)), 0, "a request in flight, its frames taken");
        drop(g);
        assert_eq!(t.sweep(Instant::now() + Duration::from_secs(11)), 1);
        assert_eq!(
            [CloseReason::Handshake, CloseReason::Stalled, CloseReason::Idle].map(|r| t.closed(r)),
            [1, 1, 2]
        );
    }
}
