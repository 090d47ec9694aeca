//! `kvferry bench --engine vllm`: real vLLM (CPU build) OpenAI-compatible servers with
//! `KvferryConnector` as the regions' engines, in the emulator's namespaces, and the
//! decision-quality sweep driven through their HTTP API: each prefix is held by vLLM A (a
//! completion with the bench tenant as `cache_salt`), decided by daemon B from vLLM B's own
//! measured prefill profile and the live link, then fetched and (another conversation of the
//! same length) recomputed for real, both timed by the daemon's receipts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvferry_bench_report::{BenchReport, LinkSpec};
use kvferry_proto::v1::{Action, PolicyMode};
use kvferry_wanem::{Emulator, Side};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use crate::regions::{Region, Regions, ns_connect};
use crate::session::{self, Allow};

/// Prompt lengths vLLM B prefills before the sweep, so that its first profile has steps from
/// 64 to 1,024 tokens: the eight at 200–500 tokens it had before could not tell the fixed cost
/// per step from the cost per token (one run's first fit had no fixed cost and 0.67 ms/token,
/// `bench/results/bench-vllm-2026-12-07/`).
///
/// The last is the longest prompt the engine takes (`max_model_len` less 32): the allocator
/// keeps what a step frees ([`VLLM_MALLOC_TUNABLES`]), but the first step longer than any before
/// it still grows the heap and faults its new pages in (a 1,024-token step 0.55 s, 14 ticks of
/// system time, where later ones took 0.20–0.30 s); a replica in service has long reached that
/// size.
const WARM_PREFILL_TOKENS: [usize; 9] = [200, 300, 400, 64, 1024, 128, 512, 768, usize::MAX];

/// Lengths vLLM B recomputes on daemon B's command before the sweep (whole blocks, at most the
/// longest prefix it takes): the sweep's range, short and long, in no order.
const WARM_RECOMPUTE_TOKENS: [u64; 4] = [128, 1920, 512, 1024];

/// glibc's allocator settings for the vLLM engines: keep freed memory for reuse (a trim
/// threshold of 4 GiB, and a fixed mmap threshold at glibc's largest, 32 MiB, instead of the
/// dynamic one), as the tcmalloc that vLLM's CPU guide preloads does. With glibc's defaults a
/// prefill's activations went back to the kernel after each step and the next step faulted
/// them in again: on this VM a first touch costs ~8 µs, and a 1,920-token step of vLLM B spent
/// 0.30 s of system time in 38,000 page faults beside 0.47 s of its own computation (0.05 s and
/// 24,000 faults in the next step of that length): the same step's time varied 1.5–2×. With
/// these settings a repeated length faults nothing (`bench/results/bench-vllm-2026-12-07-pinned/`).
pub const VLLM_MALLOC_TUNABLES: &str =
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296";

/// The vLLM servers' port inside each namespace.
pub const VLLM_PORT: u16 = 8000;

/// The vLLM engines of a `--engine vllm` run.
#[derive(Debug, Clone)]
pub struct VllmOptions {
    /// Python of a venv with vLLM's CPU build and the kvferry package (tests/vllm/install.sh).
    pub python: PathBuf,
    /// A Hugging Face model directory (local; nothing is downloaded).
    pub model: PathBuf,
    pub served_name: String,
    /// `--dtype` (float32 | bfloat16).
    pub dtype: String,
    /// vLLM's `--block-size` (tokens per KV block).
    pub block_size: u32,
    /// vLLM's `--max-model-len`: the longest prefix the sweep can use.
    pub max_model_len: u32,
    /// vLLM's `--kv-cache-memory-bytes`.
    pub kv_bytes: u64,
}

