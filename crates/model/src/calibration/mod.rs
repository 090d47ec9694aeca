//! Calibration: the cost model's inputs learnt online from what migrations actually took.
//!
//! The uncalibrated model charges a fetch one RTT plus bytes over a goodput, and a recompute
//! the engine's reported (CPU-clock) profile. Both are systematically wrong in ways one number
//! cannot absorb (issue 13): a fetch has a fixed cost of several RTTs that a goodput EWMA folds
//! into the per-byte rate, and a recompute on a shared host takes up to 3× its profile in wall
//! time. This module fits both from observed outcomes and says how sure it is:
//!
//! - [`FetchCalibration`] (one per peer): `seconds ≈ fixed + rtt_factor · rtt + per_byte ·
//!   wire_bytes`, prior from the [`LinkModel`](crate::LinkModel) (one RTT, configured/estimated
//!   goodput).
//! - [`RecomputeCalibration`] (one per engine): `seconds ≈ fixed + α_lin · L + α_attn · A +
//!   γ · load · (L + A)` over the two terms `L`, `A` of the engine's reported profile (linear
//!   in new tokens; attention over new × cached tokens), prior `α = 1, γ = 0, fixed = 0`.
//! - Every prediction is a [`Prediction`]: mean, standard error from the coefficients'
//!   uncertainty, and the per-outcome noise; wide with few samples, narrowing as they come.
//! - [`hedge()`](hedge::hedge) decides, from two predictions, whether to start the recompute
//!   while the fetch runs and keep whichever finishes first.
//! - [`InterferenceCalibration`] (one per engine): how much a split's two legs slow each other
//!   on shared resources, from executed splits (median of recent `1 + i` samples), and
//!   [`cpu_share_interference`], what the host's CPU shares predict before any split has run
//!   (its inputs learnt by [`CpuCost`]).
//!
//! - [`LoadCalibration`] (one per engine): seconds per byte for the engine to load fetched
//!   blocks into its pool after they landed, part of a fetch's cost
//!   ([`Scenario::load_s_per_byte`](crate::Scenario::load_s_per_byte)).
//! - [`SplitScatter`] and [`SplitOverhead`] (one each per engine): how far executed splits land
//!   from their predicted outcomes, and what a split costs beyond its slower leg, measured
//!   directly (its wall minus that leg).
//!
//! All of it is a pure function of values passed in: the daemon owns one calibration per peer
//! and per engine, feeds it each executed migration's measured figures, and passes the
//! calibrated [`LinkModel`](crate::LinkModel)/[`ComputeModel`](crate::ComputeModel) to
//! [`decide`](crate::decide). No I/O, no clock, no randomness; allocation only in `observe`.
//!
//! **Degenerate samples** are refused with [`CalibrationError::Sample`] or
//! [`CalibrationError::Implausible`] and leave the state unchanged: NaN or infinite values,
//! negative values, zero measured seconds, a recompute of zero tokens, more than
//! [`MAX_SAMPLE_SECONDS`]. A zero-byte fetch sample is accepted (it measures the fixed cost
//! alone); identical samples are accepted (the prior keeps the fit well posed).
//!
//! # Calling contract
//!
//! ```
//! use kvferry_model::calibration::{FetchSpread, FitConfig, HedgeChoice, HedgePolicy, RecomputeSpread};
//! use kvferry_model::{ComputeModel, FetchCalibration, FetchObservation, LinkModel};
//! use kvferry_model::{RecomputeCalibration, RecomputeObservation, hedge};
//!
//! // Once per peer / per engine, from the configured link and the engine's reported profile.
//! let link = LinkModel::new(1.0, 0.05, 1.0)?;
//! let mut fetch = FetchCalibration::new(&link, FetchSpread::default(), FitConfig::default())?;
//! let profile = ComputeModel::from_measured(1.3e-3, 2e-7)?;
//! let spread = RecomputeSpread::default();
//! let mut recompute = RecomputeCalibration::new(&profile, spread, FitConfig::default())?;
//!
//! // After every executed migration: what it moved or prefilled, and how long it took.
//! fetch.observe(FetchObservation { wire_bytes: 8 << 20, seconds: 0.21, rtt_s: 0.05 })?;
//! let prefill = RecomputeObservation { new_tokens: 64, cached_tokens: 0, load: 0.0, seconds: 0.25 };
//! recompute.observe(prefill)?;
//! // A refused sample is a typed error and changes nothing.
//! let broken = FetchObservation { wire_bytes: 1, seconds: f64::NAN, rtt_s: 0.05 };
//! assert!(fetch.observe(broken).is_err());
//!
//! // Before the next decision: calibrated inputs for `decide`, and predictions with bands.
//! let _link_for_decide = fetch.link_model(0.05, 1.0)?;
//! let _compute_for_decide = recompute.compute_model(0.0)?;
//! let f = fetch.predict(8 << 20, 0.05)?;
//! let r = recompute.predict(64, 0, 0.0)?;
//! let d = hedge(&f, &r, &HedgePolicy { allow: true, ..HedgePolicy::default() })?;
//! assert!(d.expected_s <= f.seconds.min(r.seconds));
//! if d.choice == HedgeChoice::Hedge {
//!     // Start both; keep the first to finish; cancel and account the other.
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod cpu_share;
pub mod fetch;
pub(crate) mod fit;
pub mod hedge;
pub mod interference;
pub mod load;
pub mod overhead;
pub mod recompute;
pub mod scatter;
pub mod tail;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::error::ModelError;

