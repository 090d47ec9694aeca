//! Hedging: when the calibrated bands cannot tell fetch from recompute, start the recompute
//! while the fetch runs and keep whichever finishes first.
//!
//! Under the model each action's time is Gaussian, `F ~ N(μf, σf²)`, `R ~ N(μr, σr²)`,
//! independent, with `σ` a [`Prediction`]'s [`sd_s`](Prediction::sd_s). Running both slows each
//! by its interference factor when they share a resource (this host's CPU prefill and QUIC on
//! the same cores): `X = (1 + ι_f)·F`, `Y = (1 + ι_r)·R`. A hedge finishes at `min(X, Y)`, whose
//! expectation is Clark's (1961) closed form, with `θ² = Var X + Var Y`, `α = (E Y − E X)/θ`:
//!
//! `E[min(X, Y)] = E X · Φ(α) + E Y · Φ(−α) − θ · φ(α)`.
//!
//! Finishing times are not negative, but a Gaussian whose sd is near or above its mean (an
//! uncalibrated short fetch under a wide prior band) has mass below zero, and the closed form
//! then promises a race that ends at once — which no slowdown factor can make lose. The race's
//! expected time is therefore taken as `E[min(X, Y)] + E[X⁻] + E[Y⁻]` (each `E[N⁻] =
//! σ·φ(μ/σ) − μ·Φ(−μ/σ)`, the mass below zero), an upper bound of `E[min(X⁺, Y⁺)]`: it equals
//! Clark's value where the sds are small against the means, is never below zero, and is
//! conservative (it can only argue against a hedge) where they are not.
//!
//! The recompute it starts is wasted when the fetch wins; it ran until then:
//! `E[X · 1{X < Y}] = E X · Φ(α) − (Var X / θ) · φ(α)` target-compute seconds.
//!
//! A fetch with a loss tail ([`Prediction::tail_probability`] `q`) is a two-point mixture of
//! Gaussians, on time or one delay later; every expectation above is linear in the mixture's
//! weights, so the race is `(1 − q)·race(on time) + q·race(late)`. Its band for the overlap test
//! is the mixture's sd ([`Prediction::sd_s`]), which includes the two values' spread: a short
//! fetch on a lossy path is a near-tie whose outcomes lie a round trip apart, exactly where a
//! hedge pays.
//!
//! [`hedge`] hedges only when (1) the policy allows it, (2) the two bands `μ ± z·σ` overlap —
//! the crossover lies inside the uncertainty — (3) the hedge's expected time beats the better
//! pure action's by at least the policy's minimum gain — relative, and absolute: a hedge has
//! fixed costs the multiplicative interference does not carry (a second leg started, the
//! engine told to cancel, both legs' first CPU burst on shared cores), and every hedge of
//! a ~60 ms prefix in the bench of 2026-12-03 lost by 2–18 ms — and (4) its expected wasted compute is
//! within the cap. Condition (3) makes it never worse than the better pure action in
//! expectation under the model; without interference it never is anyway (`min(F, R) ≤ F, R`).
//!
//! Owns: the rule and its arithmetic. Must not: start, cancel or account anything (the
//! executor does; a cancelled leg must leave nothing visible), or consider an infeasible fetch
//! (the caller does not ask when the egress cap forbids fetching).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::Prediction;
use crate::error::{ModelError, fraction, non_negative};

/// What the caller allows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HedgePolicy {
    /// Whether a hedge may be the answer (the engine must support cancelling a recompute).
    pub allow: bool,
    /// Bands are `seconds ± band_z · sd`; a hedge is considered only where they overlap.
    pub band_z: f64,
    /// Relative slowdown of the fetch while the recompute runs beside it (0: separate resources).
    pub fetch_interference: f64,
    /// Relative slowdown of the recompute while the fetch runs beside it.
    pub recompute_interference: f64,
    /// Smallest relative gain over the better pure action, in [0, 1).
    pub min_gain: f64,
    /// Smallest absolute gain over the better pure action, seconds.
    #[serde(default)]
    pub min_gain_s: f64,
    /// Cost cap: the most target-compute seconds a hedge may be expected to waste on a
    /// recompute that loses. `None`: no cap.
    pub max_wasted_compute_s: Option<f64>,
}

