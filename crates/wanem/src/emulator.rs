//! The emulator: two namespaces, a TUN device in each, and one forwarding thread per
//! direction between them.
//!
//! Topology (addresses from the RFC 2544 benchmarking range, 198.18.0.0/15, and only inside
//! the namespaces created here; nothing routes outside them):
//!
//! ```text
//!   netns kvf-<pid>-<n>-a                                     netns kvf-<pid>-<n>-b
//!   kvf0 198.18.0.1 peer 198.18.0.2  ── A→B thread ──▶  kvf0 198.18.0.2 peer 198.18.0.1
//!                                    ◀── B→A thread ──
//! ```
//!
//! Both ends are point-to-point, so a packet A sends to 198.18.0.2 leaves through A's TUN,
//! the emulator writes it unchanged into B's TUN, and B's kernel takes it as local: no
//! address rewriting. IPv6 is disabled on both devices so that no neighbour discovery or
//! MLD noise crosses the link.

use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Result, WanemError};
use crate::forwarder::{DirCounters, DirectionStats, Forwarder};
use crate::netns::{self, NetNs, ip};
use crate::profile::{LinkProfile, PathProfile};
use crate::rng::Rng;
use crate::shaper::Shaper;
use crate::sys;

/// The TUN device's name inside each namespace.
pub const DEVICE: &str = "kvf0";
/// Namespace A's address.
pub const ADDR_A: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// Namespace B's address.
pub const ADDR_B: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);

/// One end of the emulated path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// Namespace A (198.18.0.1).
    A,
    /// Namespace B (198.18.0.2).
    B,
}

impl Side {
    /// The other end.
    pub fn peer(self) -> Side {
        match self {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }
}

/// Knobs beyond the path profile.
#[derive(Debug, Clone)]
pub struct EmulatorConfig {
    /// The per-direction link profiles.
    pub path: PathProfile,
    /// MTU of both TUN devices (IP bytes). 1500 matches a typical WAN path.
    pub mtu: u32,
    /// Seed for loss, jitter and reordering; `None` draws one from the clock.
    pub seed: Option<u64>,
    /// The TUN devices' transmit queue length (packets the kernel buffers before the
    /// emulator reads them). This queue is not part of the emulated link: it only fills when
    /// packets arrive faster than the emulator can read them (see
    /// [`Emulator::kernel_counters`]), and is kept short so that it hides little delay.
    pub tun_txqueuelen: u32,
    /// Upper bound of TCP socket buffer autotuning inside both namespaces
    /// (`net.ipv4.tcp_rmem`/`tcp_wmem` maximum). A new namespace starts from the kernel's
    /// defaults (a 4 MiB send buffer caps one stream at ~600 Mbit/s at 50 ms); `None`
    /// leaves them. `net.core.{r,w}mem_max` are host-wide and not touched: UDP sockets that
    /// need big buffers should use SO_RCVBUFFORCE/SO_SNDBUFFORCE (root).
    pub tcp_buffer_max: Option<u64>,
    /// Receive coalescing ([`crate::gso::Coalescer`]) with this interrupt-moderation hold:
    /// consecutive packets of one flow due within it reach the receiving stack as one GSO
    /// packet, as a NIC's GRO delivers what one interrupt finds. A packet is delivered at
    /// most the hold after its due time (the first of a run exactly then, the rest sooner).
    /// Default 50 µs, the order of NICs' default `rx-usecs`; `Some(ZERO)` coalesces only
    /// what is due at once; `None` turns it off.
    pub rx_coalesce: Option<Duration>,
    /// Segmentation offload on both TUN devices (TSO for TCP, USO for UDP GSO): a send
    /// reaches the emulator whole and is cut there ([`crate::gso::Segments`]), as a NIC
    /// cuts it; `false` leaves segmenting to the sending kernel. On by default.
    pub segmentation_offload: bool,
}

impl EmulatorConfig {
    /// Defaults (MTU 1500, random seed) for `path`.
    pub fn new(path: PathProfile) -> Self {
        Self {
            path,
            mtu: 1500,
            seed: None,
            tun_txqueuelen: 1000,
            tcp_buffer_max: Some(64 << 20),
            rx_coalesce: Some(Duration::from_micros(50)),
            segmentation_offload: true,
        }
    }
}

/// Counters for both directions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// A → B.
    pub ab: DirectionStats,
    /// B → A.
    pub ba: DirectionStats,
}

