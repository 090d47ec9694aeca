//! The command-line path: start an emulated path, run commands inside it for a bounded time,
//! report counters, and clean up on exit, on error and on SIGINT/SIGTERM/SIGHUP.
//!
//! The `wanem` example is a thin `clap` front end over [`run`]; `kvferry wan` can wrap it
//! the same way.

use std::ffi::OsString;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::emulator::{Emulator, EmulatorConfig, KernelCounters, Side, Stats};
use crate::error::{Result, WanemError};
use crate::profile::PathProfile;

static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SIGNALLED.store(true, Ordering::SeqCst);
}

/// Installs handlers for SIGINT, SIGTERM and SIGHUP that only set a flag (see
/// [`signalled`], which this clears), so that the run loop can stop and the emulator's destructor can remove
/// its namespaces instead of the process dying with them in place.
pub fn install_signal_handlers() -> Result<()> {
    SIGNALLED.store(false, Ordering::SeqCst);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: sigaction is plain data; zeroed is a valid initial value (empty mask, no
        // flags). The handler only performs an atomic store, which is async-signal-safe.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(WanemError::last_os("sigaction"));
        }
    }
    Ok(())
}

/// Whether one of the handled signals has arrived since [`install_signal_handlers`].
pub fn signalled() -> bool {
    SIGNALLED.load(Ordering::SeqCst)
}

/// What to run and for how long.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Emulator configuration (profiles, MTU, seed).
    pub config: EmulatorConfig,
    /// Hard limit on the run; commands still running then are stopped.
    pub duration: Duration,
    /// Command (program and arguments) to run in namespace A; the run ends when it exits.
    pub command_a: Option<Vec<OsString>>,
    /// Command to run in namespace B (started first, e.g. a server; stopped at the end).
    pub command_b: Option<Vec<OsString>>,
    /// Print counters to stderr this often.
    pub stats_every: Option<Duration>,
}

impl RunOptions {
    /// Options for `path`, running for `duration` with no commands.
    pub fn new(path: PathProfile, duration: Duration) -> Self {
        Self {
            config: EmulatorConfig::new(path),
            duration,
            command_a: None,
            command_b: None,
            stats_every: None,
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// Exit status of the A command, if it ran to completion.
    pub status_a: Option<ExitStatus>,
    /// The duration limit was reached.
    pub timed_out: bool,
    /// A signal ended the run.
    pub interrupted: bool,
    /// Final counters.
    pub stats: Stats,
    /// Kernel counters of A and B at the end (drops outside the emulator's model).
    pub kernel: [KernelCounters; 2],
    /// Wall time of the run.
    pub elapsed: Duration,
}

/// Runs the emulator with the given commands until the A command exits (or, without one,
/// until the B command exits), the duration passes, or a signal arrives. The emulator and its
/// namespaces are removed before this returns, whatever happened.
pub fn run(opts: &RunOptions) -> Result<RunOutcome> {
    install_signal_handlers()?;
    let emu = Emulator::with_config(opts.config.clone())?;
    eprintln!(
        "wanem: A={} ({}) <-> B={} ({}), seed {}\nwanem:   A->B {}\nwanem:   B->A {}",
        emu.ns_a(),
        emu.addr_a(),
        emu.ns_b(),
        emu.addr_b(),
        emu.seed(),
        opts.config.path.ab,
        opts.config.path.ba,
    );
    let start = Instant::now();
    let deadline = start + opts.duration;
    let mut child_b = opts.command_b.as_deref().map(|c| spawn(&emu, Side::B, c)).transpose()?;
    if child_b.is_some() && opts.command_a.is_some() {
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut child_a = opts.command_a.as_deref().map(|c| spawn(&emu, Side::A, c)).transpose()?;
    let (mut status_a, mut timed_out, mut interrupted) = (None, false, false);
    let mut next_report = opts.stats_every.map(|d| start + d);
    loop {
        if signalled() {
            interrupted = true;
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            timed_out = true;
            break;
        }
        if let Some(c) = child_a.as_mut() {
            if let Ok(Some(st)) = c.try_wait() {
                status_a = Some(st);
                child_a = None;
                break;
            }
        } else if let Some(c) = child_b.as_mut()
            && let Ok(Some(_)) = c.try_wait()
        {
            child_b = None;
            break;
        }
        if let (Some(t), Some(every)) = (next_report, opts.stats_every)
            && now >= t
        {
            eprintln!("wanem: {:6.1} s  {}", (now - start).as_secs_f64(), summary(&emu.stats()));
            next_report = Some(t + every);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in [child_a.as_mut(), child_b.as_mut()].into_iter().flatten() {
        stop_child(c);
    }
    let stats = emu.stats();
    let kernel = [Side::A, Side::B].map(|s| emu.kernel_counters(s).unwrap_or_default());
    drop(emu);
    let elapsed = start.elapsed();
    eprintln!("wanem: done after {:.1} s  {}", elapsed.as_secs_f64(), summary(&stats));
    let [ka, kb] = kernel;
    if ka.tun_tx_dropped + kb.tun_tx_dropped > 0 {
        eprintln!(
            "wanem: WARNING the emulator fell behind: the kernel dropped {} A->B and {} B->A \
             packets before it could read them (outside the link model)",
            ka.tun_tx_dropped, kb.tun_tx_dropped
        );
    }
    Ok(RunOutcome { status_a, timed_out, interrupted, stats, kernel, elapsed })
}

fn spawn(emu: &Emulator, side: Side, argv: &[OsString]) -> Result<Child> {
    let (prog, args) = argv.split_first().ok_or_else(|| WanemError::Profile("empty command".into()))?;
    emu.command(side, prog)
        .args(args)
        .env("WANEM_NS_A", emu.ns_a())
        .env("WANEM_NS_B", emu.ns_b())
        .env("WANEM_ADDR_A", emu.addr_a().to_string())
        .env("WANEM_ADDR_B", emu.addr_b().to_string())
        .env("WANEM_ADDR_PEER", emu.addr(side.peer()).to_string())
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| WanemError::Sys { what: "spawn command", source: e })
}

/// SIGTERM, half a second's grace, then SIGKILL.
fn stop_child(c: &mut Child) {
    if let Ok(Some(_)) = c.try_wait() {
        return;
    }
    if let Ok(pid) = i32::try_from(c.id()) {
        // SAFETY: signalling our own child, whose pid is valid until we reap it.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = c.kill();
    let _ = c.wait();
}

/// A one-line summary of both directions.
pub fn summary(s: &Stats) -> String {
    let d = |x: &crate::forwarder::DirectionStats| {
        format!(
            "{} pkts {:.1} MB fwd, {} lost, {} queue-drop, {} reordered",
            x.tx_packets,
            x.tx_bytes as f64 / 1e6,
            x.lost,
            x.queue_drops,
            x.reordered
        )
    };
    format!("A->B: {} | B->A: {}", d(&s.ab), d(&s.ba))
}
