//! Per-peer link estimator (pure; no clock, no IO).
//!
//! Feeds on three kinds of samples, each stamped with the caller's clock in nanoseconds:
//!
//! - **RTT** samples, e.g. `quinn::Connection::rtt()` after a transfer or periodically;
//! - **goodput** samples, `(bytes, seconds)` of a completed transfer, chunk or active probe;
//! - **prediction errors**, `(predicted_s, measured_s)` of a transfer whose duration was
//!   predicted from an earlier estimate.
//!
//! RTT and goodput are exponentially weighted moving averages with a *time-based* decay: a
//! sample's weight halves every half-life of clock time, however many samples arrive in
//! between, so a busy link and an idle one age their knowledge alike. Goodput is the ratio of
//! decayed bytes to decayed seconds, so a 1 GiB transfer outweighs a 64 KiB chunk in proportion
//! to its bytes and a constant rate is reproduced exactly. Prediction error is a per-sample
//! EWMA of `|predicted − measured| / measured`.
//!
//! [`LinkEstimator::estimate`] reports the averages with an `age` (time since the newest
//! goodput sample) and a `confidence` in `[0, 1]` that rises with the number of samples and
//! bytes seen, halves every `confidence_half_life` of age, and shrinks when predictions have
//! been wrong. [`LinkEstimator::needs_probe`] says when the estimate is too old or too weak to
//! plan with, i.e. when the driver should run a bounded active probe.
//!
//! Every input is validated: zero, negative, non-finite or absurdly large durations and empty
//! byte counts are refused with a typed [`EstimatorError`] and leave the state untouched, so no
//! input sequence can make an estimate `NaN`.

use thiserror::Error;

/// Shortest duration accepted (1 ns); anything shorter is a clock artefact.
pub const MIN_DURATION_S: f64 = 1e-9;
/// Longest duration accepted (about 11.6 days); anything longer is a unit error.
pub const MAX_DURATION_S: f64 = 1e6;
/// Relative prediction errors are capped here, so one wild miss cannot dominate forever.
pub const MAX_RELATIVE_ERROR: f64 = 100.0;

