//! The requester driver: `PeerNode::fetch` runs one `kvferry_wire::Requester` core over a
//! link ([`crate::link`]: a cached QUIC connection or a TCP session). Reader tasks (the QUIC
//! connection's [`crate::router`], or one per TCP data connection) pull chunks off the data
//! channels into staging; this task feeds them to the core, lands each verified chunk through
//! the [`ChunkSink`], sends what the core asks for, and wakes for the core's timer at
//! [`Requester::poll_timeout`]. A lost connection resumes on a new one from the verified
//! chunks, within the deadline.
//!
//! A fetch that returns `Ok` has landed every byte of every held block, each verified; the
//! caller may mark those blocks valid then and only then. On `Err`, nothing is valid.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvferry_wire::frame::{BlockHash, FetchRequest, Frame};
use kvferry_wire::{ChunkVerdict, Requester, RequesterConfig, State, WireError};
use tokio::sync::mpsc;

use crate::io::{AbortOnDrop, ChunkSink, control_reader, write_frame};
use crate::link::{Link, LinkInfo};
use crate::node::PeerNode;
use crate::router::{ChunkItem, Route, read_chunks};
use crate::tls::RegionId;
use kvferry_pool::sync::LockExt;

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
    /// What carried the (last connection of the) fetch.
    pub link: LinkInfo,
}

impl PeerNode {
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
            max_retries_per_chunk: self.cfg.fetch.max_retries_per_chunk,
            deadline_ns,
            missing_grace_ns: self.cfg.fetch.missing_grace.as_nanos() as u64,
            stall_timeout_ns: (self.cfg.tuning.idle_timeout.as_nanos() as u64).max(1_000_000_000),
        };
        let mut core = Requester::new(rand::random(), spec.tenant, spec.fingerprint, spec.hashes, cfg);
        let mut stats = RunStats { t0, deadline: spec.deadline, ..RunStats::default() };
        let mut request = core.request();
        loop {
            match self.run_fetch(peer, addr, &mut core, request, &sink, &mut stats).await {
                Ok(link) => {
                    let wall = t0.elapsed();
                    let info = self.record_link(peer, &link);
                    let bytes = core.verified_bytes();
                    return Ok(FetchReceipt {
                        blocks: core.valid_blocks(),
                        bytes,
                        wall,
                        first_layer: stats.first_layer,
                        goodput_bps: bytes as f64 * 8.0 / wall.as_secs_f64().max(1e-9),
                        rtt: link.rtt(),
                        reconnects: stats.reconnects,
                        chunks_refetched: stats.refetched,
                        link: info,
                    });
                }
                // Resume when the error says a retry can help and the core can go on (a refusal
                // or a failed verification ended the transfer: nothing to resume).
                Err(e) if e.retryable() && !matches!(core.state(), State::Committed | State::Aborted) => {
                    tracing::info!(peer = %peer, error = %e, "connection lost mid-fetch; resuming");
                    self.conns.locked().remove(peer);
                    request = core.on_connection_lost(ns_since(t0))?;
                    stats.reconnects += 1;
                    let backoff = self.cfg.fetch.reconnect_backoff * stats.reconnects.min(20);
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
    ) -> Result<Link, WireError> {
        let t0 = stats.t0;
        let remaining = stats.deadline.saturating_duration_since(Instant::now());
        let conn = tokio::time::timeout(remaining, self.link(peer, addr, self.cfg.tuning.streams.max(1)))
            .await
            .map_err(|_| WireError::DeadlineExceeded)??;
        let _in_use = self.in_use(&conn);
        let (mut ctl_send, ctl_recv) = conn.open_control().await?;

        let (ctl_tx, mut ctl_rx) = mpsc::channel::<Result<Frame, WireError>>(16);
        let ctl_task = tokio::spawn(control_reader(ctl_recv, ctl_tx));
        // Route before asking, so the first chunk always finds its transfer.
        let (mut chunk_rx, _route) = self.chunk_route(&conn, core.transfer_id())?;
        write_frame(&mut ctl_send, &Frame::Request(request)).await?;
        let _guard = AbortOnDrop(vec![ctl_task.abort_handle()]);

        loop {
            // The core's next timer; with none (the transfer ended) the loop ends below.
            let due = core.poll_timeout().map_or(Duration::from_secs(86_400), Duration::from_nanos);
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
                                    let _ = core.cancel(&format!("landing failed: {e}"));
                                    return Err(e.into());
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
                _ = tokio::time::sleep_until((t0 + due).into()) => {
                    core.on_timer(ns_since(t0))?;
                    if core.stalled(ns_since(t0)) {
                        conn.close(b"stalled");
                        return Err(WireError::Connection("transfer stalled".into()));
                    }
                }
            }
            while let Some(f) = core.poll_transmit() {
                write_frame(&mut ctl_send, &f).await?;
            }
            if core.state() == State::Committed {
                ctl_send.finish().await;
                return Ok(conn);
            }
        }
    }

    /// Where transfer `id`'s chunks arrive: QUIC: registered with the connection's router
    /// (unregistered when the guard drops); TCP: one reader per data connection of the session
    /// (aborted when the guard drops).
    fn chunk_route(
        &self,
        link: &Link,
        id: u128,
    ) -> Result<(mpsc::Receiver<ChunkItem>, RouteGuard), WireError> {
        match link {
            Link::Quic(c) => {
                let router = self
                    .routers
                    .locked()
                    .get(&c.stable_id())
                    .cloned()
                    .ok_or_else(|| WireError::Connection("connection has no stream router".into()))?;
                let (rx, reg) = router.register(id);
                Ok((rx, RouteGuard::Quic(reg)))
            }
            Link::Tcp(s) => {
                let (tx, rx) = mpsc::channel(8);
                let readers = s
                    .take_data()
                    .into_iter()
                    .map(|tls| {
                        let recv = crate::link::RecvHalf::Tcp(tokio::io::split(tls).0);
                        let route = Route::Only(id, tx.clone());
                        tokio::spawn(read_chunks(recv, self.fetch_budget.clone(), route)).abort_handle()
                    })
                    .collect();
                Ok((rx, RouteGuard::Tcp(AbortOnDrop(readers))))
            }
        }
    }
}

/// Keeps a transfer's chunk route for as long as the fetch runs on the link.
#[allow(dead_code)] // held for its drop
enum RouteGuard {
    Quic(crate::router::Registration),
    Tcp(AbortOnDrop),
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

fn ns_since(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}