impl Default for HedgePolicy {
    fn default() -> Self {
        Self {
            allow: false,
            band_z: 1.0,
            fetch_interference: 0.0,
            recompute_interference: 0.0,
            min_gain: 0.02,
            min_gain_s: 0.0,
            max_wasted_compute_s: None,
        }
    }
}

impl HedgePolicy {
    fn validate(&self) -> Result<(), ModelError> {
        non_negative("hedge.band_z", self.band_z)?;
        non_negative("hedge.fetch_interference", self.fetch_interference)?;
        non_negative("hedge.recompute_interference", self.recompute_interference)?;
        non_negative("hedge.min_gain", self.min_gain)?;
        if self.min_gain > 0.0 {
            fraction("hedge.min_gain", self.min_gain)?;
        }
        non_negative("hedge.min_gain_s", self.min_gain_s)?;
        if let Some(cap) = self.max_wasted_compute_s {
            non_negative("hedge.max_wasted_compute_s", cap)?;
        }
        Ok(())
    }
}

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HedgeChoice {
    /// Fetch only.
    Fetch,
    /// Recompute only.
    Recompute,
    /// Both at once; keep the first to finish, cancel the other.
    Hedge,
}

/// Why.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HedgeReason {
    /// The policy does not allow hedging.
    Disabled,
    /// The bands do not overlap: the better pure action is clear.
    Clear { fetch_s: f64, recompute_s: f64, band_z: f64 },
    /// The hedge would not beat the better pure action by the minimum gain (interference).
    NoGain {
        hedge_s: f64,
        best_pure_s: f64,
        min_gain: f64,
        #[serde(default)]
        min_gain_s: f64,
    },
    /// The hedge's expected wasted compute exceeds the cap.
    CostCap { wasted_compute_s: f64, cap: f64 },
    /// The bands straddle the crossover and the hedge is expected faster.
    Straddle { hedge_s: f64, best_pure_s: f64, p_fetch_wins: f64 },
}

impl fmt::Display for HedgeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            HedgeReason::Disabled => f.write_str("hedging is not allowed by policy"),
            HedgeReason::Clear { fetch_s, recompute_s, band_z } => write!(
                f,
                "the {band_z}-sd bands do not overlap (fetch {:.2} ms, recompute {:.2} ms): no hedge",
                fetch_s * 1e3,
                recompute_s * 1e3
            ),
            HedgeReason::NoGain { hedge_s, best_pure_s, min_gain, min_gain_s } => write!(
                f,
                "a hedge is expected to take {:.2} ms vs {:.2} ms for the better pure action (needs {:.1}% and {:.1} ms gain)",
                hedge_s * 1e3,
                best_pure_s * 1e3,
                min_gain * 100.0,
                min_gain_s * 1e3
            ),
            HedgeReason::CostCap { wasted_compute_s, cap } => write!(
                f,
                "a hedge would waste {:.2} ms of compute in expectation, over the {:.2} ms cap",
                wasted_compute_s * 1e3,
                cap * 1e3
            ),
            HedgeReason::Straddle { hedge_s, best_pure_s, p_fetch_wins } => write!(
                f,
                "the bands straddle the crossover: hedging is expected to take {:.2} ms vs {:.2} ms (fetch wins with p = {:.2})",
                hedge_s * 1e3,
                best_pure_s * 1e3,
                p_fetch_wins
            ),
        }
    }
}

/// The answer, with every expectation it compared.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HedgeDecision {
    /// What to run.
    pub choice: HedgeChoice,
    /// Why.
    pub reason: HedgeReason,
    /// Expected seconds of the choice.
    pub expected_s: f64,
    /// Expected seconds of a pure fetch.
    pub fetch_s: f64,
    /// Expected seconds of a pure recompute.
    pub recompute_s: f64,
    /// Expected seconds of a hedge (interference included).
    pub hedge_s: f64,
    /// Probability that the fetch finishes first in a hedge.
    pub p_fetch_wins: f64,
    /// Expected target-compute seconds a hedge wastes on a recompute that loses.
    pub wasted_compute_s: f64,
}

