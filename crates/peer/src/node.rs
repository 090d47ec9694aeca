//! A region's peer endpoint: one quinn endpoint per daemon, both server and client. This file
//! owns the endpoint's state and its connection cache (one outgoing connection per peer,
//! reused until it closes); the jobs on it live beside it, each in its own module:
//!
//! - `budget.rs`: the two staging budgets (serving, fetching), bounded in bytes;
//! - `router.rs`: per-connection routing of incoming chunk streams to their transfer;
//! - `requester.rs`: the requester driver (`fetch`) around `kvferry_wire::Requester`;
//! - `owner.rs`: the owner driver (`start`, the accept loop, serving a transfer) around
//!   `kvferry_wire::Owner`;
//! - `query.rs` and `probe.rs`: `Query` and `Probe` on a cached connection.
//!
//! This module depends on none of them but the budget and the router (the state it holds), so
//! the drivers depend on the node and not the other way round.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry_wire::frame::{FetchRequest, RefusalCode};
use kvferry_wire::{LocalError, WireError};
use quinn::crypto::rustls::QuicClientConfig;
use quinn::{Connection, Endpoint, VarInt};

use crate::budget::Budget;
use crate::io::{ChunkSource, conn_err, from_conn_error};
use crate::router::{StreamRouter, route_streams};
use crate::tls::{RegionId, TlsIdentity, TrustPolicy, client_crypto};
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
    /// Fault tolerance of fetches.
    pub fetch: FetchPolicy,
}

/// A region's peer endpoint.
pub struct PeerNode {
    pub(crate) endpoint: Endpoint,
    pub(crate) cfg: PeerConfig,
    pub(crate) catalog: Arc<dyn BlockCatalog>,
    pub(crate) serve_budget: Arc<Budget>,
    pub(crate) fetch_budget: Arc<Budget>,
    pub(crate) conns: Mutex<HashMap<RegionId, Connection>>,
    pub(crate) incoming: Mutex<Vec<Connection>>,
    /// Per outgoing connection: routes incoming chunk streams to their transfer.
    pub(crate) routers: Mutex<HashMap<usize, Arc<StreamRouter>>>,
    /// Transfers being served now.
    pub(crate) serving: AtomicU32,
    /// Chunks fetched from peers that failed verification (each was refetched or ended its
    /// transfer; none was landed).
    pub(crate) verify_failures: AtomicU64,
}

impl std::fmt::Debug for PeerNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerNode").field("id", &self.cfg.identity.id).finish_non_exhaustive()
    }
}

impl PeerNode {
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
    pub fn rtt_to(&self, peer: &RegionId) -> Option<Duration> {
        self.conns.locked().get(peer).filter(|c| c.close_reason().is_none()).map(Connection::rtt)
    }

    /// Connects to `peer` (or reuses the cached connection).
    pub async fn connect(&self, peer: &RegionId, addr: SocketAddr) -> Result<Connection, WireError> {
        if let Some(c) = self.conns.locked().get(peer).cloned()
            && c.close_reason().is_none()
        {
            return Ok(c);
        }
        let tls = client_crypto(&self.cfg.identity, self.cfg.policy.roots.clone(), peer)
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
        self.conns.locked().insert(peer.clone(), conn.clone());
        Ok(conn)
    }
}
