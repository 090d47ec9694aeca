//! Tests of the calibration (`kvferry_model::calibration`) on synthetic traces: convergence to
//! the true parameters under noise and outliers, a mis-calibrated prior corrected within a
//! stated number of samples, bands that shrink as samples accumulate, monotone predictions,
//! the hedge never worse than the better pure action in expectation (and its closed form
//! checked by simulation), and no panic or NaN on degenerate inputs.
//!
//! Randomness lives only here: a seeded SplitMix64, so every trace is reproducible.

use kvferry_model::calibration::{FetchSpread, FitConfig, HedgeChoice, HedgePolicy, RecomputeSpread, hedge};
use kvferry_model::{
    CalibrationError, ComputeModel, FetchCalibration, FetchObservation, LinkModel, Prediction,
    RecomputeCalibration, RecomputeObservation,
};
use proptest::prelude::*;

/// Seeded SplitMix64 with uniform and Gaussian draws.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }
    fn log_range(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + (hi.ln() - lo.ln()) * self.uniform()).exp()
    }
    fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// The fetch a link "really" has: `fixed + rtt_factor · rtt + bytes · per_byte`.
#[derive(Clone, Copy)]
struct TrueFetch {
    fixed_s: f64,
    rtt_factor: f64,
    per_byte_s: f64,
}

impl TrueFetch {
    fn seconds(&self, bytes: f64, rtt: f64) -> f64 {
        self.fixed_s + self.rtt_factor * rtt + self.per_byte_s * bytes
    }
}

fn link_1g_50ms() -> LinkModel {
    LinkModel::new(1.0, 0.05, 1.0).unwrap()
}

fn fetch_cal(cfg: FitConfig) -> FetchCalibration {
    FetchCalibration::new(&link_1g_50ms(), FetchSpread::default(), cfg).unwrap()
}

/// Largest |predicted / true − 1| over fetch sizes 256 KiB … 256 MiB at one RTT.
fn worst_fetch_error(c: &FetchCalibration, truth: &TrueFetch, rtt: f64) -> f64 {
    [0.25, 1.0, 4.0, 16.0, 64.0, 256.0]
        .iter()
        .map(|mib| {
            let bytes = mib * MIB;
            let p = c.predict(bytes as u64, rtt).unwrap().seconds;
            (p / truth.seconds(bytes, rtt) - 1.0).abs()
        })
        .fold(0.0, f64::max)
}

#[test]
fn fetch_converges_to_the_true_parameters_under_noise_and_outliers() {
    // Fixed cost 4 ms + 2.5 RTT, 0.8 Gbit/s effective; RTT varies 20–150 ms so the two fixed
    // terms separate; 5 % Gaussian noise and 5 % of samples 3× slow (a retransmit storm).
    let truth = TrueFetch { fixed_s: 0.004, rtt_factor: 2.5, per_byte_s: 8.0 / 0.8e9 };
    let cfg = FitConfig { window: 400, forgetting: 1.0, ..FitConfig::default() };
    let mut c = fetch_cal(cfg);
    let mut rng = Rng(7);
    for i in 0..400 {
        let bytes = rng.log_range(64.0 * 1024.0, 256.0 * MIB);
        let rtt = rng.range(0.02, 0.15);
        let mut seconds = truth.seconds(bytes, rtt) * (1.0 + 0.05 * rng.normal());
        if i % 20 == 7 {
            seconds *= 3.0;
        }
        c.observe(FetchObservation { wire_bytes: bytes as u64, seconds, rtt_s: rtt }).unwrap();
    }
    let e = c.estimate(0.05).unwrap();
    let want_fixed = truth.seconds(0.0, 0.05);
    assert!((e.fixed_s / want_fixed - 1.0).abs() < 0.05, "fixed {} vs {want_fixed}", e.fixed_s);
    assert!((e.fixed_rtts.unwrap() - want_fixed / 0.05).abs() < 0.15, "{e:?}");
    // The RTT spread separates the RTT-independent part from the RTT-proportional one.
    assert!((e.base_s - truth.fixed_s).abs() < 0.002, "{e:?}");
    assert!((e.rtt_factor - truth.rtt_factor).abs() < 0.1, "{e:?}");
    assert!((e.per_byte_s / truth.per_byte_s - 1.0).abs() < 0.03, "per byte {e:?}");
    assert!((e.goodput_gbps.unwrap() - 0.8).abs() < 0.03, "{e:?}");
    assert!(e.noise > 0.03 && e.noise < 0.09, "noise is the 5 % Gaussian part: {}", e.noise);
    assert!(worst_fetch_error(&c, &truth, 0.05) < 0.03);
    // The calibrated LinkModel predicts the same at another RTT.
    let lm = c.link_model(0.1, 1.0).unwrap();
    let want = truth.seconds(32.0 * MIB, 0.1);
    assert!((lm.fetch_seconds((32.0 * MIB) as u64, 1.0) / want - 1.0).abs() < 0.03);
}

/// N for the fetch prior: the misses (a fixed cost of 2.5 RTTs where the model
/// charges 1; a goodput half of the configured one) are corrected — every size from 256 KiB
/// to 256 MiB predicted within 10 % — after at most this many fetches, and stay corrected,
/// on each of 20 seeded traces with 5 % noise.
const FETCH_PRIOR_CORRECTED_WITHIN: usize = 8;

/// Once corrected, the worst probe's error stays below this.
const STAYS_WITHIN: f64 = 0.15;

/// When a trace was corrected: the first sample after which every probe is within 10 %; from
/// then on every probe must stay within [`STAYS_WITHIN`] (the samples carry 5 % noise, so
/// the estimate wobbles).
struct Correction {
    seed: u64,
    at: Option<usize>,
}

