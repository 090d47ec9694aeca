//! The calibration state this daemon owns: one fetch calibration per peer region and one
//! recompute calibration per engine (keyed by engine id, so it survives the engine's
//! re-registration), fed by every executed fetch and recompute and handed, as plain values, to
//! the pure [`kvferry_model::calibrated`] before each decision. The fitting itself is
//! `kvferry_model::calibration`; this module only keeps the state and its priors current.
//!
//! Priors: a link's calibration starts at the live estimator's figures (one RTT, the measured
//! or configured goodput) and follows them until its first sample; an engine's starts at the
//! profile it reported and is rebased whenever the engine reports a new one. An engine's split
//! interference (how much a split's legs slow each other on this host) starts at
//! `[policy] split_interference` and follows the executed splits; its hedge interference (the
//! same two actions racing) starts at `[policy] hedge_interference`, follows the split's once
//! that is measured, and the executed hedges' own once there are any. An engine's load rate
//! (seconds per byte to copy fetched blocks into its pool, `Engine.Load`) is 0 until it has
//! loaded a block of a fetch, then the median of its recent loads ([`LoadCalibration`]). An
//! engine's split scatter and split overhead start at `[policy] split_noise` and
//! `split_overhead_ms` and follow its executed splits ([`SplitScatter`], [`SplitOverhead`]).

use std::collections::HashMap;
use std::sync::Mutex;

use kvferry_model::calibration::{
    FetchEstimate, FetchSpread, FitConfig, InterferenceCalibration, LoadCalibration, RecomputeEstimate,
    RecomputeSpread, SplitOverhead, SplitScatter,
};
use kvferry_model::{
    CalibrationError, ComputeModel, FetchCalibration, FetchObservation, LinkModel, RecomputeCalibration,
    RecomputeObservation,
};
use kvferry_pool::sync::LockExt;

use crate::links::Figures;
use crate::registry::Profile;

struct EngineCal {
    base: Profile,
    cal: RecomputeCalibration,
}

/// Every peer's and engine's calibration.
#[derive(Default)]
pub struct Calibrations {
    fetch: Mutex<HashMap<String, FetchCalibration>>,
    recompute: Mutex<HashMap<String, EngineCal>>,
    split: Mutex<HashMap<String, InterferenceCalibration>>,
    scatter: Mutex<HashMap<String, SplitScatter>>,
    overhead: Mutex<HashMap<String, SplitOverhead>>,
    hedge: Mutex<HashMap<String, InterferenceCalibration>>,
    load: Mutex<HashMap<String, LoadCalibration>>,
}

impl std::fmt::Debug for Calibrations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calibrations").finish_non_exhaustive()
    }
}

fn prior_link(fig: &Figures) -> Option<LinkModel> {
    LinkModel::new(fig.goodput_bps / 1e9, fig.rtt_s, 1.0).ok()
}

fn prior_profile(p: Profile) -> Option<ComputeModel> {
    ComputeModel::from_measured(p.linear_s_per_token, p.attention_s_per_pair).ok()
}

impl Calibrations {
    /// `region`'s fetch calibration as of now (created at the link's figures; before its
    /// first sample its prior follows the figures). `None` when the figures are no valid link.
    pub fn fetch(&self, region: &str, fig: &Figures) -> Option<FetchCalibration> {
        let prior = prior_link(fig)?;
        let mut all = self.fetch.locked();
        let cal = match all.get_mut(region) {
            Some(c) => {
                if c.samples() == 0 {
                    c.rebase(&prior).ok()?;
                }
                c
            }
            None => {
                let c = FetchCalibration::new(&prior, FetchSpread::default(), FitConfig::default()).ok()?;
                all.entry(region.to_owned()).or_insert(c)
            }
        };
        Some(cal.clone())
    }

    /// Learns from a completed fetch from `region`. A refused sample is logged and dropped.
    pub fn observe_fetch(&self, region: &str, fig: &Figures, obs: FetchObservation) {
        if self.fetch(region, fig).is_none() {
            return;
        }
        if let Some(c) = self.fetch.locked().get_mut(region) {
            log_refused("fetch", region, c.observe(obs));
        }
    }