pub use cpu_share::{CpuCost, cpu_share_interference};
pub use fetch::{FetchCalibration, FetchEstimate, FetchObservation, FetchSpread};
pub use fit::FitConfig;
pub(crate) use hedge::normal_cdf;
pub use hedge::{HedgeChoice, HedgeDecision, HedgePolicy, HedgeReason, hedge};
pub use interference::InterferenceCalibration;
pub use load::LoadCalibration;
pub use overhead::SplitOverhead;
pub use recompute::{RecomputeCalibration, RecomputeEstimate, RecomputeObservation, RecomputeSpread};
pub use scatter::SplitScatter;
pub use tail::{TailCalibration, TailEstimate};

/// Longest migration a sample may report (one day); anything longer is a broken clock or a
/// unit error, not a measurement.
pub const MAX_SAMPLE_SECONDS: f64 = 86_400.0;

/// Why a calibration refused an input. A refused sample leaves the estimator unchanged; the
/// same sample would be refused again (not retryable), so the daemon logs and drops it.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CalibrationError {
    /// A sample field is NaN, infinite, negative or zero where it must be positive.
    #[error("calibration sample refused: {0}")]
    Sample(ModelError),
    /// A sample field is finite but beyond any real migration.
    #[error("calibration sample refused: {field} = {value} exceeds {max}")]
    Implausible { field: &'static str, value: f64, max: f64 },
    /// A prior, a configuration or a prediction input is invalid.
    #[error(transparent)]
    Input(#[from] ModelError),
}

/// A calibrated prediction of one action's seconds, with its uncertainty.
///
/// A fetch on a lossy path is a two-point mixture ([`tail`]): on time with probability
/// `1 − tail_probability`, else `tail_delay_s` later, each branch Gaussian with sd
/// [`branch_sd_s`](Self::branch_sd_s). Without a tail (a recompute; a lossless path) it is one
/// Gaussian.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Expected seconds (the mixture's mean: the on-time time plus the tail's expectation).
    pub seconds: f64,
    /// Standard error of `seconds` from the fitted coefficients' uncertainty (the prior's
    /// spread with no samples; shrinks toward 0 as samples accumulate).
    pub std_error_s: f64,
    /// Sd of one outcome around `seconds` from the fitted relative noise (does not vanish).
    pub noise_s: f64,
    /// Samples the calibration has accepted so far.
    pub samples: u64,
    /// Probability of the late branch (a lost packet's extra round trip); 0 without a tail.
    #[serde(default)]
    pub tail_probability: f64,
    /// Seconds the late branch adds.
    #[serde(default)]
    pub tail_delay_s: f64,
}