impl Correction {
    fn new(seed: u64) -> Self {
        Self { seed, at: None }
    }

    /// After sample `n`, the worst probe's error is `err`.
    fn observe(&mut self, n: usize, err: f64) {
        match self.at {
            None if err <= 0.10 => self.at = Some(n),
            Some(at) => assert!(err <= STAYS_WITHIN, "seed {}: corrected at {at}, {err} at {n}", self.seed),
            None => {}
        }
    }

    /// The samples it took (`usize::MAX`: never corrected).
    fn samples(&self) -> usize {
        self.at.unwrap_or(usize::MAX)
    }
}

/// Runs `trace` on seeds 0..20 and checks the worst needed at most `within` samples.
fn corrected_within(what: &str, within: usize, trace: fn(u64) -> usize) {
    let ns: Vec<usize> = (0..20).map(trace).collect();
    println!("{what} prior corrected after {ns:?} samples");
    let worst = *ns.iter().max().unwrap();
    assert!(worst <= within, "{ns:?}");
}

/// Samples until the fetch prior is corrected ([`Correction`]), through sample 60.
fn fetch_samples_to_correct(seed: u64) -> usize {
    let truth = TrueFetch { fixed_s: 0.0, rtt_factor: 2.5, per_byte_s: 8.0 / 0.5e9 };
    let mut c = fetch_cal(FitConfig::default());
    assert!(worst_fetch_error(&c, &truth, 0.05) > 0.4, "the prior is badly off");
    let mut rng = Rng(seed);
    let mut corrected = Correction::new(seed);
    for n in 1..=60 {
        let bytes = rng.log_range(256.0 * 1024.0, 256.0 * MIB);
        let seconds = truth.seconds(bytes, 0.05) * (1.0 + 0.05 * rng.normal());
        c.observe(FetchObservation { wire_bytes: bytes as u64, seconds, rtt_s: 0.05 }).unwrap();
        corrected.observe(n, worst_fetch_error(&c, &truth, 0.05));
    }
    corrected.samples()
}

#[test]
fn a_miscalibrated_fetch_prior_is_corrected_within_n_samples() {
    corrected_within("fetch", FETCH_PRIOR_CORRECTED_WITHIN, fetch_samples_to_correct);
}

fn profile() -> ComputeModel {
    // The reference engine's order of magnitude: 1.3 ms/token, 0.2 µs per (query, key) pair.
    ComputeModel::from_measured(1.3e-3, 2e-7).unwrap()
}

fn recompute_cal(cfg: FitConfig) -> RecomputeCalibration {
    RecomputeCalibration::new(&profile(), RecomputeSpread::default(), cfg).unwrap()
}

/// Wall time of a host where recompute runs `slowdown(load)` × its CPU profile plus `fixed`.
fn true_recompute(n: u64, c: u64, load: f64, fixed: f64, base: f64, per_load: f64) -> f64 {
    fixed + profile().recompute_span_seconds(c, n) * (base + per_load * load)
}

fn worst_recompute_error(cal: &RecomputeCalibration, load: f64, truth: impl Fn(u64, u64, f64) -> f64) -> f64 {
    [(32u64, 0u64), (64, 0), (192, 0), (512, 0), (64, 1024), (256, 2048)]
        .iter()
        .map(|&(n, c)| (cal.predict(n, c, load).unwrap().seconds / truth(n, c, load) - 1.0).abs())
        .fold(0.0, f64::max)
}

/// N for the recompute prior: a host whose wall time is 3× the engine's CPU-clock profile
/// plus 2 ms (the loaded-host misses) is predicted within 10 % at every probed size
/// (up to 256 new tokens on 2048 cached) after at most this many recomputes, and stays so,
/// on each of 20 seeded traces with 5 % noise.
const RECOMPUTE_PRIOR_CORRECTED_WITHIN: usize = 10;

fn recompute_samples_to_correct(seed: u64) -> usize {
    let truth = |n, c, _load| true_recompute(n, c, 0.0, 0.002, 3.0, 0.0);
    let mut cal = recompute_cal(FitConfig::default());
    assert!(worst_recompute_error(&cal, 0.0, truth) > 0.6);
    let mut rng = Rng(seed);
    let mut corrected = Correction::new(seed);
    for k in 1..=60 {
        let n = rng.log_range(16.0, 1024.0) as u64;
        let c = if rng.uniform() < 0.5 { 0 } else { rng.range(0.0, 2048.0) as u64 };
        let seconds = truth(n, c, 0.0) * (1.0 + 0.05 * rng.normal());
        cal.observe(RecomputeObservation { new_tokens: n, cached_tokens: c, load: 0.0, seconds }).unwrap();
        corrected.observe(k, worst_recompute_error(&cal, 0.0, truth));
    }
    if seed == 0 {
        let e = cal.estimate();
        assert!((e.linear_factor - 3.0).abs() < 0.3 && (e.attention_factor - 3.0).abs() < 0.6, "{e:?}");
    }
    corrected.samples()
}

#[test]
fn a_loaded_host_is_corrected_within_n_samples() {
    corrected_within("recompute", RECOMPUTE_PRIOR_CORRECTED_WITHIN, recompute_samples_to_correct);
}