impl VllmOptions {
    /// The bench's seeded Llama (tests/vllm/make_model.py: 4 layers, 8 heads and 2 KV heads of
    /// 64, hidden 512, fp32: 4 KiB of KV per token), created under `dir` with `python`.
    pub fn tiny_llama(python: &Path, dir: &Path) -> anyhow::Result<Self> {
        let name = "tiny-llama-h512-f32";
        let model = dir.join(name);
        if !model.join("config.json").exists() {
            let script = Path::new("tests/vllm/make_model.py");
            if !script.exists() {
                bail!(
                    "--engine vllm without --vllm-model runs {} from the repository root",
                    script.display()
                );
            }
            let st = std::process::Command::new(python)
                .arg(script)
                .arg(&model)
                .args(["--layers", "4", "--heads", "8", "--kv-heads", "2", "--head-dim", "64"])
                .stdout(std::process::Stdio::null())
                .status()
                .with_context(|| format!("running {} {}", python.display(), script.display()))?;
            if !st.success() {
                bail!("{} {} failed ({st})", python.display(), script.display());
            }
        }
        Ok(Self {
            python: python.to_owned(),
            model,
            served_name: name.into(),
            dtype: "float32".into(),
            block_size: 128,
            max_model_len: 2048,
            kv_bytes: 64 << 20,
        })
    }

    fn kv_transfer_config(&self, r: &Region) -> String {
        serde_json::json!({
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "daemon_socket": r.dir.join("engine.sock"),
                "engine_id": format!("vllm-{}", r.name),
                "model_id": self.served_name,
                "server_url": format!("http://{}", vllm_addr(r)),
            }
        })
        .to_string()
    }

    /// The command that starts this region's vLLM server inside its namespace.
    pub fn command(&self, emu: &Emulator, r: &Region, cpu: usize) -> Command {
        let mut cmd = Command::from(emu.command(r.side, &self.python));
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&self.model)
            .args(["--served-model-name", &self.served_name, "--dtype", &self.dtype, "--enforce-eager"])
            .args(["--max-model-len", &self.max_model_len.to_string()])
            .args(["--block-size", &self.block_size.to_string()])
            .args(["--kv-cache-memory-bytes", &self.kv_bytes.to_string()])
            .args(["--max-num-seqs", "8", "--host", &vllm_addr(r).ip().to_string()])
            .args(["--port", &VLLM_PORT.to_string(), "--disable-log-stats", "--enable-prompt-tokens-details"])
            .arg("--kv-transfer-config")
            .arg(self.kv_transfer_config(r))
            .env("VLLM_CPU_OMP_THREADS_BIND", cpu.to_string())
            .env("OMP_NUM_THREADS", "1")
            .env("GLIBC_TUNABLES", VLLM_MALLOC_TUNABLES)
            .env("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1");
        pin_to_cpu(&mut cmd, cpu);
        cmd
    }
}

/// Runs `cmd`'s process (and all it starts) on CPU `cpu` alone.
///
/// vLLM's CPU build binds its OpenMP threads to `VLLM_CPU_OMP_THREADS_BIND` only in its
/// multi-process executor; the single-process engine the bench runs
/// (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) ignores it and runs one OpenMP thread per CPU of the
/// host, unbound. On this 2-core host both engines then spread over both cores beside the
/// daemons and the emulator, and a prefill's OpenMP threads wait for each other whenever one
/// is descheduled: vLLM B's steps took 2–4× their time on an idle host and varied 2–4× at one
/// length (`bench/results/bench-vllm-2026-12-07-pinned/`). Each engine gets its own core and
/// one thread, as vLLM's CPU deployment guide asks of a replica. The daemons and the emulator
/// are not pinned.
fn pin_to_cpu(cmd: &mut Command, cpu: usize) {
    // SAFETY: the closure runs in the forked child before `exec`; it only fills a local
    // `cpu_set_t` (plain data, all-zero is a valid empty set) and makes one
    // `sched_setaffinity` system call, both async-signal-safe, and touches no lock, allocation
    // or state shared with the parent. A CPU the host lacks makes the call fail, which leaves
    // the child unpinned rather than failing its start.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if cpu < libc::CPU_SETSIZE as usize {
                libc::CPU_SET(cpu, &mut set);
                let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
            Ok(())
        });
    }
}

