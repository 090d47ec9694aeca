//! The estimator under both calibrations: a robust, windowed, Bayesian linear fit
//! `seconds ≈ θ · x` with non-negative coefficients.
//!
//! - **Prior.** Each coefficient starts at a Gaussian prior `θⱼ ~ N(meanⱼ, sdⱼ²)` taken from the
//!   uncalibrated model (link model, engine profile). The fit is the posterior mode (a ridge
//!   pulled toward the prior), so with no samples it *is* the prior, with few samples the prior
//!   dominates, and with many the data do.
//! - **Relative noise.** Timings err in proportion to their size (a 10 ms fetch does not miss by
//!   100 ms), so each sample's variance is `(σ · ŷ)²` with `σ` a relative error. `σ` itself is
//!   estimated from the residuals (median absolute deviation, robust to outliers), shrunk toward
//!   a prior noise worth a few pseudo-samples, so one or two lucky samples do not claim
//!   certainty.
//! - **Robust.** Huber weights (`k = 1.345`: 95 % efficiency on Gaussian noise) bound the pull
//!   of any one sample, refitted by iteratively reweighted least squares.
//! - **Windowed and forgetting.** Only the last `window` samples are kept, and the `i`-th newest
//!   weighs `forgettingⁱ`, so a link or an engine whose behaviour changes is followed. The prior
//!   fades the same way (it is the oldest information), down to 1 % of its weight, so a prior
//!   that is far off leaves no lasting bias. The uncertainty does not fade with it: the
//!   covariance keeps the prior at full precision, so a coefficient the samples never pin
//!   down keeps its prior sd rather than growing without data (no covariance windup).
//! - **Non-negative.** Every coefficient is a physical cost (seconds, seconds per byte, a
//!   factor), clamped at zero by an active-set solve; with non-negative, monotone features this
//!   makes every prediction monotone in its inputs.
//!
//! Internally each coefficient is scaled by its prior sd (`θⱼ = sdⱼ · φⱼ`), which keeps the
//! normal equations well conditioned when one coefficient is ~1e-9 s/byte and another ~1 RTT.
//!
//! This module owns the arithmetic only: no validation of raw measurements (the callers do it),
//! no I/O, no clock, no randomness. It allocates only when a sample is pushed (the window and a
//! scratch vector for the median), never when predicting.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::Prediction;
use crate::error::{ModelError, count, fraction, non_negative, positive};

/// Tuning of the estimator. The defaults suit migrations of milliseconds to minutes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FitConfig {
    /// Samples kept (oldest dropped first).
    pub window: usize,
    /// Weight ratio between consecutive samples, in (0, 1]; 1 weighs the window uniformly.
    /// 0.9 gives an effective memory of about 19 samples (`(1 + f) / (1 − f)`).
    pub forgetting: f64,
    /// Prior relative noise (sd of `measured / predicted − 1`) before residuals are known.
    pub prior_noise: f64,
    /// How many samples the prior noise is worth.
    pub prior_noise_weight: f64,
    /// Smallest relative noise the fit claims, however well samples agree.
    pub min_noise: f64,
    /// Huber threshold in units of the noise sd.
    pub huber_k: f64,
    /// Predictions below this many seconds are taken as this for the relative weights.
    pub floor_s: f64,
}

impl Default for FitConfig {
    fn default() -> Self {
        Self {
            window: 64,
            forgetting: 0.9,
            prior_noise: 0.2,
            prior_noise_weight: 1.0,
            min_noise: 0.01,
            huber_k: 1.345,
            floor_s: 1e-3,
        }
    }
}

impl FitConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), ModelError> {
        count("window", self.window as u64)?;
        fraction("forgetting", self.forgetting)?;
        positive("prior_noise", self.prior_noise)?;
        non_negative("prior_noise_weight", self.prior_noise_weight)?;
        positive("min_noise", self.min_noise)?;
        positive("huber_k", self.huber_k)?;
        positive("floor_s", self.floor_s)?;
        Ok(())
    }
}

/// Most IRLS rounds per refit; it usually converges in 3–6.
const IRLS_ROUNDS: usize = 12;
/// Median absolute deviation → sd for Gaussian noise.
const MAD_TO_SD: f64 = 1.4826;
/// The prior's weight when measuring the data's own scatter (enough to keep the system
/// solvable when features are collinear, too little to pull the fit).
const DATA_PRIOR_STRENGTH: f64 = 1e-6;
/// The least weight the prior keeps as samples accumulate: a coefficient the samples never
/// pin down (a fixed cost on a link whose RTT never changes) stays within 10 prior sds.
const PRIOR_FLOOR: f64 = 0.01;

