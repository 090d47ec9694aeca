//! A region's peer endpoint: one quinn endpoint per daemon, both server and client. This file
//! owns the endpoint's state and its connection cache (one outgoing connection per peer and
//! stripe — stripe 0 carries queries, probes and unstriped fetches; a striped fetch adds
//! stripes 1.. — each reused until it closes); the jobs on it live beside it, each in its own module:
//!
//! - `budget.rs`: the two staging budgets (serving, fetching), bounded in bytes;
//! - `router.rs`: per-connection routing of incoming chunk streams to their transfer;
//! - `requester.rs`: the requester driver (`fetch`) around `kvferry_wire::Requester`, one
//!   core per stripe (the split is `stripe.rs`, pure);
//! - `owner.rs`: the owner driver (`start`, the accept loop, serving a transfer) around
//!   `kvferry_wire::Owner`;
//! - `query.rs` and `probe.rs`: `Query` and `Probe` on a cached connection;
//! - `link.rs`: the transport abstraction both drivers run on, and the choice of transport per
//!   peer (QUIC, TCP, or QUIC with a fallback to TCP); `tcp.rs`: the TCP + TLS transport.
//!
//! This module depends on none of them but the budget and the router (the state it holds), so
//! the drivers depend on the node and not the other way round.
//!
//! Certificate rotation ([`PeerNode::reload_tls`]): the node's identity and CA bundle are one
//! value ([`Credentials`]) swapped whole. New handshakes, both ways, use the new one; a
//! connection already open keeps running (its transfers finish) unless its peer's chain no
//! longer verifies against the new bundle: then it is *retired* — taken out of the connection
//! cache so that nothing new starts on it, and closed once no transfer, query or probe uses it
//! (counted per connection by `PeerNode::in_use`). TCP sessions live as long as their job:
//! a reload counts the open ones as kept or retired the same way, and a retired one simply
//! ends with its job.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_wire::frame::{FetchRequest, RefusalCode};
use kvferry_wire::{LocalError, WireError};
use quinn::crypto::rustls::QuicClientConfig;
use quinn::{Connection, Endpoint, VarInt};
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, UnixTime};

use crate::budget::Budget;
use crate::io::{ChunkSource, conn_err, from_conn_error};
use crate::link::{Link, LinkId, LinkInfo, TransportChoice};
use crate::router::{StreamRouter, route_streams};
use crate::tls::{
    IdentityError, PeerSide, RegionId, TlsIdentity, TrustPolicy, chain_still_trusted, check_identity,
    client_crypto,
};
use crate::transport::LinkTuning;
use kvferry_pool::sync::LockExt;

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
    /// The egress cap toward this peer, bits/s (0: none); reported in the query's load report.
    pub egress_cap_bps: u64,
}

/// Decides what a peer may fetch: tenant, fingerprint, and which blocks are held.
pub trait BlockCatalog: Send + Sync {
    /// Accepts (with what is held) or refuses a request from `peer`. Runs before any KV byte
    /// is read.
    fn open(&self, peer: &RegionId, req: &FetchRequest) -> Result<Served, (RefusalCode, String)>;
}

/// How a fetch rides out faults (policy; the mechanism is the requester driver's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FetchPolicy {
    /// Re-fetches allowed per chunk after it failed verification.
    pub max_retries_per_chunk: u32,
    /// After the owner's `Done`, how long in-flight chunks may take before the missing ones
    /// are asked for again (and again after each unanswered ask).
    pub missing_grace: Duration,
    /// Wait before resuming on a new connection, times the reconnects so far (at most 20).
    pub reconnect_backoff: Duration,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        Self {
            max_retries_per_chunk: 3,
            missing_grace: Duration::from_secs(2),
            reconnect_backoff: Duration::from_millis(50),
        }
    }
}

/// The TLS material a node uses for new handshakes: its identity and the CA bundle peers'
/// chains must verify against. Replaced whole by [`PeerNode::reload_tls`].
#[derive(Debug, Clone)]
pub struct Credentials {
    pub identity: TlsIdentity,
    pub roots: Arc<RootCertStore>,
}

/// What a reload did to the connections it found open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rotation {
    /// Connections whose peer still verifies against the new bundle: kept as they are.
    pub kept: usize,
    /// Connections whose peer no longer verifies: closed once idle, never used again.
    pub retired: usize,
}

/// A retired connection waits at least this long before it is closed, even when idle, so
/// that a job that took it from the cache just before the reload has marked it in use.
const RETIRE_GRACE: Duration = Duration::from_millis(500);

