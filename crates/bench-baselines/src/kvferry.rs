//! kvferry's own peer transport on the same link and at the same size as the baselines,
//! without the daemon: two `PeerNode`s (A serves an in-memory payload, B fetches it and
//! compares every landed chunk with the payload), tuned from the link's bandwidth-delay product
//! as the daemon tunes them (4 data channels, the bench's congestion controller for QUIC, BBR
//! for TCP where the kernel has it), once over QUIC (`kvferry-quic`) and once over TLS 1.3 on
//! TCP (`kvferry-tcp`): the transport choice measured beside the stacks it replaces.
//!
//! Same timing and CPU rules as the other socket baselines (see the crate docs): each side on
//! its own thread with a `current_thread` runtime (the node's tasks, rustls and the
//! verification run there), `wall_s` from the fetch call (handshakes included) to the last
//! verified chunk.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use kvferry_peer::{
    BlockCatalog, BoxFut, ChunkBytes, ChunkError, ChunkSink, ChunkSource, Congestion, FetchSpec, LinkTuning,
    PeerConfig, PeerNode, RegionId, Served, TlsIdentity, TransportChoice, TrustPolicy,
};
use kvferry_wanem::Emulator;
use kvferry_wire::ChunkSpec;
use kvferry_wire::frame::{FetchRequest, RefusalCode};

use crate::pair::{Pki, SideReport, TRUST_DOMAIN, run_pair};
use crate::{BaselineRun, PATTERN_SEED, Pattern, finish, thread_cpu, transfer_timeout};

const LAYERS: u32 = 16;
const BPBL: u64 = 256 << 10;

/// kvferry over QUIC with congestion controller `cc`.
pub fn kvferry_quic(emu: &Emulator, bytes: u64, cc: Congestion) -> anyhow::Result<BaselineRun> {
    run(emu, bytes, TransportChoice::Quic, cc)
}

/// kvferry over TLS 1.3 + TCP (the kernel's BBR where available).
pub fn kvferry_tcp(emu: &Emulator, bytes: u64, cc: Congestion) -> anyhow::Result<BaselineRun> {
    run(emu, bytes, TransportChoice::Tcp, cc)
}

/// The payload's chunk `spec`, located in the flat buffer (chunks tile it: whole layers of
/// every block, or a run of blocks of one layer).
fn span(spec: &ChunkSpec, blocks: u32) -> std::ops::Range<usize> {
    let layers = u64::from(spec.layers.1 - spec.layers.0);
    let at = u64::from(spec.layers.0) * u64::from(blocks) * BPBL + u64::from(spec.blocks.0) * layers * BPBL;
    at as usize..(at + spec.len) as usize
}

struct Piece(Arc<Vec<u8>>, std::ops::Range<usize>);

impl AsRef<[u8]> for Piece {
    fn as_ref(&self) -> &[u8] {
        &self.0[self.1.clone()]
    }
}

/// Serves the payload to any request (the baseline measures the link, not the catalog).
struct Payload {
    bytes: Arc<Vec<u8>>,
    blocks: u32,
}

impl ChunkSource for Payload {
    fn read(&self, spec: ChunkSpec) -> BoxFut<'_, Result<ChunkBytes, ChunkError>> {
        let piece = Piece(self.bytes.clone(), span(&spec, self.blocks));
        Box::pin(async move { Ok(Box::new(piece) as ChunkBytes) })
    }
}

struct Everything(Arc<Payload>);

impl BlockCatalog for Everything {
    fn open(&self, _peer: &RegionId, req: &FetchRequest) -> Result<Served, (RefusalCode, String)> {
        Ok(Served {
            blocks_held: (req.block_hashes.len() as u32).min(self.0.blocks),
            layers: LAYERS,
            bytes_per_block_layer: BPBL,
            source: self.0.clone(),
            egress_cap_bps: 0,
        })
    }
}

/// Compares every landed chunk with the payload.
struct Compare {
    expect: Arc<Vec<u8>>,
    blocks: u32,
    ok: AtomicBool,
    landed: AtomicU64,
}

impl ChunkSink for Compare {
    fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>> {
        let same = self.expect.get(span(&spec, self.blocks)) == Some(payload);
        self.ok.fetch_and(same, Ordering::Relaxed);
        self.landed.fetch_add(payload.len() as u64, Ordering::Relaxed);
        Box::pin(async { Ok(()) })
    }
}

fn config(
    identity: TlsIdentity,
    policy: TrustPolicy,
    listen: SocketAddr,
    tuning: LinkTuning,
    t: TransportChoice,
) -> PeerConfig {
    PeerConfig {
        identity,
        policy,
        listen,
        tuning,
        staging_bytes: 256 << 20,
        chunk_target_bytes: 4 << 20,
        fetch: kvferry_peer::FetchPolicy::default(),
        transport: t,
        tcp_listen: None,
        auto_fallback: Duration::from_millis(1500),
    }
}

