//! Fetch calibration for one peer: a fixed cost (seconds, and in RTTs) and a per-byte cost,
//! fitted online from completed fetches.
//!
//! `seconds ≈ fixed_s + rtt_factor · rtt + per_byte · wire_bytes`. The prior is the link
//! model's: no RTT-independent cost, one RTT (request → first byte), and `8 / goodput` seconds
//! per wire byte from the configured or estimated goodput. The two fixed terms separate when
//! the RTT varies across samples; on a link whose RTT is steady only their sum at that RTT is
//! learnt (the prior splits it), which is what predictions need.
//!
//! On a lossy path the time is two-valued ([`super::tail`]): the line above is the **on-time**
//! fit, and a [`TailCalibration`] learns how likely a fetch is to come in a round trip late.
//! Each short fetch is classified against the on-time line before it is learnt: a late one is
//! fitted less its delay (so a run of lucky or unlucky coin flips does not drag the line by an
//! RTT), and a long one, whose lateness the noise hides, less the tail's expectation.
//! Predictions add the tail back as a two-point mixture ([`Prediction::tail_probability`]).
//!
//! Owns: the per-peer fit and its conversion to a [`LinkModel`] for [`decide`](crate::decide).
//! Must not: read clocks or sockets (samples are passed in), or keep anything per migration.

use serde::{Deserialize, Serialize};

use super::fit::{FitConfig, RobustFit};
use super::tail::{self, OnTime, TailCalibration, TailEstimate};
use super::{CalibrationError, Prediction, sample_non_negative, sample_seconds};
use crate::error::{ModelError, non_negative, positive};
use crate::link::{FetchTail, LinkModel};

/// Largest RTT a sample may carry, seconds.
const MAX_RTT_S: f64 = 60.0;
/// Smallest per-byte cost used when converting to a goodput (keeps it finite).
const MIN_PER_BYTE_S: f64 = 1e-18;
/// Largest window a tail is capped at, bytes (keeps it finite when the per-byte cost fits 0).
const MAX_WINDOW_BYTES: f64 = 1e15;

/// One completed fetch, as the daemon measured it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FetchObservation {
    /// Bytes that crossed the WAN (the fetch receipt's `bytes`); 0 measures the fixed cost.
    pub wire_bytes: u64,
    /// Wall seconds from the request to the last verified byte.
    pub seconds: f64,
    /// The connection's RTT estimate during the fetch, seconds.
    pub rtt_s: f64,
}

/// How far the prior may be off: one sd for each coefficient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FetchSpread {
    /// Sd of the RTT-independent fixed cost, seconds (prior mean 0).
    pub fixed_s: f64,
    /// Sd of the fixed cost in RTTs (prior mean 1).
    pub rtt_factor: f64,
    /// Sd of the per-byte cost relative to the prior's (1.0: ±100 %).
    pub per_byte_relative: f64,
}

impl Default for FetchSpread {
    fn default() -> Self {
        Self { fixed_s: 0.01, rtt_factor: 1.5, per_byte_relative: 1.0 }
    }
}

/// The calibrated figures at one RTT: what `GetLinks` can export to routers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FetchEstimate {
    /// The RTT-independent part of the fixed cost, seconds.
    pub base_s: f64,
    /// The RTT-proportional part of the fixed cost, in RTTs.
    pub rtt_factor: f64,
    /// Fixed cost at this RTT, `base_s + rtt_factor · rtt`, seconds.
    pub fixed_s: f64,
    /// Standard error of `fixed_s`.
    pub fixed_sd_s: f64,
    /// Fixed cost in RTTs (`None` at RTT 0).
    pub fixed_rtts: Option<f64>,
    /// Seconds per wire byte.
    pub per_byte_s: f64,
    /// Standard error of `per_byte_s`.
    pub per_byte_sd_s: f64,
    /// The per-byte cost as a goodput, Gbit/s (`None` when it fitted to 0).
    pub goodput_gbps: Option<f64>,
    /// Fitted relative noise of one fetch (sd of `measured / predicted − 1`).
    pub noise: f64,
    /// Samples accepted so far.
    pub samples: u64,
    /// The loss tail: how likely a short fetch is to come in late, and by how much.
    #[serde(default)]
    pub tail: Option<TailEstimate>,
}