/// The fitted state: prior, window, coefficients, covariance, noise.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RobustFit<const D: usize> {
    cfg: FitConfig,
    prior_mean: [f64; D],
    prior_sd: [f64; D],
    window: VecDeque<([f64; D], f64)>,
    theta: [f64; D],
    cov: [[f64; D]; D],
    noise: f64,
    accepted: u64,
}

impl<const D: usize> RobustFit<D> {
    /// A fit at its prior. The caller has validated `cfg`, and `prior_sd` > 0, both finite.
    pub(crate) fn new(cfg: FitConfig, prior_mean: [f64; D], prior_sd: [f64; D]) -> Self {
        let mut f = Self {
            cfg,
            prior_mean,
            prior_sd,
            window: VecDeque::with_capacity(cfg.window.min(1024)),
            theta: [0.0; D],
            cov: [[0.0; D]; D],
            noise: cfg.prior_noise,
            accepted: 0,
        };
        f.refit();
        f
    }

    /// Adds one validated sample (finite, non-negative features; finite `y` > 0) and refits.
    pub(crate) fn push(&mut self, x: [f64; D], y: f64) {
        while self.window.len() >= self.cfg.window {
            self.window.pop_front();
        }
        self.window.push_back((x, y));
        self.accepted += 1;
        self.refit();
    }

    /// Replaces the prior (e.g. the engine re-registered a new profile) and refits the window.
    pub(crate) fn rebase(&mut self, prior_mean: [f64; D], prior_sd: [f64; D]) {
        self.prior_mean = prior_mean;
        self.prior_sd = prior_sd;
        self.refit();
    }

    /// Rewrites every sample's features (the caller then refits, via [`rebase`](Self::rebase)).
    pub(crate) fn map_features(&mut self, f: impl Fn(&[f64; D]) -> [f64; D]) {
        for (x, _) in self.window.iter_mut() {
            *x = f(x);
        }
    }

    /// The window's samples with their forgetting weights, newest first.
    pub(crate) fn weighted_samples(&self) -> impl Iterator<Item = (&[f64; D], f64, f64)> {
        let f = self.cfg.forgetting;
        self.window.iter().rev().scan(1.0, move |w, (x, y)| {
            let out = (x, *y, *w);
            *w *= f;
            Some(out)
        })
    }

    pub(crate) fn theta(&self) -> [f64; D] {
        self.theta
    }

    /// Posterior sd of each coefficient.
    pub(crate) fn theta_sd(&self) -> [f64; D] {
        std::array::from_fn(|j| self.cov[j][j].max(0.0).sqrt())
    }

    /// Fitted relative noise (sd of `measured / predicted − 1`).
    pub(crate) fn noise(&self) -> f64 {
        self.noise
    }

    /// Samples accepted since creation (the window keeps only the last few).
    pub(crate) fn accepted(&self) -> u64 {
        self.accepted
    }

    /// `θ · x`, never negative.
    pub(crate) fn mean_at(&self, x: &[f64; D]) -> f64 {
        dot(&self.theta, x).max(0.0)
    }

    /// Standard error of `θ · x` from the coefficients' uncertainty: `√(xᵀ Σ x)`.
    pub(crate) fn std_error_at(&self, x: &[f64; D]) -> f64 {
        let mut v = 0.0;
        for i in 0..D {
            for j in 0..D {
                v += x[i] * self.cov[i][j] * x[j];
            }
        }
        v.max(0.0).sqrt()
    }

    /// The fit's prediction at features `x`: the mean, its standard error, the noise band
    /// (the relative noise times the mean) and the samples behind them; `None` (nothing to
    /// do) is an exact 0 s.
    pub(crate) fn prediction_at(&self, x: Option<&[f64; D]>) -> Prediction {
        let samples = self.accepted;
        let Some(x) = x else { return Prediction { samples, ..Prediction::exact(0.0) } };
        let seconds = self.mean_at(x);
        Prediction::gaussian(seconds, self.std_error_at(x), self.noise * seconds, samples)
    }

