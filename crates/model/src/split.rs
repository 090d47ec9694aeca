//! The split plan: recompute the first `k` tokens locally while fetching the last `P − k`
//! concurrently, and pick the `k` that finishes first.
//!
//! This is Cake's idea (Jin et al., "Compute Or Load KV Cache? Why Not Both?",
//! arXiv 2410.03065): compute from the start of the prefix, load from its end, meet in the
//! middle. The two legs use different resources (target GPU, WAN), so
//! `time(k) = max(compute_wait + (1 + i)·recompute(0..k), fetch_wait + (1 + i)·fetch(P − k)) +
//! load·(P − k) + overhead`, where `load` is the target engine's seconds per token to load
//! fetched KV into its pool once it has landed (after both legs: the engine takes the fetched
//! blocks at its next step), and the overhead (an extra scheduling round and the merge) and the
//! interference `i` apply only to a real split (0 < k < P). `i` is how much each leg slows the
//! other when both run at once on shared resources (this host: CPU prefill and QUIC on the
//! same two cores); 0 on separate ones. The daemon learns it from executed splits
//! ([`crate::calibration::interference`]). The compute leg only grows with `k` and the fetch leg
//! (and the load) only shrink, so without a load the optimum sits where the legs cross: a binary
//! search over the engine's block grid finds it in O(log P) evaluations, with no allocation.
//! Past the crossing the time is the compute leg plus the load, convex in `k` (a convex prefill
//! plus a linear load), so a second binary search on its slope finds where a load dearer per
//! token than the prefill stops paying for a longer compute leg.

use serde::{Deserialize, Serialize};

use crate::calibration::normal_cdf;
use crate::compute::ComputeModel;
use crate::link::LinkModel;

/// Everything the split search needs; all values already validated by the caller.
#[derive(Debug, Clone, Copy)]
pub struct SplitInputs<'a> {
    /// Target-region prefill cost.
    pub compute: &'a ComputeModel,
    /// WAN link to the source region.
    pub link: &'a LinkModel,
    /// KV bytes per token in memory.
    pub bytes_per_token: f64,
    /// Prefix length P.
    pub prefix_tokens: u64,
    /// Split points are multiples of this (the engine's block size); ≥ 1.
    pub granularity: u64,
    /// Smallest allowed recompute part (e.g. from an egress cap); ≤ P.
    pub min_recompute_tokens: u64,
    /// Queueing wait before the target's GPU starts.
    pub compute_wait_s: f64,
    /// Queueing wait before the fetch path starts.
    pub fetch_wait_s: f64,
    /// Fixed extra seconds paid by a real split.
    pub overhead_s: f64,
    /// Relative slowdown of each leg of a real split while the other runs (≥ 0).
    pub interference: f64,
    /// Seconds per fetched token for the target engine to load it into its pool (≥ 0).
    pub load_s_per_token: f64,
    /// A real split is a candidate only if its outcome lies within this fraction of its
    /// expected time ([`SplitPoint::confidence`]) with probability at least `min_confidence`.
    pub tolerance: f64,
    /// See `tolerance`; 0 admits every split, however two-valued.
    pub min_confidence: f64,
    /// Relative scatter (sd) of a split's completion around the outcome it comes in at,
    /// learnt from executed splits ([`crate::calibration::SplitScatter`]); 0 takes each
    /// outcome as exact.
    pub noise: f64,
}

/// One evaluated split point.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SplitPoint {
    /// Tokens `[0, k)` recomputed at the target.
    pub recompute_tokens: u64,
    /// Tokens `[k, P)` fetched from the source.
    pub fetch_tokens: u64,
    /// Completion time of the compute leg (0 when it is empty).
    pub compute_leg_seconds: f64,
    /// Expected completion time of the fetch leg (0 when it is empty).
    pub fetch_leg_seconds: f64,
    /// The target engine's load of the fetched tokens, after both legs (0 when none).
    #[serde(default)]
    pub load_seconds: f64,
    /// Predicted completion, expected over the fetch leg's two outcomes: the slower leg, the
    /// load and the overhead of a real split.
    pub seconds: f64,
    /// Probability that the fetch leg comes in late (the link's tail; 0 without one).
    #[serde(default)]
    pub late_probability: f64,
    /// Completion when the fetch leg is on time, and when it is late (both `seconds` where
    /// the link has no tail; 0 in points from before they were recorded).
    #[serde(default)]
    pub on_time_seconds: f64,
    #[serde(default)]
    pub late_seconds: f64,
    /// Relative scatter (sd) of the completion around each outcome (0: exact).
    #[serde(default)]
    pub noise: f64,
}