fn run(emu: &Emulator, bytes: u64, t: TransportChoice, cc: Congestion) -> anyhow::Result<BaselineRun> {
    let pki = Pki::new()?;
    let blocks = (bytes / (u64::from(LAYERS) * BPBL)).max(1) as u32;
    let total = u64::from(blocks) * u64::from(LAYERS) * BPBL;
    let mut payload = vec![0u8; usize::try_from(total)?];
    Pattern::new(PATTERN_SEED).fill(&mut payload);
    let payload = Arc::new(payload);
    let path = &emu.config().path;
    let rtt = path.ab.one_way_delay + path.ba.one_way_delay;
    let tuning = LinkTuning {
        bandwidth_bps: path.ab.rate_bps.unwrap_or(10_000_000_000) as f64,
        rtt: rtt.max(Duration::from_millis(1)),
        streams: 4,
        congestion: cc,
        ..LinkTuning::default()
    };
    let (addr_a, addr_b) = (emu.addr_a(), emu.addr_b());
    let timeout = transfer_timeout(emu, total);
    let done = Arc::new(tokio::sync::Notify::new());
    let policy_b = TrustPolicy {
        roots: pki.roots.clone(),
        trust_domain: TRUST_DOMAIN.into(),
        allowed_regions: vec!["source".into()],
    };
    let source_id = pki.a.id.clone();
    let (id_a, policy_a, id_b) = (pki.a, pki.policy_a, pki.b);

    let served = Arc::new(Payload { bytes: payload.clone(), blocks });
    let done_a = done.clone();
    let sender = move |port_tx: tokio::sync::oneshot::Sender<u16>| async move {
        let cfg = config(id_a, policy_a, SocketAddr::new(addr_a.into(), 0), tuning, t);
        let node = PeerNode::start(cfg, Arc::new(Everything(served)))?;
        let _ = port_tx.send(node.local_addr().port());
        let c0 = thread_cpu();
        done_a.notified().await;
        Ok(SideReport { cpu_s: thread_cpu() - c0, ..SideReport::default() })
    };
    let receiver = move |port: u16| async move {
        let cfg = config(id_b, policy_b, SocketAddr::new(addr_b.into(), 0), tuning, t);
        let node = PeerNode::start(
            cfg,
            Arc::new(Everything(Arc::new(Payload { bytes: Arc::new(Vec::new()), blocks: 0 }))),
        )?;
        let sink = Arc::new(Compare {
            expect: payload,
            blocks,
            ok: AtomicBool::new(true),
            landed: AtomicU64::new(0),
        });
        let spec = FetchSpec {
            tenant: "baseline".into(),
            fingerprint: [0; 32],
            hashes: (0..blocks).map(|i| [i as u8; 32]).collect(),
            layers: LAYERS,
            bytes_per_block_layer: BPBL,
            deadline: Instant::now() + timeout,
        };
        let (t0, c0) = (Instant::now(), thread_cpu());
        let r = node.fetch(&source_id, SocketAddr::new(addr_a.into(), port), spec, sink.clone()).await;
        let (wall_s, cpu_s) = (t0.elapsed().as_secs_f64(), thread_cpu() - c0);
        done.notify_one();
        let r = r.map_err(|e| anyhow!("fetch: {e}"))?;
        let got = sink.landed.load(Ordering::Relaxed);
        Ok(SideReport {
            cpu_s,
            wall_s,
            verified: sink.ok.load(Ordering::Relaxed) && got == total && r.bytes == total,
            bytes: got,
            detail: format!(
                "{} over {} channels, congestion {}, rtt {:?} at the end, {} reconnects",
                r.link.transport.name(),
                r.link.channels,
                r.link.congestion,
                r.rtt,
                r.reconnects
            ),
        })
    };
    let (a, b) = run_pair(emu, timeout, sender, receiver)?;
    let name = match t {
        TransportChoice::Tcp => "kvferry-tcp",
        _ => "kvferry-quic",
    };
    Ok(finish(BaselineRun {
        name,
        bytes: b.bytes,
        wall_s: b.wall_s,
        goodput_bps: 0.0,
        cpu_s_sender: a.cpu_s,
        cpu_s_receiver: b.cpu_s,
        verified: b.verified,
        note: format!(
            "kvferry-peer (no daemon), windows/buffers from the link's BDP, mutual TLS 1.3 \
             (rustls/aws-lc-rs, userspace crypto: no kTLS), 4 MiB checksummed chunks; {}",
            b.detail
        ),
    }))
}
