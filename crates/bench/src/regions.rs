//! Two regions inside the WAN emulator: in each namespace, a `kvferry daemon` and a reference
//! `kvferry engine` as separate processes, with dev-mode certificates from one throwaway CA.
//! Region A (the source) lives in namespace A at 198.18.0.1, region B (the target) in B at
//! 198.18.0.2; the bench reaches their TCP listeners from threads that entered the namespace.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_wanem::{Emulator, Side};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tonic::transport::{Channel, Endpoint};

/// The reference engine's shape for the bench (f32 KV, 16-token blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineShape {
    pub layers: u32,
    pub hidden: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub ffn: u32,
    /// Pool blocks (16 tokens each).
    pub num_blocks: u32,
}

/// Tokens per KV block in the reference engine.
pub const BLOCK_TOKENS: u64 = 16;

impl EngineShape {
    /// A shape whose KV is fat next to its compute (64 KiB per token: 8 layers × 8 KV heads ×
    /// 128 dims × K and V × f32) so that GiB sessions are a few ten thousand tokens and, on a
    /// gigabit link, fetching and recomputing a token cost within a few times of each other.
    pub fn bench(max_session_bytes: u64) -> Self {
        let mut s = EngineShape {
            layers: 8,
            hidden: 64,
            heads: 8,
            kv_heads: 8,
            head_dim: 128,
            ffn: 128,
            num_blocks: 0,
        };
        s.num_blocks = (max_session_bytes.div_ceil(s.block_bytes()) + 64) as u32;
        s
    }

    /// KV bytes per token.
    pub fn bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers) * u64::from(self.kv_heads) * u64::from(self.head_dim) * 4
    }

    /// KV bytes per block.
    pub fn block_bytes(&self) -> u64 {
        self.bytes_per_token() * BLOCK_TOKENS
    }

    fn args(&self) -> Vec<String> {
        [
            ("--layers", self.layers),
            ("--hidden", self.hidden),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--head-dim", self.head_dim),
            ("--ffn", self.ffn),
            ("--num-blocks", self.num_blocks),
        ]
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.to_string()])
        .collect()
    }
}

/// How the daemons are configured for a run.
#[derive(Debug, Clone)]
pub struct RegionOptions {
    /// The `kvferry` executable.
    pub exe: PathBuf,
    pub shape: EngineShape,
    /// Expected link figures until measured (`[[peers]] gbps`, `rtt_ms`).
    pub gbps: f64,
    pub rtt_ms: f64,
    /// `[transfer] congestion`.
    pub congestion: kvferry_peer::Congestion,
    /// `[transfer] streams`.
    pub streams: u32,
    /// `[limits] landing_zone_bytes`.
    pub landing_bytes: u64,
    /// `[limits] landing_prefault`; [`Regions::start`] then waits until both zones are faulted
    /// in, so no measurement pays for (or runs beside) it.
    pub landing_prefault: bool,
    /// `Some`: real vLLM servers with KvferryConnector instead of reference engines.
    pub vllm: Option<crate::vllm::VllmOptions>,
}

/// One region's processes and addresses.
#[derive(Debug, Clone)]
pub struct Region {
    pub name: &'static str,
    pub side: Side,
    pub dir: PathBuf,
    pub(crate) ns_path: PathBuf,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub peer: SocketAddr,
    pub daemon_pid: u32,
    pub engine_pid: u32,
}

/// Both regions; stops every process on [`Regions::stop`] (and the emulator kills anything
/// left in its namespaces when it is dropped).
#[derive(Debug)]
pub struct Regions {
    pub a: Region,
    pub b: Region,
    children: Vec<(String, Child)>,
}

