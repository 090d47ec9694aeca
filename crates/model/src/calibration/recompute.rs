//! Recompute calibration for one engine: wall seconds as a function of new tokens, cached
//! context and the engine's load, learnt as corrections to the profile the engine reports.
//!
//! The engine reports `profile(c, n) = linear · n + attention · (n·c + n(n+1)/2)`, measured on
//! its own (often CPU) clock. What a migration waits for is wall time, which on a shared or
//! busy host is a multiple of it. The fit is
//!
//! `seconds ≈ fixed + s · (L + A) + δ_lin · L + δ_attn · A + γ · load · (L + A)`
//!
//! with `L = linear · n`, `A = attention · pairs(c, n)` the profile's two terms, `fixed` the
//! command's round trip and scheduling, and `load` whatever non-negative load figure the
//! daemon has for the engine (its reported utilization when it has work queued, or its queue
//! depth: the same figure at prediction time as at observation time). Prior: the profile is
//! right (`s = 1`, `δ = 0`, `γ = 0`, `fixed = 0`).
//!
//! The two factors the cost model uses are `α_lin = s + δ_lin` and `α_attn = s + δ_attn`: a
//! common **scale** with a loose prior (a host that runs everything 3× slower than the
//! engine's own clock is learnt in a few recomputes) and two **shape** departures with a
//! tight one. The shape is what the engine measured itself, at contexts short migrations never
//! reach: a run of short recomputes (almost all linear term and fixed cost) says little about
//! the attention term, and with independent factors it moved it anyway, so the first long
//! recompute after them was predicted 10–15 % short (`bench/results/recompute-replay-2026-12-05/`).
//! The departures still grow as the prior fades, so a profile whose shape is wrong is
//! corrected too, more slowly.
//!
//! Owns: the per-engine fit and its conversion to a [`ComputeModel`]. Must not: read clocks or
//! talk to the engine (samples are passed in).

use serde::{Deserialize, Serialize};

use super::fit::{FitConfig, RobustFit};
use super::{CalibrationError, Prediction, sample_non_negative, sample_seconds};
use crate::compute::{ComputeModel, SizeCorrection};
use crate::error::{ModelError, count, non_negative, positive};

/// Kernel width of the size correction, in ln(seconds): a recompute twice as long as a sample
/// weighs that sample's residual 62 %, four times as long 15 %.
const SIZE_KERNEL_LN: f64 = 0.5;
/// The size correction's pseudo-weight at factor 1: one sample at the query's size and this
/// recent moves the correction 77 % of the way to its residual.
const SIZE_PRIOR_WEIGHT: f64 = 0.3;
/// Coefficients of the fit: fixed, scale, linear shape, attention shape, load.
const D: usize = 5;
/// Largest load figure a sample may carry.
const MAX_LOAD: f64 = 1e6;
/// Smallest per-token cost the calibrated [`ComputeModel`] is given (it must be positive).
const MIN_LINEAR_S: f64 = 1e-12;
/// Largest fixed cost per prefill step an engine may report, seconds.
pub const MAX_FIXED_PRIOR_S: f64 = 60.0;

/// One completed recompute, as the daemon measured it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecomputeObservation {
    /// Tokens prefilled (≥ 1).
    pub new_tokens: u64,
    /// Tokens already in the cache before them (the context they attend to).
    pub cached_tokens: u64,
    /// The engine's load figure when the recompute was issued (≥ 0).
    pub load: f64,
    /// Wall seconds from the command to the engine's completion.
    pub seconds: f64,
}

/// How far the prior may be off: one sd for each coefficient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecomputeSpread {
    /// Sd of the fixed cost, seconds (prior mean 0).
    pub fixed_s: f64,
    /// Sd of the common factor on both of the profile's terms (prior mean 1).
    pub scale: f64,
    /// Sd of each term's departure from the common factor (prior mean 0): how far the
    /// profile's shape (linear against attention) may be off.
    pub shape: f64,
    /// Sd of the slowdown per unit of load (prior mean 0).
    pub load_factor: f64,
}

impl Default for RecomputeSpread {
    fn default() -> Self {
        Self { fixed_s: 0.01, scale: 1.0, shape: 0.1, load_factor: 2.0 }
    }
}

