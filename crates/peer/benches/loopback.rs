//! Loopback transfer benchmark between two peer endpoints in separate processes.
//!
//! `cargo bench -p kvferry-peer --bench loopback` moves 1 GiB (80-layer-like layout, 4 MiB
//! chunks) from an owner to a requester over real QUIC with mutual TLS on 127.0.0.1, for
//! quinn's default transport (one stream, as a naive user would run it) and for our tuned
//! transport with 1, 2 and 4 streams under CUBIC and BBR; each configuration 3 times, medians
//! reported. The owner is this same binary re-executed with `KVFERRY_BENCH_OWNER` set: it
//! serves from an in-memory source (zero-copy slices of one buffer, checksummed per chunk as
//! in production), the requester verifies and lands every chunk into an in-memory sink (one
//! copy, as landing into a pool does). Each process measures its own CPU time with
//! `getrusage(RUSAGE_SELF)`; the owner reports it, and its connection statistics, over its
//! stdout when asked on its stdin.
//!
//! Knobs (environment): `KVFERRY_BENCH_BYTES` (default 1 GiB), `KVFERRY_BENCH_REPS` (3),
//! `KVFERRY_BENCH_CONFIGS` (comma list of `defaults`, `cubic1`, `cubic2`, `cubic4`, `bbr1`,
//! `bbr2`, `bbr4`, or any of them with `xK` for a fetch striped over K QUIC connections, e.g.
//! `cubic4x2`; default all unstriped), `KVFERRY_BENCH_CHUNK` (chunk target bytes, 4 MiB),
//! `KVFERRY_BENCH_RTT_MS` (default 0: direct; otherwise the requester reaches the owner through
//! an in-bench UDP relay that delays each direction by half this RTT — WAN emulation without
//! netem, which this kernel lacks).
//! Without `--bench` (i.e. under `cargo test --benches`) it runs one 16 MiB smoke transfer.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_peer::{
    BoxFut, ChunkSink, Congestion, DevPki, FetchSpec, FlatChunks, LinkTuning, PeerConfig, PeerNode, RegionId,
    TlsIdentity, TrustPolicy, flat_span,
};
use kvferry_wire::ChunkSpec;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

const TD: &str = "kvferry.bench";
const OWNER_ENV: &str = "KVFERRY_BENCH_OWNER";
const LAYERS: u32 = 64;
const BPBL: u64 = 64 << 10;
const GIB: f64 = (1u64 << 30) as f64;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).filter_map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()).collect()
}

/// CPU seconds (user + system) of this process so far.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed struct we own; RUSAGE_SELF is valid.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn tuning(name: &str) -> LinkTuning {
    if name == "defaults" {
        return LinkTuning { streams: 1, ..LinkTuning::quinn_defaults() };
    }
    // `cubic4x2`: CUBIC, 4 streams per connection, each fetch striped over 2 connections.
    let (name, stripes) = name.split_once('x').unwrap_or((name, "1"));
    let (cc, streams) = name.split_at(name.len() - 1);
    LinkTuning {
        streams: streams.parse().unwrap_or(1),
        stripes: stripes.parse().unwrap_or(1),
        congestion: Congestion::parse(cc).unwrap_or(Congestion::Cubic),
        ..LinkTuning::default()
    }
}

fn pattern(len: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut v = vec![0u8; len];
    for w in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let n = w.len();
        w.copy_from_slice(&x.to_le_bytes()[..n]);
    }
    v
}

// ---------------------------------------------------------------- owner (child process)

fn identity_from_env(region: &str) -> (TlsIdentity, TrustPolicy) {
    let var = |k: &str| unhex(&std::env::var(k).unwrap_or_default());
    let id = TlsIdentity {
        id: RegionId::new(TD, region).expect("region"),
        chain: vec![CertificateDer::from(var("KVFERRY_BENCH_CERT"))],
        key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(var("KVFERRY_BENCH_KEY"))),
    };
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(var("KVFERRY_BENCH_CA"))).expect("CA");
    let policy =
        TrustPolicy { roots: Arc::new(roots), trust_domain: TD.into(), allowed_regions: vec!["dst".into()] };
    (id, policy)
}

