//! A cluster of real processes (a `kvferry daemon` and a `kvferry engine` per region on
//! loopback; two regions, or three with [`Cluster::start_regions`]), configurable per region,
//! for the CLI's integration tests: a change to each daemon's [`Config`] (written out with
//! `Config::to_toml`), extra engine flags per region.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvferry_daemon::Config;
use kvferry_daemon::config::{Listen, Peer};
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{
    Decision, GenerateRequest, GenerateResponse, MigrateSessionRequest, Policy, PolicyMode, Receipt,
    ResidencyRequest, ResidencyResponse, migration_event,
};
use tonic::transport::{Channel, Endpoint};

pub const TENANT: &str = "tenant-it";
pub const NAMES: [&str; 3] = ["region-a", "region-b", "region-c"];

/// Per-region knobs.
#[derive(Debug, Default, Clone)]
pub struct RegionSpec {
    /// Applied to the daemon's config after the cluster's own settings (its peers are the
    /// other regions in name order: with two regions, its one peer is `peers[0]`).
    pub configure: Option<fn(&mut Config)>,
    /// Extra `kvferry engine` flags (after the defaults; clap takes the last value).
    pub engine_args: Vec<String>,
    /// Start no engine in this region.
    pub no_engine: bool,
}

pub struct Cluster {
    pub root: tempfile::TempDir,
    pub procs: Vec<(String, Child)>,
    pub grpc: Vec<SocketAddr>,
    pub http: Vec<SocketAddr>,
    /// Each engine's `kvferry` arguments, by region index (to start it again).
    pub engine_args: Vec<Option<Vec<String>>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn free_tcp() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}
/// A UDP port whose TCP twin is free too: a daemon's peer endpoint binds both (QUIC on UDP,
/// the TCP transport on the same port number).
pub fn free_udp() -> SocketAddr {
    for _ in 0..64 {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        if TcpListener::bind(a).is_ok() {
            return a;
        }
    }
    panic!("no port free for both UDP and TCP after 64 tries");
}

pub fn spawn(log: &Path, args: &[&str]) -> Child {
    let out = std::fs::File::create(log).unwrap();
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .spawn()
        .unwrap()
}

pub fn wait_file(p: &Path, what: &str, procs: &mut [(String, Child)]) {
    if let Err(e) = wait_ready(p, what, procs) {
        panic!("{}", e.0);
    }
}

/// Why a cluster did not start, and whether starting it again (on new ports) can help.
struct StartError(String, bool);