/// A sample the estimator refuses.
#[derive(Debug, Clone, Copy, PartialEq, Error)]
pub enum EstimatorError {
    /// A duration that is NaN or infinite.
    #[error("{what} is not a finite number: {value}")]
    NotFinite { what: &'static str, value: f64 },
    /// A duration that is zero, negative or shorter than [`MIN_DURATION_S`].
    #[error("{what} must be at least {MIN_DURATION_S} s, got {value}")]
    NonPositive { what: &'static str, value: f64 },
    /// A duration longer than [`MAX_DURATION_S`].
    #[error("{what} of {value} s exceeds {MAX_DURATION_S} s")]
    TooLong { what: &'static str, value: f64 },
    /// A goodput sample with no bytes.
    #[error("a goodput sample needs at least one byte")]
    NoBytes,
}

fn check_duration(what: &'static str, value: f64) -> Result<f64, EstimatorError> {
    if !value.is_finite() {
        return Err(EstimatorError::NotFinite { what, value });
    }
    if value < MIN_DURATION_S {
        return Err(EstimatorError::NonPositive { what, value });
    }
    if value > MAX_DURATION_S {
        return Err(EstimatorError::TooLong { what, value });
    }
    Ok(value)
}

/// Tuning of the estimator. All durations in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EstimatorConfig {
    /// Half-life of an RTT sample's weight.
    pub rtt_half_life_s: f64,
    /// Half-life of a goodput sample's weight.
    pub goodput_half_life_s: f64,
    /// Half-life of confidence as the newest goodput sample ages.
    pub confidence_half_life_s: f64,
    /// Goodput samples at which the count half of the support reaches one half.
    pub half_support_samples: f64,
    /// Bytes at which the byte half of the support reaches one half.
    pub half_support_bytes: f64,
    /// Weight of each new prediction error in its EWMA (0 < alpha ≤ 1).
    pub prediction_alpha: f64,
    /// Probe when the newest goodput sample is older than this.
    pub stale_after_s: f64,
    /// Probe when confidence falls below this.
    pub min_confidence: f64,
}

impl Default for EstimatorConfig {
    fn default() -> Self {
        Self {
            rtt_half_life_s: 10.0,
            goodput_half_life_s: 60.0,
            confidence_half_life_s: 300.0,
            half_support_samples: 2.0,
            half_support_bytes: 64.0 * 1024.0 * 1024.0,
            prediction_alpha: 0.2,
            stale_after_s: 600.0,
            min_confidence: 0.3,
        }
    }
}

/// What the estimator believes about a link at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkEstimate {
    /// Smoothed round-trip time, seconds; `None` before the first RTT sample.
    pub rtt_s: Option<f64>,
    /// Smoothed goodput, bits per second; `None` before the first goodput sample.
    pub goodput_bps: Option<f64>,
    /// Seconds since the newest goodput sample (`f64::INFINITY` when there is none).
    pub age_s: f64,
    /// How far to trust `goodput_bps` for planning, in `[0, 1]`.
    pub confidence: f64,
    /// Goodput samples accepted so far.
    pub samples: u64,
    /// RTT samples accepted so far.
    pub rtt_samples: u64,
    /// Payload bytes covered by the goodput samples.
    pub bytes: u64,
    /// EWMA of the relative prediction error `|predicted − measured| / measured`; `None` before
    /// the first recorded prediction.
    pub prediction_error: Option<f64>,
}

impl LinkEstimate {
    /// Predicted seconds to move `bytes`: one RTT plus the bytes at the estimated goodput.
    /// `None` without a goodput estimate.
    pub fn predict_transfer_s(&self, bytes: u64) -> Option<f64> {
        let rate = self.goodput_bps?;
        Some(self.rtt_s.unwrap_or(0.0) + bytes as f64 * 8.0 / rate)
    }
}

/// `2^(-dt / half_life)`; no decay for a non-positive or non-finite half-life.
fn halving(dt_s: f64, half_life_s: f64) -> f64 {
    if half_life_s > 0.0 && half_life_s.is_finite() { (-dt_s / half_life_s).exp2() } else { 1.0 }
}

/// A weighted sum that decays with clock time: the weight of everything in it halves every
/// half-life.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Decayed {
    /// Σ wᵢ·xᵢ (or Σ wᵢ·bytesᵢ).
    num: f64,
    /// Σ wᵢ (or Σ wᵢ·secondsᵢ).
    den: f64,
    /// Clock of the last update, ns.
    at_ns: u64,
}

impl Decayed {
    const EMPTY: Self = Self { num: 0.0, den: 0.0, at_ns: 0 };

    fn factor(dt_ns: u64, half_life_s: f64) -> f64 {
        halving(dt_ns as f64 / 1e9, half_life_s)
    }

    /// Adds `(num, den)` observed at `now_ns`. A sample stamped before the last update is
    /// added with the weight it would have had by then (the clock never runs backwards here).
    fn add(&mut self, now_ns: u64, num: f64, den: f64, half_life_s: f64) {
        if now_ns >= self.at_ns {
            let f = Self::factor(now_ns - self.at_ns, half_life_s);
            self.num = self.num * f + num;
            self.den = self.den * f + den;
            self.at_ns = now_ns;
        } else {
            let f = Self::factor(self.at_ns - now_ns, half_life_s);
            self.num += num * f;
            self.den += den * f;
        }
    }

    fn ratio(&self) -> Option<f64> {
        (self.den > 0.0 && self.num.is_finite() && self.den.is_finite()).then(|| self.num / self.den)
    }
}

/// Link estimator for one peer. Feed it samples; ask it for an estimate.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkEstimator {
    cfg: EstimatorConfig,
    rtt: Decayed,
    goodput: Decayed,
    last_goodput_ns: Option<u64>,
    samples: u64,
    rtt_samples: u64,
    bytes: u64,
    prediction_error: Option<f64>,
}

impl Default for LinkEstimator {
    fn default() -> Self {
        Self::new(EstimatorConfig::default())
    }
}