/// Where a region's vLLM listens (its namespace's address).
pub fn vllm_addr(r: &Region) -> SocketAddr {
    SocketAddr::new(r.grpc.ip(), VLLM_PORT)
}

/// One HTTP/1.1 request to `to` from inside `ns`, `Connection: close`; returns status and body.
async fn http(
    ns: &Path,
    to: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> anyhow::Result<(u16, String)> {
    let mut s = ns_connect(ns.to_owned(), to).await?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {to}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(600), s.read_to_end(&mut out)).await??;
    let text = String::from_utf8_lossy(&out);
    let (head, rest) = text.split_once("\r\n\r\n").context("HTTP response without a header end")?;
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).context("HTTP status line")?;
    let chunked = head.lines().any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding: chunked"));
    Ok((status, if chunked { dechunk(rest) } else { rest.to_owned() }))
}

/// Joins an HTTP/1.1 chunked body.
fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Whether the region's vLLM answers `/v1/models`.
pub async fn ready(r: &Region) -> bool {
    matches!(http(&r.ns_path, vllm_addr(r), "GET", "/v1/models", None).await, Ok((200, _)))
}

/// A greedy completion of `tokens` in the region's vLLM under `tenant` (`cache_salt`); returns
/// the prompt tokens vLLM reported cached.
pub async fn complete(
    r: &Region,
    v: &VllmOptions,
    tokens: &[u32],
    max_tokens: u32,
    tenant: &str,
) -> anyhow::Result<u64> {
    let body = serde_json::json!({
        "model": v.served_name, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": true, "cache_salt": tenant,
    });
    let (status, text) = http(&r.ns_path, vllm_addr(r), "POST", "/v1/completions", Some(&body)).await?;
    if status != 200 {
        bail!("vLLM {} answered {status}: {text}", r.name);
    }
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("vLLM answer {text:?}"))?;
    Ok(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
}

/// How big a decision sweep is and what its plans allow.
#[derive(Debug, Clone, Copy)]
pub struct Sweep {
    /// Prefix lengths.
    pub points: usize,
    /// One repetition per length instead of two.
    pub quick: bool,
    pub decide: Allow,
}

/// vLLM A prefills `tokens` under the bench tenant, and daemon B (through `mig`) waits until
/// the peers report `n` of them held; returns B's decision at that point.
async fn hold_on_a(
    a: &Region,
    v: &VllmOptions,
    mig: &mut kvferry_proto::v1::migration_client::MigrationClient<tonic::transport::Channel>,
    tokens: &[u32],
    n: u64,
) -> anyhow::Result<kvferry_proto::v1::Decision> {
    complete(a, v, tokens, 1, session::TENANT).await?;
    session::wait_for_holdings(mig, tokens, n, Duration::from_secs(60)).await
}

/// One unscored migration of the warm-up, of `tokens` as `action` (fetch or recompute, forced);
/// returns its wall seconds. Fails unless it ran as that action, without a fallback.
async fn warm_migration(
    mig: &mut kvferry_proto::v1::migration_client::MigrationClient<tonic::transport::Channel>,
    session_id: &str,
    tokens: &[u32],
    action: Action,
) -> anyhow::Result<f64> {
    let mode = if action == Action::Fetch { PolicyMode::Fetch } else { PolicyMode::Recompute };
    let m = session::migrate(mig, session_id, tokens, mode, Allow::PURE).await?;
    if m.receipt.kind() != action || !m.receipt.fallback.is_empty() {
        bail!(
            "warm-up {} of {} tokens ended as {} ({})",
            action.as_str_name(),
            tokens.len(),
            m.receipt.action,
            m.receipt.fallback
        );
    }
    Ok(m.receipt.wall_s)
}

