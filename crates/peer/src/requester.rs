//! The requester driver: `PeerNode::fetch` runs one `kvferry_wire::Requester` core over a
//! link ([`crate::link`]: a cached QUIC connection or a TCP session). Reader tasks (the QUIC
//! connection's [`crate::router`], or one per TCP data connection) pull chunks off the data
//! channels into staging; this task feeds them to the core, lands each verified chunk through
//! the [`ChunkSink`], sends what the core asks for, and wakes for the core's timer at
//! [`Requester::poll_timeout`]. A lost connection resumes on a new one from the verified
//! chunks, within the deadline.
//!
//! Striping (`LinkTuning::stripes` > 1, QUIC only, enough blocks): the requested blocks are
//! split into contiguous ranges ([`crate::stripe::stripe_ranges`]); each range is fetched as
//! its own transfer — its own core, transfer id and resume logic, exactly the unstriped path —
//! on its own cached connection (cache key: peer and stripe index), each in its own task, all
//! at once. A stripe's chunks land through a sink that shifts their blocks to the range's
//! offset. The fetch is `Ok` only when every stripe committed; the first stripe that fails
//! (after its own retries) aborts the others and its error is the fetch's.
//!
//! A fetch that returns `Ok` has landed every byte of every held block, each verified; the
//! caller may mark those blocks valid then and only then. On `Err`, nothing is valid.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvferry_wire::frame::{BlockHash, FetchRequest, Frame, RefusalCode};
use kvferry_wire::{ChunkSpec, ChunkVerdict, LocalError, Requester, RequesterConfig, State, WireError};
use tokio::sync::mpsc;

use crate::io::{AbortOnDrop, BoxFut, ChunkError, ChunkSink, control_reader, write_frame};
use crate::link::TransportChoice;
use crate::link::{Link, LinkInfo};
use crate::node::PeerNode;
use crate::router::{ChunkItem, Route, read_chunks};
use crate::tls::RegionId;
use kvferry_pool::sync::LockExt;

/// A received chunk: header, payload, and its lease on the fetch staging budget.
type Chunk = (kvferry_wire::ChunkHeader, crate::recvbuf::RecvBuf, crate::budget::Lease);

/// The most chunks held while the manifest is still on its way. Chunks follow the manifest
/// out of the owner, so only the few already in flight on the data streams can overtake it;
/// the bound only keeps a misbehaving owner from parking staging here.
const MAX_EARLY_CHUNKS: usize = 64;

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
    /// Time until every chunk of the first layer group had verified (striped: of every
    /// stripe's first layer group).
    pub first_layer: Option<Duration>,
    /// Payload bits per second over the wall time.
    pub goodput_bps: f64,
    /// Connection RTT at the end (striped: the longest of the stripes').
    pub rtt: Duration,
    /// Connections lost and resumed (striped: summed over the stripes).
    pub reconnects: u32,
    /// Chunks that failed verification and were fetched again.
    pub chunks_refetched: u32,
    /// What carried the (last connection of the) fetch; `stripes` says over how many
    /// connections it ran.
    pub link: LinkInfo,
}

impl PeerNode {
    /// Fetches blocks from `peer` into `sink`. `Ok` means every held block landed verified.
    /// Over QUIC with `stripes` > 1 and enough blocks, the fetch runs striped (see the module
    /// doc); otherwise as one transfer on one connection.
    pub async fn fetch(
        self: &Arc<Self>,
        peer: &RegionId,
        addr: SocketAddr,
        spec: FetchSpec,
        sink: Arc<dyn ChunkSink>,
    ) -> Result<FetchReceipt, WireError> {
        let ranges = self.stripe_plan(peer, &spec);
        if ranges.len() <= 1 {
            return self.fetch_stripe(peer, addr, spec, sink, 0).await;
        }
        self.fetch_striped(peer, addr, spec, sink, ranges).await
    }

    /// The block ranges of `spec`'s stripes toward `peer` (one range: unstriped).
    fn stripe_plan(&self, peer: &RegionId, spec: &FetchSpec) -> Vec<Range<u32>> {
        let blocks = spec.hashes.len().min(u32::MAX as usize) as u32;
        let want = self.cfg.tuning.stripes;
        if want <= 1 || self.transport_choice(peer) != TransportChoice::Quic {
            return std::iter::once(0..blocks).collect();
        }
        let block_bytes = u64::from(spec.layers).saturating_mul(spec.bytes_per_block_layer);
        let min = crate::stripe::min_blocks_per_stripe(self.cfg.chunk_target_bytes, block_bytes);
        crate::stripe::stripe_ranges(blocks, want, min)
    }

