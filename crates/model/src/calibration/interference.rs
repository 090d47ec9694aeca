//! Split interference: how much the two legs of a split slow each other when they run at once
//! on shared resources, learnt from executed splits.
//!
//! A split recomputes `[0, k)` on the target's engine while it fetches `[k, P)` from the peer.
//! On separate resources (a GPU prefilling, a NIC receiving) the legs do not interact and the
//! split takes the slower leg. On a host where the engine's CPU prefill and the daemon's QUIC
//! share the same cores, each leg runs slower while the other runs: the split model charges
//! each leg `(1 + i)` times its calibrated pure cost ([`crate::split`]).
//!
//! Each executed split gives one sample of `1 + i`: the split was predicted with the
//! interference `i_used` then in force, so `1 + i ≈ (1 + i_used) · measured / predicted` (the
//! pure legs are calibrated by the pure actions; what remains is the interference). The
//! estimate is the median of the last [`WINDOW`] samples, less one, clamped to
//! `[0, MAX_INTERFERENCE]` (a split that ran faster than predicted says "none", not a
//! negative slowdown); with no sample it is the configured prior, and until
//! [`ANCHOR_SAMPLES`](crate::calibration::ANCHOR_SAMPLES) samples exist the prior fills the
//! median's missing places (`calibration::anchored_median`). The median keeps one outlier (a
//! stalled fetch, a GC pause) from ruling splits out or in — the first sample included: a median of
//! one sample is that sample, and the full benches of 2026-12-06 evening had one cold first split
//! (its prefill leg 21 % late, nothing slowed the fetch) price the next split's legs both 21 % slow
//! and miss it by 18 % (`bench/results/full-2026-12-06-evening/`).
//!
//! Pure: no clock, no I/O; the daemon keeps one per engine and passes the estimate into the
//! decision's [`Policy`](crate::Policy).

use std::collections::VecDeque;

use super::{CalibrationError, sample_non_negative, sample_seconds};

/// Samples the estimate is the median of.
pub const WINDOW: usize = 16;
/// Largest interference the estimate reports (each leg at 1/5 of its speed).
pub const MAX_INTERFERENCE: f64 = 4.0;

/// One engine's split-interference calibration.
#[derive(Debug, Clone, PartialEq)]
pub struct InterferenceCalibration {
    prior: f64,
    window: VecDeque<f64>,
    /// The estimate, kept by `observe` (the decision path reads it without allocating).
    estimate: f64,
    samples: u64,
}

impl InterferenceCalibration {
    /// Starts at `prior` (≥ 0, at most [`MAX_INTERFERENCE`]).
    pub fn new(prior: f64) -> Result<Self, CalibrationError> {
        let prior = sample_non_negative("split interference prior", prior, MAX_INTERFERENCE)?;
        Ok(InterferenceCalibration {
            prior,
            window: VecDeque::with_capacity(WINDOW),
            estimate: prior,
            samples: 0,
        })
    }

    /// Folds in one executed split: the interference it was planned with, its predicted and its
    /// measured seconds. A refused sample leaves the state unchanged.
    pub fn observe(&mut self, used: f64, predicted_s: f64, measured_s: f64) -> Result<(), CalibrationError> {
        let used = sample_non_negative("split interference used", used, MAX_INTERFERENCE)?;
        let predicted = sample_seconds("split predicted seconds", predicted_s)?;
        let measured = sample_seconds("split measured seconds", measured_s)?;
        let slowdown = ((1.0 + used) * measured / predicted).clamp(1.0, 1.0 + MAX_INTERFERENCE);
        let mut v = crate::calibration::push_recent(&mut self.window, WINDOW, slowdown);
        self.estimate = (crate::calibration::anchored_median(&mut v, 1.0 + self.prior) - 1.0)
            .clamp(0.0, MAX_INTERFERENCE);
        self.samples += 1;
        Ok(())
    }

    /// The interference to plan the next split with: the median slowdown of the window (the
    /// prior filling the places of the first
    /// [`ANCHOR_SAMPLES`](crate::calibration::ANCHOR_SAMPLES) samples not yet taken), less one.
    pub fn estimate(&self) -> f64 {
        self.estimate
    }