/// Decides whether to hedge between a calibrated fetch and a calibrated recompute.
pub fn hedge(
    fetch: &Prediction,
    recompute: &Prediction,
    policy: &HedgePolicy,
) -> Result<HedgeDecision, ModelError> {
    validate(fetch, "fetch")?;
    validate(recompute, "recompute")?;
    policy.validate()?;
    let (mf, sf) = (fetch.seconds, fetch.sd_s());
    let (mr, sr) = (recompute.seconds, recompute.sd_s());
    let (pure, best_pure_s) = if mf < mr { (HedgeChoice::Fetch, mf) } else { (HedgeChoice::Recompute, mr) };
    let race = Race::mixture(
        fetch,
        1.0 + policy.fetch_interference,
        (1.0 + policy.recompute_interference) * mr,
        (1.0 + policy.recompute_interference) * sr,
    );
    let mut d = HedgeDecision {
        choice: pure,
        reason: HedgeReason::Disabled,
        expected_s: best_pure_s,
        fetch_s: mf,
        recompute_s: mr,
        hedge_s: race.expected_min,
        p_fetch_wins: race.p_first_wins,
        wasted_compute_s: race.first_wins_time,
    };
    let z = policy.band_z;
    let overlap = mf - z * sf <= mr + z * sr && mr - z * sr <= mf + z * sf;
    d.reason = if !policy.allow {
        HedgeReason::Disabled
    } else if !overlap {
        HedgeReason::Clear { fetch_s: mf, recompute_s: mr, band_z: z }
    } else if race.expected_min > best_pure_s * (1.0 - policy.min_gain)
        || best_pure_s - race.expected_min < policy.min_gain_s
    {
        HedgeReason::NoGain {
            hedge_s: race.expected_min,
            best_pure_s,
            min_gain: policy.min_gain,
            min_gain_s: policy.min_gain_s,
        }
    } else if let Some(cap) = policy.max_wasted_compute_s.filter(|&cap| race.first_wins_time > cap) {
        HedgeReason::CostCap { wasted_compute_s: race.first_wins_time, cap }
    } else {
        d.choice = HedgeChoice::Hedge;
        d.expected_s = race.expected_min;
        HedgeReason::Straddle { hedge_s: race.expected_min, best_pure_s, p_fetch_wins: race.p_first_wins }
    };
    Ok(d)
}

fn validate(p: &Prediction, what: &'static str) -> Result<(), ModelError> {
    let field = |f: &'static str| -> &'static str {
        match (what, f) {
            ("fetch", "seconds") => "fetch.seconds",
            ("fetch", "std_error_s") => "fetch.std_error_s",
            ("fetch", _) => "fetch.noise_s",
            (_, "seconds") => "recompute.seconds",
            (_, "std_error_s") => "recompute.std_error_s",
            _ => "recompute.noise_s",
        }
    };
    non_negative(field("seconds"), p.seconds)?;
    non_negative(field("std_error_s"), p.std_error_s)?;
    non_negative(field("noise_s"), p.noise_s)?;
    let tail = if what == "fetch" { "fetch.tail_delay_s" } else { "recompute.tail_delay_s" };
    non_negative(tail, p.tail_delay_s)?;
    let q = if what == "fetch" { "fetch.tail_probability" } else { "recompute.tail_probability" };
    if non_negative(q, p.tail_probability)? > 1.0 {
        return Err(ModelError::FractionOutOfRange { field: q, value: p.tail_probability });
    }
    Ok(())
}

/// Two independent Gaussian finishing times racing: X (the fetch) and Y (the recompute).
#[derive(Debug, Clone, Copy)]
struct Race {
    /// E[min(X, Y)].
    expected_min: f64,
    /// P(X < Y).
    p_first_wins: f64,
    /// E[X · 1{X < Y}]: how long the loser Y ran when X won, in expectation.
    first_wins_time: f64,
}

impl Race {
    /// The fetch `x` (a Gaussian, or a two-point mixture of them when it has a tail), slowed
    /// by `gx`, racing a Gaussian Y: the races of the two branches, weighted.
    fn mixture(x: &Prediction, gx: f64, my: f64, sy: f64) -> Self {
        let q = x.tail_probability;
        if q <= 0.0 || x.tail_delay_s <= 0.0 {
            return Self::new(gx * x.seconds, gx * x.sd_s(), my, sy);
        }
        let (on, sb) = (gx * x.on_time_s(), gx * x.branch_sd_s());
        let early = Self::new(on, sb, my, sy);
        let late = Self::new(on + gx * x.tail_delay_s, sb, my, sy);
        let mix = |a: f64, b: f64| (1.0 - q) * a + q * b;
        Self {
            expected_min: mix(early.expected_min, late.expected_min).min(gx * x.seconds).min(my).max(0.0),
            p_first_wins: mix(early.p_first_wins, late.p_first_wins),
            first_wins_time: mix(early.first_wins_time, late.first_wins_time),
        }
    }