/// Online fetch calibration for one peer.
#[derive(Debug, Clone, PartialEq)]
pub struct FetchCalibration {
    fit: RobustFit<3>,
    spread: FetchSpread,
    tail: TailCalibration,
}

impl FetchCalibration {
    /// A calibration at the link model's prior: fixed cost one RTT, per-byte `8 / goodput`.
    pub fn new(prior: &LinkModel, spread: FetchSpread, cfg: FitConfig) -> Result<Self, CalibrationError> {
        cfg.validate()?;
        let (mean, sd) = prior_of(prior, &spread)?;
        Ok(Self { fit: RobustFit::new(cfg, mean, sd), spread, tail: TailCalibration::new() })
    }

    /// Replaces the prior (e.g. the peer's configured goodput changed) and refits the window.
    /// Not for every live goodput update: those come from the same fetches the fit learns
    /// from, so feeding them back as a prior would count each fetch twice.
    pub fn rebase(&mut self, prior: &LinkModel) -> Result<(), CalibrationError> {
        let (mean, sd) = prior_of(prior, &self.spread)?;
        self.fit.rebase(mean, sd);
        Ok(())
    }

    /// Learns from one completed fetch. Refused samples leave the state unchanged.
    ///
    /// A short fetch (on-time prediction within [`tail::SHORT_RTTS`] RTTs) is first an event
    /// of the tail ([`TailCalibration::observe`]); a late one is then fitted less the tail's
    /// delay, a long one less the tail's expected delay; the tail then re-measures its events
    /// against the moved line. On a path below [`tail::MIN_RTT_S`] nothing is classified.
    pub fn observe(&mut self, obs: FetchObservation) -> Result<(), CalibrationError> {
        let y = sample_seconds("fetch.seconds", obs.seconds)?;
        let rtt = sample_non_negative("fetch.rtt_s", obs.rtt_s, MAX_RTT_S)?;
        let bytes = obs.wire_bytes as f64;
        let x = [1.0, rtt, bytes];
        let on_time_fit = if rtt < tail::MIN_RTT_S {
            y
        } else if self.fit.mean_at(&x) <= tail::SHORT_RTTS * rtt {
            match self.tail.observe(bytes, rtt, y, &Line(&self.fit)) {
                Some(late_rtts) => (y - late_rtts * rtt).max(0.5 * y),
                None => y,
            }
        } else {
            (y - self.tail_at(rtt)?.expected_delay_s(bytes)).max(0.5 * y)
        };
        self.fit.push(x, on_time_fit);
        self.tail.refit(&Line(&self.fit));
        Ok(())
    }

    /// Learns from a fetch that ran beside other work (a split's fetch leg): only whether it
    /// came in late, as one more event of the tail; its time, slowed by what ran beside it,
    /// stays out of the on-time fit. Refused samples leave the state unchanged.
    pub fn observe_tail_only(&mut self, obs: FetchObservation) -> Result<(), CalibrationError> {
        let y = sample_seconds("fetch.seconds", obs.seconds)?;
        let rtt = sample_non_negative("fetch.rtt_s", obs.rtt_s, MAX_RTT_S)?;
        let bytes = obs.wire_bytes as f64;
        if rtt >= tail::MIN_RTT_S && self.fit.mean_at(&[1.0, rtt, bytes]) <= tail::SHORT_RTTS * rtt {
            self.tail.observe(bytes, rtt, y, &Line(&self.fit));
        }
        Ok(())
    }

    /// Predicted seconds to fetch `wire_bytes` at RTT `rtt_s`: the on-time fit's Gaussian and
    /// the tail's late branch. Fetching nothing costs nothing (no request is sent), as in
    /// [`LinkModel::fetch_seconds`].
    pub fn predict(&self, wire_bytes: u64, rtt_s: f64) -> Result<Prediction, ModelError> {
        non_negative("rtt_s", rtt_s)?;
        let x = (wire_bytes > 0).then_some([1.0, rtt_s, wire_bytes as f64]);
        let p = self.fit.prediction_at(x.as_ref());
        if x.is_none() {
            return Ok(p);
        }
        let tail = self.tail_at(rtt_s)?;
        let q = tail.late_probability(wire_bytes as f64);
        let on_time = (p.seconds + self.on_time_offset_s(rtt_s)).max(0.0);
        Ok(Prediction {
            seconds: on_time + q * tail.delay_s,
            tail_probability: q,
            tail_delay_s: if q > 0.0 { tail.delay_s } else { 0.0 },
            ..p
        })
    }