/// The calibrated figures: what `GetLinks` can export per engine.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecomputeEstimate {
    /// Fixed seconds per recompute.
    pub fixed_s: f64,
    /// Factor on the profile's linear term.
    pub linear_factor: f64,
    /// Factor on the profile's attention term.
    pub attention_factor: f64,
    /// Slowdown per unit of load.
    pub load_factor: f64,
    /// Standard errors of the four figures above, in the same order.
    pub sd: [f64; 4],
    /// Calibrated seconds per token of the linear term at load 0.
    pub linear_s_per_token: f64,
    /// Calibrated seconds per (query, key) pair at load 0.
    pub attention_s_per_pair: f64,
    /// Fitted relative noise of one recompute.
    pub noise: f64,
    /// Samples accepted so far.
    pub samples: u64,
}

/// Online recompute calibration for one engine.
#[derive(Debug, Clone, PartialEq)]
pub struct RecomputeCalibration {
    fit: RobustFit<D>,
    /// The size correction of the current fit and window, recomputed when they change (in
    /// `observe` and `rebase`), so predicting does not walk the window.
    correction: Option<SizeCorrection>,
    linear_s: f64,
    attention_s: f64,
    spread: RecomputeSpread,
    /// The prior's fixed seconds per recompute: the engine's reported fixed cost per step.
    fixed_prior_s: f64,
}

impl RecomputeCalibration {
    /// A calibration at the engine's reported profile (e.g.
    /// [`ComputeModel::from_measured`]).
    pub fn new(
        profile: &ComputeModel,
        spread: RecomputeSpread,
        cfg: FitConfig,
    ) -> Result<Self, CalibrationError> {
        cfg.validate()?;
        let (mean, sd) = prior_of(&spread, 0.0)?;
        let (linear_s, attention_s) = terms_of(profile)?;
        Ok(Self {
            fit: RobustFit::new(cfg, mean, sd),
            correction: None,
            linear_s,
            attention_s,
            spread,
            fixed_prior_s: 0.0,
        })
    }

    /// The engine reported what each prefill step costs whatever its tokens
    /// (`PrefillProfile.fixed_s`): the prior's fixed cost becomes that, with an sd of at least
    /// as much, and the window is refitted. 0 (the default) is an engine that measures none.
    pub fn set_fixed_prior(&mut self, fixed_s: f64) -> Result<(), CalibrationError> {
        let fixed = sample_non_negative("recompute fixed prior", fixed_s, MAX_FIXED_PRIOR_S)?;
        if fixed == self.fixed_prior_s {
            return Ok(());
        }
        let (mean, sd) = prior_of(&self.spread, fixed)?;
        self.fixed_prior_s = fixed;
        self.fit.rebase(mean, sd);
        self.correction = self.size_correction_now();
        Ok(())
    }

    /// The engine reported a new profile: keep the window, re-express it against the new
    /// profile, and refit. The corrections then are relative to the new profile.
    pub fn rebase(&mut self, profile: &ComputeModel) -> Result<(), CalibrationError> {
        self.rebase_with_fixed(profile, self.fixed_prior_s)
    }

    /// [`rebase`](Self::rebase) and [`set_fixed_prior`](Self::set_fixed_prior) in one refit:
    /// the engine reported a new profile with its fixed cost per step.
    pub fn rebase_with_fixed(
        &mut self,
        profile: &ComputeModel,
        fixed_s: f64,
    ) -> Result<(), CalibrationError> {
        let fixed = sample_non_negative("recompute fixed prior", fixed_s, MAX_FIXED_PRIOR_S)?;
        let (linear_s, attention_s) = terms_of(profile)?;
        let (mean, sd) = prior_of(&self.spread, fixed)?;
        self.fixed_prior_s = fixed;
        let (old_l, old_a) = (self.linear_s, self.attention_s);
        let rescale = |x: &[f64; D]| {
            let l = if old_l > 0.0 { x[2] / old_l * linear_s } else { 0.0 };
            let a = if old_a > 0.0 { x[3] / old_a * attention_s } else { 0.0 };
            let load = if x[1] > 0.0 { x[4] / x[1] } else { 0.0 };
            [1.0, l + a, l, a, load * (l + a)]
        };
        self.fit.map_features(rescale);
        self.linear_s = linear_s;
        self.attention_s = attention_s;
        self.fit.rebase(mean, sd);
        self.correction = self.size_correction_now();
        Ok(())
    }