impl SplitPoint {
    /// True when both legs are non-empty.
    pub fn is_real_split(&self) -> bool {
        self.recompute_tokens > 0 && self.fetch_tokens > 0
    }

    /// Probability that the completion lies within `tolerance` (a fraction) of `seconds`: over
    /// the two outcomes, each taken as its time scaled by `1 + ε`, `ε ~ N(0, noise²)`, the
    /// weight of each outcome times the probability that it lands inside. With no scatter that
    /// is the weight of the outcomes that lie inside: 1 where the fetch leg cannot be late.
    pub fn confidence(&self, tolerance: f64) -> f64 {
        let s = self.seconds;
        let sd = if self.noise.is_finite() { self.noise.max(0.0) } else { 0.0 };
        let within = |x: f64| {
            if sd <= 0.0 || x <= 0.0 {
                return if (x / s - 1.0).abs() <= tolerance { 1.0 } else { 0.0 };
            }
            // x·(1 + ε) ∈ [s(1 − tol), s(1 + tol)]  ⇔  ε ∈ [s(1 − tol)/x − 1, s(1 + tol)/x − 1].
            let lo = s * (1.0 - tolerance) / x - 1.0;
            let hi = s * (1.0 + tolerance) / x - 1.0;
            (normal_cdf(hi / sd) - normal_cdf(lo / sd)).clamp(0.0, 1.0)
        };
        let q = self.late_probability;
        if q.is_nan() || q <= 0.0 {
            return if sd <= 0.0 { 1.0 } else { within(s) };
        }
        (1.0 - q) * within(self.on_time_seconds) + q * within(self.late_seconds)
    }

    /// Standard deviation of the completion, in seconds: each outcome's own scatter (`noise`
    /// times its time) mixed over the two outcomes, plus the spread between them. With no
    /// tail it is `noise · seconds`.
    pub fn sd_s(&self) -> f64 {
        let q = if self.late_probability > 0.0 { self.late_probability.min(1.0) } else { 0.0 };
        let (on, late) =
            if q > 0.0 { (self.on_time_seconds, self.late_seconds) } else { (self.seconds, self.seconds) };
        let n = if self.noise.is_finite() { self.noise.max(0.0) } else { 0.0 };
        let var = (1.0 - q) * (n * on).powi(2) + q * (n * late).powi(2) + q * (1.0 - q) * (late - on).powi(2);
        var.max(0.0).sqrt()
    }
}

/// Most grid points the search evaluates one by one below the on-time crossing and between
/// the two crossings (the rest of its work is binary searches).
const SCAN_POINTS: u64 = 256;

