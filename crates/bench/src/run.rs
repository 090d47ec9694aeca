//! The sweep: for each link profile, an emulator, two regions, the transfer sizes, the
//! baselines on the same link, then decision quality around the modeled crossover.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvferry_bench_report::{
    BaselinePoint, BenchReport, DeclinedSplit, LinkSpec, SplitPoint, TransferPoint, check, markdown, plots,
    stats, target_notes,
};
use kvferry_model::LinkModel;
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{Action, GenerateRequest, PolicyMode};
use kvferry_wanem::{Emulator, EmulatorConfig, PathProfile, Side};
use tonic::transport::Channel;

use crate::regions::{BLOCK_TOKENS, EngineShape, RegionOptions, Regions, cpu_seconds};
use crate::session::{self, Allow};

const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
/// The short fetches, in engine blocks, each profile's decision sweep begins after (not
/// scored), on the reference engine and on vLLM alike: as many as the loss tail needs before
/// it believes two modes, sizes across a BDP.
pub(crate) const WARM_SHORT_FETCH_BLOCKS: [u64; 8] = [1, 2, 1, 3, 1, 4, 2, 6];

/// The daemons' congestion controller for a profile: one for every profile, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CongestionChoice {
    /// What an operator of a dedicated inter-region pipe would set: kvferry's loss-tolerant
    /// controller on every profile. Under random loss CUBIC halves its window on every loss
    /// and carries ~1 % of the link, quinn's BBR 75–83 %, the loss-tolerant controller 90–95 %
    /// (`bench/results/bench-loss-cubic-vs-bbr.md`, `bench/results/lossy-2026-12-05/`). On a
    /// lossless path quinn's CUBIC (no HyStart) leaves slow start only at a loss: a warm
    /// connection's window overran the emulator's one-BDP queue in fetches of 16–64 MiB,
    /// dropped hundreds to thousands of packets and finished a round trip late, where the
    /// loss-tolerant controller's delay signal ends slow start first (16 MiB at 1 Gbit/s ×
    /// 50 ms: 2 of 8 CUBIC fetches 1.33× the model with 117–548 drops, none of 8 with it;
    /// 64 MiB 84–85 % of the link against 74–80 %, 256 MiB–2 GiB the same or better:
    /// `bench/results/congestion-lossless-2026-12-06/`).
    Auto,
    /// This controller on every profile.
    Fixed(kvferry_peer::Congestion),
}

impl CongestionChoice {
    /// The daemons' controller.
    pub fn controller(self) -> kvferry_peer::Congestion {
        match self {
            Self::Fixed(c) => c,
            Self::Auto => kvferry_peer::Congestion::Tolerant,
        }
    }
}

fn parse_congestion(s: &str) -> Result<CongestionChoice, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(CongestionChoice::Auto);
    }
    kvferry_peer::Congestion::parse(s)
        .map(CongestionChoice::Fixed)
        .ok_or_else(|| format!("{s:?}: must be auto, cubic, bbr, newreno or tolerant"))
}

/// Flags of `kvferry bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// The CI run: two profiles, one 64 MiB session each, few decision points; under 5 minutes.
    #[arg(long)]
    pub quick: bool,
    /// Link profiles (wanem presets or specs such as `rate=1gbit,rtt=50ms,loss=0.1%`),
    /// `;`-separated, since a spec itself uses commas [default:
    /// 100mbit-20ms;1gbit-50ms;1gbit-150ms;1gbit-50ms-loss0.1; quick: 100mbit-20ms;1gbit-50ms;
    /// --engine vllm: rate=500mbit,rtt=20ms;1gbit-50ms].
    #[arg(long, value_delimiter = ';')]
    pub profiles: Vec<String>,
    /// Session sizes in MiB, comma-separated [default: 64,256,1024,2048; quick: 64].
    #[arg(long, value_delimiter = ',')]
    pub sizes_mib: Vec<u64>,
    /// Baseline transfer size in MiB [default: 256; quick: 32].
    #[arg(long)]
    pub baseline_mib: Option<u64>,
    /// Skip the baselines.
    #[arg(long)]
    pub no_baselines: bool,
    /// Skip decision quality.
    #[arg(long)]
    pub no_decisions: bool,
    /// Prefix lengths per profile for decision quality [default: 8; quick: 4].
    #[arg(long)]
    pub decision_points: Option<usize>,
    /// Decide without hedging: the sweep's plans do not ask for a hedge, so every decision
    /// is one pure action (by default they ask, and a point the daemon hedges is executed
    /// hedged on a conversation of its own and judged by its own wall time).
    #[arg(long)]
    pub no_hedge: bool,
    /// Congestion controller of the daemons (auto | cubic | bbr | newreno | tolerant; auto:
    /// the loss-tolerant controller on every profile); anything else is refused when the
    /// flags are parsed.
    #[arg(long, default_value = "auto", value_parser = parse_congestion)]
    pub congestion: CongestionChoice,
    /// The emulator's receive-coalescing hold in µs (its NIC's interrupt moderation: due
    /// packets of one flow within it reach the stack as one GSO packet).
    #[arg(long, default_value_t = 50)]
    pub wan_gro_hold_us: u64,
    /// The emulator's TUN devices without a NIC's offloads (no TSO/USO on send, no receive
    /// coalescing; checksum offload stays): the kernels segment and receive every packet.
    #[arg(long)]
    pub wan_no_offloads: bool,
    /// Parallel QUIC streams per transfer.
    #[arg(long, default_value_t = 4)]
    pub streams: u32,
    /// Where report.json, report.md and the plots go [default: bench/results/bench-latest;
    /// quick: a temporary directory unless given].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Keep the regions' run directories (configs, logs) under OUT/runs.
    #[arg(long)]
    pub keep_logs: bool,
    /// Re-render a saved report.json (Markdown, plots, target notes) next to it; runs nothing.
    #[arg(long, value_name = "REPORT_JSON")]
    pub render: Option<PathBuf>,
    /// The regions' engines: `reference` (kvferry's reference engine: transfers, baselines,
    /// decisions) or `vllm` (real vLLM CPU servers with KvferryConnector: decisions only, each
    /// point fetched and recomputed by vLLM; needs the daemon built with NIXL).
    #[arg(long, value_enum, default_value_t = Engine::Reference)]
    pub engine: Engine,
    /// `--engine vllm`: Python of a venv with vLLM and the kvferry package
    /// (`tests/vllm/install.sh` makes `.venv-vllm`).
    #[arg(long, default_value = ".venv-vllm/bin/python")]
    pub vllm_python: PathBuf,
}

/// Which engines run in the emulated regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    Reference,
    Vllm,
}

/// What a run resolves its flags to.
#[derive(Debug, Clone)]
struct Plan {
    quick: bool,
    profiles: Vec<String>,
    sizes: Vec<u64>,
    baseline_bytes: u64,
    decision_points: usize,
    /// What the sweep's plans allow (split never: the split is measured on its own).
    decide: session::Allow,
}