    /// Learns from one completed recompute. Refused samples leave the state unchanged.
    pub fn observe(&mut self, obs: RecomputeObservation) -> Result<(), CalibrationError> {
        count("recompute.new_tokens", obs.new_tokens).map_err(CalibrationError::Sample)?;
        let load = sample_non_negative("recompute.load", obs.load, MAX_LOAD)?;
        let y = sample_seconds("recompute.seconds", obs.seconds)?;
        self.fit.push(self.features(obs.new_tokens, obs.cached_tokens, load), y);
        self.correction = self.size_correction_now();
        Ok(())
    }

    /// Predicted wall seconds to prefill `new_tokens` on top of `cached_tokens` at `load`.
    /// Prefilling nothing costs nothing.
    pub fn predict(&self, new_tokens: u64, cached_tokens: u64, load: f64) -> Result<Prediction, ModelError> {
        non_negative("load", load)?;
        let x = (new_tokens > 0).then(|| self.features(new_tokens, cached_tokens, load));
        let p = self.fit.prediction_at(x.as_ref());
        let f = self.size_factor(p.seconds);
        Ok(Prediction { seconds: p.seconds * f, std_error_s: p.std_error_s * f, noise_s: p.noise_s * f, ..p })
    }

    /// The size correction (see [`SizeCorrection`]): at a prefill the fit predicts at `s`
    /// seconds, the factor `exp(Σ wᵢ rᵢ / (w₀ + Σ wᵢ))` over the window's recomputes, `rᵢ` the
    /// log residual of each against the fit now, `wᵢ` its forgetting weight times a Gaussian
    /// kernel in `ln s − ln ŝᵢ` (`SIZE_KERNEL_LN`), `w₀` `SIZE_PRIOR_WEIGHT`. `None`
    /// before the first sample. Tabulated over the samples' sizes widened by four kernel
    /// widths each way, flat beyond; [`ComputeModel::recompute_span_seconds`] applies it.
    pub fn size_correction(&self) -> Option<SizeCorrection> {
        self.correction
    }

    fn size_correction_now(&self) -> Option<SizeCorrection> {
        let mut lo = f64::INFINITY;
        let mut hi = f64::NEG_INFINITY;
        for (x, _, _) in self.fit.weighted_samples() {
            let m = self.fit.mean_at(x);
            if m > 0.0 {
                lo = lo.min(m.ln());
                hi = hi.max(m.ln());
            }
        }
        if lo > hi {
            return None;
        }
        let (lo, hi) = (lo - 4.0 * SIZE_KERNEL_LN, hi + 4.0 * SIZE_KERNEL_LN);
        let step = (hi - lo) / (crate::compute::SIZE_KNOTS - 1) as f64;
        SizeCorrection::from_fn(lo.exp(), step, |ln_s| self.size_ln_factor(ln_s))
    }

    /// ln of the size factor at a prefill the fit predicts at `ln_s` (see
    /// [`size_correction`](Self::size_correction)).
    fn size_ln_factor(&self, ln_s: f64) -> f64 {
        let (mut num, mut den) = (0.0, SIZE_PRIOR_WEIGHT);
        for (x, y, w) in self.fit.weighted_samples() {
            let m = self.fit.mean_at(x);
            if m > 0.0 {
                let d = (ln_s - m.ln()) / SIZE_KERNEL_LN;
                let k = w * (-0.5 * d * d).exp();
                num += k * (y / m).ln();
                den += k;
            }
        }
        num / den
    }

    fn size_factor(&self, seconds: f64) -> f64 {
        self.correction.map_or(1.0, |c| c.factor(seconds))
    }