    fn refit(&mut self) {
        let sd = self.prior_sd;
        let prior_phi: [f64; D] = std::array::from_fn(|j| self.prior_mean[j].max(0.0) / sd[j]);
        let at_prior: [f64; D] = std::array::from_fn(|j| prior_phi[j] * sd[j]);
        self.theta = at_prior;
        self.noise = self.cfg.prior_noise;
        if self.window.is_empty() {
            self.cov =
                std::array::from_fn(|i| std::array::from_fn(|j| if i == j { sd[i] * sd[i] } else { 0.0 }));
            return;
        }
        let mut scratch = Vec::with_capacity(self.window.len());
        // Phase 1: the data's own robust scale, from a fit the prior barely touches. Measuring
        // the noise around the posterior instead would let a far-off prior inflate it, and an
        // inflated noise lets the prior dominate: a fixed point that never learns.
        let (data_theta, noise) = self.irls(&prior_phi, DATA_PRIOR_STRENGTH, at_prior, None, &mut scratch);
        // Phase 2: the posterior mode at that noise.
        let strength = self.prior_strength();
        let (theta, _) = self.irls(&prior_phi, strength, data_theta, Some(noise), &mut scratch);
        self.theta = theta;
        self.noise = noise;
        // The band is computed with the prior at its full precision: forgetting fades the
        // prior's pull on the estimate, but a direction no sample pins down keeps the prior's
        // sd instead of widening as the prior fades (exponential forgetting's covariance
        // windup: up to 1/√PRIOR_FLOOR = 10 prior sds). A recompute's load coefficient that no
        // sample had seen away from load 0 once gave a prediction at load 1 a band of ±250 %.
        let (a, _) = self.normal_equations(&theta, noise, &prior_phi, 1.0);
        if let Some(inv) = inverse(&a) {
            self.cov = std::array::from_fn(|i| std::array::from_fn(|j| sd[i] * inv[i][j] * sd[j]));
        }
    }

    /// The prior's precision relative to its initial one: it is what was known before the
    /// first sample, so it fades like the oldest sample would (`forgettingⁿ` after n samples),
    /// down to [`PRIOR_FLOOR`]. Without forgetting it keeps its full weight (plain Bayes).
    fn prior_strength(&self) -> f64 {
        let n = i32::try_from(self.accepted).unwrap_or(i32::MAX);
        self.cfg.forgetting.powi(n).max(PRIOR_FLOOR)
    }

    /// Iteratively reweighted least squares from `start`, with the prior's precision scaled by
    /// `strength`. With `noise` given it is held fixed; else it is re-estimated every round.
    /// Returns the coefficients and the noise.
    fn irls(
        &self,
        prior_phi: &[f64; D],
        strength: f64,
        start: [f64; D],
        noise: Option<f64>,
        scratch: &mut Vec<(f64, f64)>,
    ) -> ([f64; D], f64) {
        let mut theta = start;
        let mut s = noise.unwrap_or(self.cfg.prior_noise);
        for _ in 0..IRLS_ROUNDS {
            let (a, b) = self.normal_equations(&theta, s, prior_phi, strength);
            let Some(phi) = solve_non_negative(&a, &b) else { break };
            let next: [f64; D] = std::array::from_fn(|j| phi[j] * self.prior_sd[j]);
            let moved = (0..D).map(|j| (next[j] - theta[j]).abs() / self.prior_sd[j]).fold(0.0, f64::max);
            theta = next;
            if noise.is_none() {
                s = self.noise_from_residuals(&theta, scratch);
            }
            if moved < 1e-9 {
                break;
            }
        }
        (theta, s)
    }

    /// Weighted normal equations in the scaled coefficients φ, at `theta` and `noise`, with the
    /// prior's precision scaled by `strength`.
    fn normal_equations(
        &self,
        theta: &[f64; D],
        noise: f64,
        prior_phi: &[f64; D],
        strength: f64,
    ) -> ([[f64; D]; D], [f64; D]) {
        let mut a = [[0.0; D]; D];
        let mut b: [f64; D] = std::array::from_fn(|j| strength * prior_phi[j]);
        for (j, row) in a.iter_mut().enumerate() {
            row[j] = strength;
        }
        let n = self.window.len();
        let s2 = noise * noise;
        for (i, (x, y)) in self.window.iter().enumerate() {
            let decay = self.cfg.forgetting.powi((n - 1 - i) as i32);
            let yhat = dot(theta, x).max(self.cfg.floor_s);
            let u = (y - yhat) / yhat;
            let w = decay * huber(u / noise, self.cfg.huber_k) / (yhat * yhat * s2);
            let xs: [f64; D] = std::array::from_fn(|j| x[j] * self.prior_sd[j]);
            for r in 0..D {
                b[r] += w * xs[r] * y;
                for c in 0..D {
                    a[r][c] += w * xs[r] * xs[c];
                }
            }
        }
        (a, b)
    }