fn addr(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

fn config(me: &Region, other: &Region, dev_dir: &Path, o: &RegionOptions) -> String {
    use kvferry_daemon::config::{Listen, Peer};
    let mut cfg = kvferry_daemon::Config {
        region: me.name.into(),
        trust_domain: "kvferry.bench".into(),
        run_dir: me.dir.clone(),
        listen: Listen { grpc: me.grpc, peer: me.peer, http: me.http },
        peers: vec![Peer {
            region: other.name.into(),
            addr: other.peer,
            gbps: o.gbps,
            rtt_ms: o.rtt_ms,
            max_egress_gbps: 0.0,
            tenants: None,
            transport: Default::default(),
        }],
        ..kvferry_daemon::Config::default()
    };
    cfg.tls.dev_dir = dev_dir.to_owned();
    cfg.limits.staging_bytes = 256 << 20;
    cfg.limits.landing_zone_bytes = o.landing_bytes;
    cfg.limits.landing_prefault = o.landing_prefault;
    cfg.limits.default_deadline_ms = 900_000;
    (cfg.transfer.congestion, cfg.transfer.streams) = (o.congestion, o.streams);
    cfg.to_toml()
}

/// A TCP connection made from inside a namespace (a dedicated thread enters it; the socket
/// stays in the namespace when handed to tokio).
pub async fn ns_connect(ns_path: PathBuf, to: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let r = kvferry_wanem::sys::enter_netns(&ns_path)
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|()| std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)));
        let _ = tx.send(r);
    });
    let std = rx.await.map_err(|_| std::io::Error::other("connect thread died"))??;
    std.set_nonblocking(true)?;
    std.set_nodelay(true)?;
    tokio::net::TcpStream::from_std(std)
}

