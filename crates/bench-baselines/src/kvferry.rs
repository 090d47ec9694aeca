//! kvferry's own peer transport on the same link and at the same size as the baselines,
//! without the daemon: two `PeerNode`s (A serves an in-memory payload, B fetches it and
//! compares every landed chunk with the payload), tuned from the link's bandwidth-delay product
//! as the daemon tunes them (data channels by the link's rate, at most 4: `quic_streams`,
//! `tcp_connections`; the bench's congestion controller for QUIC, BBR for TCP where the
//! kernel has it), once over QUIC (`kvferry-quic`) and once over TLS 1.3 on
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
    BoxFut, ChunkError, ChunkSink, Congestion, FetchSpec, FlatChunks, LinkTuning, PeerConfig, PeerNode,
    TlsIdentity, TransportChoice, TrustPolicy,
};
use kvferry_wanem::Emulator;
use kvferry_wire::ChunkSpec;

use crate::pair::{Pki, SideReport, TRUST_DOMAIN, measured, run_pair};
use crate::{BaselineRun, PATTERN_SEED, Pattern, thread_cpu, transfer_timeout};

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

/// Compares every landed chunk with the payload.
struct Compare {
    expect: FlatChunks,
    ok: AtomicBool,
    landed: AtomicU64,
}

impl ChunkSink for Compare {
    fn land<'a>(&'a self, spec: ChunkSpec, payload: &'a [u8]) -> BoxFut<'a, Result<(), ChunkError>> {
        let same = self.expect.get(&spec) == Some(payload);
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

    let served = Arc::new(FlatChunks::new(payload.clone(), blocks, LAYERS, BPBL));
    let done_a = done.clone();
    let sender = move |port_tx: tokio::sync::oneshot::Sender<u16>| async move {
        let cfg = config(id_a, policy_a, SocketAddr::new(addr_a.into(), 0), tuning, t);
        let node = PeerNode::start(cfg, served)?;
        let _ = port_tx.send(node.local_addr().port());
        let c0 = thread_cpu();
        done_a.notified().await;
        Ok(SideReport { cpu_s: thread_cpu() - c0, ..SideReport::default() })
    };
    let receiver = move |port: u16| async move {
        let cfg = config(id_b, policy_b, SocketAddr::new(addr_b.into(), 0), tuning, t);
        let node = PeerNode::start(cfg, Arc::new(FlatChunks::new(Arc::new(Vec::new()), 0, LAYERS, BPBL)))?;
        let sink = Arc::new(Compare {
            expect: FlatChunks::new(payload, blocks, LAYERS, BPBL),
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
    Ok(measured(
        name,
        &a,
        &b,
        format!(
            "kvferry-peer (no daemon), windows/buffers from the link's BDP, mutual TLS 1.3 \
             (rustls/aws-lc-rs, userspace crypto: no kTLS), 4 MiB checksummed chunks; {}",
            b.detail
        ),
    ))
}