    /// Learns from a split's fetch leg from `region`: only whether it came in late (its loss
    /// tail); its time ran beside the prefill and stays out of the fetch fit.
    pub fn observe_fetch_leg(&self, region: &str, fig: &Figures, obs: FetchObservation) {
        if self.fetch(region, fig).is_none() {
            return;
        }
        if let Some(c) = self.fetch.locked().get_mut(region) {
            log_refused("fetch leg", region, c.observe_tail_only(obs));
        }
    }

    /// `engine_id`'s recompute calibration against the profile it reports now (rebased when
    /// the profile changed). `None` when the profile is no valid compute model.
    pub fn recompute(&self, engine_id: &str, profile: Profile) -> Option<RecomputeCalibration> {
        let prior = prior_profile(profile)?;
        let mut all = self.recompute.locked();
        let e = match all.get_mut(engine_id) {
            Some(e) => {
                if e.base != profile {
                    e.cal.rebase_with_fixed(&prior, profile.fixed_s).ok()?;
                    e.base = profile;
                }
                e
            }
            None => {
                let mut cal =
                    RecomputeCalibration::new(&prior, RecomputeSpread::default(), FitConfig::default())
                        .ok()?;
                cal.set_fixed_prior(profile.fixed_s).ok()?;
                all.entry(engine_id.to_owned()).or_insert(EngineCal { base: profile, cal })
            }
        };
        Some(e.cal.clone())
    }

    /// Learns from a completed recompute on `engine_id`.
    pub fn observe_recompute(&self, engine_id: &str, profile: Profile, obs: RecomputeObservation) {
        if self.recompute(engine_id, profile).is_none() {
            return;
        }
        if let Some(e) = self.recompute.locked().get_mut(engine_id) {
            log_refused("recompute", engine_id, e.cal.observe(obs));
        }
    }

    /// Learns from an `Engine.Load` of `bytes` on `engine_id` that took `seconds`.
    pub fn observe_load(&self, engine_id: &str, bytes: u64, seconds: f64) {
        let mut all = self.load.locked();
        let c = all.entry(engine_id.to_owned()).or_default();
        log_refused("load", engine_id, c.observe(bytes, seconds).map(|_| ()));
    }

    /// `engine_id`'s seconds per byte to load fetched blocks into its pool (0 before its first
    /// load of at least [`kvferry_model::calibration::load::MIN_LOAD_BYTES`]).
    pub fn load_s_per_byte(&self, engine_id: &str) -> f64 {
        self.load_state(engine_id).0
    }

    /// `engine_id`'s load rate and the loads it was learnt from (`(0, 0)` before the first).
    pub fn load_state(&self, engine_id: &str) -> (f64, u64) {
        self.load.locked().get(engine_id).map_or((0.0, 0), |c| (c.s_per_byte().unwrap_or(0.0), c.samples()))
    }

    /// The interference to plan `engine_id`'s next split with: learnt from its executed
    /// splits, `prior` until the first one.
    pub fn split_interference(&self, engine_id: &str, prior: f64) -> f64 {
        self.split.locked().get(engine_id).map_or(prior, InterferenceCalibration::estimate)
    }

    /// `engine_id`'s split interference and the splits it was measured from.
    pub fn split_state(&self, engine_id: &str, prior: f64) -> (f64, u64) {
        self.split.locked().get(engine_id).map_or((prior, 0), |c| (c.estimate(), c.samples()))
    }

    /// Folds in one executed split of `engine_id`, planned with interference `used`.
    pub fn observe_split(&self, engine_id: &str, prior: f64, used: f64, predicted_s: f64, measured_s: f64) {
        observe_interference(&self.split, "split", engine_id, prior, used, predicted_s, measured_s);
    }

    /// The scatter of `engine_id`'s executed splits around their predicted outcomes (`prior`
    /// until the first), and the splits it was measured from.
    pub fn split_scatter(&self, engine_id: &str, prior: f64) -> (f64, u64) {
        self.scatter.locked().get(engine_id).map_or((prior, 0), |c| (c.estimate(), c.samples()))
    }

    /// Folds in one executed split of `engine_id`: its predicted completion with the fetch leg
    /// on time and late, and its measured seconds. `prior` starts the engine's scatter if this
    /// is its first split.
    pub fn observe_split_outcome(
        &self,
        engine_id: &str,
        prior: f64,
        on_time_s: f64,
        late_s: f64,
        measured_s: f64,
    ) {
        observe_engine(
            &self.scatter,
            "split scatter",
            engine_id,
            || SplitScatter::new(prior),
            |c| c.observe(on_time_s, late_s, measured_s),
        );
    }

