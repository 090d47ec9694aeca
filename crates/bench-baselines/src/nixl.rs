//! Baseline 3: NIXL's UCX backend restricted to TCP, between two processes, one per namespace.
//!
//! Each side runs `kvferry-nixl-baseline` (see [`crate::nixl_peer`]) through
//! `ip netns exec` (so UCX sees the namespace's own `/sys/class/net` and `kvf0`), with
//! `UCX_TLS=tcp` and `UCX_NET_DEVICES=kvf0`; everything else is NIXL's and UCX's defaults (one
//! agent per process with its progress thread, the UCX backend's default parameters). The
//! source registers an N-byte DRAM buffer holding the pattern, the target an N-byte DRAM
//! buffer; the target READs the whole buffer in one request (as vLLM's NixlConnector does: the
//! decode side pulls) and verifies it. `KVFERRY_NIXL_BASELINE_OP=write` makes the source WRITE
//! instead (UCX's TCP transport emulates RMA reads in software; writes are zero-copy).
//! Metadata (and the remote buffer address) travel through the parent over the children's
//! stdin/stdout; only the payload crosses the emulated link.
//!
//! The child binary is found at `$KVFERRY_NIXL_BASELINE_BIN`, else next to the current
//! executable or one directory up (cargo's `target/<profile>/deps` for tests and benches).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use kvferry_wanem::{DEVICE, Emulator, Side};

use crate::{BaselineRun, finish, transfer_timeout};

/// Environment variable naming the `kvferry-nixl-baseline` binary.
pub const BIN_ENV: &str = "KVFERRY_NIXL_BASELINE_BIN";
/// Environment variable choosing the operation: `read` (default: the target pulls) or `write`.
pub const OP_ENV: &str = "KVFERRY_NIXL_BASELINE_OP";
const BIN_NAME: &str = "kvferry-nixl-baseline";
/// Time allowed for agent creation, registration and metadata (each side).
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

fn find_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(BIN_ENV) {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.join(BIN_NAME), dir.parent()?.join(BIN_NAME)].into_iter().find(|p| p.is_file())
}

/// A child process, killed and reaped on drop unless it exited.
struct Peer {
    side: Side,
    child: Child,
    stdin: Option<ChildStdin>,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Peer {
    fn send(&mut self, line: &str) -> anyhow::Result<()> {
        let s = self.stdin.as_mut().ok_or_else(|| anyhow!("stdin closed"))?;
        writeln!(s, "{line}")
            .and_then(|()| s.flush())
            .with_context(|| format!("writing to side {:?}", self.side))
    }

    fn stderr_tail(&self) -> String {
        // The log is appended line by line: a poisoned one is still a whole log.
        let s = self.stderr.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(6)..].join(" | ")
    }

    /// Closes stdin and waits up to `grace` for the child to exit; kills it after that.
    fn finish(&mut self, grace: Duration) {
        let _ = self.send("QUIT");
        self.stdin = None;
        let until = Instant::now() + grace;
        while Instant::now() < until {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stdin = None;
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

enum Msg {
    Line(Side, String),
    Eof(Side),
}

fn spawn(
    emu: &Emulator,
    bin: &PathBuf,
    side: Side,
    bytes: u64,
    op: &str,
    timeout: Duration,
    tx: mpsc::Sender<Msg>,
) -> anyhow::Result<Peer> {
    let mut cmd: Command = emu.command(side, bin);
    cmd.args(["--side", if side == Side::A { "src" } else { "dst" }])
        .args(["--bytes", &bytes.to_string(), "--op", op])
        .args(["--timeout-s", &timeout.as_secs_f64().to_string()])
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", DEVICE)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("starting {} in side {side:?}", bin.display()))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let stderr = child.stderr.take().ok_or_else(|| anyhow!("no stderr"))?;
    let stdin = child.stdin.take();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(Msg::Line(side, line)).is_err() {
                return;
            }
        }
        let _ = tx.send(Msg::Eof(side));
    });
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            // Keep the last ~64 KiB: the end of the log explains a failure.
            // Poisoned or not, the log is whole between lines; keep appending.
            let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
            s.push_str(&line);
            s.push('\n');
            if s.len() > 128 << 10 {
                let cut = s.len() - (64 << 10);
                let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
                s.drain(..cut);
            }
        }
    });
    Ok(Peer { side, child, stdin, stderr: log })
}

/// What a child said in one protocol step.
enum Said {
    Ready { addr: u64, md: String },
    Skip(String),
    Done { wall: f64, cpu: f64, verified: bool },
}

fn parse(line: &str) -> Option<anyhow::Result<Said>> {
    let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
    let said = match word {
        "READY" => {
            let (a, md) = rest.split_once(' ')?;
            Ok(Said::Ready { addr: a.parse().ok()?, md: md.to_owned() })
        }
        "SKIP" => Ok(Said::Skip(rest.to_owned())),
        "DONE" => {
            let v: Vec<&str> = rest.split_whitespace().collect();
            if v.len() != 3 {
                return None;
            }
            Ok(Said::Done { wall: v[0].parse().ok()?, cpu: v[1].parse().ok()?, verified: v[2] == "1" })
        }
        "ERROR" => Err(anyhow!("{rest}")),
        _ => return None,
    };
    Some(said)
}