/// Configuration of a peer endpoint.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// The identity at start; [`PeerNode::reload_tls`] may replace it (same region).
    pub identity: TlsIdentity,
    /// Trust at start; a reload replaces its `roots` (trust domain and allow-list stay).
    pub policy: TrustPolicy,
    pub listen: SocketAddr,
    pub tuning: LinkTuning,
    /// Bound on chunk bytes held in staging, per direction (serving, fetching).
    pub staging_bytes: usize,
    /// Chunk size asked for.
    pub chunk_target_bytes: u32,
    /// Fault tolerance of fetches.
    pub fetch: FetchPolicy,
    /// The transport toward peers without their own choice ([`PeerNode::set_transport`]).
    pub transport: TransportChoice,
    /// Where TCP listens; `None`: the QUIC address's IP and port number (TCP, not UDP).
    pub tcp_listen: Option<SocketAddr>,
    /// Under `auto`: how long the QUIC handshake may take before TCP is tried instead.
    pub auto_fallback: Duration,
}

/// A region's peer endpoint.
pub struct PeerNode {
    pub(crate) endpoint: Endpoint,
    pub(crate) cfg: PeerConfig,
    pub(crate) catalog: Arc<dyn BlockCatalog>,
    pub(crate) serve_budget: Arc<Budget>,
    pub(crate) fetch_budget: Arc<Budget>,
    /// Outgoing connections by (peer, stripe).
    pub(crate) conns: Mutex<HashMap<(RegionId, u32), Connection>>,
    pub(crate) incoming: Mutex<Vec<Connection>>,
    /// Per outgoing connection: routes incoming chunk streams to their transfer.
    pub(crate) routers: Mutex<HashMap<usize, Arc<StreamRouter>>>,
    /// Transfers being served now.
    pub(crate) serving: AtomicU32,
    /// Chunks fetched from peers that failed verification (each was refetched or ended its
    /// transfer; none was landed).
    pub(crate) verify_failures: AtomicU64,
    /// Identity and roots for new handshakes.
    pub(crate) creds: Mutex<Arc<Credentials>>,
    /// Jobs using each link now.
    pub(crate) uses: Mutex<HashMap<LinkId, u32>>,
    /// Connections retired by a reload, with when; closed once idle.
    pub(crate) retiring: Mutex<Vec<(Connection, Instant)>>,
    /// Whether the task closing retired connections runs.
    pub(crate) reaping: AtomicBool,
    /// Successful reloads so far.
    pub(crate) reloads: AtomicU64,
    /// The TCP transport's listener, live sessions and rendezvous.
    pub(crate) tcp: crate::tcp::TcpState,
    /// Transport per peer, where it differs from the configured default.
    pub(crate) choices: Mutex<HashMap<RegionId, TransportChoice>>,
    /// Peers under `auto` whose QUIC handshake timed out, with when (TCP is used for a while).
    pub(crate) fallen_back: Mutex<HashMap<RegionId, Instant>>,
    /// What carried the last job to each peer, its RTT then, and when.
    pub(crate) last_link: Mutex<HashMap<RegionId, (LinkInfo, Duration, Instant)>>,
}

/// Marks a connection in use by one job until dropped.
pub(crate) struct InUse<'a> {
    node: &'a PeerNode,
    id: LinkId,
}

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        let mut u = self.node.uses.locked();
        if let Some(n) = u.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                u.remove(&self.id);
            }
        }
    }
}

fn peer_chain(conn: &Connection) -> Option<Vec<CertificateDer<'static>>> {
    conn.peer_identity().and_then(|a| a.downcast::<Vec<CertificateDer<'static>>>().ok()).map(|b| *b)
}

impl std::fmt::Debug for PeerNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerNode").field("id", &self.cfg.identity.id).finish_non_exhaustive()
    }
}

