//! CPU shares: the split interference a host's cores predict before any split has run.
//!
//! [`InterferenceCalibration`](super::InterferenceCalibration) learns a split's slowdown only
//! from executed splits, and the first splits on a loaded host are short ones whose recompute
//! leg ends inside the fetch's round trip: they report no slowdown just before the larger
//! splits run 1.3–1.8× slower (bench, 2026-12-03; `bench/results/split-misses-2026-12-05/`).
//! What predicts it is arithmetic on CPU shares: while a split runs, the host is asked for
//! `other + compute + fetch` cores (the work already there, the engine's prefill, the fetch's
//! per-byte work at the link's rate); on `cores` cores every runnable thread gets
//! `cores / demand` of one when the demand exceeds them, so each leg takes
//! `demand / cores` times as long:
//!
//! ```text
//! i_cpu = max(0, (other + compute + fetch) / cores − 1)
//! ```
//!
//! [`cpu_share_interference`] is that figure; the daemon plans a split with the larger of it
//! and the learnt estimate. [`CpuCost`] learns its two per-work inputs from executed pure
//! actions: the fetch's CPU-seconds per byte on this host, and the engine's cores while it
//! prefills (CPU-seconds per wall second). Pure: the daemon measures, this module only does
//! arithmetic.

use std::collections::VecDeque;

use super::{CalibrationError, MAX_SAMPLE_SECONDS, sample_non_negative};

/// Samples a [`CpuCost`] keeps (ratio of sums over the last this many).
pub const CPU_COST_WINDOW: usize = 16;

/// The split interference CPU shares predict: `(other + compute + fetch) / cores − 1`, at
/// least 0 and at most [`MAX_INTERFERENCE`](super::interference::MAX_INTERFERENCE). Each
/// argument is in cores (a busy thread is one); a NaN, infinite or negative share counts as
/// none, and fewer than one core counts as one, so the figure is always finite.
pub fn cpu_share_interference(
    cores: f64,
    other_busy_cores: f64,
    compute_cores: f64,
    fetch_cores: f64,
) -> f64 {
    let share = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
    let cores = if cores.is_finite() { cores.max(1.0) } else { 1.0 };
    let demand = share(other_busy_cores) + share(compute_cores) + share(fetch_cores);
    (demand / cores - 1.0).clamp(0.0, super::interference::MAX_INTERFERENCE)
}

/// CPU-seconds per unit of work (a byte fetched, a wall second of prefill), learnt as the
/// ratio of sums over the last [`CPU_COST_WINDOW`] samples: a large transfer weighs as much as
/// its bytes, so the many small ones (whose CPU time the kernel's tick barely resolves) do not
/// swing it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CpuCost {
    window: VecDeque<(f64, f64)>,
    samples: u64,
}

impl CpuCost {
    /// No sample yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds in `cpu_s` CPU-seconds spent on `units` of work. Refused (state unchanged): a NaN,
    /// infinite or negative figure, CPU-seconds beyond [`MAX_SAMPLE_SECONDS`] × 1024 cores, or
    /// no work (`units` = 0).
    pub fn observe(&mut self, cpu_s: f64, units: f64) -> Result<(), CalibrationError> {
        let cpu = sample_non_negative("CPU seconds", cpu_s, MAX_SAMPLE_SECONDS * 1024.0)?;
        let units = crate::error::positive("units of work", units).map_err(CalibrationError::Sample)?;
        if self.window.len() == CPU_COST_WINDOW {
            self.window.pop_front();
        }
        self.window.push_back((cpu, units));
        self.samples += 1;
        Ok(())
    }

    /// CPU-seconds per unit over the window; `None` before the first sample.
    pub fn per_unit(&self) -> Option<f64> {
        let (cpu, units) = self.window.iter().fold((0.0, 0.0), |(c, u), (x, y)| (c + x, u + y));
        (units > 0.0).then(|| cpu / units)
    }

    /// Samples accepted so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_interference_while_the_demand_fits_the_cores() {
        assert_eq!(cpu_share_interference(2.0, 0.0, 1.0, 0.7), 0.0);
        assert_eq!(cpu_share_interference(2.0, 0.3, 1.0, 0.7), 0.0, "exactly full");
        assert_eq!(cpu_share_interference(16.0, 4.0, 1.0, 3.0), 0.0);
    }

    #[test]
    fn a_loaded_host_predicts_what_the_bench_measured() {
        // One busy thread, one prefill thread and both daemons at 1 Gbit/s on two cores.
        let i = cpu_share_interference(2.0, 1.0, 1.0, 0.7);
        assert!((i - 0.35).abs() < 1e-12, "{i}");
    }

    #[test]
    fn monotone_in_every_share_and_falling_in_cores() {
        let base = cpu_share_interference(2.0, 1.0, 1.0, 0.5);
        for bumped in [
            cpu_share_interference(2.0, 1.5, 1.0, 0.5),
            cpu_share_interference(2.0, 1.0, 1.5, 0.5),
            cpu_share_interference(2.0, 1.0, 1.0, 1.0),
        ] {
            assert!(bumped > base, "{bumped} vs {base}");
        }
        assert!(cpu_share_interference(4.0, 1.0, 1.0, 0.5) < base);
        let mut last = 0.0;
        for k in 0..200 {
            let i = cpu_share_interference(2.0, k as f64 * 0.1, 1.0, 0.5);
            assert!(i >= last && (0.0..=super::super::interference::MAX_INTERFERENCE).contains(&i));
            last = i;
        }
        assert_eq!(last, super::super::interference::MAX_INTERFERENCE, "clamped");
    }

    #[test]
    fn broken_shares_count_as_none_and_never_give_nan() {
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0] {
            assert_eq!(cpu_share_interference(2.0, bad, 1.0, 0.5), 0.0);
            assert_eq!(cpu_share_interference(2.0, 1.0, bad, 0.5), 0.0);
            let i = cpu_share_interference(bad, 1.0, 1.0, 0.5);
            assert!(i.is_finite() && i >= 0.0, "{i}");
        }
        assert_eq!(cpu_share_interference(0.0, 0.0, 1.0, 0.0), 0.0, "fewer than one core counts as one");
    }

    #[test]
    fn a_cpu_cost_is_the_ratio_of_sums_over_its_window() {
        let mut c = CpuCost::new();
        assert_eq!(c.per_unit(), None);
        c.observe(0.0, 1.0).unwrap(); // a small transfer the tick did not resolve
        c.observe(3.0, 1000.0).unwrap();
        assert!((c.per_unit().unwrap() - 3.0 / 1001.0).abs() < 1e-15);
        for _ in 0..CPU_COST_WINDOW {
            c.observe(1.0, 10.0).unwrap();
        }
        assert!((c.per_unit().unwrap() - 0.1).abs() < 1e-12, "the old samples left the window");
        assert_eq!(c.samples(), 2 + CPU_COST_WINDOW as u64);
    }

    #[test]
    fn a_refused_cpu_sample_changes_nothing() {
        let mut c = CpuCost::new();
        c.observe(1.0, 2.0).unwrap();
        let before = c.clone();
        for (cpu, units) in
            [(f64::NAN, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, -2.0), (1.0, f64::INFINITY), (1e12, 1.0)]
        {
            assert!(c.observe(cpu, units).is_err(), "{cpu} / {units}");
        }
        assert_eq!(c, before);
    }
}