    /// The overhead to plan `engine_id`'s next split with, in seconds (`prior` until its first
    /// split), and the splits it was measured from.
    pub fn split_overhead(&self, engine_id: &str, prior: f64) -> (f64, u64) {
        self.overhead.locked().get(engine_id).map_or((prior, 0), |c| (c.estimate(), c.samples()))
    }

    /// Folds in one executed split of `engine_id`: its wall and its two legs, each timed by
    /// this daemon from the legs' common start. `prior` starts the engine's overhead if this is
    /// its first split.
    pub fn observe_split_overhead(
        &self,
        engine_id: &str,
        prior: f64,
        wall_s: f64,
        compute_leg_s: f64,
        fetch_leg_s: f64,
    ) {
        observe_engine(
            &self.overhead,
            "split overhead",
            engine_id,
            || SplitOverhead::new(prior),
            |c| c.observe(wall_s, compute_leg_s, fetch_leg_s),
        );
    }

    /// The interference to price `engine_id`'s next hedge with: learnt from its executed hedges;
    /// before the first, from its executed splits (the same two actions running at once on the
    /// same host); `prior` until either.
    pub fn hedge_interference(&self, engine_id: &str, prior: f64) -> f64 {
        self.hedge_state(engine_id, prior).0
    }

    /// `engine_id`'s hedge interference and the hedges it was measured from (0 while it is the
    /// prior or borrowed from the splits).
    pub fn hedge_state(&self, engine_id: &str, prior: f64) -> (f64, u64) {
        if let Some(c) = self.hedge.locked().get(engine_id) {
            return (c.estimate(), c.samples());
        }
        match self.split.locked().get(engine_id) {
            Some(c) if c.samples() > 0 => (c.estimate(), 0),
            _ => (prior, 0),
        }
    }

    /// Folds in one executed hedge of `engine_id` whose winner made the prefix usable
    /// `measured_s` after both legs started (a winning fetch's landing plus the engine's load
    /// its prediction included), against the race's expected `predicted_s` priced with interference
    /// `used` on both legs. Scaling both legs by `1 + i` scales the expected minimum by exactly
    /// `1 + i`, so the split's estimator ([`InterferenceCalibration`]) applies unchanged.
    /// `prior` anchors the engine's hedge calibration when this is its first race: the daemon
    /// passes what the race was priced with (the split's estimate, borrowed until then), so
    /// the first race does not drop the hedges back to the configured prior.
    pub fn observe_hedge(&self, engine_id: &str, prior: f64, used: f64, predicted_s: f64, measured_s: f64) {
        observe_interference(&self.hedge, "hedge", engine_id, prior, used, predicted_s, measured_s);
    }

    /// `region`'s calibrated fetch figures at RTT `rtt_s`, once it has any state.
    pub fn fetch_estimate(&self, region: &str, rtt_s: f64) -> Option<FetchEstimate> {
        self.fetch.locked().get(region).and_then(|c| c.estimate(rtt_s).ok())
    }