    /// The loss tail at RTT `rtt_s`, as the cost model takes it: the learnt hazard, the path's
    /// window (the on-time fit's bytes per RTT) and the learnt delay in RTTs.
    /// [`FetchTail::NONE`] below [`tail::MIN_RTT_S`] or before any late fetch.
    pub fn tail_at(&self, rtt_s: f64) -> Result<FetchTail, ModelError> {
        non_negative("rtt_s", rtt_s)?;
        let hazard = self.tail.hazard_per_packet();
        if rtt_s < tail::MIN_RTT_S || hazard <= 0.0 {
            return Ok(FetchTail::NONE);
        }
        Ok(FetchTail {
            hazard_per_packet: hazard,
            window_bytes: self.window_bytes(rtt_s),
            delay_s: self.tail.delay_rtts() * rtt_s,
        })
    }

    /// Where the tail's on-time mode sits above the fitted line at RTT `rtt_s`, seconds (0
    /// without a tail; see [`TailCalibration::on_time_rtts`]).
    fn on_time_offset_s(&self, rtt_s: f64) -> f64 {
        if rtt_s < tail::MIN_RTT_S { 0.0 } else { self.tail.on_time_rtts() * rtt_s }
    }

    /// The path's window: the bytes the on-time fit moves in one RTT.
    fn window_bytes(&self, rtt_s: f64) -> f64 {
        Line(&self.fit).window_bytes(rtt_s)
    }

    /// The calibrated figures at RTT `rtt_s`.
    pub fn estimate(&self, rtt_s: f64) -> Result<FetchEstimate, ModelError> {
        non_negative("rtt_s", rtt_s)?;
        let [c0, k, b] = self.fit.theta();
        // The tail's on-time mode, where it is not yet the line's, moves the RTT term.
        let k = k + if rtt_s > 0.0 { self.on_time_offset_s(rtt_s) / rtt_s } else { 0.0 };
        let fixed_s = (c0 + k * rtt_s).max(0.0);
        Ok(FetchEstimate {
            base_s: c0,
            rtt_factor: k,
            fixed_s,
            fixed_sd_s: self.fit.std_error_at(&[1.0, rtt_s, 0.0]),
            fixed_rtts: (rtt_s > 0.0).then(|| fixed_s / rtt_s),
            per_byte_s: b,
            per_byte_sd_s: self.fit.theta_sd()[2],
            goodput_gbps: (b > 0.0).then(|| 8.0 / b / 1e9),
            noise: self.fit.noise(),
            samples: self.fit.accepted(),
            tail: Some(self.tail.estimate()),
        })
    }

    /// The calibrated link as the cost model takes it, at RTT `rtt_s`: its `rtt_s` is the
    /// fitted fixed cost, its goodput the fitted per-byte cost and its tail the learnt one, so
    /// [`LinkModel::fetch_seconds`] equals [`predict`](Self::predict)'s mean (and the split
    /// search uses the calibrated legs). `wire_ratio` is the codec's, as before: the fit is per
    /// wire byte.
    pub fn link_model(&self, rtt_s: f64, wire_ratio: f64) -> Result<LinkModel, ModelError> {
        let e = self.estimate(rtt_s)?;
        let goodput_gbps = 8.0 / e.per_byte_s.max(MIN_PER_BYTE_S) / 1e9;
        LinkModel::new(goodput_gbps, e.fixed_s, wire_ratio)?.with_tail(self.tail_at(rtt_s)?)
    }

    /// Samples accepted so far.
    pub fn samples(&self) -> u64 {
        self.fit.accepted()
    }
}

/// The on-time fit as the tail measures events against it.
struct Line<'a>(&'a RobustFit<3>);

impl tail::OnTime for Line<'_> {
    fn seconds(&self, bytes: f64, rtt_s: f64) -> f64 {
        self.0.mean_at(&[1.0, rtt_s, bytes])
    }

    fn window_bytes(&self, rtt_s: f64) -> f64 {
        (rtt_s / self.0.theta()[2].max(MIN_PER_BYTE_S)).min(MAX_WINDOW_BYTES)
    }
}

