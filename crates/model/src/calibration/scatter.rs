//! Split scatter: how far an executed split's completion lands from the outcome the model gave
//! it, learnt from executed splits.
//!
//! A split is priced over its fetch leg's two outcomes (on time; a round trip late on a lossy
//! link) and taken only if its completion is predictable: within the policy's tolerance of its
//! expected time with high probability ([`crate::split::SplitPoint::confidence`]). Taken as
//! exact, an outcome 14.7 % under the expectation counts as inside a 15 % band; each outcome
//! has its own scatter (the legs' noise, the host), and such a split was measured 23 % under
//! (`bench/results/full-2026-12-06-split/`, run3). The scatter is that noise: the relative
//! residual of each executed split against the nearer of its two predicted outcomes (so the
//! coin flip itself, which the confidence weighs separately, is not counted twice), summarised
//! robustly (`1.4826 ×` the median absolute residual, the sd of Gaussian residuals, which one
//! stalled split does not move), over the last [`WINDOW`] splits, shrunk toward 0 by one
//! pseudo-sample (`√(n / (n + 1))`): with no sample the outcomes are taken as exact, as before
//! any was measured, and one sample does not claim its own size.
//!
//! Pure: no clock, no I/O; the daemon keeps one per engine and passes the estimate into the
//! decision's [`Policy`](crate::Policy).

use std::collections::VecDeque;

use super::{CalibrationError, sample_seconds};

/// Splits the estimate is taken over.
pub const WINDOW: usize = 16;
/// Largest scatter the estimate reports.
pub const MAX_SCATTER: f64 = 1.0;
/// Median absolute deviation → sd for Gaussian residuals.
const MAD_TO_SD: f64 = 1.4826;

/// One engine's split scatter.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SplitScatter {
    window: VecDeque<f64>,
    estimate: f64,
    samples: u64,
}

impl SplitScatter {
    /// No sample: a scatter of 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds in one executed split: its predicted completion when the fetch leg is on time and
    /// when it is late (the same value on a link without a tail), and its measured seconds, all
    /// for what the split itself executed. A refused sample leaves the state unchanged.
    pub fn observe(&mut self, on_time_s: f64, late_s: f64, measured_s: f64) -> Result<(), CalibrationError> {
        let on = sample_seconds("split on-time seconds", on_time_s)?;
        let late = sample_seconds("split late seconds", late_s)?;
        let measured = sample_seconds("split measured seconds", measured_s)?;
        let r = [on, late]
            .map(|x| measured / x - 1.0)
            .into_iter()
            .fold(f64::INFINITY, |a, b| if b.abs() < a.abs() { b } else { a });
        if self.window.len() == WINDOW {
            self.window.pop_front();
        }
        self.window.push_back(r.abs());
        let mut v: Vec<f64> = self.window.iter().copied().collect();
        let n = v.len() as f64;
        let sd = MAD_TO_SD * crate::calibration::median_of(&mut v);
        self.estimate = (sd * (n / (n + 1.0)).sqrt()).min(MAX_SCATTER);
        self.samples += 1;
        Ok(())
    }

    /// The relative scatter to plan the next split with (0 with no sample).
    pub fn estimate(&self) -> f64 {
        self.estimate
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
    fn no_sample_is_no_scatter_and_samples_set_it_robustly() {
        let mut c = SplitScatter::new();
        assert_eq!((c.estimate(), c.samples()), (0.0, 0));
        // One split 4 % over its only outcome: 1.4826 · 0.04 · √(1/2).
        c.observe(1.0, 1.0, 1.04).unwrap();
        assert!((c.estimate() - MAD_TO_SD * 0.04 * 0.5f64.sqrt()).abs() < 1e-12, "{}", c.estimate());
        // Residuals of 2, 3, 4 % (either sign) and one stalled split at +60 %: the median of
        // |r| is 3.5 % (of 0.02, 0.03, 0.04, 0.04, 0.6); the stall does not move it far.
        c.observe(1.0, 1.0, 0.98).unwrap();
        c.observe(1.0, 1.0, 1.03).unwrap();
        c.observe(1.0, 1.0, 0.96).unwrap();
        c.observe(1.0, 1.0, 1.6).unwrap();
        let want = MAD_TO_SD * 0.04 * (5.0f64 / 6.0).sqrt();
        assert!((c.estimate() - want).abs() < 1e-9, "{} vs {want}", c.estimate());
        assert_eq!(c.samples(), 5);
    }

    #[test]
    fn a_split_is_measured_against_the_nearer_of_its_outcomes() {
        // On time 87 ms, late 115: a split that took 114 ms came in late, 0.9 % early.
        let mut c = SplitScatter::new();
        c.observe(0.087, 0.115, 0.114).unwrap();
        let r = 1.0 - 0.114 / 0.115;
        assert!((c.estimate() - MAD_TO_SD * r * 0.5f64.sqrt()).abs() < 1e-12, "{}", c.estimate());
        // One that took 78 ms came in on time, 10.3 % under.
        let mut c = SplitScatter::new();
        c.observe(0.087, 0.115, 0.078).unwrap();
        let r = 1.0 - 0.078 / 0.087;
        assert!((c.estimate() - MAD_TO_SD * r * 0.5f64.sqrt()).abs() < 1e-12, "{}", c.estimate());
    }

    #[test]
    fn bad_samples_are_refused_and_change_nothing_and_the_window_forgets() {
        let mut c = SplitScatter::new();
        c.observe(1.0, 1.0, 1.1).unwrap();
        let before = c.clone();
        for (on, late, m) in [
            (f64::NAN, 1.0, 1.0),
            (1.0, -1.0, 1.0),
            (1.0, 1.0, 0.0),
            (1.0, 1.0, f64::INFINITY),
            (0.0, 1.0, 1.0),
        ] {
            assert!(c.observe(on, late, m).is_err(), "{on} {late} {m}");
            assert_eq!(c, before);
        }
        // A wild sample is capped; then WINDOW exact splits push it out entirely.
        c.observe(1e-3, 1e-3, 100.0).unwrap();
        assert!(c.estimate() <= MAX_SCATTER);
        for _ in 0..WINDOW {
            c.observe(1.0, 1.0, 1.0).unwrap();
        }
        assert_eq!(c.estimate(), 0.0);
        assert_eq!(c.samples(), 2 + WINDOW as u64);
    }
}
