//! Decision quality: did the daemon pick the action that measured faster, and what did a wrong
//! pick cost?
//!
//! For one [`DecisionPoint`] the *best* time is the smaller of the two measured times; the
//! *chosen* time is the measured time of the action the daemon chose. A decision is **correct**
//! when the chosen time equals the best (a tie counts as correct, whichever was chosen). Its
//! **regret** is `chosen / best − 1` (0 for a correct decision).
//!
//! A **hedge** (`chosen == "hedge"`) runs both actions and keeps the first to finish, so it can
//! only approach the best time, never beat it by choice: its chosen time is its own measured
//! wall ([`DecisionPoint::measured_hedge_s`]), and it counts as correct when its regret is at
//! most [`HEDGE_TOLERANCE`] (what running both cost on top of the faster action).
//!
//! Edge cases, defined rather than left to floating point:
//! - a `chosen` other than `"fetch"`, `"recompute"` or `"hedge"` (or a hedge without its
//!   measured time) is always wrong, and is charged the slower of the two measured times;
//! - the regret is 0 when the best time is 0 or not finite, or when the chosen time is not finite
//!   (such points are reported by [`crate::check::check`]; a regret derived from them would be
//!   meaningless), and it is never negative;
//! - an empty set of points summarises to `n = 0`, `accuracy = 0`, `mean_regret = 0`,
//!   `worst_regret = 0` (never NaN).

use crate::report::{DecisionPoint, DecisionSummary};

/// The profile name of the summary over every point.
pub const ALL_PROFILES: &str = "all";

/// The most regret a hedge may carry and still count as correct: 5 % over the faster pure
/// action (the price of running both on shared cores, and of cancelling the loser).
pub const HEDGE_TOLERANCE: f64 = 0.05;

/// The action that measured faster at one decision point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Winner {
    /// Fetching the KV cache was faster.
    Fetch,
    /// Recomputing the prefix was faster.
    Recompute,
    /// Both measured the same (either choice is correct).
    Tie,
}

impl Winner {
    /// `fetch`, `recompute` or `tie`.
    pub fn as_str(self) -> &'static str {
        match self {
            Winner::Fetch => "fetch",
            Winner::Recompute => "recompute",
            Winner::Tie => "tie",
        }
    }
}

/// How one decision turned out, measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// The faster action, measured.
    pub winner: Winner,
    /// `min(measured_fetch_s, measured_recompute_s)`.
    pub best_s: f64,
    /// The measured time of the chosen action (the slower one for an unknown `chosen`).
    pub chosen_s: f64,
    /// The chosen action was (one of) the fastest.
    pub correct: bool,
    /// `chosen_s / best_s − 1`, ≥ 0 (see the module docs for the guards).
    pub regret: f64,
}

/// Evaluates one decision point (see the module docs for the definitions).
pub fn outcome(p: &DecisionPoint) -> Outcome {
    let (f, r) = (p.measured_fetch_s, p.measured_recompute_s);
    let best_s = f.min(r);
    let winner = if f < r {
        Winner::Fetch
    } else if r < f {
        Winner::Recompute
    } else {
        Winner::Tie
    };
    let (chosen_s, known, hedge) = match (p.chosen.as_str(), p.measured_hedge_s) {
        ("fetch", _) => (f, true, false),
        ("recompute", _) => (r, true, false),
        ("hedge", Some(h)) => (h, true, true),
        _ => (f.max(r), false, false),
    };
    let exact = known && chosen_s == best_s;
    let regret = if exact || !(best_s.is_finite() && best_s > 0.0 && chosen_s.is_finite()) {
        0.0
    } else {
        (chosen_s / best_s - 1.0).max(0.0)
    };
    let correct = exact || (hedge && regret <= HEDGE_TOLERANCE);
    Outcome { winner, best_s, chosen_s, correct, regret }
}