    /// Robust relative noise around `theta`: the forgetting-weighted median absolute relative
    /// residual, over the effective degrees of freedom left after fitting D coefficients,
    /// shrunk toward the prior noise. Weighted, so that once the recent samples that disagree
    /// with the old ones hold half the weight (about 7 samples at forgetting 0.9) they set
    /// the scale and stop being treated as outliers: a changed link is followed, an isolated
    /// outlier is not.
    fn noise_from_residuals(&self, theta: &[f64; D], scratch: &mut Vec<(f64, f64)>) -> f64 {
        let n = self.window.len();
        scratch.clear();
        scratch.extend(self.window.iter().enumerate().map(|(i, (x, y))| {
            let yhat = dot(theta, x).max(self.cfg.floor_s);
            (((y - yhat) / yhat).abs(), self.cfg.forgetting.powi((n - 1 - i) as i32))
        }));
        let (sum_w, sum_w2) = scratch.iter().fold((0.0, 0.0), |(a, b), &(_, w)| (a + w, b + w * w));
        scratch.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        let mut acc = 0.0;
        let median = scratch
            .iter()
            .find(|&&(_, w)| {
                acc += w;
                acc >= 0.5 * sum_w
            })
            .map_or(0.0, |&(r, _)| r);
        let mad = median * MAD_TO_SD;
        let n_eff = sum_w * sum_w / sum_w2;
        let dof = (n_eff - D as f64).max(0.0);
        let (p, s0) = (self.cfg.prior_noise_weight, self.cfg.prior_noise);
        if p + dof <= 0.0 {
            return s0;
        }
        let var = (p * s0 * s0 + dof * mad * mad) / (p + dof);
        var.sqrt().max(self.cfg.min_noise)
    }
}

