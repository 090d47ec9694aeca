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
    /// Completion time of the fetch leg (0 when it is empty).
    pub fetch_leg_seconds: f64,
    /// The target engine's load of the fetched tokens, after both legs (0 when none).
    #[serde(default)]
    pub load_seconds: f64,
    /// Predicted completion: the slower leg, the load and the overhead of a real split.
    pub seconds: f64,
}

impl SplitPoint {
    /// True when both legs are non-empty.
    pub fn is_real_split(&self) -> bool {
        self.recompute_tokens > 0 && self.fetch_tokens > 0
    }
}

impl SplitInputs<'_> {
    /// Evaluates split point `k` (clamped to P).
    pub fn evaluate(&self, k: u64) -> SplitPoint {
        let p = self.prefix_tokens;
        let k = k.min(p);
        let real = k > 0 && k < p;
        let slow = if real { 1.0 + self.interference.max(0.0) } else { 1.0 };
        let compute_leg =
            if k == 0 { 0.0 } else { self.compute_wait_s + slow * self.compute.recompute_seconds(k) };
        let fetch_leg = if k == p {
            0.0
        } else {
            self.fetch_wait_s + slow * self.link.fetch_seconds(p - k, self.bytes_per_token)
        };
        let load = (p - k) as f64 * self.load_s_per_token.max(0.0);
        let seconds = compute_leg.max(fetch_leg) + load + if real { self.overhead_s } else { 0.0 };
        SplitPoint {
            recompute_tokens: k,
            fetch_tokens: p - k,
            compute_leg_seconds: compute_leg,
            fetch_leg_seconds: fetch_leg,
            load_seconds: load,
            seconds,
        }
    }

    /// The best split point on the grid, endpoints included (an endpoint is a pure action).
    pub fn best(&self) -> SplitPoint {
        let p = self.prefix_tokens;
        let g = self.granularity.max(1);
        let k_of = |j: u64| j.saturating_mul(g).min(p);
        let j_lo = self.min_recompute_tokens.min(p).div_ceil(g);
        let j_hi = p.div_ceil(g);
        // Smallest j in [j_lo, j_hi] whose compute leg is no faster than its fetch leg. At j_hi
        // the fetch leg is empty, so the predicate holds there and the search is total.
        let (mut lo, mut hi) = (j_lo, j_hi);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let pt = self.evaluate(k_of(mid));
            if pt.compute_leg_seconds >= pt.fetch_leg_seconds {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let crossing = lo;
        let mut best = self.evaluate(k_of(crossing));
        let mut consider = |j: u64| {
            let pt = self.evaluate(k_of(j));
            if pt.seconds < best.seconds {
                best = pt;
            }
        };
        if crossing > j_lo {
            consider(crossing - 1);
        }
        // Past the crossing, up to the last real split (j_hi − 1), the time is the compute leg
        // plus the load and the overhead: convex in k. Its least is the first j whose next
        // point is no faster (with no load that is the crossing itself).
        if self.load_s_per_token > 0.0 && crossing + 1 < j_hi {
            let (mut lo, mut hi) = (crossing, j_hi - 1);
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
        consider(j_hi);
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
    }

    /// Brute force over every grid point, for comparison.
    fn brute(s: &SplitInputs<'_>) -> SplitPoint {
        let g = s.granularity.max(1);
        let mut best: Option<SplitPoint> = None;
        let mut k = s.min_recompute_tokens.min(s.prefix_tokens).div_ceil(g) * g;
        loop {
            let pt = s.evaluate(k);
            if best.is_none_or(|b| pt.seconds < b.seconds) {
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
                for load in [0.0, 1e-6, 1e-4, 1e-3, 2e-2] {
                    let l = LinkModel::new(gbps, rtt, 1.0).unwrap();
                    let mut s = seed_inputs(c, &l, p);
                    s.bytes_per_token = 131_072.0;
                    s.granularity = g;
                    s.overhead_s = over;
                    s.min_recompute_tokens = kmin;
                    s.interference = interference;
                    s.load_s_per_token = load;
                    assert_eq!(
                        s.best().seconds,
                        brute(&s).seconds,
                        "{gbps} {rtt} {p} {g} {interference} {load}"
                    );
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
}