fn resolve(a: &BenchArgs) -> anyhow::Result<Plan> {
    let profiles = if !a.profiles.is_empty() {
        a.profiles.clone()
    } else if a.engine == Engine::Vllm {
        // The bench model's KV is 4 KiB/token and vLLM's CPU prefill of it ~0.04-0.1 ms/token:
        // links on which the crossover falls within vLLM's 2048-token context (measured:
        // ~850 and ~1200 tokens).
        vec!["rate=500mbit,rtt=20ms".into(), "1gbit-50ms".into()]
    } else if a.quick {
        vec!["100mbit-20ms".into(), "1gbit-50ms".into()]
    } else {
        ["100mbit-20ms", "1gbit-50ms", "1gbit-150ms", "1gbit-50ms-loss0.1", "1gbit-50ms+cpu-load"]
            .map(String::from)
            .to_vec()
    };
    for p in &profiles {
        PathProfile::parse(with_load(p).0).map_err(|e| anyhow::anyhow!("--profiles: {e}"))?;
    }
    let sizes = if !a.sizes_mib.is_empty() {
        a.sizes_mib.clone()
    } else if a.quick {
        vec![64]
    } else {
        vec![64, 256, 1024, 2048]
    };
    if sizes.iter().any(|&s| s == 0 || s > 16 << 10) {
        bail!("--sizes-mib: each size must be 1..=16384 MiB");
    }
    let baseline_mib = a.baseline_mib.unwrap_or(if a.quick { 32 } else { 256 });
    if baseline_mib == 0 {
        bail!("--baseline-mib must be positive");
    }
    let decision_points = a.decision_points.unwrap_or(if a.quick { 4 } else { 8 });
    Ok(Plan {
        quick: a.quick,
        profiles,
        sizes: sizes.iter().map(|s| s * MIB).collect(),
        baseline_bytes: baseline_mib * MIB,
        decision_points,
        decide: session::Allow { split: false, hedge: !a.no_hedge },
    })
}

fn link_spec(name: &str, p: &PathProfile) -> LinkSpec {
    let ab = &p.ab;
    LinkSpec {
        profile: name.to_owned(),
        rate_bps: ab.rate_bps.map_or(f64::INFINITY, |r| r as f64),
        rtt_s: (ab.one_way_delay + p.ba.one_way_delay).as_secs_f64(),
        loss: ab.loss,
    }
}

/// The suffix that runs a profile's decision sweep beside a competing CPU load.
pub const CPU_LOAD_SUFFIX: &str = "+cpu-load";

/// A profile name without [`CPU_LOAD_SUFFIX`], and whether it had it.
pub fn with_load(name: &str) -> (&str, bool) {
    name.strip_suffix(CPU_LOAD_SUFFIX).map_or((name, false), |base| (base, true))
}

/// Competing CPU work for as long as it lives: one busy thread per two host CPUs (at least
/// one), at normal priority, each spinning on arithmetic it never sleeps in. What a region's
/// host looks like when other work shares its cores with the engine and the daemon.
struct CpuLoad {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuLoad {
    fn start() -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let n = (std::thread::available_parallelism().map_or(2, |n| n.get()) / 2).max(1);
        let threads = (0..n)
            .map(|i| {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("bench-cpu-load-{i}"))
                    .spawn(move || {
                        let mut x = 1u64;
                        while !stop.load(Ordering::Relaxed) {
                            for _ in 0..10_000 {
                                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                            }
                        }
                    })
                    .expect("spawning a CPU-load thread")
            })
            .collect();
        Self { stop, threads }
    }

    fn threads(&self) -> usize {
        self.threads.len()
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn host() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(|l| l.split_whitespace().nth(1).unwrap_or("?").to_owned()))
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpus} CPUs, {mem} kB RAM, Linux {}", kernel.trim())
}