fn dot<const D: usize>(a: &[f64; D], b: &[f64; D]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Huber weight ψ(u)/u.
fn huber(u: f64, k: f64) -> f64 {
    let a = u.abs();
    if a <= k { 1.0 } else { k / a }
}

/// Solves `a φ = b` subject to `φ ≥ 0` by an active set: a coefficient that comes out negative
/// is fixed at zero and the rest re-solved (at most D rounds). `None` when `a` is not
/// positive definite (cannot happen with the prior's identity term, but checked anyway).
fn solve_non_negative<const D: usize>(a: &[[f64; D]; D], b: &[f64; D]) -> Option<[f64; D]> {
    let mut fixed = [false; D];
    loop {
        let mut m = *a;
        let mut r = *b;
        for j in (0..D).filter(|&j| fixed[j]) {
            for row in m.iter_mut() {
                row[j] = 0.0;
            }
            m[j] = [0.0; D];
            m[j][j] = 1.0;
            r[j] = 0.0;
        }
        let x = cholesky_solve(&m, &r)?;
        let worst = (0..D).filter(|&j| !fixed[j] && x[j] < 0.0).min_by(|&i, &j| x[i].total_cmp(&x[j]));
        match worst {
            None => return Some(x.map(|v| v.max(0.0))),
            Some(j) => fixed[j] = true,
        }
    }
}

/// Cholesky factorisation and solve of a small symmetric positive-definite system.
fn cholesky_solve<const D: usize>(a: &[[f64; D]; D], b: &[f64; D]) -> Option<[f64; D]> {
    let mut l = [[0.0; D]; D];
    for i in 0..D {
        for j in 0..=i {
            let s = a[i][j] - (0..j).map(|k| l[i][k] * l[j][k]).sum::<f64>();
            if i == j {
                if !(s > 0.0 && s.is_finite()) {
                    return None;
                }
                l[i][i] = s.sqrt();
            } else {
                l[i][j] = s / l[j][j];
            }
        }
    }
    let mut y = [0.0; D];
    for i in 0..D {
        let mut s = b[i];
        for k in 0..i {
            s -= l[i][k] * y[k];
        }
        y[i] = s / l[i][i];
    }
    let mut x = [0.0; D];
    for i in (0..D).rev() {
        let mut s = y[i];
        for k in i + 1..D {
            s -= l[k][i] * x[k];
        }
        x[i] = s / l[i][i];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

fn inverse<const D: usize>(a: &[[f64; D]; D]) -> Option<[[f64; D]; D]> {
    // `a` is symmetric, so is its inverse: column c is row c.
    let mut inv = [[0.0; D]; D];
    for (c, row) in inv.iter_mut().enumerate() {
        let e: [f64; D] = std::array::from_fn(|j| if j == c { 1.0 } else { 0.0 });
        *row = cholesky_solve(a, &e)?;
    }
    Some(inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_no_samples_the_fit_is_the_prior() {
        let f = RobustFit::<2>::new(FitConfig::default(), [0.5, 2.0], [0.1, 1.0]);
        assert_eq!(f.theta(), [0.5, 2.0]);
        assert_eq!(f.theta_sd(), [0.1, 1.0]);
        assert_eq!(f.accepted(), 0);
        assert!((f.std_error_at(&[1.0, 0.0]) - 0.1).abs() < 1e-15);
    }

    #[test]
    fn exact_samples_recover_the_line() {
        let cfg = FitConfig { forgetting: 1.0, ..FitConfig::default() };
        let mut f = RobustFit::<2>::new(cfg, [0.0, 1.0], [1.0, 1.0]);
        for i in 1..=40 {
            let x = i as f64;
            f.push([1.0, x], 0.2 + 0.05 * x);
        }
        let [a, b] = f.theta();
        assert!((a - 0.2).abs() < 2e-3 && (b - 0.05).abs() < 1e-4, "{a} {b}");
        // Residuals are zero, so only the prior noise's pseudo-samples remain: √(1 · 0.2² / (1 + 40 − 2)).
        assert!((f.noise() - (0.04 / 39.0f64).sqrt()).abs() < 1e-3, "{}", f.noise());
    }

    #[test]
    fn a_coefficient_no_sample_excites_keeps_its_prior_sd() {
        // y = 0.2 + 1.0 · x₁; x₂ (a load term) is 0 in every sample. With forgetting the prior
        // fades to PRIOR_FLOOR, but x₂'s sd must stay its prior's, not grow toward 10×.
        let mut f = RobustFit::<3>::new(FitConfig::default(), [0.0, 1.0, 0.0], [0.1, 1.0, 2.0]);
        for i in 0..200 {
            let x1 = 0.1 + f64::from(i % 7) * 0.3;
            let wobble = 1.0 + 0.03 * (f64::from(i) * 1.3).sin();
            f.push([1.0, x1, 0.0], (0.2 + x1) * wobble);
        }
        let sd = f.theta_sd();
        assert!(sd[2] <= 2.0 * (1.0 + 1e-9), "the unexcited coefficient's sd {} over its prior 2.0", sd[2]);
        assert!(sd[2] > 1.9, "nor does it shrink without data: {}", sd[2]);
        // The excited ones are pinned by the data, far below their prior sds.
        assert!(sd[0] < 0.02 && sd[1] < 0.05, "{sd:?}");
        let th = f.theta();
        assert!((th[0] - 0.2).abs() < 0.02 && (th[1] - 1.0).abs() < 0.03, "{th:?}");
    }

    #[test]
    fn a_negative_coefficient_is_clamped_and_the_rest_refit() {
        // y = 1.0 · x exactly; the intercept would fit negative from the prior pull, never < 0.
        let mut f = RobustFit::<2>::new(FitConfig::default(), [0.0, 0.5], [0.01, 1.0]);
        for x in [1.0, 2.0, 4.0, 8.0] {
            f.push([1.0, x], x);
        }
        let [a, b] = f.theta();
        assert!(a >= 0.0 && (b - 1.0).abs() < 0.02, "{a} {b}");
        assert!(f.theta_sd().iter().all(|s| s.is_finite() && *s > 0.0));
    }

    #[test]
    fn solver_handles_the_active_set() {
        let a = [[2.0, 1.0], [1.0, 2.0]];
        let x = solve_non_negative(&a, &[-1.0, 4.0]).unwrap();
        assert_eq!(x[0], 0.0);
        assert!((x[1] - 2.0).abs() < 1e-12);
        assert!(cholesky_solve(&[[0.0, 0.0], [0.0, 1.0]], &[1.0, 1.0]).is_none());
    }
}