    /// The calibrated figures.
    pub fn estimate(&self) -> RecomputeEstimate {
        let [fixed_s, scale, d_lin, d_attn, load_factor] = self.fit.theta();
        let (linear_factor, attention_factor) = (scale + d_lin, scale + d_attn);
        let sd = self.fit.theta_sd();
        RecomputeEstimate {
            fixed_s,
            linear_factor,
            attention_factor,
            load_factor,
            sd: [
                sd[0],
                self.fit.std_error_at(&[0.0, 1.0, 1.0, 0.0, 0.0]),
                self.fit.std_error_at(&[0.0, 1.0, 0.0, 1.0, 0.0]),
                sd[4],
            ],
            linear_s_per_token: linear_factor * self.linear_s,
            attention_s_per_pair: attention_factor * self.attention_s,
            noise: self.fit.noise(),
            samples: self.fit.accepted(),
        }
    }

    /// The calibrated per-token costs at `load` as the cost model takes them. The fixed cost
    /// ([`RecomputeEstimate::fixed_s`]) has no place in [`ComputeModel`]: add it to the
    /// compute path's wait, or predictions of short prefixes stay low by that much.
    pub fn compute_model(&self, load: f64) -> Result<ComputeModel, ModelError> {
        non_negative("load", load)?;
        let [_, scale, d_lin, d_attn, g] = self.fit.theta();
        let (al, aa) = (scale + d_lin, scale + d_attn);
        let linear = (self.linear_s * (al + g * load)).max(MIN_LINEAR_S);
        let attention = self.attention_s * (aa + g * load);
        Ok(ComputeModel::from_measured(linear, attention)?.with_correction(self.size_correction()))
    }

    /// Samples accepted so far.
    pub fn samples(&self) -> u64 {
        self.fit.accepted()
    }

    fn features(&self, new_tokens: u64, cached_tokens: u64, load: f64) -> [f64; D] {
        let n = new_tokens as f64;
        let c = cached_tokens as f64;
        let l = self.linear_s * n;
        let a = self.attention_s * (n * c + n * (n + 1.0) / 2.0);
        [1.0, l + a, l, a, load * (l + a)]
    }
}

fn terms_of(profile: &ComputeModel) -> Result<(f64, f64), ModelError> {
    let c = profile;
    ComputeModel::new(c.active_params, c.peak_flops, c.mfu, c.attention)?;
    Ok((c.linear_seconds_per_token(), c.attention_seconds_per_pair()))
}