impl Prediction {
    /// A prediction without uncertainty (an uncalibrated model's number, or "nothing to do").
    pub fn exact(seconds: f64) -> Self {
        Self::gaussian(seconds, 0.0, 0.0, 0)
    }

    /// A prediction without a tail.
    pub fn gaussian(seconds: f64, std_error_s: f64, noise_s: f64, samples: u64) -> Self {
        Self { seconds, std_error_s, noise_s, samples, tail_probability: 0.0, tail_delay_s: 0.0 }
    }

    /// Sd of one outcome: coefficient uncertainty, noise and the tail's two values together.
    pub fn sd_s(&self) -> f64 {
        let q = self.tail_probability;
        (self.branch_sd_s().powi(2) + q * (1.0 - q) * self.tail_delay_s.powi(2)).sqrt()
    }

    /// Sd of one branch of the mixture (coefficient uncertainty and noise).
    pub fn branch_sd_s(&self) -> f64 {
        self.std_error_s.hypot(self.noise_s)
    }

    /// Expected seconds when on time (no tail): `seconds − tail_probability · tail_delay_s`.
    pub fn on_time_s(&self) -> f64 {
        (self.seconds - self.tail_probability * self.tail_delay_s).max(0.0)
    }

    /// `[seconds − z·sd, seconds + z·sd]`, the lower end clamped at 0.
    pub fn band(&self, z: f64) -> (f64, f64) {
        let half = z * self.sd_s();
        ((self.seconds - half).max(0.0), self.seconds + half)
    }

    /// Relative sd of one outcome (`sd / seconds`; 0 when the prediction is 0).
    pub fn relative_sd(&self) -> f64 {
        if self.seconds > 0.0 { self.sd_s() / self.seconds } else { 0.0 }
    }
}

/// The decision's inputs with calibration applied: what [`plan_migration`](crate::plan_migration)
/// takes, from the measured figures `m` and the calibrations of the source's link and the
/// target engine, for a prefix of `prefix_tokens` tokens at engine load `load`.
///
/// - **Fetch**, once the link's calibration has samples: the fitted fixed cost replaces the
///   one-RTT term (`rtt_s`) and the fitted per-byte cost the goodput, so the model's fetch
///   time equals [`FetchCalibration::predict`]'s mean. Without samples the live estimator's
///   figures stand (the calibration's prior is those same figures). Its loss tail
///   ([`FetchCalibration::tail_at`]) is carried in `fetch_tail`, so the model's fetch (and a
///   split's fetch leg) is charged the expected late round trip too.
/// - **Recompute**: the calibrated per-token costs at `load` ([`RecomputeCalibration::
///   compute_model`]); the fitted fixed cost, which [`ComputeModel`](crate::ComputeModel) has
///   no term for, is spread over the prefix's tokens (exact for a full recompute of
///   `prefix_tokens`; a split's shorter leg is charged its share), and the calibration's
///   size correction ([`RecomputeCalibration::size_correction`]), so the model's recompute of
///   the prefix equals [`RecomputeCalibration::predict`]'s mean.
///
/// Pure: no state changes, no clock.
pub fn calibrated(
    m: &crate::migration::Measured,
    fetch: Option<&FetchCalibration>,
    recompute: Option<&RecomputeCalibration>,
    load: f64,
    prefix_tokens: u64,
) -> Result<crate::migration::Measured, ModelError> {
    let mut out = *m;
    if let Some(f) = fetch.filter(|f| f.samples() > 0) {
        let link = f.link_model(m.rtt_s, 1.0)?;
        out.goodput_bps = link.bits_per_second();
        out.rtt_s = link.rtt_s.max(0.0);
    }
    if let Some(f) = fetch {
        out.fetch_tail = f.tail_at(m.rtt_s)?;
    }
    if let Some(r) = recompute {
        let c = r.compute_model(load)?;
        let fixed = r.estimate().fixed_s.max(0.0);
        let spread = if prefix_tokens > 0 { fixed / prefix_tokens as f64 } else { 0.0 };
        out.linear_s_per_token = c.linear_seconds_per_token() + spread;
        out.attention_s_per_pair = c.attention_seconds_per_pair();
        out.recompute_correction = c.correction;
    }
    Ok(out)
}