async fn ns_channel(ns_path: PathBuf, to: SocketAddr) -> anyhow::Result<Channel> {
    Ok(Endpoint::try_from(format!("http://{to}"))?
        .connect_with_connector(tower::service_fn(move |_| {
            let p = ns_path.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(ns_connect(p, to).await?)) }
        }))
        .await?)
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat` (the daemon's own
/// parser); 0 when it cannot be read.
pub fn cpu_seconds(pid: u32) -> f64 {
    use kvferry_daemon::hostcpu::{parse_process_ticks, ticks_per_second};
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    parse_process_ticks(&stat).map_or(0.0, |t| t as f64 / ticks_per_second())
}

impl Regions {
    /// Starts both daemons, then both engines (each engine measures its prefill profile at
    /// start), and waits until every control socket exists.
    pub async fn start(emu: &Emulator, root: &Path, o: &RegionOptions) -> anyhow::Result<Self> {
        let dev_dir = root.join("dev-ca");
        kvferry_peer::DevPki::load_or_create(&dev_dir, "kvferry.bench")?;
        let mk = |name: &'static str, side: Side| -> anyhow::Result<Region> {
            let dir = root.join(name);
            std::fs::create_dir_all(&dir)?;
            let ip = emu.addr(side);
            Ok(Region {
                name,
                side,
                dir,
                ns_path: emu.ns(side).path(),
                grpc: addr(ip, 7070),
                peer: addr(ip, 7071),
                http: addr(ip, 7072),
                daemon_pid: 0,
                engine_pid: 0,
            })
        };
        let mut a = mk("region-a", Side::A)?;
        let mut b = mk("region-b", Side::B)?;
        std::fs::write(a.dir.join("kvferry.toml"), config(&a, &b, &dev_dir, o))?;
        std::fs::write(b.dir.join("kvferry.toml"), config(&b, &a, &dev_dir, o))?;
        let mut children = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(300);
        for r in [&mut a, &mut b] {
            let cfg = r.dir.join("kvferry.toml");
            let log = std::fs::File::create(r.dir.join("daemon.log"))?;
            let mut cmd = Command::from(emu.command(r.side, &o.exe));
            cmd.arg("daemon").arg("--config").arg(&cfg);
            cmd.stdout(log.try_clone()?).stderr(log).kill_on_drop(true);
            let child = cmd.spawn().context("spawning kvferry daemon")?;
            r.daemon_pid = child.id().unwrap_or(0);
            children.push((format!("daemon {}", r.name), child));
        }
        let mut me = Regions { a, b, children };
        for side in [Side::A, Side::B] {
            let sock = me.region(side).dir.join("engine.sock");
            let name = me.region(side).name;
            me.wait(&format!("daemon {name}"), deadline, || sock.exists()).await?;
        }
        if let Some(v) = &o.vllm {
            for (cpu, side) in [Side::A, Side::B].into_iter().enumerate() {
                let r = me.region(side).clone();
                let log = std::fs::File::create(r.dir.join("engine.log"))?;
                let mut cmd = v.command(emu, &r, cpu);
                cmd.stdout(log.try_clone()?).stderr(log).kill_on_drop(true);
                let child = cmd.spawn().context("spawning vLLM")?;
                match side {
                    Side::A => me.a.engine_pid = child.id().unwrap_or(0),
                    Side::B => me.b.engine_pid = child.id().unwrap_or(0),
                }
                me.children.push((format!("vLLM {}", r.name), child));
            }
            for side in [Side::A, Side::B] {
                let r = me.region(side).clone();
                while !crate::vllm::ready(&r).await {
                    me.check_alive()?;
                    if Instant::now() > deadline {
                        bail!("timed out waiting for vLLM in {}", r.name);
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        } else {
            for side in [Side::A, Side::B] {
                let r = me.region(side);
                let (dir, name) = (r.dir.clone(), r.name);
                let log = std::fs::File::create(dir.join("engine.log"))?;
                let mut cmd = Command::from(emu.command(side, &o.exe));
                cmd.arg("engine")
                    .arg("--run-dir")
                    .arg(&dir)
                    .arg("--engine-id")
                    .arg(format!("engine-{}", &name[7..]))
                    .arg("--control")
                    .arg(dir.join("engine-ctl.sock"))
                    .args(o.shape.args());
                cmd.stdout(log.try_clone()?).stderr(log).kill_on_drop(true);
                let child = cmd.spawn().context("spawning kvferry engine")?;
                let pid = child.id().unwrap_or(0);
                match side {
                    Side::A => me.a.engine_pid = pid,
                    Side::B => me.b.engine_pid = pid,
                }
                me.children.push((format!("engine {name}"), child));
            }
            for side in [Side::A, Side::B] {
                let ctl = me.region(side).dir.join("engine-ctl.sock");
                let name = me.region(side).name;
                me.wait(&format!("engine in {name}"), deadline, || ctl.exists()).await?;
            }
        }
        // Each engine registers its pool as it starts, and each daemon then faults its landing
        // zone in (at idle priority): a sweep started before that ends shares the cores with it
        // (a 3 GiB zone took 10-15 s a daemon here and overlapped the first 5-10 s of the vLLM
        // sweeps, when their decisions spread most).
        if o.landing_prefault {
            me.wait_prefaulted(o.landing_bytes, deadline).await?;
        }
        Ok(me)
    }

    /// Waits until each daemon's landing zone holds (nearly) its capacity in spare buffers:
    /// the engines registered, so the daemons are faulting the zones in.
    async fn wait_prefaulted(&mut self, capacity: u64, deadline: Instant) -> anyhow::Result<()> {
        const SPARE: &str = "kvferry_landing_zone_bytes{state=\"spare\"}";
        for side in [Side::A, Side::B] {
            let (mut last, mut stable) = (-1.0, 0);
            loop {
                let spare = self.metric(side, SPARE).await.unwrap_or(0.0);
                // Nearly full and no longer growing (the prefault's last buffers still cost a
                // second or two of one core here: a transfer started then is charged them), or
                // no longer growing for 2 s (a block size that does not divide the capacity, or
                // room held by something else).
                stable = if spare > 0.0 && spare == last { stable + 1 } else { 0 };
                if (spare >= 0.95 * capacity as f64 && stable >= 1) || stable >= 4 {
                    break;
                }
                last = spare;
                self.check_alive()?;
                if Instant::now() > deadline {
                    bail!(
                        "timed out waiting for {}'s landing zone to fault in ({spare} bytes)",
                        self.region(side).name
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Ok(())
    }

    /// The region on `side`.
    pub fn region(&self, side: Side) -> &Region {
        match side {
            Side::A => &self.a,
            Side::B => &self.b,
        }
    }

    async fn wait(
        &mut self,
        what: &str,
        deadline: Instant,
        mut ready: impl FnMut() -> bool,
    ) -> anyhow::Result<()> {
        while !ready() {
            for (name, c) in &mut self.children {
                if let Ok(Some(status)) = c.try_wait() {
                    bail!("{name} exited ({status}) while waiting for {what}; see its log");
                }
            }
            if Instant::now() > deadline {
                bail!("timed out waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// Fails if any process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        for (name, c) in &mut self.children {
            if let Ok(Some(status)) = c.try_wait() {
                bail!("{name} exited ({status}); see its log");
            }
        }
        Ok(())
    }

    /// A Migration client for the daemon on `side` (connected from inside its namespace).
    pub async fn migration(&self, side: Side) -> anyhow::Result<MigrationClient<Channel>> {
        let r = self.region(side);
        let ch = ns_channel(r.ns_path.clone(), r.grpc).await?;
        Ok(MigrationClient::new(ch).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20))
    }

    /// The ReferenceEngine control client of the engine on `side`.
    pub async fn engine(&self, side: Side) -> anyhow::Result<ReferenceEngineClient<Channel>> {
        let ch =
            kvferry_engine_node::daemon::connect_uds(&self.region(side).dir.join("engine-ctl.sock")).await?;
        Ok(ReferenceEngineClient::new(ch)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20))
    }

    /// The daemon's `/metrics` text.
    pub async fn metrics(&self, side: Side) -> anyhow::Result<String> {
        let r = self.region(side);
        let mut s = ns_connect(r.ns_path.clone(), r.http).await?;
        s.write_all(
            format!("GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", r.http).as_bytes(),
        )
        .await?;
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out)).await??;
        Ok(out)
    }

    /// One gauge from `/metrics` (first sample whose name and labels start with `key`).
    pub async fn metric(&self, side: Side, key: &str) -> anyhow::Result<f64> {
        let text = self.metrics(side).await?;
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find(|l| l.starts_with(key))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("metric {key} not found"))
    }

    /// SIGTERM everything, wait up to 5 s each, then kill.
    pub async fn stop(mut self) {
        for (_, c) in &mut self.children {
            if let Some(pid) = c.id() {
                // SAFETY: kill(2) on a pid we spawned and have not reaped has no memory-safety
                // preconditions.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGTERM);
                }
            }
        }
        for (name, c) in &mut self.children {
            if tokio::time::timeout(Duration::from_secs(5), c.wait()).await.is_err() {
                eprintln!("  {name} did not stop on SIGTERM; killing it");
                let _ = c.kill().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(name: &'static str, side: Side, ip: [u8; 4]) -> Region {
        let ip = Ipv4Addr::from(ip);
        Region {
            name,
            side,
            dir: PathBuf::from(format!("/tmp/{name}")),
            ns_path: PathBuf::new(),
            grpc: addr(ip, 7070),
            http: addr(ip, 7072),
            peer: addr(ip, 7071),
            daemon_pid: 0,
            engine_pid: 0,
        }
    }

    #[test]
    fn a_regions_daemon_config_is_the_daemons_own_format_with_the_options() {
        let (a, b) =
            (region("region-a", Side::A, [198, 18, 0, 1]), region("region-b", Side::B, [198, 18, 0, 2]));
        let o = RegionOptions {
            exe: PathBuf::from("kvferry"),
            shape: EngineShape {
                layers: 2,
                hidden: 64,
                heads: 2,
                kv_heads: 2,
                head_dim: 32,
                ffn: 64,
                num_blocks: 64,
            },
            gbps: 0.5,
            rtt_ms: 20.0,
            congestion: kvferry_peer::Congestion::NewReno,
            streams: 8,
            landing_bytes: 1 << 30,
            landing_prefault: true,
            vllm: None,
        };
        let cfg = kvferry_daemon::Config::parse(&config(&a, &b, Path::new("/tmp/dev"), &o)).unwrap();
        assert_eq!((cfg.region.as_str(), cfg.listen.grpc), ("region-a", a.grpc));
        assert_eq!((cfg.peers[0].region.as_str(), cfg.peers[0].addr), ("region-b", b.peer));
        assert_eq!((cfg.peers[0].gbps, cfg.peers[0].rtt_ms), (0.5, 20.0));
        assert_eq!((cfg.transfer.congestion, cfg.transfer.streams), (kvferry_peer::Congestion::NewReno, 8));
        assert_eq!((cfg.limits.landing_zone_bytes, cfg.limits.default_deadline_ms), (1 << 30, 900_000));
    }
}