/// Both endpoints' configuration: QUIC on 127.0.0.1 (any port), the transport tuning `config`
/// names, 256 MiB of staging, `KVFERRY_BENCH_CHUNK`-byte chunks (default 4 MiB).
fn endpoint_config(identity: TlsIdentity, policy: TrustPolicy, config: &str) -> PeerConfig {
    PeerConfig {
        identity,
        policy,
        listen: "127.0.0.1:0".parse().expect("addr"),
        tuning: tuning(config),
        staging_bytes: 256 << 20,
        chunk_target_bytes: env_or("KVFERRY_BENCH_CHUNK", 4 << 20),
        fetch: kvferry_peer::FetchPolicy::default(),
        transport: kvferry_peer::TransportChoice::Quic,
        tcp_listen: None,
        auto_fallback: std::time::Duration::from_millis(1500),
    }
}

fn owner_main() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let blocks: u32 = env_or("KVFERRY_BENCH_BLOCKS", 256);
    let name = std::env::var(OWNER_ENV).unwrap_or_default();
    let (identity, policy) = identity_from_env("src");
    let source = Arc::new(FlatChunks::new(
        Arc::new(pattern(blocks as usize * LAYERS as usize * BPBL as usize)),
        blocks,
        LAYERS,
        BPBL,
    ));
    let cfg = endpoint_config(identity, policy, &name);
    let node = rt.block_on(async { PeerNode::start(cfg, source) }).expect("start");
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ADDR {}", node.local_addr());
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        match line.as_deref().unwrap_or("EXIT").trim() {
            "USAGE" => {
                let _ = writeln!(out, "USAGE {}", cpu_seconds());
            }
            "STATS" => {
                let mut s = Stats::default();
                for c in node.connection_stats() {
                    s.add(&c);
                }
                let _ = writeln!(out, "STATS {}", s.encode());
            }
            _ => break,
        }
        let _ = out.flush();
    }
    drop(node);
    rt.shutdown_timeout(Duration::from_millis(100));
}

/// The connection statistics we report, summed over connections.
#[derive(Debug, Default, Clone, Copy)]
struct Stats {
    tx_datagrams: u64,
    tx_ios: u64,
    rx_datagrams: u64,
    rx_ios: u64,
    lost_packets: u64,
    congestion_events: u64,
    stream_data_blocked: u64,
    data_blocked: u64,
    acks_rx: u64,
    mtu: u64,
    cwnd: u64,
}