    /// Every engine's calibrated recompute figures and the profile they are relative to,
    /// sorted by engine id.
    pub fn engines(&self) -> Vec<(String, Profile, RecomputeEstimate)> {
        let mut v: Vec<_> =
            self.recompute.locked().iter().map(|(id, e)| (id.clone(), e.base, e.cal.estimate())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

fn observe_interference(
    map: &Mutex<HashMap<String, InterferenceCalibration>>,
    what: &str,
    engine_id: &str,
    prior: f64,
    used: f64,
    predicted_s: f64,
    measured_s: f64,
) {
    observe_engine(
        map,
        what,
        engine_id,
        || InterferenceCalibration::new(prior),
        |c| c.observe(used, predicted_s, measured_s),
    );
}

/// Folds one sample into `engine_id`'s calibration in `all`, started by `new` if this is its
/// first; a refused prior or sample is logged and changes nothing.
fn observe_engine<T>(
    all: &Mutex<HashMap<String, T>>,
    what: &str,
    engine_id: &str,
    new: impl FnOnce() -> Result<T, CalibrationError>,
    observe: impl FnOnce(&mut T) -> Result<(), CalibrationError>,
) {
    let mut all = all.locked();
    let cal = match all.get_mut(engine_id) {
        Some(c) => c,
        None => match new() {
            Ok(c) => all.entry(engine_id.to_owned()).or_insert(c),
            Err(e) => return log_refused(what, engine_id, Err(e)),
        },
    };
    log_refused(what, engine_id, observe(cal));
}

fn log_refused(what: &str, key: &str, r: Result<(), CalibrationError>) {
    if let Err(e) = r {
        tracing::warn!(calibration = what, key = %key.escape_debug(), error = %e, "sample dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(gbps: f64, rtt_s: f64) -> Figures {
        Figures {
            rtt_s,
            goodput_bps: gbps * 1e9,
            age_s: 0.0,
            confidence: 1.0,
            samples: 1,
            prediction_error: 0.0,
            measured: true,
            active: 0,
        }
    }

    const PROFILE: Profile = Profile { linear_s_per_token: 1e-3, attention_s_per_pair: 1e-7, fixed_s: 0.0 };

    #[test]
    fn the_fetch_prior_follows_the_figures_until_the_first_sample() {
        let c = Calibrations::default();
        let mib = 1u64 << 20;
        let at_1g = c.fetch("b", &figures(1.0, 0.05)).unwrap().predict(64 * mib, 0.05).unwrap().seconds;
        let at_2g = c.fetch("b", &figures(2.0, 0.05)).unwrap().predict(64 * mib, 0.05).unwrap().seconds;
        assert!(at_2g < at_1g, "{at_2g} vs {at_1g}");
        // A fetch that took 3 RTTs longer than the prior said: the next predictions move up and
        // no longer follow the figures.
        let fig = figures(2.0, 0.05);
        for _ in 0..6 {
            c.observe_fetch(
                "b",
                &fig,
                FetchObservation { wire_bytes: 64 * mib, seconds: at_2g + 0.15, rtt_s: 0.05 },
            );
        }
        let after = c.fetch("b", &figures(4.0, 0.05)).unwrap();
        assert_eq!(after.samples(), 6);
        let p = after.predict(64 * mib, 0.05).unwrap().seconds;
        assert!((p / (at_2g + 0.15) - 1.0).abs() < 0.05, "{p} vs {}", at_2g + 0.15);
        assert!(c.fetch_estimate("b", 0.05).is_some() && c.fetch_estimate("x", 0.05).is_none());
    }

    #[test]
    fn a_lossy_peer_gets_a_tail_that_get_links_exports() {
        // Short fetches on a 1 Gbit/s × 50 ms path, every third a round trip late (a lost
        // packet), every other on time: the calibration learns a tail, prices the next fetch
        // as the mixture, and its wire form carries the figures.
        let c = Calibrations::default();
        let fig = figures(1.0, 0.05);
        for k in 0..30u64 {
            let bytes = (1 + k % 4) << 20;
            let on_time = 0.05 + bytes as f64 * 8e-9;
            let seconds =
                on_time * (1.0 + 0.01 * ((k % 5) as f64 - 2.0)) + if k % 3 == 0 { 0.05 } else { 0.0 };
            c.observe_fetch("b", &fig, FetchObservation { wire_bytes: bytes, seconds, rtt_s: 0.05 });
        }
        let e = c.fetch_estimate("b", 0.05).unwrap();
        let tail = e.tail.unwrap();
        assert!(tail.hazard_per_packet > 0.0 && (tail.delay_rtts - 1.0).abs() < 0.1, "{e:?}");
        assert!((e.fixed_rtts.unwrap() - 1.0).abs() < 0.15, "the fixed cost is the on-time one: {e:?}");
        let p = c.fetch("b", &fig).unwrap().predict(2 << 20, 0.05).unwrap();
        assert!(p.tail_probability > 0.1 && p.tail_probability < 0.6 && p.tail_delay_s > 0.04, "{p:?}");
        let l = crate::plan::with_calibration(kvferry_proto::v1::LinkState::default(), &e);
        assert_eq!((l.late_hazard_per_packet, l.late_delay_rtts), (tail.hazard_per_packet, tail.delay_rtts));
        assert!(l.late_fraction > 0.2 && l.late_fraction < 0.5, "{l:?}");
        // A peer whose fetches are all on time exports no tail.
        for k in 0..30u64 {
            let bytes = (1 + k % 4) << 20;
            let seconds = (0.05 + bytes as f64 * 8e-9) * (1.0 + 0.01 * ((k % 5) as f64 - 2.0));
            c.observe_fetch("c", &fig, FetchObservation { wire_bytes: bytes, seconds, rtt_s: 0.05 });
        }
        let l = crate::plan::with_calibration(
            kvferry_proto::v1::LinkState::default(),
            &c.fetch_estimate("c", 0.05).unwrap(),
        );
        assert_eq!((l.late_hazard_per_packet, l.late_delay_rtts, l.late_fraction), (0.0, 0.0, 0.0));
    }

    #[test]
    fn split_interference_is_the_prior_until_a_split_of_that_engine_then_measured() {
        let c = Calibrations::default();
        assert_eq!(c.split_interference("e", 0.25), 0.25);
        assert_eq!(c.split_state("e", 0.25), (0.25, 0));
        // Planned with the prior 0.25; took 1.6 × its prediction: the legs slowed each other 2×.
        // One such split leaves the prior in the median; a second outvotes it.
        c.observe_split("e", 0.25, 0.25, 1.0, 1.6);
        assert!((c.split_interference("e", 0.25) - 0.25).abs() < 1e-12);
        assert_eq!(c.split_state("e", 0.25).1, 1);
        c.observe_split("e", 0.25, 0.25, 1.0, 1.6);
        assert!((c.split_interference("e", 0.25) - 1.0).abs() < 1e-12);
        assert_eq!(c.split_interference("other", 0.0), 0.0, "per engine");
        c.observe_split("e", 0.25, 0.25, f64::NAN, 1.0); // refused, logged
        assert!((c.split_interference("e", 9.0) - 1.0).abs() < 1e-12, "the prior no longer applies");
        assert_eq!(c.split_state("e", 9.0).1, 2);
    }

    #[test]
    fn split_overhead_is_the_prior_until_a_split_of_that_engine_then_measured() {
        let c = Calibrations::default();
        assert_eq!(c.split_overhead("e", 0.005), (0.005, 0));
        c.observe_split_overhead("e", 0.005, 0.2001, 0.2, 0.15);
        let (o, n) = c.split_overhead("e", 0.005);
        assert!((o - (0.005 + 0.0001) / 2.0).abs() < 1e-12 && n == 1, "{o} {n}");
        c.observe_split_overhead("e", 0.005, 0.1, 0.2, 0.15); // a leg longer than the wall: refused, logged
        assert_eq!(c.split_overhead("e", 0.05), (o, 1), "the prior no longer applies");
        assert_eq!(c.split_overhead("other", 0.0), (0.0, 0), "per engine");
        c.observe_split_overhead("bad", f64::NAN, 0.2, 0.1, 0.1); // a bad prior: refused, logged
        assert_eq!(c.split_overhead("bad", 0.002), (0.002, 0));
    }

    #[test]
    fn split_scatter_is_the_prior_until_a_split_of_that_engine_then_measured() {
        let c = Calibrations::default();
        assert_eq!(c.split_scatter("e", 0.03), (0.03, 0));
        // One split 10 % under leaves the prior in the median; a second moves it.
        c.observe_split_outcome("e", 0.03, 0.087, 0.115, 0.078);
        assert_eq!(c.split_scatter("e", 0.03).1, 1);
        c.observe_split_outcome("e", 0.03, 0.087, 0.115, 0.078);
        let (s, n) = c.split_scatter("e", 0.03);
        assert!(s > 0.03 && s < 0.1 && n == 2, "{s} {n}");
        c.observe_split_outcome("e", 0.03, 0.1, 0.1, f64::NAN); // refused, logged
        assert_eq!(c.split_scatter("e", 0.5), (s, 2), "the prior no longer applies");
        assert_eq!(c.split_scatter("other", 0.0), (0.0, 0), "per engine");
        c.observe_split_outcome("bad", f64::NAN, 0.1, 0.1, 0.1); // a bad prior: refused, logged
        assert_eq!(c.split_scatter("bad", 0.02), (0.02, 0));
    }

    #[test]
    fn hedge_interference_is_the_prior_then_the_splits_then_its_own_hedges() {
        let c = Calibrations::default();
        assert_eq!(c.hedge_state("e", 0.1), (0.1, 0));
        // Splits measured a 1.5× slowdown: hedges borrow it before any hedge ran.
        for _ in 0..2 {
            c.observe_split("e", 0.0, 0.0, 1.0, 1.5);
        }
        assert!((c.hedge_interference("e", 0.1) - 0.5).abs() < 1e-12);
        assert_eq!(c.hedge_state("e", 0.1).1, 0, "borrowed, not measured");
        assert_eq!(c.hedge_interference("other", 0.1), 0.1, "per engine");
        // A hedge priced with 0.5 whose winner took 2/1.5 of the expected race: 1 + i = 2. Its
        // own calibration is anchored on the 0.5 the race was priced with, so the first race
        // leaves 0.5 in force and the second moves it.
        c.observe_hedge("e", 0.5, 0.5, 1.5, 2.0);
        assert!((c.hedge_interference("e", 0.1) - 0.5).abs() < 1e-12);
        assert_eq!(c.hedge_state("e", 0.1).1, 1);
        c.observe_hedge("e", 0.5, 0.5, 1.5, 2.0);
        assert!((c.hedge_interference("e", 0.1) - 1.0).abs() < 1e-12);
        // The split's own estimate is untouched by hedges.
        assert!((c.split_interference("e", 0.0) - 0.5).abs() < 1e-12);
        // A hedge faster than priced says "none", never a negative slowdown.
        for _ in 0..3 {
            c.observe_hedge("e", 0.1, 1.0, 2.0, 0.5);
        }
        assert_eq!(c.hedge_interference("e", 0.1), 0.0);
    }

    #[test]
    fn refused_samples_change_nothing_and_bad_priors_give_none() {
        let c = Calibrations::default();
        let fig = figures(1.0, 0.05);
        c.observe_fetch("b", &fig, FetchObservation { wire_bytes: 1, seconds: f64::NAN, rtt_s: 0.05 });
        assert_eq!(c.fetch("b", &fig).unwrap().samples(), 0);
        assert!(c.fetch("b", &figures(0.0, 0.05)).is_none());
        let bad = Profile { linear_s_per_token: 0.0, attention_s_per_pair: 0.0, fixed_s: 0.0 };
        assert!(c.recompute("e", bad).is_none());
        c.observe_recompute(
            "e",
            bad,
            RecomputeObservation { new_tokens: 1, cached_tokens: 0, load: 0.0, seconds: 1.0 },
        );
        assert!(c.engines().is_empty());
    }

    #[test]
    fn a_recompute_slower_than_its_profile_is_learnt_and_survives_a_new_profile() {
        let c = Calibrations::default();
        let model = prior_profile(PROFILE).unwrap();
        for n in [64u64, 128, 256, 512, 96, 384] {
            let seconds = 3.0 * model.recompute_seconds(n);
            c.observe_recompute(
                "e",
                PROFILE,
                RecomputeObservation { new_tokens: n, cached_tokens: 0, load: 0.0, seconds },
            );
        }
        let p = c.recompute("e", PROFILE).unwrap().predict(200, 0, 0.0).unwrap().seconds;
        assert!((p / (3.0 * model.recompute_seconds(200)) - 1.0).abs() < 0.10, "{p}");
        // The engine now reports a profile 2x slower: the correction is relative to it, and the
        // prediction of wall time stays where the samples put it.
        let slower = Profile { linear_s_per_token: 2e-3, attention_s_per_pair: 2e-7, fixed_s: 0.0 };
        let q = c.recompute("e", slower).unwrap().predict(200, 0, 0.0).unwrap().seconds;
        assert!((q / p - 1.0).abs() < 0.10, "{q} vs {p}");
        let engines = c.engines();
        assert_eq!(engines.len(), 1);
        assert_eq!((engines[0].0.as_str(), engines[0].1), ("e", slower));
        assert_eq!(engines[0].2.samples, 6);
    }

    #[test]
    fn an_engines_fixed_cost_per_step_is_priced_from_its_first_plan() {
        let c = Calibrations::default();
        let model = prior_profile(PROFILE).unwrap();
        let with = Profile { fixed_s: 0.03, ..PROFILE };
        let p = c.recompute("e", with).unwrap().predict(16, 0, 0.0).unwrap().seconds;
        assert!((p - (0.03 + model.recompute_seconds(16))).abs() < 1e-9, "{p}");
        assert!((c.recompute("e", with).unwrap().estimate().fixed_s - 0.03).abs() < 1e-12);
        // The engine stops reporting one (or reports another): the prior follows it.
        let q = c.recompute("e", PROFILE).unwrap().predict(16, 0, 0.0).unwrap().seconds;
        assert!((q - model.recompute_seconds(16)).abs() < 1e-9, "{q}");
    }
}