    /// Runs every stripe in its own task and folds their receipts into one.
    async fn fetch_striped(
        self: &Arc<Self>,
        peer: &RegionId,
        addr: SocketAddr,
        spec: FetchSpec,
        sink: Arc<dyn ChunkSink>,
        ranges: Vec<Range<u32>>,
    ) -> Result<FetchReceipt, WireError> {
        let t0 = Instant::now();
        let k = ranges.len();
        // Dropping the set (an error below, or the caller dropping this future) aborts every
        // stripe still running.
        let mut set = tokio::task::JoinSet::new();
        for (i, r) in ranges.iter().enumerate() {
            let part =
                FetchSpec { hashes: spec.hashes[r.start as usize..r.end as usize].to_vec(), ..spec.clone() };
            let shifted: Arc<dyn ChunkSink> = Arc::new(OffsetSink { inner: sink.clone(), offset: r.start });
            let (node, peer) = (self.clone(), peer.clone());
            set.spawn(async move { (i, node.fetch_stripe(&peer, addr, part, shifted, i as u32).await) });
        }
        let mut done: Vec<Option<Option<FetchReceipt>>> = (0..k).map(|_| None).collect();
        while let Some(joined) = set.join_next().await {
            let (i, r) =
                joined.map_err(|e| LocalError::Setup(format!("a fetch stripe's task failed: {e}")))?;
            done[i] = Some(match r {
                Ok(receipt) => Some(receipt),
                // A later stripe's blocks not held: the owner holds a shorter prefix. Not an
                // error by itself: the valid prefix ends before this stripe.
                Err(WireError::Refused { code: RefusalCode::UnknownBlocks, .. }) if i > 0 => None,
                Err(e) => {
                    tracing::info!(peer = %peer, stripe = i, error = %e, "fetch stripe failed; cancelling the others");
                    set.abort_all();
                    return Err(e);
                }
            });
        }
        let parts: Vec<Option<FetchReceipt>> = done.into_iter().map(Option::flatten).collect();
        let wall = t0.elapsed();
        let mut out = fold_stripes(&ranges, &parts, wall);
        out.link.stripes = k as u32;
        if let Some((l, _, _)) = self.last_link.locked().get_mut(peer) {
            l.stripes = k as u32;
        }
        Ok(out)
    }