impl PeerNode {
    /// Marks `conn` in use by the caller's job (a transfer, served or fetched, a query, a probe)
    /// until the guard drops: a retired connection is closed only when no job uses it.
    pub(crate) fn in_use(&self, link: &Link) -> InUse<'_> {
        let id = link.id();
        *self.uses.locked().entry(id).or_insert(0) += 1;
        InUse { node: self, id }
    }

    /// The identity and roots new handshakes use now.
    pub fn credentials(&self) -> Arc<Credentials> {
        self.creds.locked().clone()
    }

    /// Successful [`PeerNode::reload_tls`] calls so far.
    pub fn tls_reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// Connections retired by a reload and not closed yet (still in use, or in their grace).
    pub fn retiring_connections(&self) -> usize {
        self.retiring.locked().iter().filter(|(c, _)| c.close_reason().is_none()).count()
            + self.tcp.retiring()
    }

    /// Replaces this node's identity and CA bundle without a restart (certificate rotation).
    ///
    /// The candidate is checked first ([`check_identity`]: same region, key matches, chains to
    /// the new bundle); a refused one changes nothing — the old identity keeps serving. Then
    /// new handshakes, accepted and dialled, use the new material; open connections whose peer
    /// still verifies against the new bundle are kept, the others retired (no new job starts
    /// on them; they close once their transfers finished).
    pub fn reload_tls(
        self: &Arc<Self>,
        identity: TlsIdentity,
        roots: Arc<RootCertStore>,
    ) -> Result<Rotation, IdentityError> {
        check_identity(&identity, &roots, &self.cfg.identity.id)?;
        let policy = TrustPolicy { roots: roots.clone(), ..self.cfg.policy.clone() };
        let server = crate::transport::quic_server_config(&identity, &policy, &self.cfg.tuning)?;
        self.endpoint.set_server_config(Some(server));
        *self.creds.locked() = Arc::new(Credentials { identity, roots: roots.clone() });
        self.reloads.fetch_add(1, Ordering::Relaxed);

        let now = UnixTime::now();
        let trusted = |c: &Connection, side| {
            c.close_reason().is_none()
                && peer_chain(c).is_some_and(|chain| chain_still_trusted(&chain, &roots, side, now))
        };
        let mut rotation = Rotation::default();
        let mut retired = Vec::new();
        self.conns.locked().retain(|_, c| {
            if c.close_reason().is_some() {
                false
            } else if trusted(c, PeerSide::Server) {
                rotation.kept += 1;
                true
            } else {
                retired.push(c.clone());
                false
            }
        });
        self.incoming.locked().retain(|c| {
            if c.close_reason().is_some() {
                false
            } else if trusted(c, PeerSide::Client) {
                rotation.kept += 1;
                true
            } else {
                retired.push(c.clone());
                false
            }
        });
        let (tcp_kept, tcp_retired) = self.tcp.rotate(&roots);
        rotation.kept += tcp_kept;
        rotation.retired = retired.len() + tcp_retired;
        if !retired.is_empty() {
            let at = Instant::now();
            self.retiring.locked().extend(retired.into_iter().map(|c| (c, at)));
            if !self.reaping.swap(true, Ordering::AcqRel) {
                tokio::spawn(reap_retired(self.clone()));
            }
        }
        tracing::info!(id = %self.cfg.identity.id, kept = rotation.kept, retired = rotation.retired,
            "peer TLS identity reloaded; new connections use it");
        Ok(rotation)
    }

    /// Chunks fetched by this node that failed verification so far (none of them landed).
    pub fn verify_failures(&self) -> u64 {
        self.verify_failures.load(Ordering::Relaxed)
    }

    /// This endpoint's serving load, as reported to peers that query it.
    pub fn load_report(&self, transfer_id: u128) -> kvferry_wire::frame::LoadReport {
        kvferry_wire::frame::LoadReport {
            transfer_id,
            active_transfers: self.serving.load(Ordering::Relaxed),
            staging_used: self.serve_budget.in_use_kib.load(Ordering::Relaxed) * 1024,
            staging_bound: self.staging_bound(),
            egress_cap_bps: 0,
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr().unwrap_or(self.cfg.listen)
    }

    /// The address TCP listens on.
    pub fn tcp_local_addr(&self) -> SocketAddr {
        self.tcp.local
    }

    /// TCP connections closed in their unauthenticated phase (TLS handshake and preamble)
    /// because more than [`MAX_PENDING_TCP`](crate::MAX_PENDING_TCP) were in it at once.
    pub fn tcp_pending_evicted(&self) -> u64 {
        crate::tcp::evicted_pending(self)
    }

    /// Sets the transport toward `peer` (the configured default otherwise).
    pub fn set_transport(&self, peer: &RegionId, choice: TransportChoice) {
        self.choices.locked().insert(peer.clone(), choice);
    }

    /// What carried the last job to `peer` (none yet: `None`).
    pub fn link_to(&self, peer: &RegionId) -> Option<LinkInfo> {
        self.last_link.locked().get(peer).map(|(l, _, _)| l.clone())
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
        for c in self.conns.locked().drain().map(|(_, c)| c).collect::<Vec<_>>() {
            c.close(VarInt::from_u32(1), b"closed by operator");
        }
        for c in {
            let mut v = self.incoming.locked();
            std::mem::take(&mut *v)
        } {
            c.close(VarInt::from_u32(1), b"closed by operator");
        }
        self.tcp.close_all();
    }

    /// Statistics of every live connection, outgoing (cached per peer) and incoming, for
    /// diagnostics (`udp_tx.datagrams / udp_tx.ios` = GSO batching; `frame_rx`/`frame_tx`
    /// `stream_data_blocked` and `data_blocked` = flow-control windows as the limit).
    pub fn connection_stats(&self) -> Vec<quinn::ConnectionStats> {
        let mut out: Vec<quinn::ConnectionStats> =
            self.conns.locked().values().map(Connection::stats).collect();
        {
            let v = self.incoming.locked();
            out.extend(v.iter().filter(|c| c.close_reason().is_none()).map(Connection::stats));
        }
        out
    }

    /// Current RTT to `peer`, if connected.
    /// (TCP: the RTT of the last job, while it is fresher than the idle timeout.)
    pub fn rtt_to(&self, peer: &RegionId) -> Option<Duration> {
        if let Some(rtt) = self
            .conns
            .locked()
            .get(&(peer.clone(), 0))
            .filter(|c| c.close_reason().is_none())
            .map(Connection::rtt)
        {
            return Some(rtt);
        }
        let last = self.last_link.locked();
        let (l, rtt, at) = last.get(peer)?;
        (l.transport == crate::link::Transport::Tcp && at.elapsed() < self.cfg.tuning.idle_timeout)
            .then_some(*rtt)
    }

    /// Connects to `peer` (or reuses the cached connection).
    pub async fn connect(&self, peer: &RegionId, addr: SocketAddr) -> Result<Connection, WireError> {
        self.connect_stripe(peer, addr, 0).await
    }

    /// Connects to `peer` for stripe `stripe` of a fetch (or reuses that stripe's cached
    /// connection); stripe 0 is [`PeerNode::connect`]'s connection.
    pub(crate) async fn connect_stripe(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        stripe: u32,
    ) -> Result<Connection, WireError> {
        let key = (peer.clone(), stripe);
        if let Some(c) = self.conns.locked().get(&key).cloned()
            && c.close_reason().is_none()
        {
            return Ok(c);
        }
        let creds = self.credentials();
        let tls = client_crypto(&creds.identity, creds.roots.clone(), peer)
            .map_err(|e| LocalError::Setup(e.to_string()))?;
        let quic = QuicClientConfig::try_from(tls).map_err(|e| LocalError::Setup(e.to_string()))?;
        let mut client = quinn::ClientConfig::new(Arc::new(quic));
        client.transport_config(Arc::new(self.cfg.tuning.transport()));
        let connecting = self.endpoint.connect_with(client, addr, "kvferry-peer").map_err(conn_err)?;
        let conn = connecting.await.map_err(|e| from_conn_error(&e))?;
        let router = Arc::new(StreamRouter::default());
        {
            let mut r = self.routers.locked();
            r.retain(|_, router| Arc::strong_count(router) > 1);
            r.insert(conn.stable_id(), router.clone());
        }
        tokio::spawn(route_streams(conn.clone(), self.fetch_budget.clone(), router));
        self.conns.locked().insert(key, conn.clone());
        Ok(conn)
    }
}

/// Closes retired connections once no job uses them (and their grace has passed); ends when
/// none is left.
async fn reap_retired(node: Arc<PeerNode>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let idle: Vec<Connection> = {
            let uses = node.uses.locked();
            let mut r = node.retiring.locked();
            let mut idle = Vec::new();
            r.retain(|(c, at)| {
                if c.close_reason().is_some() {
                    return false;
                }
                if at.elapsed() >= RETIRE_GRACE && !uses.contains_key(&LinkId::Quic(c.stable_id())) {
                    idle.push(c.clone());
                    return false;
                }
                true
            });
            idle
        };
        for c in idle {
            tracing::info!(remote = %c.remote_address(), "closing a connection whose peer the reloaded CA bundle no longer trusts");
            c.close(VarInt::from_u32(4), b"peer no longer trusted after a CA rotation");
        }
        // Decide to stop under the lock that reload_tls extends the list under.
        let r = node.retiring.locked();
        if r.is_empty() {
            node.reaping.store(false, Ordering::Release);
            return;
        }
    }
}