/// Waits until both children said something this step (other output lines are ignored).
fn both(
    rx: &mpsc::Receiver<Msg>,
    peers: &[Peer; 2],
    until: Instant,
    step: &str,
) -> anyhow::Result<[Said; 2]> {
    let mut got: [Option<Said>; 2] = [None, None];
    while got.iter().any(Option::is_none) {
        let left = until.saturating_duration_since(Instant::now());
        let idx = |s: Side| usize::from(s == Side::B);
        match rx.recv_timeout(left) {
            Ok(Msg::Line(side, line)) => match parse(&line) {
                Some(Ok(s)) => got[idx(side)] = Some(s),
                Some(Err(e)) => {
                    return Err(e.context(format!(
                        "side {side:?} failed ({step}); stderr: {}",
                        peers[idx(side)].stderr_tail()
                    )));
                }
                None => {}
            },
            Ok(Msg::Eof(side)) => {
                if got[idx(side)].is_none() {
                    std::thread::sleep(Duration::from_millis(50));
                    return Err(anyhow!(
                        "side {side:?} exited during {step}; stderr: {}",
                        peers[idx(side)].stderr_tail()
                    ));
                }
            }
            Err(_) => {
                return Err(anyhow!(
                    "{step} did not finish in time; stderr A: {} / B: {}",
                    peers[0].stderr_tail(),
                    peers[1].stderr_tail()
                ));
            }
        }
    }
    let [a, b] = got;
    Ok([a.ok_or_else(|| anyhow!("no answer"))?, b.ok_or_else(|| anyhow!("no answer"))?])
}

/// NIXL (UCX backend over TCP) between two processes, one per namespace; `skipped: ...` when
/// NIXL or the child binary is not available. See the module docs.
pub fn nixl_ucx_tcp(emu: &Emulator, bytes: u64) -> anyhow::Result<BaselineRun> {
    const NAME: &str = "nixl-ucx-tcp";
    let Some(bin) = find_binary() else {
        return Ok(BaselineRun::skipped(
            NAME,
            format!(
                "{BIN_NAME} not found next to {:?} (build it: cargo build -p kvferry-baselines --bins, \
                 or set {BIN_ENV})",
                std::env::current_exe().unwrap_or_default()
            ),
        ));
    };
    let op = match std::env::var(OP_ENV).as_deref() {
        Ok("write") => "write",
        Ok("read") | Err(_) => "read",
        Ok(o) => return Err(anyhow!("{OP_ENV} must be read or write, not {o:?}")),
    };
    let timeout = transfer_timeout(emu, bytes);
    let (tx, rx) = mpsc::channel();
    let mut peers = [
        spawn(emu, &bin, Side::A, bytes, op, timeout, tx.clone())?,
        spawn(emu, &bin, Side::B, bytes, op, timeout, tx)?,
    ];
    let ready = both(&rx, &peers, Instant::now() + SETUP_TIMEOUT, "set-up")?;
    let mut info = Vec::new();
    for s in ready {
        match s {
            Said::Skip(reason) => return Ok(BaselineRun::skipped(NAME, reason)),
            Said::Ready { addr, md } => info.push((addr, md)),
            Said::Done { .. } => return Err(anyhow!("protocol error: DONE before READY")),
        }
    }
    // READ: the target (B) initiates with the source's metadata; WRITE: the source with B's.
    let (init, passive) = if op == "read" { (1, 0) } else { (0, 1) };
    let (raddr, rmd) = &info[passive];
    peers[passive].send("GO")?;
    peers[init].send(&format!("PEER {raddr} {rmd}"))?;
    let done = both(&rx, &peers, Instant::now() + timeout + Duration::from_secs(5), "transfer")?;
    let mut r = [(0.0, 0.0, false); 2];
    for (i, s) in done.into_iter().enumerate() {
        match s {
            Said::Done { wall, cpu, verified } => r[i] = (wall, cpu, verified),
            _ => return Err(anyhow!("protocol error: expected DONE")),
        }
    }
    for p in &mut peers {
        p.finish(Duration::from_secs(5));
    }
    let wall_s = r[1].0;
    Ok(finish(BaselineRun {
        name: NAME,
        bytes,
        wall_s,
        goodput_bps: 0.0,
        cpu_s_sender: r[0].1,
        cpu_s_receiver: r[1].1,
        verified: r[1].2,
        note: format!(
            "NIXL agents (defaults) with the UCX backend (default params), UCX_TLS=tcp \
             UCX_NET_DEVICES={DEVICE}, one process per namespace, target {}: one {bytes}-byte DRAM \
             descriptor in one request; CPU = getrusage(RUSAGE_SELF) of each process over the transfer \
             window (all threads)",
            if op == "read" { "READs from the source" } else { "is written by the source (WRITE)" }
        ),
    }))
}