    /// Samples accepted so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The prior it started from.
    pub fn prior(&self) -> f64 {
        self.prior
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::ANCHOR_SAMPLES;

    #[test]
    fn the_prior_holds_until_samples_outvote_it() {
        let mut c = InterferenceCalibration::new(0.2).unwrap();
        assert_eq!((c.estimate(), c.samples()), (0.2, 0));
        // Planned with 0.2, took 1.5 × the prediction: each leg ran at 1/1.8 of its speed. One
        // sample does not outvote the prior (median of 1.2, 1.2, 1.8).
        c.observe(0.2, 1.0, 1.5).unwrap();
        assert!((c.estimate() - 0.2).abs() < 1e-12, "{}", c.estimate());
        assert_eq!(c.samples(), 1);
        // A second one does (median of 1.2, 1.8, 1.8).
        c.observe(0.2, 1.0, 1.5).unwrap();
        assert!((c.estimate() - 0.8).abs() < 1e-12, "{}", c.estimate());
        // One cold sample between two ordinary ones is outvoted, not followed.
        let mut c = InterferenceCalibration::new(0.0).unwrap();
        c.observe(0.0, 1.0, 1.21).unwrap();
        assert_eq!(c.estimate(), 0.0);
        c.observe(0.0, 1.0, 0.9).unwrap();
        assert_eq!(c.estimate(), 0.0);
        c.observe(0.0, 1.0, 1.02).unwrap();
        assert!((c.estimate() - 0.02).abs() < 1e-12, "{}", c.estimate());
        // Past the anchor the samples alone rule (median of 1.21, 1.0, 1.02, 1.3).
        c.observe(0.0, 1.0, 1.3).unwrap();
        assert!((c.estimate() - 0.115).abs() < 1e-12, "{}", c.estimate());
    }

    #[test]
    fn converges_to_the_true_interference_whatever_it_planned_with() {
        for truth in [0.0, 0.3, 1.0, 2.5] {
            let mut c = InterferenceCalibration::new(0.0).unwrap();
            for _ in 0..5 {
                // The host slows each leg by (1 + truth); the prediction used today's estimate.
                let used = c.estimate();
                let predicted = 2.0 * (1.0 + used);
                let measured = 2.0 * (1.0 + truth);
                c.observe(used, predicted, measured).unwrap();
            }
            assert!((c.estimate() - truth).abs() < 1e-9, "truth {truth}: {}", c.estimate());
        }
    }

    #[test]
    fn faster_than_predicted_means_none_and_outliers_do_not_rule() {
        let mut c = InterferenceCalibration::new(0.5).unwrap();
        for _ in 0..ANCHOR_SAMPLES {
            c.observe(0.0, 2.0, 1.0).unwrap();
        }
        assert_eq!(c.estimate(), 0.0, "never a negative slowdown");
        let mut c = InterferenceCalibration::new(0.0).unwrap();
        for _ in 0..4 {
            c.observe(0.0, 1.0, 1.1).unwrap();
        }
        c.observe(0.0, 1.0, 60.0).unwrap(); // one stalled split
        assert!((c.estimate() - 0.1).abs() < 1e-9, "{}", c.estimate());
        c.observe(0.0, 1.0, 1e6).unwrap_err(); // beyond any real split: refused
        for _ in 0..3 * WINDOW {
            c.observe(0.0, 1.0, 1e3).unwrap();
        }
        assert_eq!(c.estimate(), MAX_INTERFERENCE, "clamped");
    }

    #[test]
    fn only_recent_samples_count() {
        let mut c = InterferenceCalibration::new(0.0).unwrap();
        for _ in 0..WINDOW {
            c.observe(0.0, 1.0, 2.0).unwrap();
        }
        assert!((c.estimate() - 1.0).abs() < 1e-12);
        // The host's contention went away.
        for _ in 0..WINDOW / 2 + 1 {
            c.observe(c.estimate(), 1.0 + c.estimate(), 1.0).unwrap();
        }
        assert!(c.estimate() < 1.0, "{}", c.estimate());
        for _ in 0..WINDOW {
            c.observe(c.estimate(), 1.0 + c.estimate(), 1.0).unwrap();
        }
        assert_eq!(c.estimate(), 0.0);
    }

    #[test]
    fn bad_samples_are_refused_and_change_nothing() {
        let mut c = InterferenceCalibration::new(0.3).unwrap();
        for (used, p, m) in [
            (f64::NAN, 1.0, 1.0),
            (-0.1, 1.0, 1.0),
            (0.0, 0.0, 1.0),
            (0.0, 1.0, f64::INFINITY),
            (0.0, -1.0, 1.0),
            (MAX_INTERFERENCE + 1.0, 1.0, 1.0),
        ] {
            assert!(c.observe(used, p, m).is_err(), "{used} {p} {m}");
        }
        assert_eq!((c.estimate(), c.samples()), (0.3, 0));
        assert!(InterferenceCalibration::new(-1.0).is_err());
        assert!(InterferenceCalibration::new(f64::NAN).is_err());
    }
}
