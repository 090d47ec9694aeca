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
//! stalled split does not move), over the last [`WINDOW`] splits, and pooled with a prior
//! worth [`PRIOR_WEIGHT`] splits: `√((w·s₀² + n·mad²) / (w + n))`. The prior is the
//! operator's `[policy] split_noise` (3 % by default: what the benches' splits show, a median
//! |error| of 2–3 %). It holds from the first split on: the edge split above was one profile's
//! first, and with no prior it would have been taken as exact. The weight keeps one split from
//! ruling the rest: the first full benches of the learnt scatter, with a weight of one
//! pseudo-sample at 0, took a profile's first split (a 64-token one, 10 % under its prediction)
//! for an 11 % scatter and declined every later split of that profile.
//!
//! The weight alone was not enough: a median of one split is that split, and a profile's first
//! split 18 % over (its prefill leg 25 % slow, a host slow spell) still pooled to a 9.8 %
//! scatter, whose 15 % band held with probability 0.88 < 0.9: every later split of the profile
//! (five, each 22–29 % faster in expectation) was declined, and a declined split is never run,
//! so nothing could bring the estimate back (`bench/results/full-2026-12-07-tcp-lowat/`). Until
//! [`ANCHOR_SAMPLES`](crate::calibration::ANCHOR_SAMPLES) splits exist, the prior's own residual
//! (`s₀ / 1.4826`) holds the median's places not yet taken, as in the split interference (the
//! same `calibration::anchored_median`): one split does not move the median, a second like it
//! does.
//!
//! Pure: no clock, no I/O; the daemon keeps one per engine and passes the estimate into the
//! decision's [`Policy`](crate::Policy).

use std::collections::VecDeque;

use super::{CalibrationError, sample_non_negative, sample_seconds};

/// Splits the estimate is taken over.
pub const WINDOW: usize = 16;
/// Splits the prior is worth.
pub const PRIOR_WEIGHT: f64 = 8.0;
/// Largest scatter the estimate reports.
pub const MAX_SCATTER: f64 = 1.0;
/// Median absolute deviation → sd for Gaussian residuals.
const MAD_TO_SD: f64 = 1.4826;

/// One engine's split scatter.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitScatter {
    prior: f64,
    window: VecDeque<f64>,
    estimate: f64,
    samples: u64,
}

impl SplitScatter {
    /// Starts at `prior` (a relative sd in `[0, MAX_SCATTER]`).
    pub fn new(prior: f64) -> Result<Self, CalibrationError> {
        let prior = sample_non_negative("split scatter prior", prior, MAX_SCATTER)?;
        Ok(Self { prior, window: VecDeque::with_capacity(WINDOW), estimate: prior, samples: 0 })
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
        let mut v = crate::calibration::push_recent(&mut self.window, WINDOW, r.abs());
        let n = v.len() as f64;
        let mad = (MAD_TO_SD * crate::calibration::anchored_median(&mut v, self.prior / MAD_TO_SD))
            .min(MAX_SCATTER);
        let var = (PRIOR_WEIGHT * self.prior * self.prior + n * mad * mad) / (PRIOR_WEIGHT + n);
        self.estimate = var.sqrt().min(MAX_SCATTER);
        self.samples += 1;
        Ok(())
    }

    /// The relative scatter to plan the next split with (the prior with no sample).
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
    use crate::calibration::ANCHOR_SAMPLES;

    /// The estimate from the prior and the absolute residuals `r` (the prior's residual in the
    /// median's places not yet taken).
    fn pooled(prior: f64, r: &[f64]) -> f64 {
        let n = r.len() as f64;
        let mut v = r.to_vec();
        let mad = MAD_TO_SD * crate::calibration::anchored_median(&mut v, prior / MAD_TO_SD);
        ((PRIOR_WEIGHT * prior * prior + n * mad * mad) / (PRIOR_WEIGHT + n)).sqrt()
    }