    /// One transfer on stripe `stripe`'s connection (stripe 0: the unstriped fetch).
    async fn fetch_stripe(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        spec: FetchSpec,
        sink: Arc<dyn ChunkSink>,
        stripe: u32,
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
            match self.run_fetch(peer, addr, stripe, &mut core, request, &sink, &mut stats).await {
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
                    self.conns.locked().remove(&(peer.clone(), stripe));
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

    #[allow(clippy::too_many_arguments)]
    async fn run_fetch(
        &self,
        peer: &RegionId,
        addr: SocketAddr,
        stripe: u32,
        core: &mut Requester,
        request: FetchRequest,
        sink: &Arc<dyn ChunkSink>,
        stats: &mut RunStats,
    ) -> Result<Link, WireError> {
        let t0 = stats.t0;
        let remaining = stats.deadline.saturating_duration_since(Instant::now());
        let conn = tokio::time::timeout(
            remaining,
            self.link_stripe(peer, addr, self.cfg.tuning.tcp_connections(), stripe),
        )
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
        // Chunks that overtook the manifest (they ride other streams), fed again after it.
        let mut early: Vec<Chunk> = Vec::new();

        loop {
            // The core's next timer; with none (the transfer ended) the loop ends below.
            let due = core.poll_timeout().map_or(Duration::from_secs(86_400), Duration::from_nanos);
            tokio::select! {
                msg = ctl_rx.recv() => match msg {
                    Some(Ok(Frame::Manifest(m))) => {
                        core.on_manifest(ns_since(t0), &m)?;
                        for item in std::mem::take(&mut early) {
                            self.take_chunk(core, sink, stats, item).await?;
                        }
                    }
                    Some(Ok(Frame::Refusal(r))) => return Err(core.on_refusal(&r)),
                    Some(Ok(Frame::Done(d))) => core.on_done(ns_since(t0), &d)?,
                    Some(Ok(Frame::Cancel(c))) => return Err(core.cancel(&c.detail)),
                    Some(Ok(other)) => return Err(core.cancel(&format!("unexpected frame {other:?}"))),
                    Some(Err(e)) => return Err(e),
                    None => return Err(WireError::Connection("control stream closed".into())),
                },
                chunk = chunk_rx.recv() => match chunk {
                    Some(Ok(item)) => {
                        if let Some(item) = self.take_chunk(core, sink, stats, item).await?
                            && early.len() < MAX_EARLY_CHUNKS
                        {
                            // Past the bound it is dropped: the grace after `Done` asks again.
                            early.push(item);
                        }
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

    /// Feeds one received chunk to the core and lands it if it verified; hands it back when it
    /// arrived before the manifest ([`ChunkVerdict::Early`]), lease and all.
    async fn take_chunk(
        &self,
        core: &mut Requester,
        sink: &Arc<dyn ChunkSink>,
        stats: &mut RunStats,
        (h, payload, lease): Chunk,
    ) -> Result<Option<Chunk>, WireError> {
        let (payload, summed) = crate::offload::sum(h.transfer_id, h.chunk_id, payload).await?;
        let verdict = core.on_chunk_summed(ns_since(stats.t0), &h, &summed);
        if let Err(WireError::TooManyRetries { .. }) = verdict {
            self.verify_failures.fetch_add(1, Ordering::Relaxed);
        }
        match verdict? {
            ChunkVerdict::Land(spec) => {
                if let Err(e) = crate::offload::land(sink, spec, payload).await {
                    let _ = core.cancel(&format!("landing failed: {e}"));
                    return Err(e.into());
                }
                if stats.first_layer.is_none() && core.first_layer_verified() {
                    stats.first_layer = Some(stats.t0.elapsed());
                }
            }
            ChunkVerdict::Corrupt { chunk } => {
                stats.refetched += 1;
                self.verify_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(chunk, "chunk failed verification; refetching");
            }
            ChunkVerdict::Early => return Ok(Some((h, payload, lease))),
            ChunkVerdict::Duplicate | ChunkVerdict::Ignored => {}
        }
        drop(lease);
        Ok(None)
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
                        let recv = crate::link::RecvHalf::tcp(tls).0;
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

/// A stripe's sink: its chunks name blocks of its range, landed at the range's offset in the
/// whole fetch.
struct OffsetSink {
    inner: Arc<dyn ChunkSink>,
    offset: u32,
}

impl ChunkSink for OffsetSink {
    fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>> {
        let shifted =
            ChunkSpec { blocks: (spec.blocks.0 + self.offset, spec.blocks.1 + self.offset), ..spec };
        self.inner.land(shifted, payload)
    }
}

/// One receipt from the stripes' (in stripe order; `None`: the owner held none of that
/// stripe's blocks). Valid blocks are the prefix up to the first stripe that did not get its
/// whole range; bytes, reconnects and refetches are summed; the first layer is in when every
/// stripe's first layer group verified.
fn fold_stripes(ranges: &[Range<u32>], parts: &[Option<FetchReceipt>], wall: Duration) -> FetchReceipt {
    let mut blocks = 0;
    for (r, p) in ranges.iter().zip(parts) {
        let got = p.as_ref().map_or(0, |p| p.blocks);
        blocks += got;
        if got < r.end - r.start {
            break;
        }
    }
    let got: Vec<&FetchReceipt> = parts.iter().flatten().collect();
    let bytes = got.iter().map(|p| p.bytes).sum::<u64>();
    let first_layer =
        got.iter().map(|p| p.first_layer).collect::<Option<Vec<_>>>().and_then(|v| v.into_iter().max());
    FetchReceipt {
        blocks,
        bytes,
        wall,
        first_layer,
        goodput_bps: bytes as f64 * 8.0 / wall.as_secs_f64().max(1e-9),
        rtt: got.iter().map(|p| p.rtt).max().unwrap_or_default(),
        reconnects: got.iter().map(|p| p.reconnects).sum(),
        chunks_refetched: got.iter().map(|p| p.chunks_refetched).sum(),
        link: got.first().map(|p| p.link.clone()).unwrap_or(LinkInfo {
            transport: crate::link::Transport::Quic,
            congestion: String::new(),
            channels: 0,
            stripes: 0,
        }),
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

fn ns_since(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}