    fn new(mx: f64, sx: f64, my: f64, sy: f64) -> Self {
        let theta = sx.hypot(sy);
        // Inputs are validated finite, so θ is finite or +∞ (overflow), never NaN.
        if theta <= 1e-300 || !theta.is_finite() {
            let p = if mx < my {
                1.0
            } else if mx > my {
                0.0
            } else {
                0.5
            };
            return Self { expected_min: mx.min(my), p_first_wins: p, first_wins_time: p * mx };
        }
        let alpha = (my - mx) / theta;
        let (cdf, cdf_neg, pdf) = (normal_cdf(alpha), normal_cdf(-alpha), normal_pdf(alpha));
        // The mass the Gaussians put below zero is added back (module doc): an upper bound of
        // the race of the non-negative times, never below 0. Never above either mean, whatever
        // rounding does: min(X, Y) ≤ X and ≤ Y pointwise.
        let clark = mx * cdf + my * cdf_neg - theta * pdf;
        let expected_min = (clark + below_zero(mx, sx) + below_zero(my, sy)).min(mx).min(my).max(0.0);
        let first_wins_time = (mx * cdf - sx * sx / theta * pdf).max(0.0);
        Self { expected_min, p_first_wins: cdf, first_wins_time }
    }
}

/// `E[max(−N, 0)]` for `N ~ N(m, s²)`: how much of the mean lies below zero.
fn below_zero(m: f64, s: f64) -> f64 {
    if s <= 1e-300 || !s.is_finite() {
        return (-m).max(0.0);
    }
    (s * normal_pdf(m / s) - m * normal_cdf(-m / s)).max(0.0)
}

/// Standard normal density.
fn normal_pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Standard normal distribution function, `Φ(x) = erfc(−x/√2) / 2`.
pub(crate) fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x / std::f64::consts::SQRT_2)
}