/// Two profiles of a recorded full bench (`bench/results/full-2026-12-05-evening/run2`, the
/// reference engine on this project's 2-core host): the engine's reported profile (seconds per
/// token, per pair) and every recompute the daemon calibrated from, in order, as (tokens,
/// whether it was a pure-recompute decision point the bench scored, wall seconds).
#[allow(clippy::type_complexity)]
const RECORDED_SWEEPS: [(&str, f64, f64, &[(u64, bool, f64)]); 2] = [
    (
        "1gbit-50ms",
        0.000695411125048552,
        1.0469331154257894e-05,
        &[
            (32, false, 0.0386),
            (16, true, 0.0186),
            (16, false, 0.0177),
            (32, true, 0.0338),
            (32, false, 0.0350),
            (64, true, 0.0690),
            (176, true, 0.2507),
            (352, true, 0.7734),
            (432, true, 1.2104),
            (688, true, 2.8624),
            (1024, true, 6.2142),
        ],
    ),
    (
        "1gbit-50ms-loss0.1",
        0.0006985542379344328,
        1.0659460849172011e-05,
        &[
            (32, false, 0.0450),
            (16, true, 0.0191),
            (16, false, 0.0195),
            (32, true, 0.0407),
            (32, false, 0.0344),
            (64, true, 0.0750),
            (64, false, 0.0711),
            (176, true, 0.2531),
            (352, true, 0.8018),
            (432, true, 1.1468),
            (688, true, 2.8196),
            (1024, true, 6.2570),
        ],
    ),
];

/// The recorded sweeps predicted as the daemon predicted them (each scored recompute before it
/// is learnt from): |measured ÷ predicted − 1| of the scored points with at least `min_samples`
/// samples behind them.
fn recorded_errors(spread: RecomputeSpread, min_samples: u64) -> Vec<f64> {
    let mut errs = Vec::new();
    for (name, linear, attention, samples) in RECORDED_SWEEPS {
        let profile = ComputeModel::from_measured(linear, attention).unwrap();
        let mut cal = RecomputeCalibration::new(&profile, spread, FitConfig::default()).unwrap();
        for &(n, scored, seconds) in samples {
            let p = cal.predict(n, 0, 0.0).unwrap();
            if scored && p.samples >= min_samples {
                let e = seconds / p.seconds - 1.0;
                assert!(e.is_finite(), "{name} {n}: {p:?}");
                errs.push(e.abs());
            }
            cal.observe(RecomputeObservation { new_tokens: n, cached_tokens: 0, load: 0.0, seconds })
                .unwrap();
        }
    }
    errs
}

/// The recorded sweeps climb from 16 to 1,024 tokens, so each long recompute is predicted
/// from shorter ones. With the profile's shape held (the default spread), the long ones are
/// predicted within 11 % each (median under 8 %); with the shape as free as the scale (as the
/// independent factors were before 2026-12-05), the short recomputes pull the attention factor
/// down and the same points miss by 10–15 %.
#[test]
fn a_recorded_sweep_keeps_the_profiles_shape_at_long_prefixes() {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let m = v.len();
        if m % 2 == 1 { v[m / 2] } else { (v[m / 2 - 1] + v[m / 2]) / 2.0 }
    };
    let held = recorded_errors(RecomputeSpread::default(), 8);
    assert_eq!(held.len(), 7);
    let worst = held.iter().copied().fold(0.0, f64::max);
    assert!(worst < 0.11 && median(held.clone()) < 0.08, "held shape: {held:?}");
    let free = RecomputeSpread { shape: RecomputeSpread::default().scale, ..RecomputeSpread::default() };
    let loose = recorded_errors(free, 8);
    assert!(median(loose.clone()) > 0.10, "free shape: {loose:?}");
}

/// An engine whose cost is not the profile's shape: long prefills batch better, so the
/// linear term per token falls from the profile's at 64 tokens to 60 % of it past ~300
/// (what the reference engine does on this host: `bench/results/recompute-replay-2026-12-05/`).
fn misshaped_truth(n: u64) -> f64 {
    let p = profile();
    let efficiency = 0.6 + 0.4 * (-(n as f64 - 64.0).max(0.0) / 96.0).exp();
    0.004 + p.linear_seconds_per_token() * n as f64 * efficiency + p.recompute_seconds(n)
        - p.linear_seconds_per_token() * n as f64
}