impl Stats {
    fn add(&mut self, c: &quinn::ConnectionStats) {
        self.tx_datagrams += c.udp_tx.datagrams;
        self.tx_ios += c.udp_tx.ios;
        self.rx_datagrams += c.udp_rx.datagrams;
        self.rx_ios += c.udp_rx.ios;
        self.lost_packets += c.path.lost_packets;
        self.congestion_events += c.path.congestion_events;
        self.stream_data_blocked += c.frame_tx.stream_data_blocked;
        self.data_blocked += c.frame_tx.data_blocked;
        self.acks_rx += c.frame_rx.acks;
        self.mtu = self.mtu.max(u64::from(c.path.current_mtu));
        self.cwnd = self.cwnd.max(c.path.cwnd);
    }
    fn fields(&mut self) -> [(&'static str, &mut u64); 11] {
        [
            ("tx_datagrams", &mut self.tx_datagrams),
            ("tx_ios", &mut self.tx_ios),
            ("rx_datagrams", &mut self.rx_datagrams),
            ("rx_ios", &mut self.rx_ios),
            ("lost_packets", &mut self.lost_packets),
            ("congestion_events", &mut self.congestion_events),
            ("stream_data_blocked", &mut self.stream_data_blocked),
            ("data_blocked", &mut self.data_blocked),
            ("acks_rx", &mut self.acks_rx),
            ("mtu", &mut self.mtu),
            ("cwnd", &mut self.cwnd),
        ]
    }
    fn encode(mut self) -> String {
        self.fields().iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
    }
    fn decode(s: &str) -> Self {
        let mut out = Self::default();
        for kv in s.split_whitespace() {
            if let Some((k, v)) = kv.split_once('=') {
                for (name, slot) in out.fields() {
                    if name == k {
                        *slot = v.parse().unwrap_or(0);
                    }
                }
            }
        }
        out
    }
}

// ---------------------------------------------------------------- WAN emulation (relay)

/// A UDP relay that delays every datagram by `one_way` in each direction (netem is not
/// available here). One thread receives and one sends per direction; the delay line is a FIFO
/// (constant delay keeps due times in order). It adds latency, not a rate limit: the relay's
/// own CPU (and the kernel's socket buffers in front of it) is the bottleneck it adds.
fn spawn_relay(owner: std::net::SocketAddr, one_way: Duration) -> std::net::SocketAddr {
    use kvferry_peer::transport::bind_udp;
    use std::net::UdpSocket;
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let (front, _, _) = bind_udp(any, 64 << 20).expect("relay front");
    let (back, _, _) = bind_udp(any, 64 << 20).expect("relay back");
    back.connect(owner).expect("relay connect");
    let addr = front.local_addr().expect("relay addr");
    let client: Arc<Mutex<Option<std::net::SocketAddr>>> = Arc::new(Mutex::new(None));
    let line =
        |rx: UdpSocket, tx: UdpSocket, to_client: bool, client: Arc<Mutex<Option<std::net::SocketAddr>>>| {
            let (q_tx, q_rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
            let c = client.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while let Ok((n, from)) = rx.recv_from(&mut buf) {
                    if !to_client {
                        // One assignment per critical section: a poisoned value is still whole.
                        *c.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(from);
                    }
                    if q_tx.send((Instant::now() + one_way, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            });
            std::thread::spawn(move || {
                while let Ok((due, d)) = q_rx.recv() {
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let _ = if to_client {
                        match *client.lock().expect("relay lock") {
                            Some(c) => tx.send_to(&d, c),
                            None => continue,
                        }
                    } else {
                        tx.send(&d)
                    };
                }
            });
        };
    line(front.try_clone().expect("clone"), back.try_clone().expect("clone"), false, client.clone());
    line(back, front, true, client);
    addr
}

// ---------------------------------------------------------------- requester (parent process)

struct MemSink {
    buf: Mutex<Vec<u8>>,
    blocks: u32,
}

impl ChunkSink for MemSink {
    fn land<'a>(
        &'a self,
        spec: ChunkSpec,
        payload: &'a [u8],
    ) -> BoxFut<'a, Result<(), kvferry_peer::ChunkError>> {
        Box::pin(async move {
            let at = flat_span(&spec, self.blocks, BPBL).start;
            let mut buf = self.buf.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            buf.get_mut(at..at + payload.len())
                .ok_or_else(|| kvferry_peer::ChunkError::Mismatch {
                    chunk: spec.id,
                    detail: "out of range".into(),
                })?
                .copy_from_slice(payload);
            Ok(())
        })
    }
}

struct Owner {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    addr: std::net::SocketAddr,
}

impl Owner {
    fn spawn(pki: &DevPki, config: &str, blocks: u32) -> Self {
        let src = pki.issue("src").expect("issue");
        let key = match &src.key {
            PrivateKeyDer::Pkcs8(k) => k.secret_pkcs8_der().to_vec(),
            _ => panic!("dev keys are PKCS#8"),
        };
        let mut child = Command::new(std::env::current_exe().expect("exe"))
            .env(OWNER_ENV, config)
            .env("KVFERRY_BENCH_BLOCKS", blocks.to_string())
            .env("KVFERRY_BENCH_CA", hex(pki.ca()))
            .env("KVFERRY_BENCH_CERT", hex(&src.chain[0]))
            .env("KVFERRY_BENCH_KEY", hex(&key))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn owner");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("owner address");
        let addr = line.trim().strip_prefix("ADDR ").expect("ADDR line").parse().expect("addr");
        Self { child, stdin, stdout, addr }
    }

    fn ask(&mut self, what: &str) -> String {
        writeln!(self.stdin, "{what}").expect("owner stdin");
        self.stdin.flush().expect("flush");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("owner answer");
        line.trim().strip_prefix(what).unwrap_or_default().trim().to_owned()
    }