impl LinkEstimator {
    /// An estimator that knows nothing yet.
    pub fn new(cfg: EstimatorConfig) -> Self {
        Self {
            cfg,
            rtt: Decayed::EMPTY,
            goodput: Decayed::EMPTY,
            last_goodput_ns: None,
            samples: 0,
            rtt_samples: 0,
            bytes: 0,
            prediction_error: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EstimatorConfig {
        &self.cfg
    }

    /// An RTT sample, seconds, observed at `now_ns`.
    pub fn record_rtt(&mut self, now_ns: u64, rtt_s: f64) -> Result<(), EstimatorError> {
        let rtt_s = check_duration("rtt", rtt_s)?;
        self.rtt.add(now_ns, rtt_s, 1.0, self.cfg.rtt_half_life_s);
        self.rtt_samples += 1;
        Ok(())
    }

    /// A goodput sample: `bytes` of payload moved in `seconds`, finished at `now_ns`.
    pub fn record_goodput(&mut self, now_ns: u64, bytes: u64, seconds: f64) -> Result<(), EstimatorError> {
        let seconds = check_duration("transfer time", seconds)?;
        if bytes == 0 {
            return Err(EstimatorError::NoBytes);
        }
        self.goodput.add(now_ns, bytes as f64, seconds, self.cfg.goodput_half_life_s);
        self.last_goodput_ns = Some(self.last_goodput_ns.map_or(now_ns, |t| t.max(now_ns)));
        self.samples += 1;
        self.bytes = self.bytes.saturating_add(bytes);
        Ok(())
    }

    /// How long a transfer took against how long it was predicted to take (e.g. from
    /// [`LinkEstimate::predict_transfer_s`]).
    pub fn record_prediction(&mut self, predicted_s: f64, measured_s: f64) -> Result<(), EstimatorError> {
        let measured_s = check_duration("measured time", measured_s)?;
        if !predicted_s.is_finite() {
            return Err(EstimatorError::NotFinite { what: "predicted time", value: predicted_s });
        }
        if predicted_s < 0.0 {
            return Err(EstimatorError::NonPositive { what: "predicted time", value: predicted_s });
        }
        let rel = ((predicted_s - measured_s).abs() / measured_s).min(MAX_RELATIVE_ERROR);
        let alpha = if self.cfg.prediction_alpha > 0.0 && self.cfg.prediction_alpha <= 1.0 {
            self.cfg.prediction_alpha
        } else {
            EstimatorConfig::default().prediction_alpha
        };
        self.prediction_error = Some(match self.prediction_error {
            None => rel,
            Some(e) => e + alpha * (rel - e),
        });
        Ok(())
    }

    /// The estimate at `now_ns`.
    pub fn estimate(&self, now_ns: u64) -> LinkEstimate {
        let age_s = self.last_goodput_ns.map_or(f64::INFINITY, |t| now_ns.saturating_sub(t) as f64 / 1e9);
        LinkEstimate {
            rtt_s: self.rtt.ratio(),
            goodput_bps: self.goodput.ratio().map(|bytes_per_s| bytes_per_s * 8.0),
            age_s,
            confidence: self.confidence(age_s),
            samples: self.samples,
            rtt_samples: self.rtt_samples,
            bytes: self.bytes,
            prediction_error: self.prediction_error,
        }
    }

    /// Support (samples and bytes) × freshness (halving with age) × prediction accuracy.
    fn confidence(&self, age_s: f64) -> f64 {
        if self.samples == 0 || !age_s.is_finite() {
            return 0.0;
        }
        let n = self.samples as f64;
        let b = self.bytes as f64;
        let half = |x: f64, h: f64| if h > 0.0 { x / (x + h) } else { 1.0 };
        let support =
            0.5 * half(n, self.cfg.half_support_samples) + 0.5 * half(b, self.cfg.half_support_bytes);
        let freshness = halving(age_s, self.cfg.confidence_half_life_s);
        let accuracy = 1.0 / (1.0 + self.prediction_error.unwrap_or(0.0));
        let c = support * freshness * accuracy;
        if c.is_finite() { c.clamp(0.0, 1.0) } else { 0.0 }
    }

    /// Whether the estimate is too old or too weak to plan with: no goodput sample yet, the
    /// newest one older than `stale_after_s`, or confidence below `min_confidence`.
    pub fn needs_probe(&self, now_ns: u64) -> bool {
        let e = self.estimate(now_ns);
        e.goodput_bps.is_none() || e.age_s > self.cfg.stale_after_s || e.confidence < self.cfg.min_confidence
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;
    const MIB: u64 = 1 << 20;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn empty_estimator_knows_nothing_and_wants_a_probe() {
        let e = LinkEstimator::default();
        let est = e.estimate(5 * S);
        assert_eq!(est.rtt_s, None);
        assert_eq!(est.goodput_bps, None);
        assert_eq!(est.age_s, f64::INFINITY);
        assert_eq!(est.confidence, 0.0);
        assert_eq!(est.samples, 0);
        assert_eq!(est.prediction_error, None);
        assert_eq!(est.predict_transfer_s(1), None);
        assert!(e.needs_probe(0));
    }

    #[test]
    fn rejects_bad_samples_with_typed_errors_and_keeps_state() {
        let mut e = LinkEstimator::default();
        e.record_goodput(S, 100 * MIB, 1.0).unwrap();
        let before = e.clone();
        assert!(matches!(e.record_rtt(S, 0.0), Err(EstimatorError::NonPositive { what: "rtt", .. })));
        assert!(matches!(e.record_rtt(S, -1.0), Err(EstimatorError::NonPositive { .. })));
        assert!(matches!(e.record_rtt(S, f64::NAN), Err(EstimatorError::NotFinite { .. })));
        assert!(matches!(e.record_rtt(S, f64::INFINITY), Err(EstimatorError::NotFinite { .. })));
        assert!(matches!(e.record_rtt(S, 1e7), Err(EstimatorError::TooLong { .. })));
        assert!(matches!(e.record_goodput(S, 1, 0.0), Err(EstimatorError::NonPositive { .. })));
        assert!(matches!(e.record_goodput(S, 1, -0.5), Err(EstimatorError::NonPositive { .. })));
        assert!(matches!(e.record_goodput(S, 1, f64::NEG_INFINITY), Err(EstimatorError::NotFinite { .. })));
        assert_eq!(e.record_goodput(S, 0, 1.0), Err(EstimatorError::NoBytes));
        assert!(matches!(e.record_prediction(1.0, 0.0), Err(EstimatorError::NonPositive { .. })));
        assert!(matches!(e.record_prediction(-1.0, 1.0), Err(EstimatorError::NonPositive { .. })));
        assert!(matches!(e.record_prediction(f64::NAN, 1.0), Err(EstimatorError::NotFinite { .. })));
        assert_eq!(e, before, "a refused sample must not change the estimator");
        // The errors say what was wrong.
        let msg = e.record_rtt(S, -1.0).unwrap_err().to_string();
        assert!(msg.contains("rtt") && msg.contains("-1"), "{msg}");
    }

    #[test]
    fn goodput_is_bytes_weighted() {
        let mut e = LinkEstimator::default();
        // 1 GiB at 8 Gbit/s and a 64 KiB chunk at 80 Mbit/s at the same instant.
        e.record_goodput(S, 1 << 30, (1u64 << 30) as f64 * 8.0 / 8e9).unwrap();
        e.record_goodput(S, 64 << 10, (64u64 << 10) as f64 * 8.0 / 80e6).unwrap();
        let g = e.estimate(S).goodput_bps.unwrap();
        assert!(g > 7.5e9 && g < 8e9, "{g}");
    }

    #[test]
    fn old_samples_fade_with_clock_time_not_sample_count() {
        let cfg = EstimatorConfig { goodput_half_life_s: 10.0, ..EstimatorConfig::default() };
        let mut e = LinkEstimator::new(cfg);
        e.record_goodput(0, 100 * MIB, 1.0).unwrap(); // 100 MiB/s
        e.record_goodput(10 * S, 100 * MIB, 2.0).unwrap(); // 50 MiB/s, one half-life later
        // Weights 0.5 and 1: (50 + 100) MiB / (0.5 + 2) s = 60 MiB/s.
        let g = e.estimate(10 * S).goodput_bps.unwrap() / 8.0;
        assert!(close(g, 60.0 * MIB as f64), "{g}");
        // A late-arriving sample stamped in the past counts as old.
        let mut e2 = LinkEstimator::new(cfg);
        e2.record_goodput(10 * S, 100 * MIB, 2.0).unwrap();
        e2.record_goodput(0, 100 * MIB, 1.0).unwrap();
        assert!(close(e2.estimate(10 * S).goodput_bps.unwrap(), e.estimate(10 * S).goodput_bps.unwrap()));
        assert_eq!(e2.estimate(10 * S).age_s, 0.0);
    }

    #[test]
    fn rtt_ewma_moves_towards_new_samples() {
        let cfg = EstimatorConfig { rtt_half_life_s: 1.0, ..EstimatorConfig::default() };
        let mut e = LinkEstimator::new(cfg);
        e.record_rtt(0, 0.100).unwrap();
        assert!(close(e.estimate(0).rtt_s.unwrap(), 0.100));
        e.record_rtt(S, 0.050).unwrap();
        // Weights 0.5 and 1: (0.05 + 0.05) / 1.5.
        assert!(close(e.estimate(S).rtt_s.unwrap(), 0.1 / 1.5));
        assert_eq!(e.estimate(S).rtt_samples, 2);
    }

    #[test]
    fn confidence_rises_with_samples_and_decays_with_age() {
        let mut e = LinkEstimator::default();
        e.record_goodput(0, MIB, 0.01).unwrap();
        let c1 = e.estimate(0).confidence;
        e.record_goodput(0, 100 * MIB, 1.0).unwrap();
        let c2 = e.estimate(0).confidence;
        for _ in 0..20 {
            e.record_goodput(0, 100 * MIB, 1.0).unwrap();
        }
        let c3 = e.estimate(0).confidence;
        assert!(0.0 < c1 && c1 < c2 && c2 < c3 && c3 <= 1.0, "{c1} {c2} {c3}");
        assert!(!e.needs_probe(0));
        let half = e.config().confidence_half_life_s;
        let aged = e.estimate((half * 1e9) as u64).confidence;
        assert!(close(aged, c3 / 2.0), "{aged} vs {c3}");
        // Stale after `stale_after_s` whatever the confidence.
        assert!(e.needs_probe((e.config().stale_after_s * 1e9) as u64 + S));
    }

    #[test]
    fn prediction_error_is_an_ewma_of_relative_error_and_lowers_confidence() {
        let mut e = LinkEstimator::default();
        for _ in 0..10 {
            e.record_goodput(0, 100 * MIB, 1.0).unwrap();
        }
        let c0 = e.estimate(0).confidence;
        e.record_prediction(2.0, 1.0).unwrap(); // 100 % off
        assert!(close(e.estimate(0).prediction_error.unwrap(), 1.0));
        e.record_prediction(1.0, 1.0).unwrap(); // exact: 1 + 0.2 × (0 − 1)
        assert!(close(e.estimate(0).prediction_error.unwrap(), 0.8));
        assert!(e.estimate(0).confidence < c0);
        // A wild miss is capped.
        e.record_prediction(1e9, 1e-9).unwrap();
        assert!(e.estimate(0).prediction_error.unwrap() <= MAX_RELATIVE_ERROR);
    }

    #[test]
    fn predicts_rtt_plus_serialisation() {
        let mut e = LinkEstimator::default();
        e.record_rtt(0, 0.1).unwrap();
        e.record_goodput(0, 125_000_000, 1.0).unwrap(); // 1 Gbit/s
        let t = e.estimate(0).predict_transfer_s(250_000_000).unwrap();
        assert!(close(t, 2.1), "{t}");
    }

    #[test]
    fn extreme_gaps_and_values_stay_finite() {
        let mut e = LinkEstimator::default();
        e.record_goodput(0, u64::MAX, MIN_DURATION_S).unwrap();
        e.record_goodput(u64::MAX, 1, MAX_DURATION_S).unwrap();
        e.record_rtt(0, MAX_DURATION_S).unwrap();
        e.record_rtt(u64::MAX, MIN_DURATION_S).unwrap();
        for now in [0, 1, u64::MAX / 2, u64::MAX] {
            let est = e.estimate(now);
            assert!(est.goodput_bps.unwrap().is_finite() && est.goodput_bps.unwrap() > 0.0);
            assert!(est.rtt_s.unwrap().is_finite());
            assert!((0.0..=1.0).contains(&est.confidence));
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Rtt(u64, f64),
        Goodput(u64, u64, f64),
        Prediction(f64, f64),
    }

    fn any_f64() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>(),
            -10.0f64..10.0,
            1e-12f64..1e3,
            Just(0.0),
            Just(-0.0),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::MIN_POSITIVE),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<u64>(), any_f64()).prop_map(|(t, r)| Op::Rtt(t, r)),
            (any::<u64>(), prop_oneof![any::<u64>(), 0u64..(1 << 32)], any_f64())
                .prop_map(|(t, b, s)| Op::Goodput(t, b, s)),
            (any_f64(), any_f64()).prop_map(|(p, m)| Op::Prediction(p, m)),
        ]
    }