/// The prior's means and sds: the profile is right, with `fixed_s` of fixed cost (sd at
/// least `fixed_s`: the engine's own figure may be off by its size).
fn prior_of(spread: &RecomputeSpread, fixed_s: f64) -> Result<([f64; D], [f64; D]), ModelError> {
    positive("spread.fixed_s", spread.fixed_s)?;
    positive("spread.scale", spread.scale)?;
    positive("spread.shape", spread.shape)?;
    positive("spread.load_factor", spread.load_factor)?;
    Ok((
        [fixed_s, 1.0, 0.0, 0.0, 0.0],
        [spread.fixed_s.max(fixed_s), spread.scale, spread.shape, spread.shape, spread.load_factor],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> ComputeModel {
        ComputeModel::from_measured(1.3e-3, 2e-7).unwrap()
    }

    #[test]
    fn the_prior_is_the_profile() {
        let c =
            RecomputeCalibration::new(&profile(), RecomputeSpread::default(), FitConfig::default()).unwrap();
        let p = c.predict(192, 64, 0.0).unwrap();
        let want = profile().recompute_span_seconds(64, 192);
        assert!((p.seconds - want).abs() < 1e-12, "{} vs {want}", p.seconds);
        let m = c.compute_model(0.0).unwrap();
        assert!((m.recompute_span_seconds(64, 192) - want).abs() < 1e-12);
        assert_eq!(c.predict(0, 10, 0.0).unwrap().seconds, 0.0);
        assert!(c.predict(1, 0, -1.0).is_err());
    }

    #[test]
    fn the_engines_fixed_cost_per_step_is_the_priors() {
        let mut c =
            RecomputeCalibration::new(&profile(), RecomputeSpread::default(), FitConfig::default()).unwrap();
        let before = c.clone();
        for bad in [f64::NAN, -0.01, f64::INFINITY, MAX_FIXED_PRIOR_S + 1.0] {
            assert!(c.set_fixed_prior(bad).is_err(), "{bad}");
            assert_eq!(c, before);
        }
        c.set_fixed_prior(0.02).unwrap();
        let want = 0.02 + profile().recompute_span_seconds(64, 192);
        let p = c.predict(192, 64, 0.0).unwrap();
        assert!((p.seconds - want).abs() < 1e-9, "{} vs {want}", p.seconds);
        assert!((c.estimate().fixed_s - 0.02).abs() < 1e-12);
        assert_eq!(c.predict(0, 10, 0.0).unwrap().seconds, 0.0, "prefilling nothing costs nothing");
        // A new profile keeps the engine's fixed cost.
        c.rebase(&ComputeModel::from_measured(2.6e-3, 4e-7).unwrap()).unwrap();
        assert!((c.estimate().fixed_s - 0.02).abs() < 1e-12);
        // Recomputes that cost it are predicted from the first: a 16-token one (the fixed cost
        // is half of it) within 1 %, where the prior without it is off by nearly half.
        let truth = |n: u64| 0.02 + profile().recompute_span_seconds(0, n);
        let mut with =
            RecomputeCalibration::new(&profile(), RecomputeSpread::default(), FitConfig::default()).unwrap();
        with.set_fixed_prior(0.02).unwrap();
        let without =
            RecomputeCalibration::new(&profile(), RecomputeSpread::default(), FitConfig::default()).unwrap();
        let err = |c: &RecomputeCalibration| (c.predict(16, 0, 0.0).unwrap().seconds / truth(16) - 1.0).abs();
        assert!(err(&with) < 0.01 && err(&without) > 0.45, "{} / {}", err(&with), err(&without));
        for n in [64, 512, 16, 1024] {
            with.observe(RecomputeObservation {
                new_tokens: n,
                cached_tokens: 0,
                load: 0.0,
                seconds: truth(n),
            })
            .unwrap();
        }
        assert!(err(&with) < 0.01, "{}", err(&with));
    }

    #[test]
    fn refused_samples_leave_the_state_unchanged() {
        let mut c =
            RecomputeCalibration::new(&profile(), RecomputeSpread::default(), FitConfig::default()).unwrap();
        let before = c.clone();
        let ok = RecomputeObservation { new_tokens: 64, cached_tokens: 0, load: 0.0, seconds: 0.1 };
        for bad in [
            RecomputeObservation { new_tokens: 0, ..ok },
            RecomputeObservation { load: f64::NAN, ..ok },
            RecomputeObservation { load: -0.5, ..ok },
            RecomputeObservation { seconds: f64::NAN, ..ok },
            RecomputeObservation { seconds: -0.1, ..ok },
            RecomputeObservation { seconds: 0.0, ..ok },
            RecomputeObservation { seconds: f64::INFINITY, ..ok },
        ] {
            assert!(c.observe(bad).is_err(), "{bad:?}");
        }
        assert_eq!(c, before);
        c.observe(ok).unwrap();
        assert_eq!(c.samples(), 1);
    }

    #[test]
    fn a_rebased_profile_keeps_the_wall_time_learnt() {
        let mut c =
            RecomputeCalibration::new(&profile(), RecomputeSpread::default(), FitConfig::default()).unwrap();
        for n in [32u64, 64, 128, 256].repeat(4) {
            let seconds = 3.0 * profile().recompute_seconds(n);
            c.observe(RecomputeObservation { new_tokens: n, cached_tokens: 0, load: 0.0, seconds }).unwrap();
        }
        let before = c.predict(100, 0, 0.0).unwrap().seconds;
        // The engine now reports a profile twice as fast; the measured wall times did not change.
        c.rebase(&ComputeModel::from_measured(0.65e-3, 1e-7).unwrap()).unwrap();
        let after = c.predict(100, 0, 0.0).unwrap().seconds;
        // The new prior (factor 1 on the new profile) is 5 sds from the learnt factor 6, and
        // pulls a little: within 5 % after 16 samples.
        assert!((after / before - 1.0).abs() < 0.05, "{before} -> {after}");
        assert!(c.estimate().linear_factor > 4.0, "{:?}", c.estimate());
    }
}