/// Kernel counters of one end, outside the emulator's model. Non-zero values mean packets
/// were lost where the emulator did not decide it (it fell behind, or a socket overflowed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelCounters {
    /// Packets the TUN device dropped on transmit (before the emulator read them).
    pub tun_tx_dropped: u64,
    /// Packets the TUN device dropped on receive (written by the emulator).
    pub tun_rx_dropped: u64,
    /// UDP datagrams dropped for a full socket receive buffer in this namespace.
    pub udp_rcvbuf_errors: u64,
}

/// A running emulated path. Dropping it stops the forwarders, kills any process left in its
/// namespaces and deletes the namespaces (and with them the TUN devices).
#[derive(Debug)]
pub struct Emulator {
    // Field order matters for drop: threads are joined in `Drop::drop`, then the namespaces go.
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    counters: [Arc<DirCounters>; 2],
    config: EmulatorConfig,
    seed: u64,
    ns_a: NetNs,
    ns_b: NetNs,
}

/// Whether this process can run the emulator (root and `/dev/net/tun`); the reason if not.
pub fn check_support() -> Result<()> {
    if !sys::is_root() {
        return Err(WanemError::NotRoot);
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Err(WanemError::NoTun);
    }
    Ok(())
}

impl Emulator {
    /// Starts an emulated path with `ab` applied to A→B packets and `ba` to B→A packets.
    pub fn start(ab: LinkProfile, ba: LinkProfile) -> Result<Self> {
        Self::with_config(EmulatorConfig::new(PathProfile { ab, ba }))
    }

    /// Starts an emulated path from a [`PathProfile`] (for example a preset).
    pub fn start_path(path: PathProfile) -> Result<Self> {
        Self::with_config(EmulatorConfig::new(path))
    }

    /// Starts an emulated path with explicit configuration.
    pub fn with_config(config: EmulatorConfig) -> Result<Self> {
        check_support()?;
        config.path.ab.validate()?;
        config.path.ba.validate()?;
        netns::cleanup_stale();
        // Each guard deletes its namespace if a later step fails.
        let base = NetNs::unique_base();
        let ns_a = NetNs::create(format!("{base}-a"))?;
        let ns_b = NetNs::create(format!("{base}-b"))?;
        let tun_a = Arc::new(setup_end(&ns_a, ADDR_A, ADDR_B, &config)?);
        let tun_b = Arc::new(setup_end(&ns_b, ADDR_B, ADDR_A, &config)?);
        let seed = config.seed.unwrap_or_else(Rng::entropy_seed);
        let stop = Arc::new(AtomicBool::new(false));
        let counters = [Arc::new(DirCounters::default()), Arc::new(DirCounters::default())];
        let buf_size = config.mtu as usize + sys::VNET_HDR_LEN + 64;
        let mut emu = Self { stop, threads: Vec::new(), counters, config, seed, ns_a, ns_b };
        let dirs = [
            ("A->B", &tun_a, &tun_b, emu.config.path.ab.clone(), 0),
            ("B->A", &tun_b, &tun_a, emu.config.path.ba.clone(), 1),
        ];
        for (label, ingress, egress, profile, i) in dirs {
            let fwd = Forwarder {
                ingress: Arc::clone(ingress),
                egress: Arc::clone(egress),
                shaper: Shaper::new(profile, seed ^ 0xA5A5_5A5A_0F0F_F0F0u64.wrapping_mul(i as u64 + 1)),
                counters: Arc::clone(&emu.counters[i]),
                stop: Arc::clone(&emu.stop),
                buf_size,
                coalesce: emu.config.rx_coalesce,
            };
            let handle = std::thread::Builder::new()
                .name(format!("wanem {label}"))
                .spawn(move || fwd.run())
                .map_err(|e| WanemError::Thread(e.to_string()))?;
            emu.threads.push(handle);
        }
        Ok(emu)
    }

    /// The namespace of `side`.
    pub fn ns(&self, side: Side) -> &NetNs {
        match side {
            Side::A => &self.ns_a,
            Side::B => &self.ns_b,
        }
    }

    /// Namespace A's name.
    pub fn ns_a(&self) -> &str {
        self.ns_a.name()
    }

    /// Namespace B's name.
    pub fn ns_b(&self) -> &str {
        self.ns_b.name()
    }

    /// The address of `side`.
    pub fn addr(&self, side: Side) -> Ipv4Addr {
        match side {
            Side::A => ADDR_A,
            Side::B => ADDR_B,
        }
    }

    /// Namespace A's address, 198.18.0.1.
    pub fn addr_a(&self) -> Ipv4Addr {
        ADDR_A
    }

    /// Namespace B's address, 198.18.0.2.
    pub fn addr_b(&self) -> Ipv4Addr {
        ADDR_B
    }