/// Complementary error function, Chebyshev fit with fractional error < 1.2e-7 everywhere
/// (Press et al., Numerical Recipes, 2nd ed., §6.2, `erfcc`).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pred(seconds: f64, sd: f64) -> Prediction {
        Prediction::gaussian(seconds, sd, 0.0, 3)
    }

    fn allowed() -> HedgePolicy {
        HedgePolicy { allow: true, ..HedgePolicy::default() }
    }

    #[test]
    fn normal_functions() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.959_964) - 0.975).abs() < 1e-7);
        assert!((normal_cdf(-1.0) - 0.158_655_25).abs() < 1e-7);
        assert!((normal_pdf(0.0) - 0.398_942_28).abs() < 1e-8);
        assert_eq!(normal_cdf(-40.0), 0.0);
        assert_eq!(normal_cdf(40.0), 1.0);
    }

    #[test]
    fn equal_means_hedge_and_gain_by_the_closed_form() {
        // min of two iid N(μ, σ²) has mean μ − σ/√π.
        let d = hedge(&pred(1.0, 0.2), &pred(1.0, 0.2), &allowed()).unwrap();
        assert_eq!(d.choice, HedgeChoice::Hedge);
        assert!((d.hedge_s - (1.0 - 0.2 / std::f64::consts::PI.sqrt())).abs() < 1e-6, "{d:?}");
        assert!((d.p_fetch_wins - 0.5).abs() < 1e-6);
        assert!(matches!(d.reason, HedgeReason::Straddle { .. }));
    }

    #[test]
    fn clear_disabled_no_gain_and_cap() {
        let d = hedge(&pred(0.1, 0.01), &pred(1.0, 0.05), &allowed()).unwrap();
        assert_eq!((d.choice, d.expected_s), (HedgeChoice::Fetch, 0.1));
        assert!(matches!(d.reason, HedgeReason::Clear { .. }));
        let d = hedge(&pred(1.0, 0.2), &pred(1.0, 0.2), &HedgePolicy::default()).unwrap();
        assert_eq!((d.choice, d.reason), (HedgeChoice::Recompute, HedgeReason::Disabled));
        // Both legs twice as slow when run together: a hedge loses.
        let shared = HedgePolicy { fetch_interference: 1.0, recompute_interference: 1.0, ..allowed() };
        let d = hedge(&pred(1.0, 0.2), &pred(1.0, 0.2), &shared).unwrap();
        assert!(matches!(d.reason, HedgeReason::NoGain { .. }), "{d:?}");
        assert_eq!(d.choice, HedgeChoice::Recompute);
        let capped = HedgePolicy { max_wasted_compute_s: Some(0.1), ..allowed() };
        let d = hedge(&pred(1.0, 0.2), &pred(1.0, 0.2), &capped).unwrap();
        assert!(matches!(d.reason, HedgeReason::CostCap { .. }), "{d:?}");
        assert!(d.reason.to_string().contains("cap"));
    }

    #[test]
    fn a_hedge_must_also_gain_the_absolute_floor() {
        // 60 ms against 72 ms, wide bands: a hedge is expected some milliseconds faster.
        let (f, r) = (pred(0.072, 0.012), pred(0.060, 0.010));
        let d = hedge(&f, &r, &allowed()).unwrap();
        assert_eq!(d.choice, HedgeChoice::Hedge, "{d:?}");
        let gain = 0.060 - d.hedge_s;
        assert!(gain > 0.0 && gain < 0.010, "{gain}");
        let floor = HedgePolicy { min_gain_s: 0.010, ..allowed() };
        let d = hedge(&f, &r, &floor).unwrap();
        assert!(matches!(d.reason, HedgeReason::NoGain { min_gain_s, .. } if min_gain_s == 0.010), "{d:?}");
        assert_eq!((d.choice, d.expected_s), (HedgeChoice::Recompute, 0.060));
        assert!(d.reason.to_string().contains("10.0 ms gain"), "{}", d.reason);
        // Seconds-long legs with the same relative overlap clear a 10 ms floor.
        let d = hedge(&pred(7.2, 1.2), &pred(6.0, 1.0), &floor).unwrap();
        assert_eq!(d.choice, HedgeChoice::Hedge, "{d:?}");
        let bad = HedgePolicy { min_gain_s: -1.0, ..allowed() };
        assert!(hedge(&f, &r, &bad).is_err());
    }

    #[test]
    fn the_expected_time_is_never_negative() {
        // A short fetch with a wide prior band: the Gaussian closed form goes below 0.
        let d = hedge(&pred(0.001, 0.010), &pred(0.07, 0.06), &allowed()).unwrap();
        assert!(d.hedge_s > 0.0 && d.expected_s > 0.0, "{d:?}");
        // The mass below zero added back: a race of wide bands is no faster than its faster
        // mean (nothing to gain from the band), so a 5× slowdown always loses.
        let d = hedge(&pred(0.0014, 0.010), &pred(0.2, 0.15), &allowed()).unwrap();
        assert!((d.hedge_s - 0.0014).abs() < 1e-12, "{d:?}");
        assert!(below_zero(1.0, 0.2) < 1e-7 && (below_zero(0.0, 1.0) - normal_pdf(0.0)).abs() < 1e-12);
        assert_eq!((below_zero(-2.0, 0.0), below_zero(2.0, 0.0)), (2.0, 0.0));
        let slowed =
            HedgePolicy { fetch_interference: 4.0, recompute_interference: 4.0, band_z: 1e6, ..allowed() };
        for (mf, sf, mr, sr) in [(0.0014, 0.010, 0.2, 0.15), (1.0, 5.0, 1.0, 5.0), (0.01, 1.0, 0.02, 1.0)] {
            let d = hedge(&pred(mf, sf), &pred(mr, sr), &slowed).unwrap();
            assert!(matches!(d.reason, HedgeReason::NoGain { .. }), "{mf} {sf} {mr} {sr}: {d:?}");
        }
    }

    #[test]
    fn degenerate_inputs() {
        let d = hedge(&pred(0.0, 0.0), &pred(0.0, 0.0), &allowed()).unwrap();
        assert!(d.expected_s == 0.0 && d.hedge_s == 0.0 && d.wasted_compute_s.is_finite());
        assert!(hedge(&pred(f64::NAN, 0.0), &pred(1.0, 0.0), &allowed()).is_err());
        assert!(hedge(&pred(1.0, -0.1), &pred(1.0, 0.0), &allowed()).is_err());
        let bad = HedgePolicy { min_gain: 1.5, ..allowed() };
        assert!(hedge(&pred(1.0, 0.1), &pred(1.0, 0.1), &bad).is_err());
        let huge = hedge(&pred(1e300, 1e300), &pred(1e300, 1e300), &allowed()).unwrap();
        assert!(huge.expected_s.is_finite());
    }

    /// A fetch a round trip late with probability `q`: on time `on`, late `on + d`.
    fn tailed(on: f64, sd: f64, q: f64, d: f64) -> Prediction {
        Prediction { seconds: on + q * d, tail_probability: q, tail_delay_s: d, ..pred(on, sd) }
    }

    #[test]
    fn a_tailed_fetch_races_as_its_two_branches() {
        // Monte Carlo of min(X, Y) with X the mixture: within 1 ms of the closed form.
        let (f, r) = (tailed(0.065, 0.004, 0.5, 0.05), pred(0.09, 0.003));
        let d = hedge(&f, &r, &allowed()).unwrap();
        let mut seed = 11_u64;
        let mut uniform = || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((seed >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let n = 200_000;
        let (mut sum, mut wins) = (0.0, 0.0);
        for _ in 0..n {
            let z = |u: f64, v: f64| (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
            let late = uniform() < 0.5;
            let x = 0.065 + if late { 0.05 } else { 0.0 } + 0.004 * z(uniform(), uniform());
            let y = 0.09 + 0.003 * z(uniform(), uniform());
            sum += x.min(y);
            wins += f64::from(u8::from(x < y));
        }
        assert!((d.hedge_s - sum / f64::from(n)).abs() < 1e-3, "{} vs {}", d.hedge_s, sum / f64::from(n));
        assert!((d.p_fetch_wins - wins / f64::from(n)).abs() < 0.01);
        // A 12.5 ms expected gain over either pure action (both 90 ms): hedged.
        assert_eq!(d.choice, HedgeChoice::Hedge, "{d:?}");
        assert!(d.expected_s < f.seconds.min(r.seconds));
    }

    #[test]
    fn a_fetch_almost_surely_late_is_not_hedged_and_loses_to_recompute() {
        // The lossy miss of 2026-12-06: on time 85 ms, late by 50 ms with p 0.95, against a
        // 106 ms recompute. The mixture's mean (132.5 ms) picks the recompute; a hedge would
        // gain under a millisecond (the fetch wins only in its rare on-time branch).
        let d = hedge(&tailed(0.085, 0.003, 0.95, 0.05), &pred(0.106, 0.003), &allowed()).unwrap();
        assert_eq!(d.choice, HedgeChoice::Recompute, "{d:?}");
        assert!(d.fetch_s > 0.13 && d.recompute_s - d.hedge_s < 0.002, "{d:?}");
        // No tail: exactly the Gaussian race.
        let plain = hedge(&pred(0.1, 0.01), &pred(0.1, 0.01), &allowed()).unwrap();
        let zero = Prediction { tail_delay_s: 0.05, ..pred(0.1, 0.01) };
        assert_eq!(hedge(&zero, &pred(0.1, 0.01), &allowed()).unwrap(), plain);
        // The mixture is never slower in expectation than either pure action.
        for q in [0.0, 0.1, 0.5, 0.9, 1.0] {
            for mr in [0.05, 0.08, 0.1, 0.15] {
                let d = hedge(&tailed(0.07, 0.005, q, 0.05), &pred(mr, 0.004), &allowed()).unwrap();
                assert!(d.hedge_s <= d.fetch_s.min(d.recompute_s) + 1e-12, "{q} {mr}: {d:?}");
            }
        }
        let broken = Prediction { tail_probability: 1.5, ..pred(0.1, 0.01) };
        assert!(hedge(&broken, &pred(0.1, 0.01), &allowed()).is_err());
    }
}