/// Decision quality of `points`, labelled `profile`: accuracy (share correct), mean and worst
/// regret. `n = 0` gives accuracy 0 and regrets 0.
pub fn summarize(profile: &str, points: &[&DecisionPoint]) -> DecisionSummary {
    let n = points.len();
    if n == 0 {
        return DecisionSummary {
            profile: profile.to_owned(),
            n: 0,
            accuracy: 0.0,
            mean_regret: 0.0,
            worst_regret: 0.0,
        };
    }
    let mut correct = 0usize;
    let mut sum = 0.0f64;
    let mut worst = 0.0f64;
    for p in points {
        let o = outcome(p);
        correct += usize::from(o.correct);
        sum += o.regret;
        worst = worst.max(o.regret);
    }
    DecisionSummary {
        profile: profile.to_owned(),
        n,
        accuracy: correct as f64 / n as f64,
        // The rounding of a sum of equal values can put the mean an ulp above them.
        mean_regret: (sum / n as f64).min(worst),
        worst_regret: worst,
    }
}

/// Median |measured ÷ predicted − 1| of one action over decision points whose calibration had
/// `samples_lo..=samples_hi` samples when it predicted.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorBucket {
    pub action: &'static str,
    pub samples_lo: u32,
    pub samples_hi: u32,
    pub n: usize,
    pub median_abs_error: f64,
}

/// The median of a non-empty `v` (sorted in place; the mean of the middle two when even).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len();
    if m % 2 == 1 { v[m / 2] } else { (v[m / 2 - 1] + v[m / 2]) / 2.0 }
}

/// Sample-count buckets of [`error_by_samples`].
pub const SAMPLE_BUCKETS: [(u32, u32); 4] = [(0, 0), (1, 2), (3, 9), (10, u32::MAX)];

/// Each decision point's prediction error for `action` (`fetch` or `recompute`): the
/// calibration samples behind its prediction and |measured ÷ predicted − 1|, in point order.
/// Points with a non-finite or non-positive prediction or measurement are skipped.
pub fn prediction_errors(points: &[DecisionPoint], action: &str) -> Vec<(u32, f64)> {
    points
        .iter()
        .filter_map(|p| {
            let (pred, meas, n) = match action {
                "fetch" => (p.predicted_fetch_s, p.measured_fetch_s, p.fetch_samples),
                "recompute" => (p.predicted_recompute_s, p.measured_recompute_s, p.recompute_samples),
                _ => return None,
            };
            let ok = pred.is_finite() && meas.is_finite() && pred > 0.0 && meas > 0.0;
            ok.then(|| (n, (meas / pred - 1.0).abs()))
        })
        .collect()
}

/// Prediction error against the number of calibration samples, per action and bucket of
/// [`SAMPLE_BUCKETS`] (empty buckets left out): the error should fall as samples accumulate.
/// Points with a non-finite or non-positive prediction or measurement are skipped.
pub fn error_by_samples(points: &[DecisionPoint]) -> Vec<ErrorBucket> {
    let mut out = Vec::new();
    for action in ["fetch", "recompute"] {
        let all = prediction_errors(points, action);
        for (lo, hi) in SAMPLE_BUCKETS {
            let mut errs: Vec<f64> =
                all.iter().filter(|(n, _)| (lo..=hi).contains(n)).map(|&(_, e)| e).collect();
            if errs.is_empty() {
                continue;
            }
            let (n, median_abs_error) = (errs.len(), median(&mut errs));
            out.push(ErrorBucket { action, samples_lo: lo, samples_hi: hi, n, median_abs_error });
        }
    }
    out
}

/// How well one action's bands describe its outcomes: of the `n` points with a band (sd > 0),
/// the share whose measurement fell within 1 and 2 sd of the prediction (a Gaussian's: 68 %
/// and 95 %) and the median |measured − predicted| / sd. Bands much wider than the outcomes'
/// spread (coverage near 100 %, median z ≪ 0.67) make hedges look cheaper than they are — a
/// race of two wide Gaussians is expected to end early; bands too narrow hide the crossover.
#[derive(Debug, Clone, PartialEq)]
pub struct BandCoverage {
    pub action: &'static str,
    pub n: usize,
    pub within_1sd: f64,
    pub within_2sd: f64,
    pub median_z: f64,
}