    #[test]
    fn the_prior_holds_from_the_start_and_samples_move_it_robustly() {
        let mut c = SplitScatter::new(0.03).unwrap();
        assert_eq!((c.estimate(), c.samples(), c.prior()), (0.03, 0, 0.03));
        // One split 10 % under its only outcome (a profile's first, short split in the benches)
        // does not move the estimate: the prior holds two of the median's three places.
        c.observe(1.0, 1.0, 0.9).unwrap();
        assert!((c.estimate() - 0.03).abs() < 1e-12, "{}", c.estimate());
        // Nor does the first split 18 % over, which with the median of that one split pooled to
        // 9.8 % and declined every later split of a profile (see the module docs).
        let mut first = SplitScatter::new(0.03).unwrap();
        first.observe(0.082, 0.082, 0.097).unwrap();
        assert!((first.estimate() - 0.03).abs() < 1e-12, "{}", first.estimate());
        // A second like it does.
        first.observe(0.082, 0.082, 0.097).unwrap();
        assert!(first.estimate() > 0.09, "{}", first.estimate());
        // Residuals of 2, 3, 4 % (either sign) and one stalled split at +60 %: the median of
        // |r| is 4 % (of 0.02, 0.03, 0.04, 0.1, 0.6); the stall does not move it far.
        c.observe(1.0, 1.0, 0.98).unwrap();
        c.observe(1.0, 1.0, 1.03).unwrap();
        c.observe(1.0, 1.0, 0.96).unwrap();
        c.observe(1.0, 1.0, 1.6).unwrap();
        let want = pooled(0.03, &[0.1, 0.02, 0.03, 0.04, 0.6]);
        assert!((c.estimate() - want).abs() < 1e-9, "{} vs {want}", c.estimate());
        assert_eq!(c.samples(), 5);
        // An engine whose splits miss by 15–20 % every time ends up at its own scatter.
        let mut c = SplitScatter::new(0.03).unwrap();
        for i in 0..WINDOW {
            c.observe(1.0, 1.0, if i % 2 == 0 { 1.2 } else { 0.85 }).unwrap();
        }
        assert!(c.estimate() > 0.2, "{}", c.estimate());
        // A prior of 0 with no sample takes outcomes as exact.
        assert_eq!(SplitScatter::new(0.0).unwrap().estimate(), 0.0);
    }

    #[test]
    fn a_split_is_measured_against_the_nearer_of_its_outcomes() {
        // On time 87 ms, late 115: a split that took 114 ms came in late, 0.9 % early (three
        // alike, so the median is theirs).
        let mut c = SplitScatter::new(0.0).unwrap();
        for _ in 0..ANCHOR_SAMPLES {
            c.observe(0.087, 0.115, 0.114).unwrap();
        }
        let r = 1.0 - 0.114 / 0.115;
        assert!((c.estimate() - pooled(0.0, &[r; ANCHOR_SAMPLES])).abs() < 1e-12, "{}", c.estimate());
        assert!(c.estimate() > 0.0);
        // One that took 78 ms came in on time, 10.3 % under.
        let mut c = SplitScatter::new(0.0).unwrap();
        for _ in 0..ANCHOR_SAMPLES {
            c.observe(0.087, 0.115, 0.078).unwrap();
        }
        let r = 1.0 - 0.078 / 0.087;
        assert!((c.estimate() - pooled(0.0, &[r; ANCHOR_SAMPLES])).abs() < 1e-12, "{}", c.estimate());
        assert!(c.estimate() > 0.05);
    }

    #[test]
    fn bad_samples_and_priors_are_refused_and_the_window_forgets() {
        for bad in [-0.1, f64::NAN, MAX_SCATTER + 0.1] {
            assert!(SplitScatter::new(bad).is_err(), "{bad}");
        }
        let mut c = SplitScatter::new(0.03).unwrap();
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
        // A wild sample is capped; then WINDOW exact splits push it out, and the prior's share
        // is what is left.
        c.observe(1e-3, 1e-3, 100.0).unwrap();
        assert!(c.estimate() <= MAX_SCATTER);
        for _ in 0..WINDOW {
            c.observe(1.0, 1.0, 1.0).unwrap();
        }
        assert!((c.estimate() - pooled(0.03, &[0.0; WINDOW])).abs() < 1e-12, "{}", c.estimate());
        assert_eq!(c.samples(), 2 + WINDOW as u64);
    }
}
