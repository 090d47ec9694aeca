//! The host's CPU, measured for the split's CPU-share floor
//! ([`kvferry_model::calibration::cpu_share_interference`]).
//!
//! Three figures, all in cores:
//!
//! - **other work** — the host's busy CPU less this daemon's and its registered engines'
//!   (their processes named by the Engine API socket's peer credentials), in 50 ms windows
//!   sampled from `/proc/stat` and `/proc/<pid>/stat`, each per second of the time the kernel
//!   *accounted* (all of `/proc/stat`'s fields over its CPUs, not the wall clock: ticks a
//!   paused virtual CPU never counted are missing from both sides of the ratio, never read as
//!   idle); the figure is the *quietest* span of [`QUIET_SPAN`] consecutive windows (200 ms:
//!   one 50 ms window is a few ticks, and its rounding alone moved the minimum of 60 of them by
//!   a fifth of a core) in the last [`HORIZON`]. Back-to-back migrations keep the host busy
//!   with this region's own work (which is subtracted) and, in the bench, with the peer
//!   region's processes on the same host (which are not, and which come and go); the minimum
//!   finds the work that stays.
//! - **the fetch's CPU per byte** — the host's busy CPU while a pure fetch ran (this daemon
//!   and everything the transfer makes busy on this host: the kernel's network path, a peer
//!   daemon or an emulator on the same host), less the engines' and less the other work over
//!   its wall time, over the bytes fetched ([`CpuCost`], ratio of sums). Only a migration
//!   that ran alone in this daemon is measured (two at once would each be charged both).
//! - **the engine's prefill cores** — its process's CPU while a pure recompute ran over the
//!   recompute's wall time (the host's busy CPU less this daemon's and the other work where
//!   the engine's process is not known). [`DEFAULT_COMPUTE_CORES`] before the first.
//!
//! The parsing and the arithmetic are pure functions, unit-tested on fixed text; the sampler
//! is one task reading three small files every 50 ms while `[policy] split_cpu_floor` is on.
//! Linux only: where `/proc` cannot be read nothing is measured and no floor applies.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_model::calibration::{CpuCost, cpu_share_interference};
use kvferry_pool::sync::LockExt;

/// How often the sampler closes a window.
pub const WINDOW: Duration = Duration::from_millis(50);
/// How far back the quietest window is looked for.
pub const HORIZON: Duration = Duration::from_secs(3);
/// Windows needed before the other work is reported (half a second).
pub const MIN_WINDOWS: usize = 10;
/// Consecutive windows the quietest span is made of (200 ms).
pub const QUIET_SPAN: usize = 4;
/// An engine's prefill cores before its first pure recompute: a CPU prefill keeps at least one
/// core busy, and so does a GPU engine's host thread while it waits on the device.
pub const DEFAULT_COMPUTE_CORES: f64 = 1.0;
/// Engine processes followed at most (registrations from more are not followed).
pub const MAX_ENGINE_PIDS: usize = 64;

/// The host's ticks from `/proc/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTicks {
    /// User, nice, system, irq, softirq, steal (guest time is inside user).
    pub busy: u64,
    /// Every state the kernel accounted: the busy ones, idle and iowait.
    pub accounted: u64,
    /// The `cpuN` lines: the CPUs the first line sums over.
    pub cpus: u32,
    /// Time the hypervisor ran something else while a virtual CPU was ready (`None` on kernels
    /// whose line has no steal field).
    pub steal: Option<u64>,
}

/// The host's ticks from `/proc/stat`: the first line's busy and accounted sums, and the CPUs
/// listed after it.
pub fn parse_host_ticks(stat: &str) -> Option<HostTicks> {
    let mut lines = stat.lines();
    let mut f = lines.next()?.split_ascii_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.map(|x| x.parse().ok()).collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    let busy = at(0) + at(1) + at(2) + at(5) + at(6) + at(7);
    let accounted = busy + at(3) + at(4);
    let cpus = lines
        .take_while(|l| l.starts_with("cpu"))
        .filter(|l| l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count();
    let cpus = u32::try_from(cpus).ok().filter(|&c| c > 0)?;
    Some(HostTicks { busy, accounted, cpus, steal: v.get(7).copied() })
}

/// A process's user + system ticks from its `/proc/<pid>/stat` (fields 14 and 15, counted
/// after the command name's closing parenthesis, which may itself contain spaces and
/// parentheses).
pub fn parse_process_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_ascii_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime + stime)
}