/// Waits for `p` to appear (at most 120 s); fails when one of `procs` exits first (retryable when its log,
/// `<name>.log` next to `p`'s directory's, says a port it was given was taken meanwhile: the
/// free ports are picked before the processes bind them).
fn wait_ready(p: &Path, what: &str, procs: &mut [(String, Child)]) -> Result<(), StartError> {
    let t = Instant::now();
    while !p.exists() {
        for (name, c) in procs.iter_mut() {
            if let Ok(Some(s)) = c.try_wait() {
                let logs = p.parent().and_then(Path::parent).map(port_taken).unwrap_or(false);
                return Err(StartError(format!("{name} exited ({s}) while waiting for {what}"), logs));
            }
        }
        if t.elapsed() >= Duration::from_secs(120) {
            return Err(StartError(format!("timed out waiting for {what}"), false));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn kill_all(procs: &mut [(String, Child)]) {
    for (_, c) in procs.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Whether any region's daemon log under `root` reports an address already in use.
fn port_taken(root: &Path) -> bool {
    NAMES.iter().any(|n| {
        std::fs::read_to_string(root.join(n).join("daemon.log"))
            .is_ok_and(|l| l.contains("in use") || l.contains("os error 98"))
    })
}

/// The engine flags every test uses (the e2e model: 2 layers, 1 KiB of KV per token).
pub const ENGINE_ARGS: &[&str] = &[
    "--layers",
    "2",
    "--hidden",
    "128",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "32",
    "--ffn",
    "256",
    "--vocab",
    "512",
    "--num-blocks",
    "2048",
];

impl Cluster {
    pub fn dir(&self, i: usize) -> PathBuf {
        self.root.path().join(NAMES[i])
    }

    pub fn dev_dir(&self) -> PathBuf {
        self.root.path().join("dev-ca")
    }

    /// Two regions, A and B.
    pub fn start(specs: [RegionSpec; 2]) -> Self {
        Self::start_regions(&specs)
    }

    /// One region per spec (at most three: A, B, C), every region a peer of every other.
    /// Started again on new ports (at most three times) when a daemon found a port it was
    /// given taken by the time it bound it. A start that fails kills what it had started
    /// before it panics (a `Child` dropped is not killed: a failed start used to leave its
    /// daemons running after the test binary exited).
    pub fn start_regions(specs: &[RegionSpec]) -> Self {
        let mut tries = 0;
        loop {
            tries += 1;
            match Self::try_start_regions(specs) {
                Ok(c) => return c,
                Err(StartError(e, true)) if tries < 3 => {
                    eprintln!("cluster start failed ({e}): a port was taken; again")
                }
                Err(StartError(e, _)) => panic!("{e}"),
            }
        }
    }

    fn try_start_regions(specs: &[RegionSpec]) -> Result<Self, StartError> {
        let n = specs.len();
        assert!((2..=NAMES.len()).contains(&n), "{n} regions");
        let root = tempfile::Builder::new().prefix("kvferry-it-").tempdir().unwrap();
        let grpc: Vec<SocketAddr> = (0..n).map(|_| free_tcp()).collect();
        let http: Vec<SocketAddr> = (0..n).map(|_| free_tcp()).collect();
        let peer: Vec<SocketAddr> = (0..n).map(|_| free_udp()).collect();
        let dev = root.path().join("dev-ca");
        kvferry_peer::DevPki::load_or_create(&dev, "kvferry.e2e").unwrap();
        let mut procs = Vec::new();
        let mut engine_args = vec![None; n];
        for i in 0..n {
            let dir = root.path().join(NAMES[i]);
            std::fs::create_dir_all(&dir).unwrap();
            let mut cfg = Config {
                region: NAMES[i].into(),
                trust_domain: "kvferry.e2e".into(),
                run_dir: dir.clone(),
                listen: Listen { grpc: grpc[i], peer: peer[i], http: http[i] },
                peers: (0..n)
                    .filter(|&j| j != i)
                    .map(|j| Peer {
                        region: NAMES[j].into(),
                        addr: peer[j],
                        gbps: 10.0,
                        rtt_ms: 1.0,
                        max_egress_gbps: 0.0,
                        tenants: None,
                        transport: Default::default(),
                    })
                    .collect(),
                ..Config::default()
            };
            cfg.tls.dev_dir = dev.clone();
            (cfg.limits.staging_bytes, cfg.limits.landing_zone_bytes, cfg.limits.max_tokens) =
                (32 << 20, 256 << 20, 65_536);
            // The tests run beside each other on a host they keep busy: a daemon measuring
            // that host would (rightly) plan no split. `calibration.rs` turns it on with a
            // load of its own.
            cfg.policy.split_cpu_floor = false;
            if let Some(f) = specs[i].configure {
                f(&mut cfg);
            }
            let path = dir.join("kvferry.toml");
            std::fs::write(&path, cfg.to_toml()).unwrap();
            procs.push((
                format!("daemon {}", NAMES[i]),
                spawn(&dir.join("daemon.log"), &["daemon", "--config", path.to_str().unwrap()]),
            ));
        }
        for (i, name) in NAMES.into_iter().take(n).enumerate() {
            let dir = root.path().join(name);
            if let Err(e) = wait_ready(&dir.join("engine.sock"), "daemon", &mut procs) {
                kill_all(&mut procs);
                return Err(e);
            }
            if specs[i].no_engine {
                continue;
            }
            let ctl = dir.join("ctl.sock");
            let id = format!("engine-{}", &name[7..]);
            let mut args: Vec<&str> = vec![
                "engine",
                "--run-dir",
                dir.to_str().unwrap(),
                "--engine-id",
                &id,
                "--control",
                ctl.to_str().unwrap(),
            ];
            // Defaults, less any flag the spec sets itself.
            for pair in ENGINE_ARGS.chunks(2) {
                if !specs[i].engine_args.iter().any(|a| a == pair[0]) {
                    args.extend(pair);
                }
            }
            args.extend(specs[i].engine_args.iter().map(String::as_str));
            procs.push((id.clone(), spawn(&dir.join("engine.log"), &args)));
            engine_args[i] = Some(args.iter().map(|a| a.to_string()).collect());
        }
        for (i, name) in NAMES.into_iter().take(n).enumerate() {
            if !specs[i].no_engine
                && let Err(e) = wait_ready(&root.path().join(name).join("ctl.sock"), "engine", &mut procs)
            {
                kill_all(&mut procs);
                return Err(e);
            }
        }
        Ok(Self { root, procs, grpc, http, engine_args })
    }

    pub async fn router(&self, i: usize) -> MigrationClient<Channel> {
        let ch = Endpoint::from_shared(format!("http://{}", self.grpc[i])).unwrap().connect().await.unwrap();
        MigrationClient::new(ch)
    }

    pub async fn engine(&self, i: usize) -> ReferenceEngineClient<Channel> {
        let ch = kvferry_engine_node::daemon::connect_uds(&self.dir(i).join("ctl.sock")).await.unwrap();
        ReferenceEngineClient::new(ch)
    }

    /// Stops region `i`'s daemon (SIGKILL when `kill`, else SIGTERM and a clean exit) and
    /// starts it again on the same config (same ports, run dir, identity); its log is appended
    /// to. Returns once the new daemon's engine socket is bound.
    pub fn restart_daemon(&mut self, i: usize, kill: bool) {
        self.stop(&format!("daemon {}", NAMES[i]), kill);
        self.start_daemon(i);
    }

    /// Stops process `name` (SIGKILL when `kill`, else SIGTERM, which must end in a clean
    /// exit) and waits for it.
    pub fn stop(&mut self, name: &str, kill: bool) {
        let at = self.procs.iter().position(|(n, _)| n == name).expect("a process of that name");
        let child = &mut self.procs[at].1;
        if kill {
            let _ = child.kill();
        } else {
            let s = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
            assert!(s.success(), "kill -TERM {name}");
        }
        let status = child.wait().unwrap();
        assert!(kill || status.success(), "{name} did not stop cleanly on SIGTERM: {status}");
    }

    /// Starts region `i`'s (stopped) daemon again on its config, its log appended to. Returns
    /// once its engine socket and router port are bound.
    pub fn start_daemon(&mut self, i: usize) {
        let name = format!("daemon {}", NAMES[i]);
        let dir = self.dir(i);
        let at = self.procs.iter().position(|(n, _)| *n == name).expect("a daemon process");
        let _ = std::fs::remove_file(dir.join("engine.sock"));
        let log = std::fs::OpenOptions::new().append(true).open(dir.join("daemon.log")).unwrap();
        let cfg = dir.join("kvferry.toml");
        let child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["daemon", "--config", cfg.to_str().unwrap()])
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.procs[at].1 = child;
        wait_file(&dir.join("engine.sock"), "the restarted daemon", &mut self.procs);
        let t = Instant::now();
        while std::net::TcpStream::connect(self.grpc[i]).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the restarted {name} never bound its router port"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts region `i`'s (stopped) engine again with its arguments, its log appended to.
    /// Returns once its control socket is bound (a new process: its cache starts empty).
    pub fn start_engine(&mut self, i: usize) {
        let name = format!("engine-{}", &NAMES[i][7..]);
        let dir = self.dir(i);
        let at = self.procs.iter().position(|(n, _)| *n == name).expect("an engine process");
        let _ = std::fs::remove_file(dir.join("ctl.sock"));
        let log = std::fs::OpenOptions::new().append(true).open(dir.join("engine.log")).unwrap();
        let args = self.engine_args[i].clone().expect("region i has an engine");
        let child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(&args)
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.procs[at].1 = child;
        wait_file(&dir.join("ctl.sock"), "the restarted engine", &mut self.procs);
    }

    /// Whether process `name` is still running.
    pub fn alive(&mut self, name: &str) -> bool {
        self.procs.iter_mut().any(|(n, c)| n == name && matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL.
    pub fn kill(&mut self, name: &str) {
        for (n, c) in &mut self.procs {
            if n == name {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    pub fn log(&self, i: usize, what: &str) -> String {
        std::fs::read_to_string(self.dir(i).join(format!("{what}.log"))).unwrap_or_default()
    }

    /// `/metrics` of region `i`'s daemon.
    pub async fn metrics(&self, i: usize) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(self.http[i]).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out)).await.unwrap().unwrap();
        out
    }
}

/// The value of one sample line (`name{labels} value`) of a metrics text.
pub fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no sample {sample} in:\n{text}"))
}

/// `n` prompt tokens in the e2e model's vocabulary.
pub fn tokens(n: usize, seed: u64) -> Vec<u32> {
    kvferry_engine_node::prompt(n, 512, seed)
}

pub async fn generate(
    c: &mut ReferenceEngineClient<Channel>,
    t: &[u32],
    use_cache: bool,
) -> GenerateResponse {
    c.generate(GenerateRequest { tenant: TENANT.into(), token_ids: t.to_vec(), max_new_tokens: 4, use_cache })
        .await
        .unwrap()
        .into_inner()
}

/// The next turn on `engine` (the migrated conversation `convo` and 7 more tokens), warm and
/// from scratch, must agree bit for bit, the warm one with at least `min_ready` tokens loaded.
pub async fn assert_warm_equals_cold(b: &mut ReferenceEngineClient<Channel>, convo: &[u32], min_ready: u64) {
    let mut next = convo.to_vec();
    next.extend(tokens(7, 99));
    let warm = generate(b, &next, true).await;
    let cold = generate(b, &next, false).await;
    assert!(
        warm.loaded_tokens >= min_ready,
        "only {} tokens were ready (want {min_ready})",
        warm.loaded_tokens
    );
    assert_eq!(warm.new_tokens, cold.new_tokens);
    assert_eq!(
        warm.logits_digest, cold.logits_digest,
        "logits after the migrated prefix differ from a recompute"
    );
}

/// `router`'s residency view of `tenant`'s prefix `t`, asking `regions` (empty: every peer).
pub async fn residency(
    router: &mut MigrationClient<Channel>,
    tenant: &str,
    t: &[u32],
    regions: &[&str],
) -> ResidencyResponse {
    let req = ResidencyRequest {
        tenant: tenant.into(),
        token_ids: t.to_vec(),
        regions: regions.iter().map(|r| r.to_string()).collect(),
        ..Default::default()
    };
    router.get_residency(req).await.unwrap().into_inner()
}

pub fn request(session: &str, t: &[u32], mode: PolicyMode) -> MigrateSessionRequest {
    MigrateSessionRequest {
        session_id: session.into(),
        tenant: TENANT.into(),
        token_ids: t.to_vec(),
        source_region: "region-a".into(),
        deadline_ms: 30_000,
        policy: Some(Policy { mode: mode as i32, ..Default::default() }),
        ..Default::default()
    }
}

/// Runs one migration to its end: its decision and its receipt.
pub async fn migrate(c: &mut MigrationClient<Channel>, req: MigrateSessionRequest) -> (Decision, Receipt) {
    let mut s = c.migrate_session(req).await.unwrap().into_inner();
    let (mut d, mut r) = (None, None);
    while let Some(ev) = s.message().await.unwrap() {
        match ev.event {
            Some(migration_event::Event::Decision(x)) => d = Some(x),
            Some(migration_event::Event::Receipt(x)) => r = Some(x),
            _ => {}
        }
    }
    (d.expect("a decision"), r.expect("a receipt"))
}

/// Waits until `router`'s plan for `req` sees the source's blocks (engines report them
/// asynchronously).
pub async fn wait_for_source(router: &mut MigrationClient<Channel>, req: &MigrateSessionRequest) {
    let t = Instant::now();
    let full_blocks = (req.token_ids.len() / 16 * 16) as u64;
    loop {
        let plan = router.plan_migration(req.clone()).await.unwrap().into_inner();
        if plan.source_tokens >= full_blocks {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the source's blocks never became visible: {plan:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes `files` into `dir` the way the kubelet updates a mounted Secret (cert-manager's
/// certificates arrive so): the contents go into a fresh hidden directory, `..data` is swapped
/// onto it with one rename, and each visible name is a symlink through `..data`. Called again,
/// it rotates the files atomically; the previous version's directory is removed after the swap.
pub fn write_secret(dir: &Path, files: &[(&str, &str)]) {
    use std::os::unix::fs::symlink;
    std::fs::create_dir_all(dir).unwrap();
    let version = format!("..{}_{:x}", std::process::id(), rand_suffix());
    let vdir = dir.join(&version);
    std::fs::create_dir(&vdir).unwrap();
    for (name, text) in files {
        std::fs::write(vdir.join(name), text).unwrap();
    }
    let old = std::fs::read_link(dir.join("..data")).ok();
    symlink(&version, dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    for (name, _) in files {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            symlink(Path::new("..data").join(name), &link).unwrap();
        }
    }
    if let Some(old) = old {
        let _ = std::fs::remove_dir_all(dir.join(old));
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

/// The Secret files of a region identity issued by `pki` (`ca.crt`, `tls.crt`, `tls.key`).
pub fn identity_secret(dir: &Path, pki: &kvferry_peer::DevPki, region: &str) {
    let (cert, key) = pki.issue(region).unwrap().to_pem();
    write_secret(dir, &[("ca.crt", &pki.ca_pem()), ("tls.crt", &cert), ("tls.key", &key)]);
}

/// A `configure` step: this region's peer identity in `tls.mode = "files"`, issued by the
/// cluster's dev CA into `<run_dir>/peer-tls` in the kubelet's layout ([`write_secret`]).
pub fn peer_identity_from_files(c: &mut Config) {
    let pki = kvferry_peer::DevPki::load_or_create(&c.tls.dev_dir, &c.trust_domain).unwrap();
    let dir = c.run_dir.join("peer-tls");
    identity_secret(&dir, &pki, &c.region);
    c.tls.mode = kvferry_daemon::config::TlsMode::Files;
    (c.tls.ca, c.tls.cert, c.tls.key) = (dir.join("ca.crt"), dir.join("tls.crt"), dir.join("tls.key"));
}

impl Cluster {
    /// The process id of `name` (for signals).
    pub fn pid(&self, name: &str) -> u32 {
        self.procs.iter().find(|(n, _)| n == name).map(|(_, c)| c.id()).unwrap()
    }

    /// Sends SIGHUP to `name`.
    pub fn sighup(&self, name: &str) {
        let s = Command::new("kill").args(["-HUP", &self.pid(name).to_string()]).status().unwrap();
        assert!(s.success(), "kill -HUP {name}");
    }

    /// Waits until region `i`'s `what` log (`daemon`, `engine`) says `needle` `times` times
    /// (bounded).
    pub async fn wait_log(&self, i: usize, what: &str, needle: &str, times: usize) {
        let t = Instant::now();
        while self.log(i, what).matches(needle).count() < times {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{what} log never said {needle:?} {times}×:\n{}",
                self.log(i, what)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `sample` in region `i`'s `/metrics` reaches `want` (bounded).
    pub async fn wait_metric(&self, i: usize, sample: &str, want: f64) {
        let t = Instant::now();
        loop {
            let m = self.metrics(i).await;
            if metric(&m, sample) >= want {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{sample} never reached {want}:\n{m}\n--- daemon log:\n{}",
                self.log(i, "daemon")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
