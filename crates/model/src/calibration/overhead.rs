//! Split overhead: the seconds a real split costs beyond its slower leg, learnt from executed
//! splits.
//!
//! The model charges a real split a fixed overhead (`[policy] split_overhead_ms`: an extra
//! scheduling round and the merge; 0.5 ms by default, 5 ms before the benches below) on top of its
//! slower leg and the engine's load ([`crate::split`]). Whether an engine pays it, and how much, is
//! a property of the engine and the daemon, not of the operator's guess: in the full benches of
//! 2026-12-07 every executed split's wall exceeded its slower leg by 0.0–0.2 ms, and the 5 ms the
//! model charged put every 64-token split (≈ 75 ms) 5–10 % under its prediction
//! (`bench/results/full-2026-12-07-prior/`). That bias also entered the split scatter
//! ([`super::SplitScatter`]) and the split interference ([`super::InterferenceCalibration`]),
//! both learnt from the same splits' residuals.
//!
//! The daemon measures the overhead directly, not as a residual of the model: the split's wall
//! minus its slower leg, both timed by the daemon. The estimate is the median of the last
//! [`WINDOW`] such samples (one stalled merge does not move it), pooled with the prior worth
//! [`PRIOR_WEIGHT`] split: `(w·o₀ + n·median) / (w + n)`. The prior weighs little because the
//! samples are direct measurements with little noise, not residuals.
//!
//! Pure: no clock, no I/O; the daemon keeps one per engine and passes the estimate into the
//! decision's [`Policy`](crate::Policy).

use std::collections::VecDeque;

use super::{CalibrationError, MAX_SAMPLE_SECONDS, sample_non_negative};

/// Splits the estimate is taken over.
pub const WINDOW: usize = 16;
/// Splits the prior is worth.
pub const PRIOR_WEIGHT: f64 = 1.0;

/// One engine's split overhead.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitOverhead {
    prior: f64,
    window: VecDeque<f64>,
    estimate: f64,
    samples: u64,
}

impl SplitOverhead {
    /// Starts at `prior` seconds (finite, ≥ 0).
    pub fn new(prior: f64) -> Result<Self, CalibrationError> {
        let prior = sample_non_negative("split overhead prior", prior, MAX_SAMPLE_SECONDS)?;
        Ok(Self { prior, window: VecDeque::with_capacity(WINDOW), estimate: prior, samples: 0 })
    }

    /// Folds in one executed split: its wall and its two legs' measured seconds (each from
    /// the legs' common start). The sample is `wall − max(legs)`; a refused sample (a field
    /// not finite, negative or beyond a day; legs longer than the wall) leaves the state
    /// unchanged.
    pub fn observe(
        &mut self,
        wall_s: f64,
        compute_leg_s: f64,
        fetch_leg_s: f64,
    ) -> Result<(), CalibrationError> {
        let wall = sample_non_negative("split wall seconds", wall_s, MAX_SAMPLE_SECONDS)?;
        let c = sample_non_negative("split compute leg seconds", compute_leg_s, MAX_SAMPLE_SECONDS)?;
        let f = sample_non_negative("split fetch leg seconds", fetch_leg_s, MAX_SAMPLE_SECONDS)?;
        let legs = c.max(f);
        if legs > wall {
            return Err(CalibrationError::Implausible { field: "split leg seconds", value: legs, max: wall });
        }
        let mut v = crate::calibration::push_recent(&mut self.window, WINDOW, wall - legs);
        let n = v.len() as f64;
        let median = crate::calibration::median_of(&mut v);
        self.estimate = (PRIOR_WEIGHT * self.prior + n * median) / (PRIOR_WEIGHT + n);
        self.samples += 1;
        Ok(())
    }

    /// The overhead to plan the next split with, in seconds (the prior with no sample).
    pub fn estimate(&self) -> f64 {
        self.estimate
    }

    /// The prior it started from.
    pub fn prior(&self) -> f64 {
        self.prior
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
    fn the_prior_gives_way_to_what_the_splits_measure() {
        let mut c = SplitOverhead::new(0.005).unwrap();
        assert_eq!((c.estimate(), c.samples(), c.prior()), (0.005, 0, 0.005));
        // The benches' splits: wall 0.1 ms over the slower leg.
        c.observe(0.0751, 0.075, 0.050).unwrap();
        assert!((c.estimate() - (0.005 + 0.0001) / 2.0).abs() < 1e-12, "{}", c.estimate());
        for _ in 0..7 {
            c.observe(0.2001, 0.150, 0.200).unwrap();
        }
        // (1·5 ms + 8·0.1 ms) / 9.
        assert!((c.estimate() - (0.005 + 8.0 * 0.0001) / 9.0).abs() < 1e-9, "{}", c.estimate());
        assert!(c.estimate() < 0.001);
        assert_eq!(c.samples(), 8);
        // An engine that does pay an extra scheduling round (20 ms) is charged it.
        let mut c = SplitOverhead::new(0.005).unwrap();
        for _ in 0..WINDOW {
            c.observe(0.120, 0.100, 0.090).unwrap();
        }
        assert!((c.estimate() - 0.02).abs() < 0.001, "{}", c.estimate());
        // A prior of 0 stays 0 while the splits measure nothing more.
        let mut c = SplitOverhead::new(0.0).unwrap();
        c.observe(0.1, 0.1, 0.05).unwrap();
        assert_eq!(c.estimate(), 0.0);
    }

    #[test]
    fn one_stalled_merge_does_not_move_it_and_the_window_forgets() {
        let mut c = SplitOverhead::new(0.0).unwrap();
        for _ in 0..4 {
            c.observe(0.101, 0.1, 0.1).unwrap();
        }
        c.observe(0.4, 0.1, 0.1).unwrap(); // a 300 ms stall after the legs
        assert!(c.estimate() < 0.002, "{}", c.estimate());
        // After a window of 2 ms splits, the 1 ms ones and the stall are forgotten.
        for _ in 0..WINDOW {
            c.observe(0.102, 0.1, 0.05).unwrap();
        }
        let want = WINDOW as f64 * 0.002 / (WINDOW as f64 + PRIOR_WEIGHT);
        assert!((c.estimate() - want).abs() < 1e-9, "{} vs {want}", c.estimate());
    }

    #[test]
    fn bad_samples_and_priors_are_refused_and_change_nothing() {
        for bad in [f64::NAN, -0.001, f64::INFINITY, 1e9] {
            assert!(SplitOverhead::new(bad).is_err(), "{bad}");
        }
        let mut c = SplitOverhead::new(0.005).unwrap();
        c.observe(0.2, 0.1, 0.15).unwrap();
        let before = c.clone();
        for (w, l, f) in [
            (f64::NAN, 0.1, 0.1),
            (0.2, f64::NAN, 0.1),
            (0.2, 0.1, -1.0),
            (f64::INFINITY, 0.1, 0.1),
            (0.1, 0.2, 0.05), // a leg longer than the wall
            (0.1, 0.05, 0.2),
        ] {
            assert!(c.observe(w, l, f).is_err(), "{w} {l} {f}");
            assert_eq!(c, before);
        }
        // A split whose wall equals its slower leg measures 0.
        c.observe(0.1, 0.1, 0.05).unwrap();
        assert_eq!(c.samples(), 2);
    }
}