/// One reading of the host's, this process's and each engine process's CPU ticks.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    pub at: Instant,
    pub host: HostTicks,
    pub own: u64,
    pub engines: BTreeMap<u32, u64>,
}

impl Reading {
    /// Ticks the engines spent between `self` and the later `b`, over the processes read both
    /// times (one that exited or registered in between is left out).
    pub fn engine_ticks_until(&self, b: &Reading) -> u64 {
        self.engines.iter().filter_map(|(pid, t)| b.engines.get(pid).map(|u| u.saturating_sub(*t))).sum()
    }

    /// The other work between `self` and the later `b`: (its ticks — the host's busy ticks less
    /// this process's and the engines' —, the interval's seconds as the kernel accounted them
    /// per CPU). `None` for an empty or backwards interval.
    pub fn other_ticks_until(&self, b: &Reading, hz: f64) -> Option<(u64, f64)> {
        b.at.checked_duration_since(self.at).filter(|d| !d.is_zero())?;
        let accounted = b.host.accounted.checked_sub(self.host.accounted).filter(|&t| t > 0)?;
        let busy = b.host.busy.saturating_sub(self.host.busy);
        let ours = b.own.saturating_sub(self.own) + self.engine_ticks_until(b);
        Some((busy.saturating_sub(ours), accounted as f64 / hz / f64::from(b.host.cpus.max(1))))
    }

    /// The other work's cores between `self` and the later `b`: [`Self::other_ticks_until`]'s
    /// ticks per accounted second, at `hz` ticks a second.
    pub fn other_cores_until(&self, b: &Reading, hz: f64) -> Option<f64> {
        let (ticks, s) = self.other_ticks_until(b, hz)?;
        Some(ticks as f64 / hz / s)
    }
}

/// What a plan's CPU-share floor was made of, in cores (exported as metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Floor {
    pub cores: f64,
    pub other: f64,
    pub compute: f64,
    pub fetch: f64,
    /// `cpu_share_interference` of the four.
    pub interference: f64,
}

#[derive(Default)]
struct State {
    last: Option<Reading>,
    /// (window's end, other work's ticks in it, its accounted seconds), oldest first.
    windows: VecDeque<(Instant, u64, f64)>,
    fetch: CpuCost,
    compute: HashMap<String, CpuCost>,
}

/// The host's CPU, shared by the sampler, the executor (which feeds it pure actions) and the
/// planner (which asks for the floor).
pub struct HostCpu {
    hz: f64,
    cores: f64,
    engine_pids: Mutex<BTreeSet<u32>>,
    state: Mutex<State>,
}

impl std::fmt::Debug for HostCpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCpu").field("cores", &self.cores).finish_non_exhaustive()
    }
}

impl Default for HostCpu {
    fn default() -> Self {
        Self::new()
    }
}

/// `/proc`'s ticks a second (`_SC_CLK_TCK`; 100 where it cannot be read).
pub fn ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a system constant; no memory is passed.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