/// [`BandCoverage`] of fetch and of recompute (an action without banded points is left out).
pub fn band_coverage(points: &[DecisionPoint]) -> Vec<BandCoverage> {
    let mut out = Vec::new();
    for action in ["fetch", "recompute"] {
        let mut z: Vec<f64> = points
            .iter()
            .filter_map(|p| {
                let (pred, sd, meas) = match action {
                    "fetch" => (p.predicted_fetch_s, p.predicted_fetch_sd_s, p.measured_fetch_s),
                    _ => (p.predicted_recompute_s, p.predicted_recompute_sd_s, p.measured_recompute_s),
                };
                let ok = pred.is_finite() && meas.is_finite() && sd.is_finite() && sd > 0.0 && meas > 0.0;
                ok.then(|| (meas - pred).abs() / sd)
            })
            .collect();
        if z.is_empty() {
            continue;
        }
        let n = z.len();
        let median_z = median(&mut z);
        let share = |k: f64| z.iter().filter(|&&v| v <= k).count() as f64 / n as f64;
        out.push(BandCoverage { action, n, within_1sd: share(1.0), within_2sd: share(2.0), median_z });
    }
    out
}

/// One summary per link profile, in the order profiles first appear in `points`, then one over
/// every point with profile [`ALL_PROFILES`] (always present, `n = 0` for no points).
pub fn summaries(points: &[DecisionPoint]) -> Vec<DecisionSummary> {
    let mut order: Vec<&str> = Vec::new();
    for p in points {
        if !order.contains(&p.link.profile.as_str()) {
            order.push(&p.link.profile);
        }
    }
    let mut out: Vec<DecisionSummary> = order
        .iter()
        .map(|prof| {
            let group: Vec<&DecisionPoint> = points.iter().filter(|p| p.link.profile == *prof).collect();
            summarize(prof, &group)
        })
        .collect();
    let all: Vec<&DecisionPoint> = points.iter().collect();
    out.push(summarize(ALL_PROFILES, &all));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::LinkSpec;
    use proptest::prelude::*;

    fn point(profile: &str, chosen: &str, f: f64, r: f64) -> DecisionPoint {
        DecisionPoint {
            link: LinkSpec { profile: profile.into(), rate_bps: 1e9, rtt_s: 0.05, loss: 0.0 },
            prefix_tokens: 4096,
            chosen: chosen.into(),
            predicted_fetch_s: f,
            predicted_recompute_s: r,
            measured_fetch_s: f,
            measured_recompute_s: r,
            fetch_load_s: 0.0,
            modeled_crossover_tokens: Some(2000.0),
            fetch_samples: 0,
            recompute_samples: 0,
            predicted_fetch_sd_s: 0.0,
            predicted_recompute_sd_s: 0.0,
            predicted_fetch_late_p: 0.0,
            measured_hedge_s: None,
            hedge_winner: None,
        }
    }

    #[test]
    fn errors_are_bucketed_by_samples() {
        let mut pts = Vec::new();
        for (k, err) in [(0u32, 1.0), (0, 3.0), (5, 0.2), (12, 0.05), (12, 0.07), (12, 0.09)] {
            let mut p = point("a", "fetch", 1.0, 1.0);
            (p.fetch_samples, p.recompute_samples) = (k, k);
            p.measured_fetch_s = 1.0 + err;
            p.measured_recompute_s = 1.0 - err / 10.0;
            pts.push(p);
        }
        let mut bad = point("a", "fetch", f64::NAN, 0.0);
        bad.fetch_samples = 1;
        pts.push(bad);
        let b = error_by_samples(&pts);
        let fetch: Vec<_> = b.iter().filter(|x| x.action == "fetch").map(|x| (x.samples_lo, x.n)).collect();
        assert_eq!(fetch, vec![(0, 2), (3, 1), (10, 3)], "the NaN point is skipped, (1, 2) is empty");
        let f0 = b.iter().find(|x| x.action == "fetch" && x.samples_lo == 0).unwrap();
        assert!((f0.median_abs_error - 2.0).abs() < 1e-12);
        let f10 = b.iter().find(|x| x.action == "fetch" && x.samples_lo == 10).unwrap();
        assert!((f10.median_abs_error - 0.07).abs() < 1e-12);
        assert!(b.iter().filter(|x| x.action == "recompute").all(|x| x.median_abs_error < 0.31));
        assert!(error_by_samples(&[]).is_empty());
    }

    #[test]
    fn band_coverage_counts_outcomes_within_one_and_two_sd() {
        let mut pts = Vec::new();
        // Fetch: predicted 1.0 ± 0.1, measured 0.05, 0.15, 0.25 and 0.5 off: z 0.5, 1.5, 2.5, 5.
        for off in [0.05, -0.15, 0.25, 0.5] {
            let mut p = point("a", "fetch", 1.0, 2.0);
            p.predicted_fetch_sd_s = 0.1;
            p.measured_fetch_s = 1.0 + off;
            pts.push(p);
        }
        // No band (sd 0, old reports) and a NaN measurement: left out.
        pts.push(point("a", "fetch", 1.0, 2.0));
        let mut nan = point("a", "fetch", 1.0, 2.0);
        (nan.predicted_fetch_sd_s, nan.measured_fetch_s) = (0.1, f64::NAN);
        pts.push(nan);
        let b = band_coverage(&pts);
        assert_eq!(b.len(), 1, "recompute has no band: {b:?}");
        let f = &b[0];
        assert_eq!((f.action, f.n), ("fetch", 4));
        assert!((f.within_1sd - 0.25).abs() < 1e-12 && (f.within_2sd - 0.5).abs() < 1e-12, "{f:?}");
        assert!((f.median_z - 2.0).abs() < 1e-9, "median of 0.5, 1.5, 2.5, 5: {f:?}");
        assert!(band_coverage(&[]).is_empty());
    }

    #[test]
    fn right_choice_has_no_regret() {
        let o = outcome(&point("a", "fetch", 1.0, 2.0));
        assert!(o.correct);
        assert_eq!(o.winner, Winner::Fetch);
        assert_eq!(o.regret, 0.0);
        let o = outcome(&point("a", "recompute", 3.0, 2.0));
        assert!(o.correct);
        assert_eq!(o.winner, Winner::Recompute);
        assert_eq!(o.regret, 0.0);
    }

    #[test]
    fn wrong_choice_regret_is_ratio_minus_one() {
        let o = outcome(&point("a", "recompute", 1.0, 3.0));
        assert!(!o.correct);
        assert_eq!(o.chosen_s, 3.0);
        assert!((o.regret - 2.0).abs() < 1e-12);
    }

    #[test]
    fn tie_is_correct_either_way() {
        for c in ["fetch", "recompute"] {
            let o = outcome(&point("a", c, 2.0, 2.0));
            assert!(o.correct);
            assert_eq!(o.winner, Winner::Tie);
            assert_eq!(o.regret, 0.0);
        }
    }

    #[test]
    fn unknown_choice_is_wrong_and_charged_the_worst() {
        let o = outcome(&point("a", "split", 1.0, 4.0));
        assert!(!o.correct);
        assert_eq!(o.chosen_s, 4.0);
        assert!((o.regret - 3.0).abs() < 1e-12);
        // Even on a tie.
        let o = outcome(&point("a", "", 2.0, 2.0));
        assert!(!o.correct);
        assert_eq!(o.regret, 0.0);
    }

    #[test]
    fn degenerate_times_give_zero_regret() {
        assert_eq!(outcome(&point("a", "recompute", 0.0, 1.0)).regret, 0.0);
        assert_eq!(outcome(&point("a", "recompute", f64::NAN, 1.0)).regret, 0.0);
        assert_eq!(outcome(&point("a", "recompute", 1.0, f64::INFINITY)).regret, 0.0);
    }

    #[test]
    fn empty_is_defined() {
        let s = summarize("x", &[]);
        assert_eq!(
            s,
            DecisionSummary { profile: "x".into(), n: 0, accuracy: 0.0, mean_regret: 0.0, worst_regret: 0.0 }
        );
        let all = summaries(&[]);
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].profile, ALL_PROFILES);
        assert_eq!(all[0].n, 0);
    }

    #[test]
    fn a_hedge_is_judged_by_its_own_time_within_the_tolerance() {
        let hedge = |h: Option<f64>| {
            let mut p = point("a", "hedge", 1.0, 2.0);
            p.measured_hedge_s = h;
            p
        };
        // Within the tolerance of the faster action: correct, its regret still reported.
        let o = outcome(&hedge(Some(1.04)));
        assert!(o.correct && (o.regret - 0.04).abs() < 1e-12 && o.chosen_s == 1.04, "{o:?}");
        // Faster than both measured separately (noise): correct, no regret.
        let o = outcome(&hedge(Some(0.9)));
        assert!(o.correct && o.regret == 0.0, "{o:?}");
        // Past the tolerance: wrong, charged its own time (not the slower action's).
        let o = outcome(&hedge(Some(1.5)));
        assert!(!o.correct && (o.regret - 0.5).abs() < 1e-12, "{o:?}");
        // A hedge without a measured time is an unknown choice.
        let o = outcome(&hedge(None));
        assert!(!o.correct && (o.regret - 1.0).abs() < 1e-12, "{o:?}");
    }

    #[test]
    fn summaries_group_in_first_seen_order() {
        let pts = vec![
            point("b", "fetch", 1.0, 2.0),
            point("a", "fetch", 3.0, 1.0),
            point("b", "recompute", 1.0, 1.5),
            point("a", "recompute", 3.0, 1.0),
        ];
        let s = summaries(&pts);
        let names: Vec<&str> = s.iter().map(|s| s.profile.as_str()).collect();
        assert_eq!(names, ["b", "a", "all"]);
        assert_eq!(s[0].n, 2);
        assert!((s[0].accuracy - 0.5).abs() < 1e-12);
        assert!((s[0].mean_regret - 0.25).abs() < 1e-12);
        assert!((s[0].worst_regret - 0.5).abs() < 1e-12);
        assert!((s[1].accuracy - 0.5).abs() < 1e-12);
        assert!((s[1].worst_regret - 2.0).abs() < 1e-12);
        assert_eq!(s[2].n, 4);
        assert!((s[2].accuracy - 0.5).abs() < 1e-12);
        assert!((s[2].mean_regret - 2.5 / 4.0).abs() < 1e-12);
        assert!((s[2].worst_regret - 2.0).abs() < 1e-12);
    }

    fn arb_point() -> impl Strategy<Value = DecisionPoint> {
        (
            prop::sample::select(vec!["p1", "p2", "p3"]),
            prop::sample::select(vec!["fetch", "recompute", "split", "hedge", ""]),
            prop_oneof![4 => 0.0f64..1e4, 1 => Just(0.0), 1 => Just(f64::INFINITY), 1 => Just(f64::NAN)],
            prop_oneof![4 => 0.0f64..1e4, 1 => Just(0.0), 1 => Just(f64::INFINITY), 1 => Just(f64::NAN)],
            prop::option::of(prop_oneof![
                4 => 0.0f64..1e4,
                1 => Just(0.0),
                1 => Just(f64::INFINITY),
                1 => Just(f64::NAN)
            ]),
        )
            .prop_map(|(prof, c, f, r, h)| {
                let mut p = point(prof, c, f, r);
                p.measured_hedge_s = h;
                p
            })
    }

    proptest! {
        #[test]
        fn summary_invariants(points in prop::collection::vec(arb_point(), 0..40)) {
            let s = summaries(&points);
            let (all, per) = s.split_last().unwrap();
            prop_assert_eq!(all.profile.as_str(), ALL_PROFILES);
            prop_assert_eq!(all.n, points.len());
            prop_assert_eq!(per.iter().map(|s| s.n).sum::<usize>(), all.n);
            for s in &s {
                prop_assert!((0.0..=1.0).contains(&s.accuracy), "{s:?}");
                prop_assert!(s.mean_regret >= 0.0 && s.mean_regret.is_finite(), "{s:?}");
                prop_assert!(s.worst_regret >= 0.0 && s.worst_regret.is_finite(), "{s:?}");
                prop_assert!(s.worst_regret >= s.mean_regret, "{s:?}");
            }
        }

        #[test]
        fn choosing_the_faster_action_is_free(f in 1e-6f64..1e4, r in 1e-6f64..1e4) {
            let chosen = if f <= r { "fetch" } else { "recompute" };
            let o = outcome(&point("p", chosen, f, r));
            prop_assert!(o.correct);
            prop_assert_eq!(o.regret, 0.0);
            let s = summarize("p", &[&point("p", chosen, f, r)]);
            prop_assert_eq!(s.accuracy, 1.0);
            prop_assert_eq!(s.worst_regret, 0.0);
        }

        #[test]
        fn choosing_the_slower_action_costs_the_ratio(f in 1e-3f64..1e4, r in 1e-3f64..1e4) {
            prop_assume!(f != r);
            let chosen = if f > r { "fetch" } else { "recompute" };
            let o = outcome(&point("p", chosen, f, r));
            prop_assert!(!o.correct);
            let want = f.max(r) / f.min(r) - 1.0;
            prop_assert!((o.regret - want).abs() <= 1e-9 * want.max(1.0));
        }
    }
}