fn prior_of(link: &LinkModel, spread: &FetchSpread) -> Result<([f64; 3], [f64; 3]), ModelError> {
    LinkModel::new(link.goodput_gbps, link.rtt_s, link.wire_ratio)?;
    positive("spread.fixed_s", spread.fixed_s)?;
    positive("spread.rtt_factor", spread.rtt_factor)?;
    positive("spread.per_byte_relative", spread.per_byte_relative)?;
    let per_byte = 8.0 / link.bits_per_second();
    Ok(([0.0, 1.0, per_byte], [spread.fixed_s, spread.rtt_factor, spread.per_byte_relative * per_byte]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> LinkModel {
        LinkModel::new(1.0, 0.05, 1.0).unwrap()
    }

    #[test]
    fn the_prior_is_the_link_model() {
        let c = FetchCalibration::new(&link(), FetchSpread::default(), FitConfig::default()).unwrap();
        let bytes = 64 << 20;
        let p = c.predict(bytes, 0.05).unwrap();
        let want = link().fetch_seconds(bytes, 1.0);
        assert!((p.seconds - want).abs() < 1e-12 * want, "{} vs {want}", p.seconds);
        assert_eq!(p.samples, 0);
        assert!(p.std_error_s > 0.5 * want, "the prior's band is wide: {}", p.std_error_s);
        let lm = c.link_model(0.05, 1.0).unwrap();
        assert!((lm.fetch_seconds(bytes, 1.0) - want).abs() < 1e-12 * want);
        let e = c.estimate(0.05).unwrap();
        assert_eq!(e.fixed_rtts, Some(1.0));
        assert!((e.goodput_gbps.unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(c.predict(0, 0.05).unwrap().seconds, 0.0);
    }

    #[test]
    fn refused_samples_leave_the_state_unchanged() {
        let mut c = FetchCalibration::new(&link(), FetchSpread::default(), FitConfig::default()).unwrap();
        let before = c.clone();
        for (seconds, rtt) in [
            (f64::NAN, 0.05),
            (-1.0, 0.05),
            (0.0, 0.05),
            (1.0, f64::INFINITY),
            (1.0, -0.01),
            (1e7, 0.05),
            (1.0, 100.0),
        ] {
            assert!(c.observe(FetchObservation { wire_bytes: 1 << 20, seconds, rtt_s: rtt }).is_err());
        }
        assert_eq!(c, before);
        assert!(c.predict(1, f64::NAN).is_err());
        assert!(
            FetchCalibration::new(
                &link(),
                FetchSpread { fixed_s: 0.0, ..FetchSpread::default() },
                FitConfig::default()
            )
            .is_err()
        );
        let bad = LinkModel { goodput_gbps: f64::NAN, ..link() };
        assert!(FetchCalibration::new(&bad, FetchSpread::default(), FitConfig::default()).is_err());
    }

    #[test]
    fn zero_byte_and_identical_samples_are_fine() {
        let mut c = FetchCalibration::new(&link(), FetchSpread::default(), FitConfig::default()).unwrap();
        for _ in 0..100 {
            c.observe(FetchObservation { wire_bytes: 0, seconds: 0.1, rtt_s: 0.05 }).unwrap();
            c.observe(FetchObservation { wire_bytes: 64 << 20, seconds: 0.7, rtt_s: 0.05 }).unwrap();
        }
        // Two RTTs where the prior says one, every time: one mode, so no tail, and the fixed
        // cost is learnt.
        let e = c.estimate(0.05).unwrap();
        assert_eq!(c.tail_at(0.05).unwrap(), FetchTail::NONE);
        assert!((e.fixed_s - 0.1).abs() < 0.002, "{e:?}");
        assert!((e.per_byte_s * f64::from(64u32 << 20) - 0.6).abs() < 0.01, "{e:?}");
        let p = c.predict(64 << 20, 0.05).unwrap();
        assert!(p.seconds.is_finite() && p.sd_s().is_finite() && (p.seconds - 0.7).abs() < 0.01);
    }
}