/// The size correction bends the fitted curve toward what recomputes of a similar size took:
/// after a climbing sweep (16 … 1,024 tokens, twice, 3 % noise) the median error over the
/// sizes visited and between them falls to under 3 % and under 60 % of the fit's alone, and
/// from 128 tokens up every size is within 6 % (the fit alone misses by up to 11 %). A kernel
/// half an e-fold wide cannot follow the residual's swing between 16 and 64 tokens (+25 % to
/// −19 %), so the shortest sizes keep part of their error. A prefill far beyond every sample
/// gets (almost) the fit's own prediction.
#[test]
fn a_misshaped_profile_is_bent_toward_recomputes_of_similar_size() {
    let mut cal = recompute_cal(FitConfig::default());
    let mut rng = Rng(5);
    let sweep = [16u64, 32, 64, 128, 192, 256, 384, 512, 768, 1024];
    for n in sweep.iter().chain(sweep.iter()) {
        let seconds = misshaped_truth(*n) * (1.0 + 0.03 * rng.normal());
        cal.observe(RecomputeObservation { new_tokens: *n, cached_tokens: 0, load: 0.0, seconds }).unwrap();
    }
    let fixed = cal.estimate().fixed_s;
    let plain = cal.compute_model(0.0).unwrap().with_correction(None);
    let (mut bent, mut alone, mut worst_long) = (Vec::new(), Vec::new(), 0.0f64);
    for n in sweep.iter().copied().chain([48, 96, 320, 640, 896]) {
        let truth = misshaped_truth(n);
        let e = (cal.predict(n, 0, 0.0).unwrap().seconds / truth - 1.0).abs();
        bent.push(e);
        alone.push(((plain.recompute_seconds(n) + fixed) / truth - 1.0).abs());
        if n >= 128 {
            worst_long = worst_long.max(e);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (bent, alone) = (median(bent), median(alone));
    assert!(bent < 0.03 && bent < 0.6 * alone, "median error corrected {bent}, fit alone {alone}");
    assert!(worst_long < 0.06, "{worst_long}");
    let far = 16_384;
    let ratio = cal.predict(far, 0, 0.0).unwrap().seconds / (plain.recompute_seconds(far) + fixed);
    assert!((ratio - 1.0).abs() < 0.02, "far beyond the samples: {ratio}");
}

#[test]
fn recompute_learns_the_load_dependence() {
    // Wall = (1 + 1.5 · utilization) × profile + 3 ms; utilization reported 0 … 0.9.
    let truth = |n, c, load| true_recompute(n, c, load, 0.003, 1.0, 1.5);
    let cfg = FitConfig { window: 200, forgetting: 1.0, ..FitConfig::default() };
    let mut cal = recompute_cal(cfg);
    let mut rng = Rng(99);
    for _ in 0..200 {
        let n = rng.log_range(16.0, 1024.0) as u64;
        let c = rng.range(0.0, 2048.0) as u64;
        let load = rng.range(0.0, 0.9);
        let seconds = truth(n, c, load) * (1.0 + 0.05 * rng.normal());
        cal.observe(RecomputeObservation { new_tokens: n, cached_tokens: c, load, seconds }).unwrap();
    }
    let e = cal.estimate();
    assert!((e.load_factor - 1.5).abs() < 0.15, "{e:?}");
    assert!((e.fixed_s - 0.003).abs() < 0.002, "{e:?}");
    for load in [0.0, 0.5, 0.9] {
        let err = worst_recompute_error(&cal, load, truth);
        assert!(err < 0.05, "load {load}: {err}");
    }
    // The calibrated ComputeModel carries the same per-token costs (without the fixed cost),
    // and the same size correction (there keyed on the seconds without the fixed cost, so
    // equal to well within the noise, not exactly).
    let m = cal.compute_model(0.5).unwrap();
    let p = cal.predict(512, 0, 0.5).unwrap().seconds;
    assert!(((m.recompute_seconds(512) + e.fixed_s) / p - 1.0).abs() < 1e-3, "{m:?} {p}");
}

#[test]
fn bands_shrink_as_samples_accumulate() {
    let truth = TrueFetch { fixed_s: 0.002, rtt_factor: 2.0, per_byte_s: 8.0 / 0.9e9 };
    let mut c = fetch_cal(FitConfig::default());
    let mut rng = Rng(3);
    let probe = (16.0 * MIB) as u64;
    let mut se = vec![c.predict(probe, 0.05).unwrap()];
    let mut fed = 0;
    for target in [2, 5, 10, 20, 40] {
        while fed < target {
            let bytes = rng.log_range(256.0 * 1024.0, 256.0 * MIB);
            let seconds = truth.seconds(bytes, 0.05) * (1.0 + 0.05 * rng.normal());
            c.observe(FetchObservation { wire_bytes: bytes as u64, seconds, rtt_s: 0.05 }).unwrap();
            fed += 1;
        }
        se.push(c.predict(probe, 0.05).unwrap());
    }
    for w in se.windows(2) {
        assert!(w[1].std_error_s < w[0].std_error_s, "standard error did not shrink: {se:?}");
    }
    let first = se[0].relative_sd();
    let last = se.last().unwrap();
    assert!(first > 0.5, "no samples: wide ({first})");
    assert!(last.relative_sd() < 0.1, "40 samples at 5 % noise: narrow ({last:?})");
    assert!(last.std_error_s < 0.03 * last.seconds, "{last:?}");
    // Recompute too.
    let mut r = recompute_cal(FitConfig::default());
    // With forgetting 0.9 the effective memory is ~19 samples, so the band shrinks until then
    // and then holds.
    let mut prev = r.predict(128, 0, 0.0).unwrap().std_error_s;
    for k in 0..40u64 {
        let n = 16 + 16 * (k % 8);
        let seconds = profile().recompute_seconds(n) * 2.0 * (1.0 + 0.05 * rng.normal());
        r.observe(RecomputeObservation { new_tokens: n, cached_tokens: 0, load: 0.0, seconds }).unwrap();
        let now = r.predict(128, 0, 0.0).unwrap().std_error_s;
        if [2, 9, 19].contains(&k) {
            assert!(now < prev, "recompute band did not shrink at {k}: {prev} -> {now}");
            prev = now;
        }
        if k > 19 {
            assert!(now < 1.5 * prev, "recompute band grew at {k}: {prev} -> {now}");
        }
    }
}

#[test]
fn a_host_that_changes_is_followed() {
    // 40 fetches at 1 Gbit/s, then the link degrades to 0.25 Gbit/s: at first the new fetches
    // look like outliers, but once they hold half the forgetting weight (≈ 14 samples) they
    // set the scale, and within 20 the fit has followed.
    let fast = TrueFetch { fixed_s: 0.0, rtt_factor: 1.5, per_byte_s: 8.0 / 1e9 };
    let slow = TrueFetch { per_byte_s: 8.0 / 0.25e9, ..fast };
    let mut c = fetch_cal(FitConfig::default());
    let mut rng = Rng(21);
    for k in 0..60 {
        let truth = if k < 40 { fast } else { slow };
        let bytes = rng.log_range(MIB, 256.0 * MIB);
        let seconds = truth.seconds(bytes, 0.05) * (1.0 + 0.03 * rng.normal());
        c.observe(FetchObservation { wire_bytes: bytes as u64, seconds, rtt_s: 0.05 }).unwrap();
    }
    let err = worst_fetch_error(&c, &slow, 0.05);
    assert!(err < 0.1, "{err}");
}

#[test]
fn the_hedge_matches_a_simulation() {
    let mut rng = Rng(1234);
    for (mf, sf, mr, sr, ifet, irec) in [
        (1.0, 0.2, 1.1, 0.3, 0.0, 0.0),
        (0.10, 0.05, 0.12, 0.01, 0.2, 0.5),
        (2.0, 1.0, 1.0, 0.1, 0.0, 0.0),
        (0.5, 0.0, 0.6, 0.2, 0.1, 0.1),
    ] {
        let f = Prediction::gaussian(mf, sf, 0.0, 1);
        let r = Prediction::gaussian(mr, 0.0, sr, 1);
        let policy = HedgePolicy {
            allow: true,
            band_z: 10.0,
            fetch_interference: ifet,
            recompute_interference: irec,
            min_gain: 0.0,
            min_gain_s: 0.0,
            max_wasted_compute_s: None,
        };
        let d = hedge(&f, &r, &policy).unwrap();
        let (mut sum_min, mut sum_wasted, mut fetch_wins) = (0.0, 0.0, 0u32);
        let draws = 200_000;
        for _ in 0..draws {
            let x = (1.0 + ifet) * (mf + sf * rng.normal());
            let y = (1.0 + irec) * (mr + sr * rng.normal());
            sum_min += x.min(y);
            if x < y {
                sum_wasted += x;
                fetch_wins += 1;
            }
        }
        let n = f64::from(draws);
        let tol = 0.01 * d.hedge_s.abs().max(0.05);
        assert!((sum_min / n - d.hedge_s).abs() < tol, "E[min] {} vs {}", sum_min / n, d.hedge_s);
        assert!(
            (sum_wasted / n - d.wasted_compute_s).abs() < tol,
            "wasted {} vs {}",
            sum_wasted / n,
            d.wasted_compute_s
        );
        assert!((f64::from(fetch_wins) / n - d.p_fetch_wins).abs() < 0.01);
    }
}

#[test]
fn an_uncertain_prior_hedges_and_a_calibrated_one_decides() {
    // 8 MiB over 1 Gbit/s × 50 ms and 64 tokens of prefill predict about the same time: with
    // no samples the bands are wide and overlap, so a hedge is expected faster. After 30
    // samples (the recompute really 4× its profile) both bands are narrow and apart: fetch.
    let mut f = fetch_cal(FitConfig::default());
    let mut r = recompute_cal(FitConfig::default());
    let d0 = hedge(
        &f.predict((8.0 * MIB) as u64, 0.05).unwrap(),
        &r.predict(64, 0, 0.0).unwrap(),
        &HedgePolicy { allow: true, ..HedgePolicy::default() },
    )
    .unwrap();
    assert_eq!(d0.choice, HedgeChoice::Hedge, "{d0:?}");
    let truth = TrueFetch { fixed_s: 0.0, rtt_factor: 1.0, per_byte_s: 8.0 / 1e9 };
    let mut rng = Rng(8);
    for _ in 0..30 {
        let bytes = rng.log_range(MIB, 64.0 * MIB);
        let seconds = truth.seconds(bytes, 0.05) * (1.0 + 0.02 * rng.normal());
        f.observe(FetchObservation { wire_bytes: bytes as u64, seconds, rtt_s: 0.05 }).unwrap();
        let n = rng.log_range(16.0, 512.0) as u64;
        let seconds = 4.0 * profile().recompute_seconds(n) * (1.0 + 0.02 * rng.normal());
        r.observe(RecomputeObservation { new_tokens: n, cached_tokens: 0, load: 0.0, seconds }).unwrap();
    }
    let d = hedge(
        &f.predict((8.0 * MIB) as u64, 0.05).unwrap(),
        &r.predict(64, 0, 0.0).unwrap(),
        &HedgePolicy { allow: true, ..HedgePolicy::default() },
    )
    .unwrap();
    assert_eq!(d.choice, HedgeChoice::Fetch, "{d:?}");
}

fn arb_prediction() -> impl Strategy<Value = Prediction> {
    (0.0..100.0f64, 0.0..50.0f64, 0.0..50.0f64, 0u64..100)
        .prop_map(|(seconds, se, noise, samples)| Prediction::gaussian(seconds, se, noise, samples))
}

fn arb_policy() -> impl Strategy<Value = HedgePolicy> {
    (
        any::<bool>(),
        0.0..4.0f64,
        0.0..2.0f64,
        0.0..2.0f64,
        0.0..0.5f64,
        prop::option::of(0.0..50.0f64),
        prop_oneof![Just(0.0), 0.0..5.0f64],
    )
        .prop_map(|(allow, band_z, fi, ri, min_gain, cap, min_gain_s)| HedgePolicy {
            allow,
            band_z,
            fetch_interference: fi,
            recompute_interference: ri,
            min_gain,
            min_gain_s,
            max_wasted_compute_s: cap,
        })
}

/// A random training trace: (bytes, seconds, rtt).
fn arb_fetch_trace() -> impl Strategy<Value = Vec<(u64, f64, f64)>> {
    prop::collection::vec((0u64..(1 << 30), 1e-4..100.0f64, 0.0..0.5f64), 0..40)
}

fn arb_recompute_trace() -> impl Strategy<Value = Vec<(u64, u64, f64, f64)>> {
    prop::collection::vec((1u64..4096, 0u64..8192, 0.0..4.0f64, 1e-4..100.0f64), 0..40)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever it learnt, more bytes never predict less time, nor does a longer RTT.
    #[test]
    fn fetch_is_monotone(trace in arb_fetch_trace(), a in 0u64..(1 << 32), b in 0u64..(1 << 32),
                         r1 in 0.0..1.0f64, r2 in 0.0..1.0f64) {
        let mut c = fetch_cal(FitConfig::default());
        for (wire_bytes, seconds, rtt_s) in trace {
            c.observe(FetchObservation { wire_bytes, seconds, rtt_s }).unwrap();
        }
        let (lo, hi) = (a.min(b), a.max(b));
        let (rlo, rhi) = (r1.min(r2), r1.max(r2));
        let p = |bytes, rtt| c.predict(bytes, rtt).unwrap();
        prop_assert!(p(hi, rlo).seconds >= p(lo, rlo).seconds);
        prop_assert!(p(lo, rhi).seconds >= p(lo, rlo).seconds);
        for x in [p(lo, rlo), p(hi, rhi)] {
            prop_assert!(x.seconds.is_finite() && x.seconds >= 0.0 && x.sd_s().is_finite() && x.sd_s() >= 0.0);
        }
        let e = c.estimate(rlo).unwrap();
        prop_assert!(e.fixed_s >= 0.0 && e.per_byte_s >= 0.0 && e.noise > 0.0);
        prop_assert!(c.link_model(rlo, 1.0).is_ok());
    }

    /// More new tokens, more cached context or more load never predict less time.
    #[test]
    fn recompute_is_monotone(trace in arb_recompute_trace(), n1 in 0u64..100_000, n2 in 0u64..100_000,
                             c1 in 0u64..100_000, c2 in 0u64..100_000, l1 in 0.0..4.0f64, l2 in 0.0..4.0f64) {
        let mut cal = recompute_cal(FitConfig::default());
        for (new_tokens, cached_tokens, load, seconds) in trace {
            cal.observe(RecomputeObservation { new_tokens, cached_tokens, load, seconds }).unwrap();
        }
        let p = |n, c, l| cal.predict(n, c, l).unwrap().seconds;
        let (n_lo, n_hi) = (n1.min(n2), n1.max(n2));
        let (c_lo, c_hi) = (c1.min(c2), c1.max(c2));
        let (l_lo, l_hi) = (l1.min(l2), l1.max(l2));
        prop_assert!(p(n_hi, c_lo, l_lo) >= p(n_lo, c_lo, l_lo));
        prop_assert!(p(n_lo, c_hi, l_lo) >= p(n_lo, c_lo, l_lo));
        prop_assert!(p(n_lo, c_lo, l_hi) >= p(n_lo, c_lo, l_lo));
        let x = cal.predict(n_hi, c_hi, l_hi).unwrap();
        prop_assert!(x.seconds.is_finite() && x.sd_s().is_finite());
        prop_assert!(cal.compute_model(l_hi).is_ok());
    }

    /// The hedge is never worse than the better pure action in expectation under the model,
    /// and hedges only when the bands overlap and it is allowed.
    #[test]
    fn hedge_never_worse_than_the_better_pure_action(f in arb_prediction(), r in arb_prediction(), policy in arb_policy()) {
        let d = hedge(&f, &r, &policy).unwrap();
        let best = f.seconds.min(r.seconds);
        prop_assert!(d.expected_s <= best * (1.0 + 1e-12), "{d:?}");
        prop_assert!(d.hedge_s.is_finite() && d.wasted_compute_s.is_finite() && d.wasted_compute_s >= 0.0);
        prop_assert!((0.0..=1.0).contains(&d.p_fetch_wins));
        match d.choice {
            HedgeChoice::Hedge => {
                prop_assert!(policy.allow);
                prop_assert!(d.hedge_s <= best * (1.0 - policy.min_gain) * (1.0 + 1e-12));
                prop_assert!(best - d.hedge_s >= policy.min_gain_s, "{d:?} {policy:?}");
                let z = policy.band_z;
                prop_assert!(f.seconds - z * f.sd_s() <= r.seconds + z * r.sd_s());
                prop_assert!(r.seconds - z * r.sd_s() <= f.seconds + z * f.sd_s());
                if let Some(cap) = policy.max_wasted_compute_s {
                    prop_assert!(d.wasted_compute_s <= cap);
                }
            }
            HedgeChoice::Fetch => prop_assert!(f.seconds < r.seconds),
            HedgeChoice::Recompute => prop_assert!(r.seconds <= f.seconds),
        }
        // Without interference a hedge's expectation is below both pure actions.
        if policy.fetch_interference == 0.0 && policy.recompute_interference == 0.0 {
            prop_assert!(d.hedge_s <= best * (1.0 + 1e-12));
        }
    }

    /// Arbitrary floats as samples: a typed refusal or an accepted sample, never a panic, and
    /// the predictions stay finite.
    #[test]
    fn garbage_samples_never_panic(bytes in any::<u64>(), seconds in any::<f64>(), rtt in any::<f64>(),
                                   n in any::<u64>(), c in any::<u64>(), load in any::<f64>()) {
        let mut f = fetch_cal(FitConfig::default());
        let before = f.clone();
        match f.observe(FetchObservation { wire_bytes: bytes, seconds, rtt_s: rtt }) {
            Ok(()) => prop_assert!(seconds.is_finite() && seconds > 0.0 && rtt >= 0.0),
            Err(CalibrationError::Sample(_) | CalibrationError::Implausible { .. }) => prop_assert_eq!(&f, &before),
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
        let p = f.predict(bytes, 0.05).unwrap();
        prop_assert!(p.seconds.is_finite() && p.sd_s().is_finite());
        let mut r = recompute_cal(FitConfig::default());
        let n = n % 1_000_000;
        let c = c % 1_000_000;
        let _ = r.observe(RecomputeObservation { new_tokens: n, cached_tokens: c, load, seconds });
        let p = r.predict(n, c, 0.5).unwrap();
        prop_assert!(p.seconds.is_finite() && p.sd_s().is_finite());
    }
}

fn measured_1g_50ms() -> kvferry_model::migration::Measured {
    let p = profile();
    kvferry_model::migration::Measured {
        kv: kvferry_model::KvFootprint::new(
            kvferry_model::KvShape::Gqa { layers: 4, kv_heads: 2, head_dim: 64 },
            2.0,
        )
        .unwrap(),
        linear_s_per_token: p.linear_seconds_per_token(),
        attention_s_per_pair: p.attention_seconds_per_pair(),
        goodput_bps: 1e9,
        rtt_s: 0.05,
        fetch_utilization: 0.0,
        compute_utilization: 0.0,
        recompute_correction: None,
        load_s_per_byte: 0.0,
        fetch_tail: kvferry_model::FetchTail::NONE,
    }
}

/// Without samples, `calibrated` changes nothing: the live figures and the reported profile.
#[test]
fn calibrated_without_samples_is_the_measured_input() {
    let m = measured_1g_50ms();
    let f = fetch_cal(FitConfig::default());
    let r = recompute_cal(FitConfig::default());
    let out = kvferry_model::calibrated(&m, Some(&f), Some(&r), 0.0, 512).unwrap();
    assert_eq!(out.goodput_bps, m.goodput_bps);
    assert_eq!(out.rtt_s, m.rtt_s);
    assert!((out.linear_s_per_token / m.linear_s_per_token - 1.0).abs() < 1e-9);
    assert!((out.attention_s_per_pair / m.attention_s_per_pair - 1.0).abs() < 1e-9);
    assert_eq!(kvferry_model::calibrated(&m, None, None, 0.0, 512).unwrap(), m);
}

/// After samples, the model's times from `calibrated` equal the calibrations' predictions:
/// the fetch's fixed cost of 3 RTTs and a recompute 3× its profile are what the plan uses.
#[test]
fn calibrated_inputs_price_what_the_calibrations_predict() {
    let m = measured_1g_50ms();
    let truth = TrueFetch { fixed_s: 0.0, rtt_factor: 3.0, per_byte_s: 8.0 / 0.7e9 };
    let mut f = fetch_cal(FitConfig::default());
    let mut r = recompute_cal(FitConfig::default());
    let prof = profile();
    for (i, mib) in [1.0, 4.0, 16.0, 64.0, 2.0, 32.0, 8.0, 128.0].iter().enumerate() {
        let bytes = (mib * MIB) as u64;
        f.observe(FetchObservation {
            wire_bytes: bytes,
            seconds: truth.seconds(bytes as f64, 0.05),
            rtt_s: 0.05,
        })
        .unwrap();
        let n = 64 * (i as u64 + 1);
        let seconds = 3.0 * prof.recompute_seconds(n) + 0.01;
        r.observe(RecomputeObservation { new_tokens: n, cached_tokens: 0, load: 0.0, seconds }).unwrap();
    }
    for tokens in [32u64, 256, 1024] {
        let out = kvferry_model::calibrated(&m, Some(&f), Some(&r), 0.0, tokens).unwrap();
        let bytes = (tokens as f64 * m.kv.bytes_per_token()) as u64;
        let link = LinkModel::new(out.goodput_bps / 1e9, out.rtt_s, 1.0).unwrap();
        let model_fetch = link.fetch_seconds(tokens, m.kv.bytes_per_token());
        let want = f.predict(bytes, 0.05).unwrap().seconds;
        assert!((model_fetch / want - 1.0).abs() < 1e-6, "{tokens}: {model_fetch} vs {want}");
        assert!((model_fetch / truth.seconds(bytes as f64, 0.05) - 1.0).abs() < 0.05, "{tokens}");
        let compute = ComputeModel::from_measured(out.linear_s_per_token, out.attention_s_per_pair)
            .unwrap()
            .with_correction(out.recompute_correction);
        let model_rec = compute.recompute_seconds(tokens);
        let want = r.predict(tokens, 0, 0.0).unwrap().seconds;
        assert!((model_rec / want - 1.0).abs() < 1e-6, "{tokens}: {model_rec} vs {want}");
        let true_rec = 3.0 * prof.recompute_seconds(tokens) + 0.01;
        assert!((model_rec / true_rec - 1.0).abs() < 0.10, "{tokens}: {model_rec} vs {true_rec}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Slower observed recomputes never make the calibrated recompute cheaper.
    #[test]
    fn calibrated_recompute_is_monotone_in_what_was_observed(
        n in 16u64..4096, slow in 1.0f64..5.0, extra in 0.0f64..3.0, tokens in 16u64..8192,
    ) {
        let m = measured_1g_50ms();
        let prof = profile();
        let mut a = recompute_cal(FitConfig::default());
        let mut b = recompute_cal(FitConfig::default());
        for k in 0..4 {
            let nn = n + 64 * k;
            let s = slow * prof.recompute_seconds(nn);
            a.observe(RecomputeObservation { new_tokens: nn, cached_tokens: 0, load: 0.0, seconds: s }).unwrap();
            b.observe(RecomputeObservation { new_tokens: nn, cached_tokens: 0, load: 0.0, seconds: s * (1.0 + extra) }).unwrap();
        }
        let ca = kvferry_model::calibrated(&m, None, Some(&a), 0.0, tokens).unwrap();
        let cb = kvferry_model::calibrated(&m, None, Some(&b), 0.0, tokens).unwrap();
        let ta = ComputeModel::from_measured(ca.linear_s_per_token, ca.attention_s_per_pair).unwrap().recompute_seconds(tokens);
        let tb = ComputeModel::from_measured(cb.linear_s_per_token, cb.attention_s_per_pair).unwrap().recompute_seconds(tokens);
        prop_assert!(tb >= ta * (1.0 - 1e-9), "{ta} -> {tb}");
    }
}

/// A lossy path as the bench's `1gbit-50ms-loss0.1` profile has it: one RTT plus the payload
/// at 0.94 Gbit/s, 2 % noise, and one more RTT whenever a packet of a short fetch is lost
/// (p = 0.1 %, packets capped at the path's window). Returns the true expected seconds of a
/// fetch of `bytes` and one draw.
fn lossy_fetch(rng: &mut Rng, bytes: f64) -> (f64, f64) {
    let (rtt, per_byte, p): (f64, f64, f64) = (0.05, 8.0 / 0.94e9, 0.001);
    let window = rtt / per_byte;
    let q = 1.0 - (1.0 - p).powf(kvferry_model::link::packets(bytes, window));
    let on_time = rtt + per_byte * bytes;
    let late = rng.uniform() < q;
    let draw = (on_time + if late { rtt } else { 0.0 }) * (1.0 + 0.02 * rng.normal());
    (on_time + q * rtt, draw)
}

#[test]
fn a_lossy_path_is_priced_as_a_coin_not_followed_flip_by_flip() {
    // The decision of 2026-12-06 that lost 42 %: 64 tokens of 64 KiB on the lossy path against
    // a 106 ms recompute. Its true expected fetch is 0.133 s (late with p 0.95). With the
    // tail, every prediction after the first 20 samples stays within 10 % of that on each of
    // 20 traces (bench-like: short fetches of 16–160 tokens and every fifth a long one), so
    // the recompute is chosen every time; without it a run's prediction ranged 0.093–0.168 s.
    let bytes_64 = 64.0 * 65_536.0;
    let link = LinkModel::new(0.94, 0.05, 1.0).unwrap();
    let mut worst: f64 = 0.0;
    for seed in 0..20 {
        let mut rng = Rng(1000 + seed);
        let mut c = FetchCalibration::new(&link, FetchSpread::default(), FitConfig::default()).unwrap();
        let (truth_64, _) = lossy_fetch(&mut Rng(0), bytes_64);
        for k in 0..80 {
            let tokens = if k % 5 == 4 { 4096.0 } else { [16.0, 32.0, 48.0, 64.0, 96.0, 160.0][k % 6] };
            let (_, seconds) = lossy_fetch(&mut rng, tokens * 65_536.0);
            let obs = FetchObservation { wire_bytes: (tokens * 65_536.0) as u64, seconds, rtt_s: 0.05 };
            c.observe(obs).unwrap();
            if k >= 20 {
                let p = c.predict(bytes_64 as u64, 0.05).unwrap();
                let err = p.seconds / truth_64 - 1.0;
                worst = worst.max(err.abs());
                assert!(p.seconds > 0.106, "seed {seed} at {k}: {p:?}");
                // The model's link prices it the same (the split's fetch leg too).
                let lm = c.link_model(0.05, 1.0).unwrap();
                assert!((lm.fetch_seconds(64, 65_536.0) / p.seconds - 1.0).abs() < 1e-9);
                if k == 79 {
                    assert!(p.tail_probability > 0.6 && p.tail_delay_s > 0.04, "{p:?}");
                }
            }
        }
        let tail = c.estimate(0.05).unwrap().tail.unwrap();
        assert!(tail.hazard_per_packet > 0.0004 && tail.hazard_per_packet < 0.0025, "seed {seed}: {tail:?}");
    }
    println!("worst |predicted / true − 1| at 64 tokens after 20 samples: {worst:.3}");
    assert!(worst < 0.10, "{worst}");
}

#[test]
fn a_lossless_path_learns_no_tail() {
    // The same traffic with no loss: no fetch is late, the predictions are the plain fit's.
    let link = LinkModel::new(0.94, 0.05, 1.0).unwrap();
    let mut c = FetchCalibration::new(&link, FetchSpread::default(), FitConfig::default()).unwrap();
    let mut rng = Rng(5);
    for k in 0..80 {
        let tokens = [16.0, 32.0, 48.0, 64.0, 96.0, 160.0, 4096.0][k % 7];
        let bytes = tokens * 65_536.0;
        let seconds = (0.05 + bytes * 8.0 / 0.94e9) * (1.0 + 0.02 * rng.normal());
        c.observe(FetchObservation { wire_bytes: bytes as u64, seconds, rtt_s: 0.05 }).unwrap();
    }
    assert_eq!(c.tail_at(0.05).unwrap(), kvferry_model::FetchTail::NONE);
    let p = c.predict(1 << 22, 0.05).unwrap();
    assert_eq!((p.tail_probability, p.tail_delay_s), (0.0, 0.0));
    assert!((p.seconds / (0.05 + 4.0 * MIB * 8.0 / 0.94e9) - 1.0).abs() < 0.03, "{p:?}");
}