/// Appends `x` to `window`, dropping its oldest value once it holds `cap`, and returns a copy
/// of what it holds now (for a median, which sorts).
pub(crate) fn push_recent(window: &mut std::collections::VecDeque<f64>, cap: usize, x: f64) -> Vec<f64> {
    if window.len() >= cap {
        window.pop_front();
    }
    window.push_back(x);
    window.iter().copied().collect()
}

/// Samples below which a calibration's prior still holds places in its median: one sample
/// leaves the prior in force, two move the median to the middle of the prior and both. The
/// split scatter and the split interference both anchor this way.
pub const ANCHOR_SAMPLES: usize = 3;

/// Median of `v` with `anchor` filling the places of the first [`ANCHOR_SAMPLES`] values not
/// yet taken (so a single sample cannot move it). `v` may be empty; it is sorted and grown.
pub(crate) fn anchored_median(v: &mut Vec<f64>, anchor: f64) -> f64 {
    v.resize(v.len().max(ANCHOR_SAMPLES), anchor);
    median_of(v)
}

/// Median of a non-empty slice (mean of the middle two for even lengths); sorts it.
pub(crate) fn median_of(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 }
}

/// Checks a measured value: finite, > 0, at most [`MAX_SAMPLE_SECONDS`].
pub(crate) fn sample_seconds(field: &'static str, value: f64) -> Result<f64, CalibrationError> {
    crate::error::positive(field, value).map_err(CalibrationError::Sample)?;
    if value > MAX_SAMPLE_SECONDS {
        return Err(CalibrationError::Implausible { field, value, max: MAX_SAMPLE_SECONDS });
    }
    Ok(value)
}

/// Checks a sample's non-negative input (an RTT, a load): finite, ≥ 0, at most `max`.
pub(crate) fn sample_non_negative(
    field: &'static str,
    value: f64,
    max: f64,
) -> Result<f64, CalibrationError> {
    crate::error::non_negative(field, value).map_err(CalibrationError::Sample)?;
    if value > max {
        return Err(CalibrationError::Implausible { field, value, max });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_and_sd() {
        let p = Prediction::gaussian(1.0, 0.3, 0.4, 2);
        assert!((p.sd_s() - 0.5).abs() < 1e-15);
        assert_eq!(p.band(1.0), (0.5, 1.5));
        assert_eq!(p.band(3.0).0, 0.0);
        assert_eq!(Prediction::exact(0.0).relative_sd(), 0.0);
        // A tail adds its Bernoulli variance, q(1 − q)·d², and its mean.
        let t = Prediction { seconds: 1.0 + 0.25 * 0.8, tail_probability: 0.25, tail_delay_s: 0.8, ..p };
        assert!((t.sd_s() - (0.25_f64 + 0.25 * 0.75 * 0.64).sqrt()).abs() < 1e-12);
        assert!((t.on_time_s() - 1.0).abs() < 1e-12 && t.branch_sd_s() == p.sd_s());
    }

    #[test]
    fn sample_checks_are_typed() {
        assert!(matches!(sample_seconds("seconds", f64::NAN), Err(CalibrationError::Sample(_))));
        assert!(matches!(sample_seconds("seconds", 0.0), Err(CalibrationError::Sample(_))));
        assert!(matches!(sample_seconds("seconds", -1.0), Err(CalibrationError::Sample(_))));
        assert!(matches!(sample_seconds("seconds", 1e9), Err(CalibrationError::Implausible { .. })));
        assert!(matches!(sample_non_negative("rtt_s", -0.1, 10.0), Err(CalibrationError::Sample(_))));
        assert_eq!(sample_non_negative("rtt_s", 0.0, 10.0), Ok(0.0));
    }
}