impl HostCpu {
    /// The host's cores as this process may use them (`available_parallelism`).
    pub fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        Self::with(cores, ticks_per_second())
    }

    /// A host of `cores` cores whose `/proc` counts `hz` ticks a second.
    pub fn with(cores: f64, hz: f64) -> Self {
        Self { hz, cores, engine_pids: Mutex::new(BTreeSet::new()), state: Mutex::new(State::default()) }
    }

    /// The cores the floor divides by.
    pub fn cores(&self) -> f64 {
        self.cores
    }

    /// Follows an engine's process from now on.
    pub fn add_engine_pid(&self, pid: u32) {
        let mut p = self.engine_pids.locked();
        if p.len() < MAX_ENGINE_PIDS {
            p.insert(pid);
        }
    }

    /// Reads the counters now; `None` where `/proc` cannot be read.
    pub fn read(&self) -> Option<Reading> {
        let host = parse_host_ticks(&std::fs::read_to_string("/proc/stat").ok()?)?;
        let own = parse_process_ticks(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
        let pids: Vec<u32> = self.engine_pids.locked().iter().copied().collect();
        let mut engines = BTreeMap::new();
        for pid in pids {
            match std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| parse_process_ticks(&s))
            {
                Some(t) => {
                    engines.insert(pid, t);
                }
                None => {
                    self.engine_pids.locked().remove(&pid);
                }
            }
        }
        Some(Reading { at: Instant::now(), host, own, engines })
    }

    /// Closes a window at `now` (the sampler's step; tests feed readings directly).
    pub fn sample(&self, now: Reading) {
        let mut s = self.state.locked();
        if let Some((ticks, secs)) = s.last.as_ref().and_then(|l| l.other_ticks_until(&now, self.hz)) {
            s.windows.push_back((now.at, ticks, secs));
        }
        while s.windows.front().is_some_and(|(t, _, _)| now.at.saturating_duration_since(*t) > HORIZON) {
            s.windows.pop_front();
        }
        s.last = Some(now);
    }

    /// The other work's cores: the quietest span of [`QUIET_SPAN`] consecutive windows in the
    /// last [`HORIZON`] (its ticks over its accounted seconds), once there are [`MIN_WINDOWS`]
    /// windows.
    pub fn other_cores(&self) -> Option<f64> {
        let mut s = self.state.locked();
        if s.windows.len() < MIN_WINDOWS {
            return None;
        }
        s.windows
            .make_contiguous()
            .windows(QUIET_SPAN)
            .filter_map(|span| {
                let (ticks, secs) = span.iter().fold((0u64, 0.0), |(t, s), &(_, u, v)| (t + u, s + v));
                (secs > 0.0).then(|| ticks as f64 / self.hz / secs)
            })
            .reduce(f64::min)
    }

    /// Folds in a pure fetch of `bytes` that ran from `start` to `end`.
    pub fn observe_fetch(&self, start: &Reading, end: &Reading, bytes: u64) {
        let Some(wall) = end.at.checked_duration_since(start.at).map(|d| d.as_secs_f64()) else { return };
        let busy = end.host.busy.saturating_sub(start.host.busy);
        let ticks = busy.saturating_sub(start.engine_ticks_until(end));
        let cpu = (ticks as f64 / self.hz - self.other_cores().unwrap_or(0.0) * wall).max(0.0);
        if bytes > 0 {
            let _ = self.state.locked().fetch.observe(cpu, bytes as f64);
        }
    }

    /// Folds in a pure recompute on `engine_id` that ran from `start` to `end`.
    pub fn observe_recompute(&self, engine_id: &str, start: &Reading, end: &Reading) {
        let Some(wall) = end.at.checked_duration_since(start.at).map(|d| d.as_secs_f64()) else { return };
        if wall <= 0.0 {
            return;
        }
        let followed = !start.engines.is_empty() && start.engines.keys().any(|p| end.engines.contains_key(p));
        let cpu = if followed {
            start.engine_ticks_until(end) as f64 / self.hz
        } else {
            let busy = end.host.busy.saturating_sub(start.host.busy);
            let own = end.own.saturating_sub(start.own);
            (busy.saturating_sub(own) as f64 / self.hz - self.other_cores().unwrap_or(0.0) * wall).max(0.0)
        };
        let mut s = self.state.locked();
        let c = s.compute.entry(engine_id.to_owned()).or_default();
        let _ = c.observe(cpu, wall);
    }

    /// The fetch's CPU-seconds per byte on this host, once one pure fetch was measured.
    pub fn fetch_cpu_s_per_byte(&self) -> Option<f64> {
        self.state.locked().fetch.per_unit()
    }

    /// `engine_id`'s prefill cores ([`DEFAULT_COMPUTE_CORES`] before its first pure
    /// recompute).
    pub fn compute_cores(&self, engine_id: &str) -> f64 {
        self.state
            .locked()
            .compute
            .get(engine_id)
            .and_then(CpuCost::per_unit)
            .unwrap_or(DEFAULT_COMPUTE_CORES)
    }

    /// The floor for a split on `engine_id` fetching at `bytes_per_s`: `None` until the other
    /// work is known.
    pub fn floor(&self, engine_id: &str, bytes_per_s: f64) -> Option<Floor> {
        let other = self.other_cores()?;
        let compute = self.compute_cores(engine_id);
        let fetch = self.fetch_cpu_s_per_byte().unwrap_or(0.0) * bytes_per_s.max(0.0);
        let interference = cpu_share_interference(self.cores, other, compute, fetch);
        Some(Floor { cores: self.cores, other, compute, fetch, interference })
    }
}