/// Runs the bench; returns the report (already written under the output directory).
pub async fn run(a: &BenchArgs, command: String) -> anyhow::Result<BenchReport> {
    if let Some(json) = &a.render {
        return render(json);
    }
    let plan = resolve(a)?;
    kvferry_wanem::check_support()
        .map_err(|e| anyhow::anyhow!("kvferry bench needs the WAN emulator: {e}"))?;
    let vllm = match a.engine {
        Engine::Reference => None,
        Engine::Vllm => Some(crate::vllm::VllmOptions::tiny_llama(
            &a.vllm_python,
            &std::env::temp_dir().join("kvferry-bench-vllm-models"),
        )?),
    };
    let out = match (&a.out, a.quick) {
        (Some(o), _) => o.clone(),
        (None, false) if vllm.is_some() => PathBuf::from("bench/results/bench-vllm"),
        (None, false) => PathBuf::from("bench/results/bench-latest"),
        (None, true) => std::env::temp_dir().join(format!("kvferry-bench-quick-{}", std::process::id())),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let exe = std::env::current_exe()?;
    let max_session = plan.sizes.iter().copied().max().unwrap_or(64 * MIB);
    let shape = EngineShape::bench(max_session.max(plan.baseline_bytes));
    let started =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut report =
        BenchReport { command, started_unix: started, host: host(), quick: a.quick, ..Default::default() };
    let c = crate::ceilings::measure(Duration::from_millis(300));
    println!(
        "one core's ceilings, CPU s/GiB: memcpy {:.3}, AES-128-GCM {:.3}, XXH3-128 {:.3} (a side's floor {:.3})",
        c.memcpy_s_per_gib,
        c.aes128gcm_s_per_gib,
        c.checksum_s_per_gib,
        c.per_side_floor_s_per_gib()
    );
    report.ceilings = Some(c);
    println!(
        "kvferry bench: {} profiles, sessions {:?} MiB; engine KV {} KiB/token; {}",
        plan.profiles.len(),
        plan.sizes.iter().map(|s| s / MIB).collect::<Vec<_>>(),
        shape.bytes_per_token() / 1024,
        report.host
    );
    let t0 = Instant::now();
    for name in &plan.profiles {
        let path = PathProfile::parse(with_load(name).0)?;
        let mut link = link_spec(name, &path);
        if vllm.is_some() {
            link.profile = format!("{name} (vLLM)");
        }
        let congestion = a.congestion.controller();
        println!(
            "\n== profile {name}: {:.0} Mbit/s, RTT {:.0} ms, loss {:.2}%, congestion {}",
            link.rate_bps / 1e6,
            link.rtt_s * 1e3,
            link.loss * 100.0,
            congestion.name()
        );
        let mut wan = EmulatorConfig::new(path);
        wan.segmentation_offload = !a.wan_no_offloads;
        wan.rx_coalesce = (!a.wan_no_offloads).then(|| Duration::from_micros(a.wan_gro_hold_us));
        let emu = Emulator::with_config(wan).map_err(|e| anyhow::anyhow!("starting the emulator: {e}"))?;
        let root = tempfile::Builder::new().prefix("kvferry-bench-").tempdir()?;
        let opts = RegionOptions {
            exe: exe.clone(),
            shape,
            gbps: if link.rate_bps.is_finite() { link.rate_bps / 1e9 } else { 10.0 },
            rtt_ms: link.rtt_s * 1e3,
            congestion,
            streams: a.streams,
            // vLLM's fetches are at most its KV pool (`--kv-cache-memory-bytes`); the zone the
            // throughput sizes need (3 GiB for 2 GiB) took 10-15 s a daemon to fault in.
            landing_bytes: match &vllm {
                Some(v) => (4 * v.kv_bytes).max(256 * MIB),
                None => (max_session + max_session / 2).max(512 * MIB),
            },
            // A daemon that has run a while lands in memory it already faulted in; a fresh
            // one would pay ~0.5 s/GiB (2.4 s/GiB for memory this VM never touched) in the
            // first fetches' CPU figures (`bench/results/cpu-profile-2026-12-03/`).
            landing_prefault: true,
            vllm: vllm.clone(),
        };
        let t_start = Instant::now();
        let mut regions = match Regions::start(&emu, root.path(), &opts).await {
            Ok(r) => r,
            Err(e) => bail!("profile {name}: {e:#} (logs kept in {})", root.keep().display()),
        };
        println!(
            "  two regions up in {:.1} s (daemon + {} each, in namespaces)",
            t_start.elapsed().as_secs_f64(),
            if vllm.is_some() { "vLLM with KvferryConnector" } else { "reference engine" }
        );
        let result = match &vllm {
            // vLLM's sessions are small (max-model-len): decisions only.
            Some(v) => {
                let seed = 17 + 7 * report.decisions.len() as u64;
                crate::vllm::decisions(
                    crate::vllm::Sweep {
                        points: plan.decision_points,
                        quick: plan.quick,
                        decide: plan.decide,
                    },
                    &link,
                    v,
                    &mut regions,
                    &mut report,
                    seed,
                )
                .await
            }
            None => profile_body(&plan, a, &link, &shape, &emu, &mut regions, &mut report).await,
        };
        regions.stop().await;
        if a.keep_logs {
            let dst = out.join("runs").join(name.replace(['=', ',', '%'], "_"));
            let _ = std::fs::create_dir_all(&dst);
            let _ = copy_logs(root.path(), &dst);
        }
        // What is measured so far is on disk after every profile.
        report.decision_summary = stats::summaries(&report.decisions);
        std::fs::write(out.join("report.json"), serde_json::to_string_pretty(&report)?)?;
        if let Err(e) = result {
            let logs = root.keep();
            bail!(
                "profile {name}: {e:#} (logs kept in {}; the profiles before it are in {})",
                logs.display(),
                out.join("report.json").display()
            );
        }
        let s = emu.stats();
        let per = |d: &kvferry_wanem::DirectionStats| {
            format!(
                "{} packets, {} sends cut (TSO/USO), {} of them delivered in {} coalesced writes (GRO)",
                d.tx_packets, d.segmented, d.coalesced_packets, d.coalesced
            )
        };
        println!("  emulator A->B: {}; B->A: {}", per(&s.ab), per(&s.ba));
        drop(emu);
    }
    report.decision_summary = stats::summaries(&report.decisions);
    println!("\n({} s)", t0.elapsed().as_secs());
    finish(report, &out)
}

/// Notes the targets, writes report.json, report.md and the plots under `out`, prints the
/// summary, and fails if the report does not add up.
fn finish(mut report: BenchReport, out: &Path) -> anyhow::Result<BenchReport> {
    report.notes = target_notes(&report);
    let problems = check::check(&report);
    std::fs::write(out.join("report.json"), serde_json::to_string_pretty(&report)?)?;
    std::fs::write(out.join("report.md"), markdown::markdown(&report))?;
    match plots::write_all(&report, out) {
        Ok(files) => println!(
            "plots: {}",
            files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
        Err(e) => println!("plots not written: {e}"),
    }
    println!("report: {}", out.join("report.md").display());
    for s in &report.decision_summary {
        println!(
            "decisions {}: n {} accuracy {:.1}% mean regret {:.1}% worst {:.1}%",
            s.profile,
            s.n,
            s.accuracy * 100.0,
            s.mean_regret * 100.0,
            s.worst_regret * 100.0
        );
    }
    for n in &report.notes {
        println!("  {n}");
    }
    if !problems.is_empty() {
        bail!("the bench's answers are wrong:\n  {}", problems.join("\n  "));
    }
    Ok(report)
}

/// `kvferry bench --render report.json`: re-renders a saved run (Markdown, plots, target notes)
/// next to it, after checking that it adds up.
pub fn render(json: &Path) -> anyhow::Result<BenchReport> {
    let text = std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let report: BenchReport =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
    let out = json.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    finish(report, out)
}

fn copy_logs(from: &Path, to: &Path) -> std::io::Result<()> {
    for r in ["region-a", "region-b"] {
        for f in ["daemon.log", "engine.log", "kvferry.toml"] {
            let src = from.join(r).join(f);
            if src.exists() {
                std::fs::copy(&src, to.join(format!("{r}-{f}")))?;
            }
        }
    }
    Ok(())
}

async fn profile_body(
    plan: &Plan,
    a: &BenchArgs,
    link: &LinkSpec,
    shape: &EngineShape,
    emu: &Emulator,
    regions: &mut Regions,
    report: &mut BenchReport,
) -> anyhow::Result<()> {
    let mut seed = 1 + 1000 * report.transfers.len() as u64 + 7 * report.decisions.len() as u64;
    // A loaded profile measures decisions under contention: one (the smallest) transfer warms
    // the daemon's link estimate, no baselines; the load runs during the decision sweep only.
    let loaded = with_load(&link.profile).1;
    let sizes: Vec<u64> =
        if loaded { plan.sizes.iter().copied().min().into_iter().collect() } else { plan.sizes.clone() };
    for &bytes in &sizes {
        seed += 1;
        let p = transfer(emu, link, shape, regions, bytes, seed).await?;
        println!(
            "  fetch {:>5} MiB: {:.2} s, {:.0} Mbit/s ({:.0}% of link), model {:.2} s (ratio {:.2}), first layer {:.3} s, CPU s/GiB src {:.2} tgt {:.2}, engine load {:.3} s ({:.2} CPU s/GiB), queue drops {}, verified {}",
            bytes / MIB,
            p.wall_s,
            p.goodput_bps / 1e6,
            100.0 * p.goodput_bps / link.rate_bps,
            p.model_fetch_s,
            p.wall_s / p.model_fetch_s,
            p.first_layer_s,
            p.cpu_s_per_gib_source,
            p.cpu_s_per_gib_target,
            p.load_s,
            p.load_cpu_s_per_gib,
            p.queue_drops.unwrap_or(0),
            p.verified
        );
        report.transfers.push(p);
        regions.check_alive()?;
    }
    if !a.no_baselines && !loaded {
        type Baseline<'a> =
            Box<dyn Fn(&Emulator, u64) -> anyhow::Result<kvferry_baselines::BaselineRun> + 'a>;
        let cc = a.congestion.controller();
        let runs: [(&str, Baseline<'_>); 5] = [
            ("quinn-defaults", Box::new(kvferry_baselines::quinn_defaults)),
            ("tcp-tls", Box::new(kvferry_baselines::tcp_tls)),
            ("nixl-ucx-tcp", Box::new(kvferry_baselines::nixl_ucx_tcp)),
            // kvferry's own transport at the same size, QUIC beside TCP (peer level, no daemon).
            ("kvferry-quic", Box::new(move |e: &Emulator, b| kvferry_baselines::kvferry_quic(e, b, cc))),
            ("kvferry-tcp", Box::new(move |e: &Emulator, b| kvferry_baselines::kvferry_tcp(e, b, cc))),
        ];
        for (name, f) in runs {
            let bytes = plan.baseline_bytes;
            let r = tokio::task::block_in_place(|| f(emu, bytes));
            let point = match r {
                Ok(b) => BaselinePoint {
                    link: link.clone(),
                    name: b.name.to_owned(),
                    bytes: b.bytes,
                    wall_s: b.wall_s,
                    goodput_bps: b.goodput_bps,
                    cpu_s_sender: b.cpu_s_sender,
                    cpu_s_receiver: b.cpu_s_receiver,
                    verified: b.verified,
                    note: b.note,
                },
                // A baseline that cannot finish (e.g. CUBIC with quinn's windows on a lossy
                // link) is a finding, not a failure of the bench: record why and go on.
                Err(e) => BaselinePoint::skipped(
                    link.clone(),
                    name,
                    &format!("did not complete {} MiB: {e:#}", bytes / MIB),
                ),
            };
            println!(
                "  baseline {:<15} {:>5} MiB: {:.2} s, {:.0} Mbit/s, verified {} {}",
                point.name,
                point.bytes / MIB,
                point.wall_s,
                point.goodput_bps / 1e6,
                point.verified,
                point.note
            );
            report.baselines.push(point);
        }
    }
    if !a.no_decisions && plan.decision_points > 0 {
        let load = loaded.then(CpuLoad::start);
        if let Some(l) = &load {
            println!("  competing CPU load: {} busy thread(s) during the decision sweep", l.threads());
        }
        decisions(plan, link, shape, emu, regions, report, seed * 31).await?;
    }
    Ok(())
}

fn model_fetch_s(link: &LinkSpec, bytes: u64) -> f64 {
    match LinkModel::new(link.rate_bps / 1e9, link.rtt_s, 1.0) {
        Ok(m) => m.fetch_seconds(1, bytes as f64),
        Err(_) => 0.0,
    }
}

async fn transfer(
    emu: &Emulator,
    link: &LinkSpec,
    shape: &EngineShape,
    regions: &mut Regions,
    bytes: u64,
    seed: u64,
) -> anyhow::Result<TransferPoint> {
    let tokens_n = (bytes / shape.bytes_per_token()).div_ceil(BLOCK_TOKENS) * BLOCK_TOKENS;
    let tokens = session::prompt(tokens_n as usize, seed);
    let mut eng_a = regions.engine(Side::A).await?;
    let mut eng_b = regions.engine(Side::B).await?;
    let mut mig = regions.migration(Side::B).await?;
    let filled = session::fill(&mut eng_a, &tokens).await?;
    session::wait_for_holdings(&mut mig, &tokens, filled.tokens, Duration::from_secs(60)).await?;
    let (cpu_a0, cpu_b0) = (cpu_seconds(regions.a.daemon_pid), cpu_seconds(regions.b.daemon_pid));
    let drops0 = emu.stats().ab.queue_drops;
    let m =
        session::migrate(&mut mig, &format!("bench-fetch-{seed}"), &tokens, PolicyMode::Fetch, Allow::PURE)
            .await?;
    let (cpu_a1, cpu_b1) = (cpu_seconds(regions.a.daemon_pid), cpu_seconds(regions.b.daemon_pid));
    let queue_drops = emu.stats().ab.queue_drops.saturating_sub(drops0);
    let r = &m.receipt;
    if r.kind() != Action::Fetch || !r.fallback.is_empty() {
        bail!("a {} MiB fetch ended as {} (fallback: {})", bytes / MIB, r.action, r.fallback);
    }
    // The target engine's next turn loads the landed blocks into its pool (Engine.Load):
    // what that takes in the target daemon, wall (its own load metric) and CPU.
    let load_us0 = regions.metric(Side::B, "kvferry_engine_load_microseconds_total").await.unwrap_or(0.0);
    let load_cpu0 = cpu_seconds(regions.b.daemon_pid);
    let landed = session::digest(&mut eng_b, &tokens).await?;
    let load_cpu_s = cpu_seconds(regions.b.daemon_pid) - load_cpu0;
    let load_us1 = regions.metric(Side::B, "kvferry_engine_load_microseconds_total").await.unwrap_or(0.0);
    let verified =
        landed.tokens == filled.tokens && landed.digest == filled.digest && r.bytes_moved == filled.bytes;
    let gib = filled.bytes as f64 / GIB;
    let model_s = model_fetch_s(link, filled.bytes);
    let staging_a =
        regions.metric(Side::A, "kvferry_staging_high_water_bytes{direction=\"serve\"}").await.unwrap_or(0.0);
    let staging_b =
        regions.metric(Side::B, "kvferry_staging_high_water_bytes{direction=\"fetch\"}").await.unwrap_or(0.0);
    Ok(TransferPoint {
        link: link.clone(),
        session_bytes: filled.bytes,
        tokens: filled.tokens,
        wall_s: r.wall_s,
        goodput_bps: filled.bytes as f64 * 8.0 / r.wall_s.max(1e-9),
        model_fetch_s: model_s,
        model_goodput_bps: if model_s > 0.0 { filled.bytes as f64 * 8.0 / model_s } else { 0.0 },
        daemon_predicted_s: r.predicted_s,
        first_layer_s: r.first_layer_s,
        cpu_s_per_gib_source: (cpu_a1 - cpu_a0) / gib,
        cpu_s_per_gib_target: (cpu_b1 - cpu_b0) / gib,
        staging_bytes_source: staging_a as u64,
        staging_bytes_target: staging_b as u64,
        load_s: (load_us1 - load_us0).max(0.0) / 1e6,
        load_cpu_s_per_gib: load_cpu_s / gib,
        queue_drops: Some(queue_drops),
        verified,
    })
}

/// Prefix lengths around the crossover `x` (tokens), whole blocks, at least one block, at
/// most `cap`; `n` of them, geometric from x/4 to 4x. Without a crossover: 1 block to `cap`.
pub fn sweep_lengths(x: Option<f64>, n: usize, cap: u64) -> Vec<u64> {
    sweep_lengths_in(x, n, cap, BLOCK_TOKENS)
}

/// [`sweep_lengths`] for an engine with `block`-token blocks.
pub fn sweep_lengths_in(x: Option<f64>, n: usize, cap: u64, block: u64) -> Vec<u64> {
    let b = block.max(1) as f64;
    let (lo, hi) = match x {
        Some(x) if x.is_finite() && x > 0.0 => ((x / 4.0).max(b), (x * 4.0).min(cap as f64)),
        _ => (b, cap as f64),
    };
    let hi = hi.max(lo);
    let mut v: Vec<u64> = (0..n.max(1))
        .map(|i| {
            let f = if n <= 1 { 0.5 } else { i as f64 / (n - 1) as f64 };
            let t = lo * (hi / lo).powf(f);
            ((t / b).round().max(1.0) as u64 * block.max(1)).min(cap.max(block.max(1)))
        })
        .collect();
    v.dedup();
    v
}

/// The daemon's two predictions at one prefix length, with their bands (see [`band_sweep`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BandProbe {
    pub tokens: u64,
    pub fetch_s: f64,
    pub fetch_sd_s: f64,
    pub recompute_s: f64,
    pub recompute_sd_s: f64,
}

impl BandProbe {
    /// Whether the `z`-sd bands of fetch and recompute overlap here (where the daemon is unsure
    /// which is faster, and may hedge). A non-finite figure never overlaps.
    pub fn overlaps(&self, z: f64) -> bool {
        let gap = (self.fetch_s - self.recompute_s).abs();
        gap.is_finite() && gap <= z * (self.fetch_sd_s + self.recompute_sd_s)
    }
}

/// Bands are judged at ±1 sd, the daemon's default `policy.hedge_band_z`.
pub const BAND_Z: f64 = 1.0;

/// `n` prefix lengths (whole `block`s, at most `cap`) for a decision sweep: half spread evenly
/// across the uncertainty band — from the shortest to the longest probed length whose bands
/// overlap ([`BandProbe::overlaps`] at [`BAND_Z`]), widened to the probed neighbours on each
/// side — and the rest placed geometrically around `crossover` by [`sweep_lengths_in`]. With
/// no overlap anywhere on `grid`, all `n` are geometric. Sorted, deduplicated.
pub fn band_sweep(grid: &[BandProbe], crossover: Option<f64>, n: usize, cap: u64, block: u64) -> Vec<u64> {
    let b = block.max(1);
    let mut sorted: Vec<&BandProbe> = grid.iter().collect();
    sorted.sort_by_key(|p| p.tokens);
    let inside: Vec<usize> = (0..sorted.len()).filter(|&i| sorted[i].overlaps(BAND_Z)).collect();
    let (Some(&first), Some(&last)) = (inside.first(), inside.last()) else {
        return sweep_lengths_in(crossover, n, cap, block);
    };
    let lo = sorted[first.saturating_sub(1)].tokens;
    let hi = sorted[(last + 1).min(sorted.len() - 1)].tokens;
    let k = n.div_ceil(2).max(1);
    let mut v: Vec<u64> = (0..k)
        .map(|i| {
            let f = if k == 1 { 0.5 } else { i as f64 / (k - 1) as f64 };
            let t = lo as f64 + (hi - lo) as f64 * f;
            ((t / b as f64).round().max(1.0) as u64 * b).min(cap.max(b))
        })
        .collect();
    v.extend(sweep_lengths_in(crossover, n.saturating_sub(k), cap, block));
    v.sort_unstable();
    v.dedup();
    // Lengths that coincided: fill up, first from the band's other whole-block lengths, then
    // from a denser geometric sweep, then from any length up to `cap`; each time the candidate
    // farthest (in log tokens) from every length already chosen.
    let all: Vec<u64> = (1..=cap.max(b) / b).map(|i| i * b).collect();
    let pools = [
        all.iter().copied().filter(|t| (lo..=hi).contains(t)).collect(),
        sweep_lengths_in(crossover, 4 * n, cap, block),
        all,
    ];
    for mut spare in pools {
        spare.retain(|t| !v.contains(t));
        while v.len() < n && !spare.is_empty() {
            let gap =
                |t: u64| v.iter().map(|&x| (t as f64 / x as f64).ln().abs()).fold(f64::INFINITY, f64::min);
            let (i, _) = spare.iter().enumerate().fold((0, f64::NEG_INFINITY), |best, (i, &t)| {
                if gap(t) > best.1 { (i, gap(t)) } else { best }
            });
            v.push(spare.swap_remove(i));
            v.sort_unstable();
        }
    }
    v
}

/// The band probe at `tokens` from the daemon's decision there.
fn band_probe(tokens: u64, d: &kvferry_proto::v1::Decision) -> BandProbe {
    let band = |a: &str| {
        d.candidates.iter().find(|c| c.action == a).map_or((f64::NAN, 0.0), |c| (c.seconds, c.sd_s))
    };
    let ((fetch_s, fetch_sd_s), (recompute_s, recompute_sd_s)) = (band("fetch"), band("recompute"));
    BandProbe { tokens, fetch_s, fetch_sd_s, recompute_s, recompute_sd_s }
}

/// Plans `probe`'s prefixes at 12 geometric lengths from one block to `cap` and returns the
/// band probes (nothing moves).
pub(crate) async fn probe_band(
    mig: &mut kvferry_proto::v1::migration_client::MigrationClient<tonic::transport::Channel>,
    probe: &[u32],
    cap: u64,
    block: u64,
) -> anyhow::Result<Vec<BandProbe>> {
    let b = block.max(1);
    let mut lengths: Vec<u64> = (0..12)
        .map(|i| {
            let t = b as f64 * (cap.max(b) as f64 / b as f64).powf(f64::from(i) / 11.0);
            ((t / b as f64).round().max(1.0) as u64 * b).min(cap.max(b))
        })
        .collect();
    lengths.dedup();
    let mut out = Vec::with_capacity(lengths.len());
    for n in lengths {
        let d = session::plan(mig, &probe[..n as usize], Allow::PURE).await?;
        out.push(band_probe(n, &d));
    }
    Ok(out)
}

async fn decisions(
    plan: &Plan,
    link: &LinkSpec,
    shape: &EngineShape,
    emu: &Emulator,
    regions: &mut Regions,
    report: &mut BenchReport,
    mut seed: u64,
) -> anyhow::Result<()> {
    let mut eng_a = regions.engine(Side::A).await?;
    let mut eng_b = regions.engine(Side::B).await?;
    let mut mig = regions.migration(Side::B).await?;
    // One long conversation held by region A: its prefixes show what the daemon models now
    // (live link estimate, the engine's measured profile) at every length.
    let max_tokens = (u64::from(shape.num_blocks) * BLOCK_TOKENS / 4).max(BLOCK_TOKENS);
    let probe = session::prompt(max_tokens as usize, seed);
    seed += 1;
    let held = session::fill(&mut eng_a, &probe).await?;
    session::wait_for_holdings(&mut mig, &probe, held.tokens, Duration::from_secs(60)).await?;
    // The longest point's recompute must stay affordable on this CPU: double the length while
    // the daemon predicts a recompute under the budget.
    let budget_s = if plan.quick { 3.0 } else { 12.0 };
    let mut cap_tokens = BLOCK_TOKENS;
    let mut d0 = session::plan(&mut mig, &probe[..cap_tokens as usize], Allow::PURE).await?;
    while cap_tokens * 2 <= max_tokens {
        let d = session::plan(&mut mig, &probe[..(cap_tokens * 2) as usize], Allow::PURE).await?;
        if session::predicted(&d, "recompute").is_none_or(|s| s > budget_s) {
            break;
        }
        cap_tokens *= 2;
        d0 = d;
    }
    let crossover = d0.crossover_tokens;
    let grid = probe_band(&mut mig, &probe, cap_tokens, BLOCK_TOKENS).await?;
    let lengths = band_sweep(&grid, crossover, plan.decision_points, cap_tokens, BLOCK_TOKENS);
    println!("  {}", band_note(&grid));
    println!(
        "  decisions: modeled crossover {} tokens (linear recompute {:.3} ms/token, {} KiB/token, {:.3} ms/token on the wire at the live estimate); prefixes {:?}",
        crossover.map_or("none".into(), |x| format!("{x:.0}")),
        d0.recompute_s_per_token * 1e3,
        shape.bytes_per_token() / 1024,
        session::predicted(&d0, "fetch").map_or(f64::NAN, |f| (f - link.rtt_s) / cap_tokens as f64 * 1e3),
        lengths
    );
    // The target engine sat idle through the transfers and the baselines (minutes). On this
    // host, memory a process touched before costs 4–10× to touch again after seconds of idleness
    // (`bench/results/full-2026-12-06/`), and its first prefill after the pause ran up to 3.7×
    // the same prefill a moment later; as the daemon's first calibration sample that skewed the
    // sweep's next predictions. A serving replica is not idle: one prefill on the engine itself
    // (`Generate` without the cache: not through the daemon, so nothing calibrates from it)
    // brings it back first.
    {
        let warm = session::prompt(2 * BLOCK_TOKENS as usize, seed);
        seed += 1;
        let g = eng_b
            .generate(GenerateRequest {
                tenant: session::TENANT.into(),
                token_ids: warm,
                max_new_tokens: 1,
                use_cache: false,
            })
            .await?
            .into_inner();
        println!(
            "  target engine woken: a {}-token prefill on it took {:.3} s",
            g.computed_tokens, g.prefill_s
        );
    }
    // Warm-up, not scored: in the full runs of 2026-12-03 the target engine's first recompute
    // of a sweep — after the baselines' quiet spell, or as the CPU load started — took 1.6–5.6×
    // its prediction in 4 of 15 sweeps, the next ones on time (`bench/results/full-2026-12-03/`).
    // One fetch and one recompute of a short fresh prefix first (they are calibration samples
    // like any other migration).
    {
        let n = 2 * BLOCK_TOKENS;
        let (x, y) = (session::prompt(n as usize, seed), session::prompt(n as usize, seed + 1));
        seed += 2;
        let f = session::fill(&mut eng_a, &x).await?;
        session::wait_for_holdings(&mut mig, &x, f.tokens, Duration::from_secs(60)).await?;
        let (f, r) = session::pure_runs(&mut mig, ("bench-warm", seed), &x, &y, n, BLOCK_TOKENS).await?;
        // The engine's next step loads the fetched blocks (the daemon's first load sample).
        let load_s = engine_load_s(regions, &mut eng_b, &x).await?;
        // The daemon's receipts (what the sweep scores) and the router's walls, which add the
        // gRPC round trip across the link: the warm-ups "twice as slow" in the runs of
        // 2026-12-03 were router walls read against receipts (one RTT more, 50 and 150 ms).
        println!(
            "  warm-up (not scored): fetch {:.3} s + engine load {load_s:.3} s, recompute {:.3} s of {n} tokens (router's walls {:.3} / {:.3} s)",
            f.receipt.wall_s, r.receipt.wall_s, f.router_s, r.router_s
        );
    }
    // Short fetches, not scored: a daemon in service has fetched many short prefixes from its
    // peers before any one decision, and the link's loss tail (`calibration::tail`) is learnt
    // only from such fetches — whether each came in on time or a round trip late. Without them
    // the sweep's first points are decided from two or three, the coin flips of a lossy path
    // taken as its cost (`bench/results/lossy-small-fetches-2026-12-06/`).
    {
        let mut walls = Vec::with_capacity(WARM_SHORT_FETCH_BLOCKS.len());
        for n in WARM_SHORT_FETCH_BLOCKS.map(|b| b * BLOCK_TOKENS) {
            let x = session::prompt(n as usize, seed);
            seed += 1;
            let f = session::fill(&mut eng_a, &x).await?;
            session::wait_for_holdings(&mut mig, &x, f.tokens, Duration::from_secs(60)).await?;
            let m = session::migrate(
                &mut mig,
                &format!("bench-warm-short-{seed}"),
                &x,
                PolicyMode::Fetch,
                Allow::PURE,
            )
            .await?;
            if m.receipt.kind() != Action::Fetch || !m.receipt.fallback.is_empty() {
                bail!("warm-up fetch of {n} tokens ended as {} ({})", m.receipt.action, m.receipt.fallback);
            }
            engine_load_s(regions, &mut eng_b, &x).await?;
            walls.push(format!("{n}: {:.3}", m.receipt.wall_s));
        }
        println!("  short fetches (calibration, not scored), tokens: s — {}", walls.join(", "));
    }
    for &n in &lengths {
        // Three conversations of the same length: one decided then fetched, one recomputed,
        // one migrated with the split allowed (contents differ so no run warms another); a
        // fourth when the daemon hedges, executed hedged.
        let x = session::prompt(n as usize, seed);
        let y = session::prompt(n as usize, seed + 1);
        let z = session::prompt(n as usize, seed + 2);
        let w = session::prompt(n as usize, seed + 3);
        seed += 4;
        for t in [&x, &z] {
            let f = session::fill(&mut eng_a, t).await?;
            session::wait_for_holdings(&mut mig, t, f.tokens, Duration::from_secs(60)).await?;
        }
        let d = session::plan(&mut mig, &x, plan.decide).await?;
        let (fetched, recomputed) =
            session::pure_runs(&mut mig, ("bench-dq", seed), &x, &y, n, BLOCK_TOKENS).await?;
        let chosen = if matches!(d.kind(), Action::Fetch | Action::Recompute) {
            d.action.clone()
        } else {
            format!("{} (unexpected)", d.action)
        };
        let mut p = session::decision_point(link, n, chosen, &d, &fetched, &recomputed);
        // A fetch ends, for the engine, when its next step has loaded the fetched blocks into
        // its pool; a recompute wrote the pool as it ran.
        p.fetch_load_s = engine_load_s(regions, &mut eng_b, &x).await?;
        p.measured_fetch_s += p.fetch_load_s;
        if d.hedge {
            let f = session::fill(&mut eng_a, &w).await?;
            session::wait_for_holdings(&mut mig, &w, f.tokens, Duration::from_secs(60)).await?;
            let hedged = session::migrate(
                &mut mig,
                &format!("bench-dq-hedge-{seed}"),
                &w,
                PolicyMode::Auto,
                plan.decide,
            )
            .await?;
            session::record_hedge(&mut p, &hedged)?;
            // Whichever leg won, the engine's next step loads what was fetched (nothing after
            // a recompute won).
            let load_s = engine_load_s(regions, &mut eng_b, &w).await?;
            if let Some(h) = p.measured_hedge_s.as_mut() {
                *h += load_s;
            }
        }
        let steal0 = session::host_steal_s();
        let drops0 = emu.stats().ab.queue_drops;
        let split =
            session::migrate(&mut mig, &format!("bench-dq-split-{seed}"), &z, PolicyMode::Auto, Allow::SPLIT)
                .await?;
        let host_steal_s = steal0.zip(session::host_steal_s()).map(|(a, b)| (b - a).max(0.0));
        let queue_drops = emu.stats().ab.queue_drops.saturating_sub(drops0);
        let split_load_s = engine_load_s(regions, &mut eng_b, &z).await?;
        let split_note = if split.receipt.action == "split" && split.receipt.fallback.is_empty() {
            let s = SplitPoint {
                link: link.clone(),
                prefix_tokens: n,
                split_recompute_tokens: split.decision.split_recompute_tokens,
                predicted_split_s: split.receipt.predicted_s,
                measured_split_s: split.receipt.wall_s + split_load_s,
                measured_fetch_s: p.measured_fetch_s,
                measured_recompute_s: p.measured_recompute_s,
                compute_leg_s: split.receipt.split_compute_leg_s,
                fetch_leg_s: split.receipt.split_fetch_leg_s,
                predicted_compute_leg_s: split.receipt.predicted_compute_leg_s,
                predicted_fetch_leg_s: split.receipt.predicted_fetch_leg_s,
                host_steal_s,
                load_s: split_load_s,
                queue_drops: Some(queue_drops),
            };
            let note = format!(
                "split {} recomputed: {:.3} s (predicted {:.3}; legs: compute {:.3} / {:.3}, fetch {:.3} / {:.3}, then load {:.3}; queue drops {queue_drops}{})",
                s.split_recompute_tokens,
                s.measured_split_s,
                s.predicted_split_s,
                s.compute_leg_s,
                s.predicted_compute_leg_s,
                s.fetch_leg_s,
                s.predicted_fetch_leg_s,
                s.load_s,
                s.host_steal_s.map_or(String::new(), |x| format!("; host steal {x:.3} CPU s"))
            );
            report.splits.push(s);
            note
        } else {
            let declined = split.decision.declined_split.as_ref().map_or(String::new(), |x| {
                report.declined_splits.push(DeclinedSplit {
                    link: link.clone(),
                    prefix_tokens: n,
                    action: split.receipt.action.clone(),
                    measured_s: split.receipt.wall_s + split_load_s,
                    reason: split.decision.reason.clone(),
                });
                format!(
                    "(a split declined as not predictable: {:.3} s expected, its fetch leg late with probability {:.2}, then {:.3} s later)",
                    x.seconds, x.late_probability, x.late_delay_s
                )
            });
            format!("with split allowed: {} {declined}", split.receipt.action)
        };
        println!(
            "    {n:>6} tokens: chose {:<9} predicted fetch {:.3} s / recompute {:.3} s; measured {:.3} (load {:.3}) / {:.3}; {split_note}",
            p.chosen,
            p.predicted_fetch_s,
            p.predicted_recompute_s,
            p.measured_fetch_s,
            p.fetch_load_s,
            p.measured_recompute_s
        );
        println!("           {}", session::hedge_note(&p, &d));
        report.decisions.push(p);
        regions.check_alive()?;
    }
    Ok(())
}

/// The target engine's next step on the prefix `tokens`: it loads what of it landed in this
/// region into its pool (`Engine.Load`, served by the target daemon), and hashes it. Returns
/// the target daemon's load time for it (its `kvferry_engine_load_microseconds_total`), 0 when
/// nothing was loaded (a recompute wrote the pool itself).
async fn engine_load_s(
    regions: &Regions,
    eng_b: &mut ReferenceEngineClient<Channel>,
    tokens: &[u32],
) -> anyhow::Result<f64> {
    let us0 = target_load_us(regions).await;
    session::digest(eng_b, tokens).await?;
    Ok((target_load_us(regions).await - us0).max(0.0) / 1e6)
}

/// The target daemon's engine loads so far, microseconds (0 where its metrics cannot be read).
pub(crate) async fn target_load_us(regions: &Regions) -> f64 {
    regions.metric(Side::B, "kvferry_engine_load_microseconds_total").await.unwrap_or(0.0)
}

/// Where the daemon's bands overlapped on the probed grid, for the log.
pub(crate) fn band_note(grid: &[BandProbe]) -> String {
    let inside: Vec<u64> = grid.iter().filter(|p| p.overlaps(BAND_Z)).map(|p| p.tokens).collect();
    match (inside.first(), inside.last()) {
        (Some(lo), Some(hi)) => format!(
            "uncertainty band: fetch and recompute overlap at ±{BAND_Z} sd from {lo} to {hi} tokens ({} of {} probed lengths)",
            inside.len(),
            grid.len()
        ),
        _ => format!("uncertainty band: no overlap at ±{BAND_Z} sd on {} probed lengths", grid.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn args(v: &[&str]) -> BenchArgs {
        Cli::try_parse_from(std::iter::once("x").chain(v.iter().copied())).unwrap().bench
    }

    #[test]
    fn the_congestion_flag_is_typed_when_parsed() {
        use kvferry_peer::Congestion;
        assert_eq!(args(&[]).congestion, CongestionChoice::Auto);
        assert_eq!(
            args(&["--congestion", "NewReno"]).congestion,
            CongestionChoice::Fixed(Congestion::NewReno)
        );
        let e = Cli::try_parse_from(["x", "--congestion", "vegas"]).unwrap_err().to_string();
        assert!(e.contains("must be auto, cubic, bbr, newreno or tolerant"), "{e}");
        assert_eq!(
            args(&["--congestion", "tolerant"]).congestion,
            CongestionChoice::Fixed(Congestion::Tolerant)
        );
        // auto: the loss-tolerant controller; a fixed choice as given.
        assert_eq!(CongestionChoice::Auto.controller(), Congestion::Tolerant);
        assert_eq!(CongestionChoice::Fixed(Congestion::Bbr).controller(), Congestion::Bbr);
        assert_eq!(CongestionChoice::Fixed(Congestion::Cubic).controller(), Congestion::Cubic);
    }

    #[test]
    fn sweep_brackets_the_crossover_in_whole_blocks() {
        let v = sweep_lengths(Some(400.0), 5, 100_000);
        assert_eq!(v.first(), Some(&96)); // 400/4 = 100 -> 6 blocks
        assert_eq!(v.last(), Some(&1600));
        assert!(v.windows(2).all(|w| w[0] < w[1]));
        assert!(v.iter().all(|n| n % BLOCK_TOKENS == 0));
        // Capped, deduplicated, never below one block.
        assert_eq!(sweep_lengths(Some(400.0), 5, 128), vec![96, 112, 128]);
        assert_eq!(sweep_lengths(Some(1.0), 3, 1000), vec![16]);
        // No crossover (or a garbage one): one block to the cap.
        assert_eq!(sweep_lengths(None, 2, 512), vec![16, 512]);
        assert_eq!(sweep_lengths(Some(f64::NAN), 1, 512), vec![96]);
    }

    fn probe(tokens: u64, f: f64, r: f64, sd: f64) -> BandProbe {
        BandProbe { tokens, fetch_s: f, fetch_sd_s: sd, recompute_s: r, recompute_sd_s: sd }
    }

    #[test]
    fn half_the_sweep_lies_across_the_uncertainty_band() {
        // Fetch 0.1 s + 1 ms/token, recompute 1.5 ms/token, ±20 ms each: bands overlap from
        // about 120 to 280 tokens (crossover 200).
        let grid: Vec<BandProbe> = [16u64, 32, 64, 128, 160, 192, 224, 256, 320, 512, 1024, 2048]
            .iter()
            .map(|&n| probe(n, 0.1 + 1e-3 * n as f64, 1.5e-3 * n as f64, 0.02))
            .collect();
        let inside: Vec<u64> = grid.iter().filter(|p| p.overlaps(BAND_Z)).map(|p| p.tokens).collect();
        assert_eq!(inside, [128, 160, 192, 224, 256]);
        let v = band_sweep(&grid, Some(200.0), 8, 2048, 16);
        assert!(v.windows(2).all(|w| w[0] < w[1]) && v.iter().all(|n| n % 16 == 0), "{v:?}");
        // Four evenly across 64..=320 (the band widened to its probed neighbours) ...
        for want in [64, 144, 240, 320] {
            assert!(v.contains(&want), "{want} missing from {v:?}");
        }
        // ... and the geometric ones around the crossover, from x/4 to 4x.
        assert!(v.contains(&48) && v.contains(&800), "{v:?}");
        let banded = v.iter().filter(|&&n| (64..=320).contains(&n)).count();
        assert!(banded >= 4, "{v:?}");
        // No overlap anywhere (or no finite figures): all geometric, as before.
        let clear: Vec<BandProbe> =
            grid.iter().map(|p| BandProbe { fetch_sd_s: 0.0, recompute_sd_s: 0.0, ..*p }).collect();
        assert_eq!(band_sweep(&clear, Some(200.0), 8, 2048, 16), sweep_lengths_in(Some(200.0), 8, 2048, 16));
        let nan = [probe(64, f64::NAN, 0.1, 1.0)];
        assert!(!nan[0].overlaps(BAND_Z));
        assert_eq!(band_sweep(&nan, None, 3, 256, 16), sweep_lengths_in(None, 3, 256, 16));
        assert!(band_note(&grid).contains("from 128 to 256 tokens (5 of 12"), "{}", band_note(&grid));
        // A narrow range whose band and geometric points coincide still gets n distinct lengths.
        let short: Vec<BandProbe> = [16u64, 64, 160, 192, 256]
            .iter()
            .map(|&n| probe(n, 0.1 + 1e-3 * n as f64, 1.5e-3 * n as f64, 0.02))
            .collect();
        let v = band_sweep(&short, Some(630.0), 4, 256, 16);
        assert_eq!(v.len(), 4, "{v:?}");
        assert!(v.windows(2).all(|w| w[0] < w[1]) && v.iter().all(|&n| n % 16 == 0 && n <= 256), "{v:?}");
        assert_eq!(
            band_sweep(&short, Some(630.0), 40, 32, 16),
            [16, 32],
            "no more lengths than whole blocks"
        );
    }

    #[test]
    fn flags_resolve_to_the_documented_defaults_and_bad_ones_are_refused() {
        let q = resolve(&args(&["--quick"])).unwrap();
        assert_eq!((q.profiles.len(), q.sizes.clone(), q.decision_points), (2, vec![64 * MIB], 4));
        let full = resolve(&args(&[])).unwrap();
        assert_eq!(
            full.profiles,
            ["100mbit-20ms", "1gbit-50ms", "1gbit-150ms", "1gbit-50ms-loss0.1", "1gbit-50ms+cpu-load"]
        );
        assert_eq!(with_load("1gbit-50ms+cpu-load"), ("1gbit-50ms", true));
        assert_eq!(with_load("1gbit-50ms"), ("1gbit-50ms", false));
        assert!(resolve(&args(&["--profiles", "1gbit-50ms+cpu-load;clean+cpu-load"])).is_ok());
        assert!(resolve(&args(&["--profiles", "1gbit-50ms+gpu-load"])).is_err());
        assert_eq!(full.sizes, vec![64 * MIB, 256 * MIB, 1024 * MIB, 2048 * MIB]);
        let custom =
            resolve(&args(&["--profiles", "rate=1gbit,rtt=20ms;clean", "--sizes-mib", "8,16"])).unwrap();
        assert_eq!(custom.profiles, ["rate=1gbit,rtt=20ms", "clean"]);
        assert!(resolve(&args(&["--profiles", "5gbit-nowhere"])).is_err());
        assert!(resolve(&args(&["--sizes-mib", "0"])).is_err());
        assert!(resolve(&args(&["--baseline-mib", "0"])).is_err());
        let v = resolve(&args(&["--engine", "vllm"])).unwrap();
        assert_eq!(v.profiles, ["rate=500mbit,rtt=20ms", "1gbit-50ms"]);
        assert!(Cli::try_parse_from(["x", "--engine", "sglang"]).is_err());
    }

    #[test]
    fn vllm_sweeps_are_in_whole_vllm_blocks() {
        let v = sweep_lengths_in(Some(700.0), 4, 1920, 128);
        assert!(v.iter().all(|n| n % 128 == 0 && *n <= 1920), "{v:?}");
        assert_eq!((v[0], *v.last().unwrap()), (128, 1920)); // 175 -> 1 block; 2800 -> cap
        assert_eq!(sweep_lengths_in(None, 2, 1920, 128), vec![128, 1920]);
        assert_eq!(sweep_lengths_in(Some(10_000.0), 3, 1920, 128), vec![1920]);
    }
}