impl SplitInputs<'_> {
    /// Evaluates split point `k` (clamped to P).
    pub fn evaluate(&self, k: u64) -> SplitPoint {
        self.legs(k).0
    }

    /// Split point `k` and its fetch leg's on-time and late completions.
    fn legs(&self, k: u64) -> (SplitPoint, f64, f64) {
        let p = self.prefix_tokens;
        let k = k.min(p);
        let real = k > 0 && k < p;
        let slow = if real { 1.0 + self.interference.max(0.0) } else { 1.0 };
        let compute_leg =
            if k == 0 { 0.0 } else { self.compute_wait_s + slow * self.compute.recompute_seconds(k) };
        let (fetch_leg, on_leg, late_leg, q) = if k == p {
            (0.0, 0.0, 0.0, 0.0)
        } else {
            let b = self.link.fetch_branches(p - k, self.bytes_per_token);
            let leg = |s: f64| self.fetch_wait_s + slow * s;
            (leg(b.mean_s()), leg(b.on_time_s), leg(b.late_s()), b.late_probability)
        };
        let load = (p - k) as f64 * self.load_s_per_token.max(0.0);
        let overhead = if real { self.overhead_s } else { 0.0 };
        let on_time = compute_leg.max(on_leg) + load + overhead;
        let late = compute_leg.max(late_leg) + load + overhead;
        // Below both fetch outcomes the compute leg never decides, and the expectation is the
        // expected fetch leg's (the same sum as the pure fetch's price); above both, it always
        // decides; between them, the mixture.
        let seconds = if compute_leg <= on_leg {
            fetch_leg + load + overhead
        } else if compute_leg >= late_leg || q <= 0.0 {
            compute_leg + load + overhead
        } else {
            (1.0 - q) * on_time + q * late
        };
        let pt = SplitPoint {
            recompute_tokens: k,
            fetch_tokens: p - k,
            compute_leg_seconds: compute_leg,
            fetch_leg_seconds: fetch_leg,
            load_seconds: load,
            seconds,
            late_probability: q,
            on_time_seconds: on_time,
            late_seconds: late,
            noise: if real { self.noise.max(0.0) } else { 0.0 },
        };
        (pt, on_leg, late_leg)
    }

    /// Whether `pt` may be chosen: a pure action always, a real split only if predictable.
    fn admits(&self, pt: &SplitPoint) -> bool {
        !pt.is_real_split()
            || self.min_confidence <= 0.0
            || pt.confidence(self.tolerance) >= self.min_confidence
    }

    /// The best admitted split point on the grid, endpoints included (an endpoint is a pure
    /// action). "Best" is the least expected time.
    ///
    /// With a tail the fetch leg has two outcomes, so there are two crossings: `j1`, where the
    /// compute leg first outlasts an on-time fetch leg, and `j2 ≥ j1`, where it first outlasts
    /// a late one. Below `j1` the time is the expected fetch leg plus the load, which only
    /// falls with `k` (a shorter fetch is faster and less often late), so the best admitted
    /// point there is the last admitted one. From `j2` on both outcomes are the compute leg
    /// (convex, as without a tail), every point admitted. Between them, `(1 − q)·compute +
    /// q·late fetch`, with no shape to rely on, is scanned. Without a tail `j1 = j2` and this
    /// is the plain crossing search. (A scatter, `noise`, admits or rules out every point
    /// from `j2` on alike: there the completion is one outcome, the compute leg.)
    pub fn best(&self) -> SplitPoint {
        let p = self.prefix_tokens;
        let g = self.granularity.max(1);
        let k_of = |j: u64| j.saturating_mul(g).min(p);
        let j_lo = self.min_recompute_tokens.min(p).div_ceil(g);
        let j_hi = p.div_ceil(g);
        // Smallest j in [j_lo, j_hi] whose compute leg is no faster than the chosen fetch leg.
        // At j_hi the fetch leg is empty, so the predicate holds there and the search is total.
        let crossing = |late: bool| {
            let (mut lo, mut hi) = (j_lo, j_hi);
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                let (pt, on, lt) = self.legs(k_of(mid));
                if pt.compute_leg_seconds >= if late { lt } else { on } {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            lo
        };
        let j1 = crossing(false);
        let j2 = crossing(true).max(j1);
        // The pure recompute endpoint is always admitted, so `best` always ends up set.
        let mut best = self.evaluate(k_of(j_hi));
        let mut consider = |j: u64| {
            let pt = self.evaluate(k_of(j));
            let ok = self.admits(&pt);
            if ok && pt.seconds < best.seconds {
                best = pt;
            }
            ok
        };
        for j in (j_lo..j1).rev().take(SCAN_POINTS as usize) {
            if consider(j) {
                break;
            }
        }
        let band = j2 - j1;
        if band <= SCAN_POINTS {
            (j1..=j2).for_each(|j| {
                consider(j);
            });
        } else {
            (0..=SCAN_POINTS).for_each(|i| {
                consider(j1 + band * i / SCAN_POINTS);
            });
        }
        // Past j2, up to the last real split (j_hi − 1), the time is the compute leg plus the
        // load and the overhead: convex in k. Its least is the first j whose next point is no
        // faster (with no load that is j2 itself).
        if self.load_s_per_token > 0.0 && j2 + 1 < j_hi {
            let (mut lo, mut hi) = (j2, j_hi - 1);
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if self.evaluate(k_of(mid + 1)).seconds >= self.evaluate(k_of(mid)).seconds {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            consider(lo);
        }
        // The endpoints are the pure actions (no overhead); a split with overhead can lose to them.
        consider(j_lo);
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::FetchTail;

    fn seed_inputs<'a>(c: &'a ComputeModel, l: &'a LinkModel, p: u64) -> SplitInputs<'a> {
        SplitInputs {
            compute: c,
            link: l,
            bytes_per_token: 327_680.0,
            prefix_tokens: p,
            granularity: 1,
            min_recompute_tokens: 0,
            compute_wait_s: 0.0,
            fetch_wait_s: 0.0,
            overhead_s: 0.0,
            interference: 0.0,
            load_s_per_token: 0.0,
            tolerance: 0.15,
            min_confidence: 0.0,
            noise: 0.0,
        }
    }

    /// Brute force over every grid point, for comparison.
    fn brute(s: &SplitInputs<'_>) -> SplitPoint {
        let g = s.granularity.max(1);
        let mut best: Option<SplitPoint> = None;
        let mut k = s.min_recompute_tokens.min(s.prefix_tokens).div_ceil(g) * g;
        loop {
            let pt = s.evaluate(k);
            if s.admits(&pt) && best.is_none_or(|b| pt.seconds < b.seconds) {
                best = Some(pt);
            }
            if k >= s.prefix_tokens {
                break;
            }
            k = (k + g).min(s.prefix_tokens);
        }
        best.unwrap()
    }

    #[test]
    fn issue_numbers_at_8k_tokens() {
        let c = ComputeModel::new(70e9, 989e12, 0.4, None).unwrap();
        // 100 Gbps: about 7% faster than fetching (279.72 ms).
        let fast = LinkModel::new(100.0, 0.07, 1.0).unwrap();
        let s = seed_inputs(&c, &fast, 8000).best();
        let gain = 1.0 - s.seconds / fast.fetch_seconds(8000, 327_680.0);
        assert!((gain - 0.069).abs() < 0.002, "{gain}");
        // 5 Gbps: about 39% faster than recomputing (2831.14 ms).
        let weak = LinkModel::new(5.0, 0.07, 1.0).unwrap();
        let s = seed_inputs(&c, &weak, 8000).best();
        let gain = 1.0 - s.seconds / c.recompute_seconds(8000);
        assert!((gain - 0.393).abs() < 0.002, "{gain}");
        assert!(s.is_real_split());
    }

    #[test]
    fn search_matches_brute_force() {
        let c = ComputeModel::new(8e9, 312e12, 0.5, None).unwrap();
        for (gbps, rtt, p, g, over, kmin) in [
            (1.0, 0.05, 4096, 16, 0.0, 0),
            (10.0, 0.15, 777, 16, 0.01, 0),
            (0.5, 0.02, 100, 1, 0.0, 40),
            (100.0, 0.07, 16, 16, 0.0, 0),
            (3.0, 0.0, 1, 16, 0.0, 0),
            (2.0, 0.3, 50_000, 64, 0.2, 20_000),
        ] {
            // With a calibrated size correction too: the search relies on the compute leg
            // growing with k, which the correction's least slope keeps.
            let bent = c.with_correction(crate::compute::SizeCorrection::from_fn(1e-4, 0.8, |x| {
                0.4 * (3.0 * x).sin()
            }));
            for (interference, c) in [0.0, 0.1, 0.5, 1.0, 3.0].into_iter().flat_map(|i| [(i, &c), (i, &bent)])
            {
                // Loads from none to dearer per token than the prefill (so the least lies
                // past the crossing, inside the compute leg's range).
                // And with loss tails from none to nearly every fetch late, each with the
                // predictability filter off and on.
                for (load, (hazard, conf)) in [0.0, 1e-6, 1e-4, 1e-3, 2e-2].into_iter().flat_map(|l| {
                    [(0.0, 0.0), (1e-4, 0.0), (1e-3, 0.9), (1e-3, 0.0), (3e-2, 0.6)].map(|t| (l, t))
                }) {
                    let bare = LinkModel::new(gbps, rtt, 1.0).unwrap();
                    let tail = FetchTail {
                        hazard_per_packet: hazard,
                        window_bytes: gbps * 1e9 / 8.0 * rtt,
                        delay_s: rtt.max(0.01),
                    };
                    let l = bare.with_tail(tail).unwrap();
                    let mut s = seed_inputs(c, &l, p);
                    s.bytes_per_token = 131_072.0;
                    s.granularity = g;
                    s.overhead_s = over;
                    s.min_recompute_tokens = kmin;
                    s.interference = interference;
                    s.load_s_per_token = load;
                    s.min_confidence = conf;
                    let (best, reference) = (s.best(), brute(&s));
                    assert_eq!(
                        best.seconds, reference.seconds,
                        "{gbps} {rtt} {p} {g} {interference} {load} {hazard} {conf}"
                    );
                    assert!(s.admits(&best));
                }
            }
        }
    }

    #[test]
    fn interference_slows_real_splits_only_and_can_rule_them_out() {
        let c = ComputeModel::new(70e9, 989e12, 0.4, None).unwrap();
        let weak = LinkModel::new(5.0, 0.07, 1.0).unwrap();
        let mut s = seed_inputs(&c, &weak, 8000);
        let alone = s.best();
        assert!(alone.is_real_split());
        let mut last = alone.seconds;
        for i in [0.1, 0.3, 0.6, 1.0, 2.0] {
            s.interference = i;
            let b = s.best();
            assert!(b.seconds >= last, "more interference, never faster: {i}");
            last = b.seconds;
            // The pure endpoints are unaffected.
            assert_eq!(s.evaluate(0).seconds, weak.fetch_seconds(8000, 327_680.0));
            assert_eq!(s.evaluate(8000).seconds, c.recompute_seconds(8000));
        }
        // When each leg runs at half speed while the other runs, splitting cannot win here.
        s.interference = 1.0;
        assert!(!s.best().is_real_split(), "{:?}", s.best());
    }

    #[test]
    fn the_load_is_paid_after_both_legs_for_the_fetched_tokens_only() {
        let c = ComputeModel::new(70e9, 989e12, 0.4, None).unwrap();
        let weak = LinkModel::new(5.0, 0.07, 1.0).unwrap();
        let mut s = seed_inputs(&c, &weak, 8000);
        let free = s.best();
        s.load_s_per_token = 1e-5;
        // The pure endpoints: a fetch pays the whole load, a recompute none.
        assert_eq!(s.evaluate(0).seconds, weak.fetch_seconds(8000, 327_680.0) + 8000.0 * 1e-5);
        assert_eq!(s.evaluate(8000).seconds, c.recompute_seconds(8000));
        let pt = s.evaluate(free.recompute_tokens);
        assert_eq!(pt.load_seconds, free.fetch_tokens as f64 * 1e-5);
        assert_eq!(pt.seconds, pt.compute_leg_seconds.max(pt.fetch_leg_seconds) + pt.load_seconds);
        // A dearer load never makes the best split faster, and moves it toward recomputing.
        let mut last = s.best();
        for load in [1e-4, 1e-3, 1e-2] {
            s.load_s_per_token = load;
            let b = s.best();
            assert!(b.seconds >= last.seconds && b.recompute_tokens >= last.recompute_tokens, "{load}");
            last = b;
        }
    }

    /// A 0.1 %-loss path at 1 Gbit/s × 50 ms and a prefill of 1.5 ms per token: the bench's
    /// lossy profile, where a 16-token fetch leg is late about half the time.
    fn lossy_inputs<'a>(c: &'a ComputeModel, l: &'a LinkModel, p: u64) -> SplitInputs<'a> {
        let mut s = seed_inputs(c, l, p);
        s.bytes_per_token = 32_768.0;
        s.granularity = 16;
        s.overhead_s = 0.005;
        s
    }

    fn lossy_link() -> LinkModel {
        let tail =
            FetchTail { hazard_per_packet: -(1.0f64 - 1e-3).ln(), window_bytes: 6.25e6, delay_s: 0.05 };
        LinkModel::new(0.95, 0.05, 1.0).unwrap().with_tail(tail).unwrap()
    }

    #[test]
    fn a_late_fetch_leg_is_priced_as_the_expected_slower_leg_not_the_slower_expected_leg() {
        let c = ComputeModel::from_measured(1.5e-3, 0.0).unwrap();
        let l = lossy_link();
        let s = lossy_inputs(&c, &l, 64);
        let pt = s.evaluate(48);
        let q = pt.late_probability;
        assert!(q > 0.2 && q < 0.8, "{q}");
        let expected = (1.0 - q) * pt.on_time_seconds + q * pt.late_seconds;
        assert!((pt.seconds - expected).abs() < 1e-12);
        // E[max] ≥ max(E): the old price, the slower of the expected legs, was too low.
        let naive = pt.compute_leg_seconds.max(pt.fetch_leg_seconds) + pt.load_seconds + s.overhead_s;
        assert!(pt.seconds > naive + 1e-4, "{} vs {naive}", pt.seconds);
        assert!(pt.late_seconds - pt.on_time_seconds > 0.03);
        // Without a tail both outcomes are the one time.
        let bare = LinkModel::new(0.95, 0.05, 1.0).unwrap();
        let b = lossy_inputs(&c, &bare, 64).evaluate(48);
        assert_eq!((b.late_probability, b.on_time_seconds, b.late_seconds), (0.0, b.seconds, b.seconds));
        assert_eq!(b.confidence(0.0), 1.0);
    }

    #[test]
    fn a_split_that_is_a_coin_flip_is_not_admitted_and_a_covered_one_is() {
        let c = ComputeModel::from_measured(1.5e-3, 0.0).unwrap();
        let l = lossy_link();
        let mut s = lossy_inputs(&c, &l, 64);
        let gamble = s.best();
        assert!(gamble.is_real_split(), "{gamble:?}");
        assert!(gamble.confidence(0.15) < 0.9, "{gamble:?}");
        s.min_confidence = 0.9;
        let safe = s.best();
        assert!(s.admits(&safe) && safe.confidence(0.15) >= 0.9, "{safe:?}");
        assert!(safe.seconds >= gamble.seconds);
        // A long prefix: the compute leg can cover a late fetch leg, and that split is kept.
        let mut s = lossy_inputs(&c, &l, 2048);
        s.min_confidence = 0.9;
        let covered = s.best();
        assert!(covered.is_real_split() && covered.confidence(0.15) >= 0.9, "{covered:?}");
        // Confidence is the weight of the outcomes inside the band, monotone in the band.
        let mut last = 0.0;
        for tol in [0.0, 0.05, 0.1, 0.2, 0.5, 1.0] {
            let c = gamble.confidence(tol);
            assert!((0.0..=1.0).contains(&c) && c >= last, "{tol} {c}");
            last = c;
        }
        assert_eq!(gamble.confidence(1.0), 1.0);
    }

    /// The 48/16 split of the lossy link below: on time (87 ms) or late (115 ms) about evenly.
    fn lossy_edge() -> SplitPoint {
        SplitPoint {
            recompute_tokens: 48,
            fetch_tokens: 16,
            compute_leg_seconds: 0.082,
            fetch_leg_seconds: 0.101,
            load_seconds: 0.0,
            seconds: 0.102,
            late_probability: 0.54,
            on_time_seconds: 0.087,
            late_seconds: 0.115,
            noise: 0.0,
        }
    }

    /// run3 of `bench/results/full-2026-12-06-split/`: a 48/16 split on the lossy link, on
    /// time (87 ms) or late (115 ms) about evenly, expected at 102 ms: −14.7 % and +12.7 %,
    /// both inside 15 % taken as exact; it came in 23 % under. With the splits' scatter
    /// counted, each outcome is inside only part of the time and the split is declined.
    #[test]
    fn an_outcome_at_the_edge_of_the_band_counts_only_as_often_as_it_lands_inside() {
        let edge = lossy_edge();
        assert_eq!(edge.confidence(0.15), 1.0);
        let mut last = 1.0;
        for noise in [0.01, 0.02, 0.04, 0.08, 0.2] {
            let c = SplitPoint { noise, ..edge }.confidence(0.15);
            assert!(c < last && c > 0.0, "{noise}: {c}");
            last = c;
        }
        // At the scatter the benches' splits show (a median |error| of 2–3 %: sd ≈ 4 %).
        let c = SplitPoint { noise: 0.04, ..edge }.confidence(0.15);
        assert!(c < 0.75, "{c}");
        // One outcome, well inside the band: the same scatter leaves it predictable; a wide
        // one (an engine whose splits miss by 20 %) does not.
        let steady =
            SplitPoint { late_probability: 0.0, on_time_seconds: 0.102, late_seconds: 0.102, ..edge };
        assert_eq!(steady.confidence(0.15), 1.0);
        assert!(SplitPoint { noise: 0.04, ..steady }.confidence(0.15) > 0.999);
        assert!(SplitPoint { noise: 0.2, ..steady }.confidence(0.15) < 0.6);
        // An outcome just outside the band lands inside some of the time.
        let out =
            SplitPoint { late_probability: 0.1, late_seconds: 0.102 * 1.16, on_time_seconds: 0.1, ..edge };
        assert!((out.confidence(0.15) - 0.9).abs() < 1e-12);
        let c = SplitPoint { noise: 0.04, ..out }.confidence(0.15);
        assert!(c > 0.9 && c < 1.0, "{c}");
    }

    #[test]
    fn the_search_declines_every_split_of_a_link_whose_splits_scatter_widely() {
        let c = ComputeModel::from_measured(1.5e-3, 0.0).unwrap();
        let bare = LinkModel::new(0.95, 0.05, 1.0).unwrap();
        let mut s = lossy_inputs(&c, &bare, 1024);
        s.min_confidence = 0.9;
        let taken = s.best();
        assert!(taken.is_real_split(), "{taken:?}");
        s.noise = 0.04;
        let still = s.best();
        assert_eq!(still.recompute_tokens, taken.recompute_tokens);
        assert_eq!(still.noise, 0.04);
        s.noise = 0.2;
        assert!(!s.best().is_real_split(), "{:?}", s.best());
        // The pure endpoints carry no scatter: they are not splits.
        assert_eq!(s.evaluate(0).noise, 0.0);
        assert_eq!(s.evaluate(1024).noise, 0.0);
    }

    /// The split's sd is the law of total variance over its two outcomes, checked against the
    /// moments of the mixture computed directly (two Gaussians, weights 1 − q and q).
    #[test]
    fn a_splits_sd_is_its_outcomes_scatter_and_their_spread() {
        let pt =
            SplitPoint { late_probability: 0.0, on_time_seconds: 0.102, late_seconds: 0.102, ..lossy_edge() };
        assert_eq!(pt.sd_s(), 0.0);
        // No tail: the scatter around the one outcome.
        assert!((SplitPoint { noise: 0.05, ..pt }.sd_s() - 0.05 * 0.102).abs() < 1e-15);
        // A scatter that is not a number counts as none (as in `confidence`).
        assert_eq!(SplitPoint { noise: f64::NAN, ..pt }.sd_s(), 0.0);
        for (q, n) in [(0.54, 0.0), (0.54, 0.04), (0.1, 0.2), (1.0, 0.03)] {
            let (on, late) = (0.087, 0.115);
            let t =
                SplitPoint { late_probability: q, on_time_seconds: on, late_seconds: late, noise: n, ..pt };
            let mean = (1.0 - q) * on + q * late;
            let second = (1.0 - q) * on * on * (1.0 + n * n) + q * late * late * (1.0 + n * n);
            let direct = (second - mean * mean).max(0.0).sqrt();
            assert!((t.sd_s() - direct).abs() < 1e-12, "{q} {n}: {} vs {direct}", t.sd_s());
        }
        // More scatter never narrows it; a later late outcome never narrows it.
        let base = SplitPoint { late_probability: 0.3, on_time_seconds: 0.087, late_seconds: 0.115, ..pt };
        let mut last = 0.0;
        for n in [0.0, 0.01, 0.05, 0.1] {
            let sd = SplitPoint { noise: n, ..base }.sd_s();
            assert!(sd >= last, "{n}");
            last = sd;
        }
        assert!(SplitPoint { late_seconds: 0.2, ..base }.sd_s() > base.sd_s());
    }
}
