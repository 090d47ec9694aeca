//! `kvferry demo`: two regions on loopback, end to end, with no setup.
//!
//! Starts, as separate processes, a daemon and a reference engine for region A and for region
//! B (shared-memory pools, dev-mode certificates from a throwaway CA); runs a conversation in
//! A; migrates it to B through `MigrateSession`; prints the decision with its reasons and the
//! receipt; then proves that the migrated prefix yields the same next tokens — and the
//! bit-identical logits — as recomputing it from scratch in B. Exits 0 only if that proof
//! holds, and stops every process it started.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{
    GenerateRequest, GenerateResponse, MigrateSessionRequest, Policy, PolicyMode, migration_event,
};
use tokio::process::{Child, Command};
use tonic::transport::{Channel, Endpoint};

/// Flags of `kvferry demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Tokens in the conversation's first prompt.
    #[arg(long, default_value_t = 1500)]
    prompt_tokens: usize,
    /// Tokens each turn generates.
    #[arg(long, default_value_t = 8)]
    new_tokens: u32,
    /// Migration policy: auto | fetch | recompute.
    #[arg(long, default_value = "auto")]
    mode: String,
    /// Allow the split.
    #[arg(long)]
    allow_split: bool,
    /// Keep the run directory (logs, configs) instead of deleting it.
    #[arg(long)]
    keep: bool,
}

struct Procs(Vec<(String, Child)>);

impl Procs {
    async fn stop(&mut self) {
        for (_, c) in &mut self.0 {
            if let Some(pid) = c.id() {
                // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped) and a
                // valid signal number has no memory-safety preconditions.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGTERM);
                }
            }
        }
        for (name, c) in &mut self.0 {
            if tokio::time::timeout(Duration::from_secs(5), c.wait()).await.is_err() {
                eprintln!("  {name} did not stop on SIGTERM; killing it");
                let _ = c.kill().await;
            }
        }
        self.0.clear();
    }
}

fn free_tcp() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn free_udp() -> anyhow::Result<SocketAddr> {
    Ok(UdpSocket::bind("127.0.0.1:0")?.local_addr()?)
}

struct Region {
    name: &'static str,
    dir: PathBuf,
    grpc: SocketAddr,
    peer: SocketAddr,
    http: SocketAddr,
}

fn config(me: &Region, other: &Region, dev_dir: &Path) -> String {
    let mut cfg = kvferry_daemon::Config {
        region: me.name.into(),
        trust_domain: "kvferry.demo".into(),
        run_dir: me.dir.clone(),
        peers: vec![kvferry_daemon::config::Peer {
            region: other.name.into(),
            addr: other.peer,
            gbps: 10.0,
            rtt_ms: 1.0,
            max_egress_gbps: 0.0,
            tenants: None,
        }],
        ..kvferry_daemon::Config::default()
    };
    cfg.listen = kvferry_daemon::config::Listen { grpc: me.grpc, peer: me.peer, http: me.http };
    cfg.tls.dev_dir = dev_dir.to_owned();
    cfg.limits.staging_bytes = 64 << 20;
    cfg.limits.landing_zone_bytes = 256 << 20;
    cfg.to_toml()
}

fn spawn(procs: &mut Procs, name: &str, log: &Path, args: &[&str]) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let out = std::fs::File::create(log)?;
    let child =
        Command::new(exe).args(args).stdout(out.try_clone()?).stderr(out).kill_on_drop(true).spawn()?;
    procs.0.push((name.to_owned(), child));
    Ok(())
}