    /// The configuration in force.
    pub fn config(&self) -> &EmulatorConfig {
        &self.config
    }

    /// The seed in use (to replay a run's loss pattern, pass it in [`EmulatorConfig::seed`]).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A `Command` running `program` inside `side`'s namespace (`ip netns exec`); add
    /// arguments and spawn it as usual. Processes still running there at drop are killed.
    pub fn command(&self, side: Side, program: impl AsRef<std::ffi::OsStr>) -> Command {
        self.ns(side).command(program)
    }

    /// Spawns a thread that runs `f` inside `side`'s namespace (via `setns`). Sockets it
    /// creates stay in that namespace even when moved to other threads.
    pub fn spawn_thread_in<T, F>(&self, side: Side, f: F) -> Result<JoinHandle<Result<T>>>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        self.ns(side).spawn_thread(f)
    }

    /// Runs `f` inside `side`'s namespace and returns its result; handy for creating sockets
    /// (`emu.run_in(Side::B, || UdpSocket::bind(...))`) to use from any thread or runtime.
    pub fn run_in<T, F>(&self, side: Side, f: F) -> Result<T>
    where
        T: Send,
        F: FnOnce() -> T + Send,
    {
        self.ns(side).run(f)
    }

    /// A snapshot of both directions' counters.
    pub fn stats(&self) -> Stats {
        Stats { ab: self.counters[0].snapshot(), ba: self.counters[1].snapshot() }
    }

    /// Reads `side`'s [`KernelCounters`] (from `/proc/thread-self/net` inside its namespace).
    pub fn kernel_counters(&self, side: Side) -> Result<KernelCounters> {
        let (dev, snmp) = self.run_in(side, || {
            (
                std::fs::read_to_string("/proc/thread-self/net/dev"),
                std::fs::read_to_string("/proc/thread-self/net/snmp"),
            )
        })?;
        let io = |source| WanemError::Sys { what: "read /proc/thread-self/net", source };
        let (dev, snmp) = (dev.map_err(io)?, snmp.map_err(io)?);
        let mut k = KernelCounters::default();
        if let Some(line) = dev.lines().find_map(|l| l.trim().strip_prefix("kvf0:")) {
            let f: Vec<u64> = line.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
            k.tun_rx_dropped = f.get(3).copied().unwrap_or(0);
            k.tun_tx_dropped = f.get(11).copied().unwrap_or(0);
        }
        let udp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Udp:")).collect();
        if let [names, values, ..] = udp.as_slice() {
            let idx = names.split_whitespace().position(|n| n == "RcvbufErrors");
            let val = idx.and_then(|i| values.split_whitespace().nth(i));
            k.udp_rcvbuf_errors = val.and_then(|v| v.parse().ok()).unwrap_or(0);
        }
        Ok(k)
    }

    /// Stops forwarding and removes the namespaces now (also done on drop).
    pub fn shutdown(self) {}
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // The TUN fds went with the threads; `ns_a` and `ns_b` now delete the namespaces.
    }
}

/// Creates, addresses and raises the TUN device of one end; returns its fd.
fn setup_end(ns: &NetNs, local: Ipv4Addr, peer: Ipv4Addr, cfg: &EmulatorConfig) -> Result<OwnedFd> {
    let fd = ns.run(|| {
        let fd = sys::open_tun(DEVICE, cfg.segmentation_offload)?;
        // Best effort: a kernel without IPv6 has no such file, and then no IPv6 noise either.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{DEVICE}/disable_ipv6"), "1");
        if let Some(max) = cfg.tcp_buffer_max {
            for (key, default) in [("tcp_rmem", 131_072), ("tcp_wmem", 16_384)] {
                std::fs::write(format!("/proc/sys/net/ipv4/{key}"), format!("4096 {default} {max}"))
                    .map_err(|source| WanemError::Sys { what: "set tcp buffer sysctl", source })?;
            }
        }
        Ok::<_, WanemError>(fd)
    })??;
    let n = ns.name();
    let (mtu, qlen) = (cfg.mtu.to_string(), cfg.tun_txqueuelen.to_string());
    ip(&["-n", n, "link", "set", DEVICE, "mtu", &mtu, "txqueuelen", &qlen])?;
    let (local, peer) = (format!("{local}/32"), format!("{peer}/32"));
    ip(&["-n", n, "addr", "add", &local, "peer", &peer, "dev", DEVICE])?;
    ip(&["-n", n, "link", "set", DEVICE, "up"])?;
    Ok(fd)
}