/// Samples `host` every [`WINDOW`] until aborted.
pub async fn sampler(host: Arc<HostCpu>) {
    let mut tick = tokio::time::interval(WINDOW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Some(r) = host.read() {
            host.sample(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str =
        "cpu  1000 20 300 5000 40 5 6 7 100 0\ncpu0 500 10 150 2500 20 2 3 3 50 0\nintr 1 2 3\n";

    #[test]
    fn the_host_line_sums_the_busy_and_the_accounted_fields() {
        let t = parse_host_ticks(STAT).unwrap();
        assert_eq!(t.busy, 1000 + 20 + 300 + 5 + 6 + 7);
        assert_eq!(t.accounted, t.busy + 5000 + 40, "idle and iowait are accounted, not busy");
        assert_eq!((t.cpus, t.steal), (1, Some(7)));
        let two = parse_host_ticks("cpu  1 2 3 4\ncpu0 1 1 1 2\ncpu1 0 1 2 2\nintr 5\n").unwrap();
        assert_eq!((two.busy, two.accounted, two.cpus), (6, 10, 2), "old kernels: four fields");
        assert_eq!(two.steal, None, "old kernels have no steal field");
        for bad in ["", "cpu0 1 2 3 4 5", "cpu 1 2", "cpu 1 x 3 4 5", "intr 1", "cpu 1 2 3 4\nintr 1"] {
            assert_eq!(parse_host_ticks(bad), None, "{bad:?}");
        }
        let real = parse_host_ticks(&std::fs::read_to_string("/proc/stat").unwrap()).unwrap();
        assert!(real.cpus >= 1 && real.accounted >= real.busy, "{real:?}");
    }

    #[test]
    fn a_process_line_is_read_after_the_last_parenthesis() {
        let s = "4242 (kv (ferry) d) S 1 4242 4242 0 -1 4194560 100 0 0 0 77 23 0 0 20 0 9 0 123 456 789\n";
        assert_eq!(parse_process_ticks(s), Some(100));
        assert_eq!(parse_process_ticks("1 (x) S 1 2 3"), None);
        assert_eq!(parse_process_ticks("no parenthesis"), None);
        let real = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(parse_process_ticks(&real).is_some(), "{real}");
    }

    /// A reading of a 2-CPU host at 100 Hz whose every tick was accounted.
    fn at(t0: Instant, ms: u64, host: u64, own: u64, engines: &[(u32, u64)]) -> Reading {
        accounted(t0, ms, host, 1_000_000 + ms / 5, own, engines)
    }

    fn accounted(
        t0: Instant,
        ms: u64,
        busy: u64,
        accounted: u64,
        own: u64,
        engines: &[(u32, u64)],
    ) -> Reading {
        Reading {
            at: t0 + Duration::from_millis(ms),
            host: HostTicks { busy, accounted, cpus: 2, steal: None },
            own,
            engines: engines.iter().copied().collect(),
        }
    }

    #[test]
    fn other_work_is_the_host_less_this_region_per_second() {
        let t0 = Instant::now();
        let a = at(t0, 0, 1000, 50, &[(7, 10), (8, 5)]);
        // 100 ms at 100 Hz: 20 ticks busy = 2 cores; 5 our own, 5 the engine that stayed.
        let b = at(t0, 100, 1020, 55, &[(7, 15), (9, 400)]);
        assert_eq!(a.engine_ticks_until(&b), 5, "only processes read both times");
        assert!((a.other_cores_until(&b, 100.0).unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(a.other_cores_until(&a, 100.0), None, "an empty interval");
        assert_eq!(b.other_cores_until(&a, 100.0), None, "backwards");
        let ours_only = at(t0, 100, 1010, 60, &[(7, 10)]);
        assert_eq!(a.other_cores_until(&ours_only, 100.0), Some(0.0), "never negative");
    }

    #[test]
    fn other_work_is_per_accounted_second_not_per_wall_second() {
        let t0 = Instant::now();
        // 100 ms of wall clock in which the kernel accounted only 60 ms per CPU (a paused
        // virtual CPU): 12 ticks, every one busy, is both CPUs busy, not 1.2 of them.
        let a = accounted(t0, 0, 1000, 2000, 0, &[]);
        let b = accounted(t0, 100, 1012, 2012, 0, &[]);
        assert!((a.other_cores_until(&b, 100.0).unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(
            a.other_cores_until(&accounted(t0, 100, 1000, 2000, 0, &[]), 100.0),
            None,
            "nothing accounted"
        );
    }

    #[test]
    fn the_quietest_span_of_the_horizon_is_the_other_work() {
        let host = HostCpu::with(2.0, 100.0);
        let t0 = Instant::now();
        assert_eq!(host.other_cores(), None);
        // 50 ms windows: 5 ticks of host per window per busy core. A load of one core
        // throughout, and a peer's prefill of one more but for 200 ms.
        let mut busy = 0;
        host.sample(at(t0, 0, busy, 0, &[]));
        for k in 1..=20u64 {
            busy += if (9..=12).contains(&k) { 5 } else { 10 };
            host.sample(at(t0, 50 * k, busy, 0, &[]));
            if (k as usize) < MIN_WINDOWS {
                assert_eq!(host.other_cores(), None, "{k} windows: not enough yet");
            }
        }
        assert!((host.other_cores().unwrap() - 1.0).abs() < 1e-9, "{:?}", host.other_cores());
        // Windows older than the horizon leave.
        let later = 50 * 20 + HORIZON.as_millis() as u64 + 100;
        host.sample(at(t0, later, busy, 0, &[]));
        assert_eq!(host.other_cores(), None, "one window left: not enough yet");
    }

    #[test]
    fn one_windows_rounding_does_not_make_the_quiet() {
        let host = HostCpu::with(2.0, 100.0);
        let t0 = Instant::now();
        // Both cores busy throughout, one window read 3 ticks short (rounded at its start, the
        // next window reads them): the quietest span is still nearly both cores.
        let mut busy = 0;
        host.sample(at(t0, 0, busy, 0, &[]));
        for k in 1..=20u64 {
            busy += match k {
                7 => 7,
                8 => 13,
                _ => 10,
            };
            host.sample(at(t0, 50 * k, busy, 0, &[]));
        }
        let other = host.other_cores().unwrap();
        assert!((other - 1.85).abs() < 1e-9, "one short window in a span of four: {other}");
    }

    #[test]
    fn the_floor_adds_the_prefill_and_the_fetch_at_the_links_rate() {
        let host = HostCpu::with(2.0, 100.0);
        let t0 = Instant::now();
        assert_eq!(host.floor("e", 125e6), None, "other work not known yet");
        for k in 0..=MIN_WINDOWS as u64 {
            host.sample(at(t0, 50 * k, 5 * k, 0, &[])); // one busy core
        }
        // Before any measurement: a core of prefill, no fetch cost.
        let f = host.floor("e", 125e6).unwrap();
        assert_eq!((f.compute, f.fetch, f.interference), (DEFAULT_COMPUTE_CORES, 0.0, 0.0));
        // A pure fetch of 125 MB over one second: 170 busy ticks = 1.7 core-seconds, one of
        // them the other work's, 0.7 this fetch's: 5.6 ns a byte, 0.7 cores at 125 MB/s.
        let s = at(t0, 1000, 10_000, 0, &[(3, 0)]);
        let e = at(t0, 2000, 10_170, 60, &[(3, 0)]);
        host.observe_fetch(&s, &e, 125_000_000);
        assert!((host.fetch_cpu_s_per_byte().unwrap() - 0.7 / 125e6).abs() < 1e-15);
        // A pure recompute of half a second on a followed engine: 50 ticks of its process.
        let s = at(t0, 3000, 20_000, 0, &[(3, 100)]);
        let e = at(t0, 3500, 20_100, 5, &[(3, 150)]);
        host.observe_recompute("e", &s, &e);
        assert!((host.compute_cores("e") - 1.0).abs() < 1e-9);
        assert_eq!(host.compute_cores("other"), DEFAULT_COMPUTE_CORES);
        let f = host.floor("e", 125e6).unwrap();
        assert!((f.interference - 0.35).abs() < 1e-9, "{f:?}");
        let slow = host.floor("e", 12.5e6).unwrap();
        assert!((slow.interference - 0.035).abs() < 1e-9, "a tenth of the rate: {slow:?}");
    }

    #[test]
    fn an_engine_not_followed_is_measured_from_the_host() {
        let host = HostCpu::with(2.0, 100.0);
        let t0 = Instant::now();
        for k in 0..=MIN_WINDOWS as u64 {
            host.sample(at(t0, 50 * k, 0, 0, &[])); // an idle host
        }
        let s = at(t0, 1000, 0, 0, &[]);
        let e = at(t0, 2000, 160, 10, &[]);
        host.observe_recompute("e", &s, &e);
        assert!((host.compute_cores("e") - 1.5).abs() < 1e-9, "{}", host.compute_cores("e"));
    }

    #[test]
    fn reading_this_host_works_and_follows_engines_until_they_exit() {
        let host = HostCpu::new();
        host.add_engine_pid(std::process::id());
        host.add_engine_pid(u32::MAX - 1); // no such process
        let r = host.read().expect("/proc readable");
        assert!(r.engines.contains_key(&std::process::id()));
        assert!(!r.engines.contains_key(&(u32::MAX - 1)));
        assert!(!host.engine_pids.locked().contains(&(u32::MAX - 1)), "an exited pid is dropped");
        assert!(host.cores() >= 1.0);
    }
}