/// vLLM B's next turn in the conversation whose first `prefix` tokens a migration brought:
/// 16 new tokens (of `seed`) after them. Returns the tokens vLLM reported cached and the
/// seconds its connector spent loading fetched blocks in that turn (the target daemon's
/// engine-load counter), which is where a fetch ends for vLLM.
async fn next_turn(
    regions: &Regions,
    b: &Region,
    v: &VllmOptions,
    prefix: &[u32],
    seed: u64,
) -> anyhow::Result<(u64, f64)> {
    let mut turn = prefix.to_vec();
    turn.extend(session::prompt(16, seed));
    let us0 = crate::run::target_load_us(regions).await;
    let cached = complete(b, v, &turn, 1, session::TENANT).await?;
    let load_s = (crate::run::target_load_us(regions).await - us0).max(0.0) / 1e6;
    Ok((cached, load_s))
}

/// The decision-quality sweep with vLLM engines (see the module doc).
pub async fn decisions(
    Sweep { points, quick, decide }: Sweep,
    link: &LinkSpec,
    v: &VllmOptions,
    regions: &mut Regions,
    report: &mut BenchReport,
    mut seed: u64,
) -> anyhow::Result<()> {
    let bs = u64::from(v.block_size);
    let (a, b) = (&regions.a.clone(), &regions.b.clone());
    let mut mig = regions.migration(Side::B).await?;
    // vLLM B measures its own prefill profile from its steps: give it some to time, of lengths
    // spread widely enough to tell its fixed cost per step from its cost per token (the
    // connector skips its first three steps, its warm-up).
    for (i, n) in (0u64..).zip(WARM_PREFILL_TOKENS) {
        let p = session::prompt(n.min(v.max_model_len as usize - 32), seed + i);
        complete(b, v, &p, 2, &format!("warm-{seed}-{i}")).await?;
    }
    seed += WARM_PREFILL_TOKENS.len() as u64;
    // Short fetches, not scored, as in the reference engine's sweep: a daemon in service has
    // fetched many short prefixes before any one decision, and without them the first point's
    // fetch is the daemons' first transfer on a cold link.
    let mut walls = Vec::with_capacity(crate::run::WARM_SHORT_FETCH_BLOCKS.len());
    for n in crate::run::WARM_SHORT_FETCH_BLOCKS.map(|k| k * bs) {
        let x = session::prompt(n as usize, seed);
        seed += 1;
        hold_on_a(a, v, &mut mig, &x, n).await?;
        let wall = warm_migration(&mut mig, &format!("vllm-warm-short-{seed}"), &x, Action::Fetch).await?;
        walls.push(format!("{n}: {wall:.3}"));
        // vLLM B's next turn loads what was fetched, as after every scored fetch: the
        // connector's first Load sets up NIXL's connection to the daemon (~25 ms, once per
        // pool), which a scored point paid before (`bench/results/bench-vllm-2026-12-07-pinned/`).
        next_turn(regions, b, v, &x, seed + 7).await?;
    }
    println!("  short fetches (calibration, not scored), tokens: s — {}", walls.join(", "));
    // Recomputes across the sweep's range, not scored: a daemon in service has recomputed
    // prefixes of many lengths before any one decision. Without them the first points'
    // recompute is predicted from vLLM's step profile alone, short by the command's own path
    // (~12 ms: the connector's request to its server, scheduling, the token generated), and
    // the defaults' first point, a near-tie at 128 tokens, was missed by up to 59 %. Not short
    // ones only: eight of 128-768 tokens fixed the short predictions but moved the fit's scale,
    // and 1,920 tokens were then predicted 0.80 s for 0.52 s measured
    // (`bench/results/bench-vllm-2026-12-07-prefault/README.md`). The longest prefix vLLM can
    // hold in one request, in whole blocks, bounds them (and the sweep's probe below).
    let max_tokens = (u64::from(v.max_model_len) - 32) / bs * bs;
    let mut walls = Vec::with_capacity(WARM_RECOMPUTE_TOKENS.len());
    for n in WARM_RECOMPUTE_TOKENS.map(|t| t.min(max_tokens) / bs * bs) {
        let y = session::prompt(n as usize, seed);
        seed += 1;
        let wall =
            warm_migration(&mut mig, &format!("vllm-warm-recompute-{seed}"), &y, Action::Recompute).await?;
        walls.push(format!("{n}: {wall:.3}"));
    }
    println!("  recomputes (calibration, not scored), tokens: s — {}", walls.join(", "));
    let probe = session::prompt(max_tokens as usize, seed);
    seed += 1;
    let d0 = hold_on_a(a, v, &mut mig, &probe, max_tokens).await?;
    let crossover = d0.crossover_tokens;
    let grid = crate::run::probe_band(&mut mig, &probe, max_tokens, bs).await?;
    let lengths = crate::run::band_sweep(&grid, crossover, points, max_tokens, bs);
    println!("  {}", crate::run::band_note(&grid));
    println!(
        "  decisions (vLLM): modeled crossover {} tokens (vLLM B's measured prefill {:.3} ms/token linear), prefixes {:?}",
        crossover.map_or("none".into(), |x| format!("{x:.0}")),
        d0.recompute_s_per_token * 1e3,
        lengths
    );
    let reps = if quick { 1 } else { 2 };
    for &n in &lengths {
        for _ in 0..reps {
            let x = session::prompt(n as usize, seed);
            let y = session::prompt(n as usize, seed + 1);
            let w = session::prompt(n as usize, seed + 2);
            seed += 3;
            hold_on_a(a, v, &mut mig, &x, n).await?;
            let t = Instant::now();
            let d = session::plan(&mut mig, &x, decide).await?;
            let plan_s = t.elapsed().as_secs_f64();
            let (fetched, recomputed) =
                session::pure_runs(&mut mig, ("vllm-dq", seed), &x, &y, n, bs).await?;
            // The next turn in B finds both prefixes warm (fetched: loaded by the connector;
            // recomputed: vLLM B's own prefix cache).
            let (cached_fetch, load_s) = next_turn(regions, b, v, &x, seed + 7).await?;
            if cached_fetch + bs < n {
                bail!("vLLM B's next turn after a fetch of {n} tokens reported only {cached_fetch} cached");
            }
            let mut p = session::decision_point(link, n, d.action.clone(), &d, &fetched, &recomputed);
            // The fetch ends, for vLLM, once its next turn has loaded the blocks (the turn's
            // own prefill of the new tokens is not counted).
            p.fetch_load_s = load_s;
            p.measured_fetch_s += load_s;
            if d.hedge {
                hold_on_a(a, v, &mut mig, &w, n).await?;
                let hedged = session::migrate(
                    &mut mig,
                    &format!("vllm-dq-hedge-{seed}"),
                    &w,
                    PolicyMode::Auto,
                    decide,
                )
                .await?;
                session::record_hedge(&mut p, &hedged)?;
                // As for the fetch: the hedge ends, for vLLM, once its next turn has loaded
                // what was fetched (nothing after a recompute won).
                let (_, load_s) = next_turn(regions, b, v, &w, seed + 8).await?;
                if let Some(h) = p.measured_hedge_s.as_mut() {
                    *h += load_s;
                }
            }
            println!(
                "    {n:>5} tokens: chose {:<9} predicted fetch {:.3} s / recompute {:.3} s; measured {:.3} / {:.3}; next turn cached {cached_fetch} (plan {:.0} ms)",
                p.chosen,
                p.predicted_fetch_s,
                p.predicted_recompute_s,
                p.measured_fetch_s,
                p.measured_recompute_s,
                plan_s * 1e3
            );
            report.decisions.push(p);
            regions.check_alive()?;
        }
    }
    Ok(())
}