async fn wait_for(
    what: &str,
    deadline: Instant,
    mut ready: impl FnMut() -> bool,
    procs: &mut Procs,
) -> anyhow::Result<()> {
    while !ready() {
        for (name, c) in &mut procs.0 {
            if let Ok(Some(status)) = c.try_wait() {
                anyhow::bail!("{name} exited ({status}) while waiting for {what}; see its log");
            }
        }
        if Instant::now() > deadline {
            anyhow::bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn engine_client(sock: PathBuf) -> anyhow::Result<ReferenceEngineClient<Channel>> {
    Ok(ReferenceEngineClient::new(kvferry_engine_node::daemon::connect_uds(&sock).await?))
}

async fn generate(
    c: &mut ReferenceEngineClient<Channel>,
    tokens: &[u32],
    n: u32,
    use_cache: bool,
) -> anyhow::Result<GenerateResponse> {
    let req = GenerateRequest {
        tenant: "tenant-demo".into(),
        token_ids: tokens.to_vec(),
        max_new_tokens: n,
        use_cache,
    };
    Ok(c.generate(req).await?.into_inner())
}

/// Runs the demo.
pub async fn run(a: &DemoArgs) -> anyhow::Result<()> {
    let tmp = tempfile::Builder::new().prefix("kvferry-demo-").tempdir()?;
    let root = tmp.path().to_owned();
    let dev_dir = root.join("dev-ca");
    // Create the throwaway CA once, before both daemons start.
    kvferry_peer::DevPki::load_or_create(&dev_dir, "kvferry.demo")?;
    let mut regions = Vec::new();
    for name in ["region-a", "region-b"] {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)?;
        regions.push(Region { name, dir, grpc: free_tcp()?, peer: free_udp()?, http: free_tcp()? });
    }
    for (i, r) in regions.iter().enumerate() {
        std::fs::write(r.dir.join("kvferry.toml"), config(r, &regions[1 - i], &dev_dir))?;
    }
    println!("kvferry demo: two regions on loopback (dev-mode certificates, shared-memory pools)");
    println!("  run directory: {}", root.display());
    let mut procs = Procs(Vec::new());
    let result = demo_body(a, &regions, &mut procs).await;
    procs.stop().await;
    println!("  stopped every process the demo started");
    if a.keep {
        let kept = tmp.keep();
        println!("  kept {}", kept.display());
    }
    result
}

async fn demo_body(a: &DemoArgs, regions: &[Region], procs: &mut Procs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let boot = Instant::now() + Duration::from_secs(60);
    for r in regions {
        let cfg = r.dir.join("kvferry.toml");
        spawn(
            procs,
            &format!("daemon {}", r.name),
            &r.dir.join("daemon.log"),
            &["daemon", "--config", cfg.to_str().unwrap_or_default()],
        )?;
    }
    for r in regions {
        let sock = r.dir.join("engine.sock");
        wait_for(&format!("daemon {}", r.name), boot, || sock.exists(), procs).await?;
    }
    for r in regions {
        let id = format!("engine-{}", &r.name[7..]);
        let ctl = r.dir.join("engine-ctl.sock");
        spawn(
            procs,
            &id,
            &r.dir.join("engine.log"),
            &[
                "engine",
                "--run-dir",
                r.dir.to_str().unwrap_or_default(),
                "--engine-id",
                &id,
                "--control",
                ctl.to_str().unwrap_or_default(),
            ],
        )?;
    }
    for r in regions {
        let ctl = r.dir.join("engine-ctl.sock");
        wait_for(&format!("engine in {}", r.name), boot, || ctl.exists(), procs).await?;
    }
    println!("  started: 2 daemons + 2 reference engines in {:.1} s", t0.elapsed().as_secs_f64());

    let mut eng_a = engine_client(regions[0].dir.join("engine-ctl.sock")).await?;
    let mut eng_b = engine_client(regions[1].dir.join("engine-ctl.sock")).await?;

    // A conversation in region A: a long prompt, then a reply.
    let mut convo = kvferry_engine_node::prompt(a.prompt_tokens, 1024, 0x5EED);
    let turn1 = generate(&mut eng_a, &convo, a.new_tokens, true).await?;
    convo.extend(&turn1.new_tokens);
    println!(
        "\n[region-a] turn 1: {} prompt tokens prefilled in {:.3} s, replied {:?}",
        a.prompt_tokens, turn1.prefill_s, turn1.new_tokens
    );

    // The router moves the session to region B.
    let mode = match a.mode.as_str() {
        "fetch" => PolicyMode::Fetch,
        "recompute" => PolicyMode::Recompute,
        _ => PolicyMode::Auto,
    };
    let ch = Endpoint::from_shared(format!("http://{}", regions[1].grpc))?.connect().await?;
    let mut router = MigrationClient::new(ch);
    let req = MigrateSessionRequest {
        session_id: "demo-session-1".into(),
        tenant: "tenant-demo".into(),
        token_ids: convo.clone(),
        source_region: "region-a".into(),
        deadline_ms: 30_000,
        policy: Some(Policy {
            mode: mode as i32,
            allow_split: a.allow_split,
            max_egress_bytes: 0,
            allow_hedge: false,
        }),
        ..Default::default()
    };
    println!("\n[router] MigrateSession(session demo-session-1, {} tokens) -> region-b", convo.len());
    let mut stream = router.migrate_session(req).await?.into_inner();
    let mut receipt = None;
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(migration_event::Event::Decision(d)) => println!("{}", indent(&crate::report::decision(&d))),
            Some(migration_event::Event::Receipt(r)) => receipt = Some(r),
            _ => {}
        }
    }
    let receipt = receipt.ok_or_else(|| anyhow::anyhow!("MigrateSession ended without a receipt"))?;
    println!("{}", indent(&crate::report::receipt(&receipt)));

    // The next turn, in region B: with the migrated prefix, and from scratch.
    let user_turn = kvferry_engine_node::prompt(24, 1024, 0xBEEF);
    let mut turn2_prompt = convo.clone();
    turn2_prompt.extend(&user_turn);
    let warm = generate(&mut eng_b, &turn2_prompt, a.new_tokens, true).await?;
    let cold = generate(&mut eng_b, &turn2_prompt, a.new_tokens, false).await?;
    let in_a = generate(&mut eng_a, &turn2_prompt, a.new_tokens, true).await?;
    println!("\n[region-b] turn 2 ({} tokens):", turn2_prompt.len());
    println!(
        "  with the migrated prefix: {} tokens ready, {} computed, prefill {:.3} s -> {:?}",
        warm.loaded_tokens, warm.computed_tokens, warm.prefill_s, warm.new_tokens
    );
    println!(
        "  recomputed from scratch:  {} computed, prefill {:.3} s -> {:?}",
        cold.computed_tokens, cold.prefill_s, cold.new_tokens
    );
    println!("  (region-a, for reference: {:?})", in_a.new_tokens);
    let same_tokens = warm.new_tokens == cold.new_tokens && warm.new_tokens == in_a.new_tokens;
    let same_logits = warm.logits_digest == cold.logits_digest && !warm.logits_digest.is_empty();
    let used_prefix = warm.loaded_tokens > 0;
    println!(
        "\nproof: next tokens identical: {same_tokens}; logits bit-identical (sha256 {}): {same_logits}; prefix reused: {used_prefix}",
        hex(&warm.logits_digest[..warm.logits_digest.len().min(8)])
    );
    if same_tokens && same_logits && used_prefix {
        println!(
            "PASS: the migrated prefix yields exactly what recomputing it yields ({:.1} s total)",
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    } else {
        anyhow::bail!("FAIL: the migrated prefix does not reproduce a local recompute")
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