    proptest! {
        /// No input sequence yields NaN, a negative rate, or confidence outside [0, 1]; every
        /// refused input is refused with a typed error and changes nothing.
        #[test]
        fn never_nan_whatever_the_input(ops in proptest::collection::vec(op(), 0..40), now in any::<u64>()) {
            let mut e = LinkEstimator::default();
            for op in ops {
                let before = e.clone();
                let r = match op {
                    Op::Rtt(t, r) => e.record_rtt(t, r),
                    Op::Goodput(t, b, s) => e.record_goodput(t, b, s),
                    Op::Prediction(p, m) => e.record_prediction(p, m),
                };
                if r.is_err() {
                    prop_assert_eq!(&e, &before);
                }
                let est = e.estimate(now);
                prop_assert!((0.0..=1.0).contains(&est.confidence), "{:?}", est);
                prop_assert!(!est.age_s.is_nan() && est.age_s >= 0.0);
                if let Some(g) = est.goodput_bps { prop_assert!(g.is_finite() && g > 0.0, "{:?}", est); }
                if let Some(r) = est.rtt_s { prop_assert!(r.is_finite() && r > 0.0, "{:?}", est); }
                if let Some(p) = est.prediction_error { prop_assert!(p.is_finite() && p >= 0.0); }
                let _ = e.needs_probe(now);
            }
        }

        /// A constant rate and RTT are reproduced exactly, whatever the sample sizes and times.
        #[test]
        fn converges_to_a_constant_input(
            rate in 1e6f64..1e11,
            rtt in 1e-6f64..1.0,
            samples in proptest::collection::vec(((1u64 << 10)..(1 << 34), 0u64..(1000 * S)), 1..30),
        ) {
            let mut e = LinkEstimator::default();
            let mut t = 0;
            for (bytes, dt) in samples {
                t += dt;
                let secs = bytes as f64 * 8.0 / rate;
                e.record_goodput(t, bytes, secs).unwrap();
                e.record_rtt(t, rtt).unwrap();
            }
            let est = e.estimate(t);
            prop_assert!((est.goodput_bps.unwrap() / rate - 1.0).abs() < 1e-6, "{:?} vs {}", est, rate);
            prop_assert!((est.rtt_s.unwrap() / rtt - 1.0).abs() < 1e-9);
        }

        /// Of two equal-sized samples, the newer one pulls the estimate closer to itself.
        #[test]
        fn older_samples_weigh_less(
            a in 1e6f64..1e10, b in 1e6f64..1e10, gap in 1u64..(3600 * S), bytes in (1u64 << 10)..(1 << 30)
        ) {
            prop_assume!((a - b).abs() > 1e3);
            let mut e = LinkEstimator::default();
            e.record_rtt(0, a / 1e10).unwrap();
            e.record_rtt(gap, b / 1e10).unwrap();
            let r = e.estimate(gap).rtt_s.unwrap() * 1e10;
            prop_assert!((r - b).abs() < (r - a).abs(), "rtt {} between old {} and new {}", r, a, b);
            // Goodput with equal byte counts: the newer sample's rate dominates.
            let mut e = LinkEstimator::default();
            e.record_goodput(0, bytes, bytes as f64 / a).unwrap();
            e.record_goodput(gap, bytes, bytes as f64 / b).unwrap();
            let g = e.estimate(gap).goodput_bps.unwrap() / 8.0;
            // Harmonic weighting: compare in time-per-byte space, where it is a weighted mean.
            prop_assert!((1.0 / g - 1.0 / b).abs() < (1.0 / g - 1.0 / a).abs());
        }
    }
}