    fn cpu(&mut self) -> f64 {
        self.ask("USAGE").parse().unwrap_or(f64::NAN)
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "EXIT");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone, Copy)]
struct Run {
    gbps: f64,
    req_cpu_per_gib: f64,
    own_cpu_per_gib: f64,
    owner: Stats,
    requester: Stats,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run_config(rt: &tokio::runtime::Runtime, pki: &DevPki, config: &str, bytes: u64, reps: usize) -> Vec<Run> {
    let blocks = (bytes / (u64::from(LAYERS) * BPBL)).max(1) as u32;
    let total = u64::from(blocks) * u64::from(LAYERS) * BPBL;
    let mut owner = Owner::spawn(pki, config, blocks);
    let dst = pki.issue("dst").expect("issue");
    let policy =
        TrustPolicy { roots: pki.roots(), trust_domain: TD.into(), allowed_regions: vec!["src".into()] };
    let cfg = endpoint_config(dst, policy, config);
    let catalog = Arc::new(FlatChunks::new(Arc::new(Vec::new()), 0, LAYERS, BPBL));
    let node = rt.block_on(async { PeerNode::start(cfg, catalog) }).expect("start requester");
    // Non-zero fill: every page is touched now, not during the first measured run.
    let sink = Arc::new(MemSink { buf: Mutex::new(vec![0xEEu8; total as usize]), blocks });
    let src = RegionId::new(TD, "src").expect("id");
    let rtt_ms: u64 = env_or("KVFERRY_BENCH_RTT_MS", 0);
    // The relay runs in its own process so its CPU is charged to neither endpoint.
    let relay = (rtt_ms > 0).then(|| Relay::spawn(owner.addr, Duration::from_micros(rtt_ms * 500)));
    let target = relay.as_ref().map_or(owner.addr, |r| r.addr);
    let spec = |blocks: u32| FetchSpec {
        tenant: "bench".into(),
        fingerprint: [1; 32],
        hashes: (0..blocks).map(|i| [(i % 251) as u8; 32]).collect(),
        layers: LAYERS,
        bytes_per_block_layer: BPBL,
        deadline: Instant::now() + Duration::from_secs(600),
    };
    // Warm-up (not measured): allocator, page cache of both processes, code paths.
    let warm = blocks.min(16);
    rt.block_on(node.fetch(&src, target, spec(warm), sink.clone())).expect("warm-up fetch");
    node.close_connections();
    std::thread::sleep(Duration::from_millis(200));
    let mut runs = Vec::new();
    for rep in 0..reps {
        let (own0, req0) = (owner.cpu(), cpu_seconds());
        let r = rt.block_on(node.fetch(&src, target, spec(blocks), sink.clone())).expect("fetch");
        let (own1, req1) = (owner.cpu(), cpu_seconds());
        assert_eq!(r.bytes, total);
        let owner_stats = Stats::decode(&owner.ask("STATS"));
        let mut requester = Stats::default();
        for c in node.connection_stats() {
            requester.add(&c);
        }
        node.close_connections();
        std::thread::sleep(Duration::from_millis(200));
        let gib = total as f64 / GIB;
        let run = Run {
            gbps: r.goodput_bps / 1e9,
            req_cpu_per_gib: (req1 - req0) / gib,
            own_cpu_per_gib: (own1 - own0) / gib,
            owner: owner_stats,
            requester,
        };
        eprintln!(
            "  {config} rep {rep}: {:.2} Gbit/s, wall {:?}, rtt {:?}, requester acks sent {}, {run:?}",
            run.gbps, r.wall, r.rtt, run.requester.tx_datagrams
        );
        runs.push(run);
    }
    drop(relay);
    drop(owner);
    runs
}

const RELAY_ENV: &str = "KVFERRY_BENCH_RELAY";

/// The relay child process: `KVFERRY_BENCH_RELAY=<owner addr>,<one-way µs>`; prints its
/// address, relays until its stdin closes.
struct Relay {
    child: Child,
    addr: std::net::SocketAddr,
}

impl Relay {
    fn spawn(owner: std::net::SocketAddr, one_way: Duration) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("exe"))
            .env(RELAY_ENV, format!("{owner},{}", one_way.as_micros()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn relay");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("relay address");
        let addr = line.trim().strip_prefix("ADDR ").expect("ADDR line").parse().expect("addr");
        Self { child, addr }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn relay_main(spec: &str) {
    let (owner, us) = spec.split_once(',').expect("owner,us");
    let addr =
        spawn_relay(owner.parse().expect("owner addr"), Duration::from_micros(us.parse().expect("us")));
    println!("ADDR {addr}");
    let _ = std::io::stdout().flush();
    let mut sink = String::new();
    while std::io::stdin().read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {}
}

fn main() {
    if std::env::var_os(OWNER_ENV).is_some() {
        owner_main();
        return;
    }
    if let Ok(spec) = std::env::var(RELAY_ENV) {
        relay_main(&spec);
        return;
    }
    let bench = std::env::args().any(|a| a == "--bench");
    let bytes: u64 = env_or("KVFERRY_BENCH_BYTES", if bench { 1 << 30 } else { 16 << 20 });
    let reps: usize = env_or("KVFERRY_BENCH_REPS", if bench { 3 } else { 1 });
    let all = "defaults,cubic1,cubic2,cubic4,bbr1,bbr2,bbr4";
    let configs: String = env_or("KVFERRY_BENCH_CONFIGS", if bench { all.into() } else { "cubic4".into() });
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let pki = DevPki::generate(TD).expect("pki");
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_owned();
    let rtt_ms: u64 = env_or("KVFERRY_BENCH_RTT_MS", 0);
    let path = if rtt_ms > 0 { format!("via a {rtt_ms} ms RTT relay") } else { "direct".into() };
    println!(
        "loopback transfer of {} MiB ({path}), {reps} runs per config, medians; loadavg at start {}",
        bytes >> 20,
        load()
    );
    println!();
    println!(
        "| config | Gbit/s | GiB/s | requester CPU s/GiB | owner CPU s/GiB | owner datagrams/io (GSO) | lost pkts | congestion events | blocked frames (stream/conn) | ACKs rx by owner | MTU | all runs Gbit/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut medians = Vec::new();
    for config in configs.split(',').map(str::trim).filter(|c| !c.is_empty()) {
        let runs = run_config(&rt, &pki, config, bytes, reps);
        let g = median(runs.iter().map(|r| r.gbps).collect());
        let rc = median(runs.iter().map(|r| r.req_cpu_per_gib).collect());
        let oc = median(runs.iter().map(|r| r.own_cpu_per_gib).collect());
        let gso =
            median(runs.iter().map(|r| r.owner.tx_datagrams as f64 / r.owner.tx_ios.max(1) as f64).collect());
        let cong = median(runs.iter().map(|r| r.owner.congestion_events as f64).collect());
        let acks = median(runs.iter().map(|r| r.owner.acks_rx as f64).collect());
        let lost = median(runs.iter().map(|r| r.owner.lost_packets as f64).collect());
        let sdb = median(runs.iter().map(|r| r.owner.stream_data_blocked as f64).collect());
        let db = median(runs.iter().map(|r| r.owner.data_blocked as f64).collect());
        let all: Vec<String> = runs.iter().map(|r| format!("{:.2}", r.gbps)).collect();
        println!(
            "| {config} | {g:.2} | {:.3} | {rc:.2} | {oc:.2} | {gso:.1} | {lost:.0} | {cong:.0} | {sdb:.0}/{db:.0} | {acks:.0} | {} | {} |",
            g * 1e9 / 8.0 / GIB,
            runs[0].owner.mtu,
            all.join(", ")
        );
        medians.push((config.to_owned(), g));
    }
    if let Some((_, base)) = medians.iter().find(|(c, _)| c == "defaults")
        && let Some((best, g)) =
            medians.iter().filter(|(c, _)| c != "defaults").max_by(|a, b| a.1.total_cmp(&b.1))
    {
        println!();
        println!(
            "best tuned ({best}) / defaults = {:.2}x (target 1.5x); loadavg at end {}",
            g / base,
            load()
        );
    }
}
