//! Consistency checks: what makes a bench run *wrong* (as opposed to slow). A report with any
//! problem fails the bench; a slow but consistent report passes (its misses go in the notes).
//!
//! Checked:
//! - every transfer and every baseline that ran was verified byte for byte (a baseline that could
//!   not run is [`BaselinePoint::is_skipped`] and is not a problem);
//! - times, rates, goodputs and CPU figures are finite and not negative; a transfer or a baseline
//!   that ran took some time (`wall_s > 0`); links have a positive rate and a loss in \[0, 1\];
//! - every goodput agrees with its bytes and its time (`bytes × 8 / wall_s`) within
//!   [`GOODPUT_TOLERANCE`], the modeled goodput with the modeled fetch time likewise;
//! - every decision chose `fetch` or `recompute`, and its modeled crossover (if any) is finite and
//!   not negative;
//! - `decision_summary` equals [`crate::stats::summaries`] of the decisions, within
//!   [`SUMMARY_TOLERANCE`];
//! - no split recomputes more tokens than its prefix has.

use crate::report::{BaselinePoint, BenchReport, LinkSpec, TransferPoint};
use crate::stats::summaries;

/// Relative difference allowed between a stated goodput and `bytes × 8 / seconds`.
pub const GOODPUT_TOLERANCE: f64 = 0.01;

/// Absolute difference allowed between a stated and a recomputed summary figure.
pub const SUMMARY_TOLERANCE: f64 = 1e-9;

/// Every problem of `r`, one readable sentence each, naming the point (empty: consistent).
pub fn check(r: &BenchReport) -> Vec<String> {
    let mut out = Vec::new();
    for (i, t) in r.transfers.iter().enumerate() {
        check_transfer(
            &format!("transfer #{i} ({}, {} bytes)", t.link.profile, t.session_bytes),
            t,
            &mut out,
        );
    }
    for (i, b) in r.baselines.iter().enumerate() {
        check_baseline(&format!("baseline #{i} ({} on {})", b.name, b.link.profile), b, &mut out);
    }
    for (i, d) in r.decisions.iter().enumerate() {
        let what = format!("decision #{i} ({}, {} tokens)", d.link.profile, d.prefix_tokens);
        check_link(&what, &d.link, &mut out);
        match (d.chosen.as_str(), d.measured_hedge_s) {
            ("fetch" | "recompute", None) => {}
            ("hedge", Some(h)) => non_negative(&what, "measured_hedge_s", h, &mut out),
            ("hedge", None) => out.push(format!("{what}: a hedge without its measured time")),
            ("fetch" | "recompute", Some(_)) => {
                out.push(format!("{what}: a measured hedge time on a {} decision", d.chosen))
            }
            _ => out
                .push(format!("{what}: chosen is {:?}, not \"fetch\", \"recompute\" or \"hedge\"", d.chosen)),
        }
        for (name, v) in [
            ("predicted_fetch_s", d.predicted_fetch_s),
            ("predicted_recompute_s", d.predicted_recompute_s),
            ("measured_fetch_s", d.measured_fetch_s),
            ("measured_recompute_s", d.measured_recompute_s),
        ] {
            non_negative(&what, name, v, &mut out);
        }
        if let Some(c) = d.modeled_crossover_tokens {
            non_negative(&what, "modeled_crossover_tokens", c, &mut out);
        }
    }
    check_summary(r, &mut out);
    for (i, s) in r.splits.iter().enumerate() {
        let what = format!("split #{i} ({}, {} tokens)", s.link.profile, s.prefix_tokens);
        check_link(&what, &s.link, &mut out);
        if s.split_recompute_tokens > s.prefix_tokens {
            out.push(format!(
                "{what}: recomputes {} tokens, more than the prefix's {}",
                s.split_recompute_tokens, s.prefix_tokens
            ));
        }
        for (name, v) in [
            ("predicted_split_s", s.predicted_split_s),
            ("measured_split_s", s.measured_split_s),
            ("measured_fetch_s", s.measured_fetch_s),
            ("measured_recompute_s", s.measured_recompute_s),
            ("compute_leg_s", s.compute_leg_s),
            ("fetch_leg_s", s.fetch_leg_s),
            ("predicted_compute_leg_s", s.predicted_compute_leg_s),
            ("predicted_fetch_leg_s", s.predicted_fetch_leg_s),
            ("host_steal_s", s.host_steal_s.unwrap_or(0.0)),
        ] {
            non_negative(&what, name, v, &mut out);
        }
    }
    out
}

fn check_transfer(what: &str, t: &TransferPoint, out: &mut Vec<String>) {
    check_link(what, &t.link, out);
    if !t.verified {
        out.push(format!("{what}: not verified (the target's blocks differ from the source's)"));
    }
    for (name, v) in [
        ("wall_s", t.wall_s),
        ("goodput_bps", t.goodput_bps),
        ("model_fetch_s", t.model_fetch_s),
        ("model_goodput_bps", t.model_goodput_bps),
        ("daemon_predicted_s", t.daemon_predicted_s),
        ("first_layer_s", t.first_layer_s),
        ("cpu_s_per_gib_source", t.cpu_s_per_gib_source),
        ("cpu_s_per_gib_target", t.cpu_s_per_gib_target),
    ] {
        non_negative(what, name, v, out);
    }
    positive_time(what, "wall_s", t.wall_s, out);
    positive_time(what, "model_fetch_s", t.model_fetch_s, out);
    consistent_goodput(what, "goodput_bps", t.goodput_bps, t.session_bytes, t.wall_s, out);
    consistent_goodput(what, "model_goodput_bps", t.model_goodput_bps, t.session_bytes, t.model_fetch_s, out);
}

fn check_baseline(what: &str, b: &BaselinePoint, out: &mut Vec<String>) {
    check_link(what, &b.link, out);
    if b.is_skipped() {
        return;
    }
    if !b.verified {
        out.push(format!(
            "{what}: not verified (a baseline that could not run needs wall_s = 0 and a note \
             starting \"skipped:\"; note: {:?})",
            b.note
        ));
    }
    for (name, v) in [
        ("wall_s", b.wall_s),
        ("goodput_bps", b.goodput_bps),
        ("cpu_s_sender", b.cpu_s_sender),
        ("cpu_s_receiver", b.cpu_s_receiver),
    ] {
        non_negative(what, name, v, out);
    }
    positive_time(what, "wall_s", b.wall_s, out);
    consistent_goodput(what, "goodput_bps", b.goodput_bps, b.bytes, b.wall_s, out);
}

fn check_link(what: &str, l: &LinkSpec, out: &mut Vec<String>) {
    if !(l.rate_bps.is_finite() && l.rate_bps > 0.0) {
        out.push(format!("{what}: link rate_bps is {}, not a positive number", l.rate_bps));
    }
    non_negative(what, "link rtt_s", l.rtt_s, out);
    if !(0.0..=1.0).contains(&l.loss) {
        out.push(format!("{what}: link loss is {}, not in [0, 1]", l.loss));
    }
}

fn non_negative(what: &str, name: &str, v: f64, out: &mut Vec<String>) {
    if !v.is_finite() {
        out.push(format!("{what}: {name} is {v}, not finite"));
    } else if v < 0.0 {
        out.push(format!("{what}: {name} is negative ({v})"));
    }
}

/// A finite, non-negative time that must also be non-zero (reported once: `non_negative` has
/// already reported the other cases).
fn positive_time(what: &str, name: &str, v: f64, out: &mut Vec<String>) {
    if v == 0.0 {
        out.push(format!("{what}: {name} is 0"));
    }
}

fn consistent_goodput(what: &str, name: &str, goodput: f64, bytes: u64, secs: f64, out: &mut Vec<String>) {
    if !(goodput.is_finite() && secs.is_finite() && secs > 0.0) {
        return; // Reported as non-finite or zero already.
    }
    let want = bytes as f64 * 8.0 / secs;
    let off = (goodput - want).abs();
    let bad = if want == 0.0 { off > 0.0 } else { off > GOODPUT_TOLERANCE * want };
    if bad {
        out.push(format!(
            "{what}: {name} {goodput:.6e} disagrees with bytes × 8 / time = {want:.6e} (off by more than {} %)",
            GOODPUT_TOLERANCE * 100.0
        ));
    }
}

fn check_summary(r: &BenchReport, out: &mut Vec<String>) {
    let want = summaries(&r.decisions);
    let got = &r.decision_summary;
    if got.len() != want.len() {
        out.push(format!(
            "decision_summary has {} entries, the decisions give {} ({})",
            got.len(),
            want.len(),
            want.iter().map(|s| s.profile.as_str()).collect::<Vec<_>>().join(", ")
        ));
        return;
    }
    let close = |a: f64, b: f64| (a - b).abs() <= SUMMARY_TOLERANCE;
    for (g, w) in got.iter().zip(&want) {
        if g.profile != w.profile
            || g.n != w.n
            || !close(g.accuracy, w.accuracy)
            || !close(g.mean_regret, w.mean_regret)
            || !close(g.worst_regret, w.worst_regret)
        {
            out.push(format!("decision_summary entry {g:?} disagrees with the decisions' {w:?}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::sample_report;

    fn one_problem(r: &BenchReport, needle: &str) {
        problems(r, needle, 1);
    }

    fn problems(r: &BenchReport, needle: &str, n: usize) {
        let p = check(r);
        assert_eq!(p.len(), n, "{p:#?}");
        assert!(p.iter().all(|p| p.contains(needle)), "{p:#?} lacks {needle:?}");
    }

    #[test]
    fn sample_is_consistent() {
        let r = sample_report();
        assert!(r.baselines.iter().any(BaselinePoint::is_skipped));
        assert_eq!(check(&r), Vec::<String>::new());
    }

    #[test]
    fn empty_report_is_consistent() {
        let mut r = sample_report();
        r.transfers.clear();
        r.baselines.clear();
        r.decisions.clear();
        r.splits.clear();
        r.decision_summary = summaries(&[]);
        assert_eq!(check(&r), Vec::<String>::new());
    }

    #[test]
    fn unverified_transfer() {
        let mut r = sample_report();
        r.transfers[1].verified = false;
        one_problem(&r, "transfer #1");
    }

    #[test]
    fn unverified_baseline() {
        let mut r = sample_report();
        let i = r.baselines.iter().position(|b| !b.is_skipped()).unwrap();
        r.baselines[i].verified = false;
        one_problem(&r, "not verified");
    }

    #[test]
    fn skipped_needs_zero_wall_and_the_prefix() {
        let mut r = sample_report();
        let i = r.baselines.iter().position(BaselinePoint::is_skipped).unwrap();
        r.baselines[i].note = "could not run".into();
        let p = check(&r);
        assert_eq!(p.len(), 2, "{p:#?}");
        assert!(p[0].contains("not verified") && p[1].contains("wall_s is 0"), "{p:#?}");
        let mut r = sample_report();
        r.baselines[i].wall_s = 1.0;
        assert!(!check(&r).is_empty());
    }

    #[test]
    fn non_finite_time() {
        let mut r = sample_report();
        r.transfers[0].first_layer_s = f64::NAN;
        one_problem(&r, "first_layer_s is NaN");
        let mut r = sample_report();
        r.splits[0].measured_split_s = f64::INFINITY;
        one_problem(&r, "measured_split_s is inf");
    }

    #[test]
    fn negative_time() {
        let mut r = sample_report();
        r.transfers[0].daemon_predicted_s = -1.0;
        one_problem(&r, "daemon_predicted_s is negative");
        let mut r = sample_report();
        r.transfers[0].cpu_s_per_gib_target = -0.5;
        one_problem(&r, "cpu_s_per_gib_target is negative");
    }

    #[test]
    fn zero_wall_transfer() {
        let mut r = sample_report();
        r.transfers[0].wall_s = 0.0;
        one_problem(&r, "wall_s is 0");
    }

    #[test]
    fn negative_decision_time() {
        let mut r = sample_report();
        // Keep the summary consistent so that only the time is reported.
        r.decisions[0].predicted_recompute_s = -0.1;
        one_problem(&r, "predicted_recompute_s is negative");
    }

    #[test]
    fn goodput_inconsistent_with_bytes_and_wall() {
        let mut r = sample_report();
        r.transfers[2].goodput_bps *= 1.02;
        one_problem(&r, "goodput_bps");
        // Within 1 % passes.
        let mut r = sample_report();
        r.transfers[2].goodput_bps *= 1.005;
        assert_eq!(check(&r), Vec::<String>::new());
    }

    #[test]
    fn baseline_goodput_inconsistent() {
        let mut r = sample_report();
        let i = r.baselines.iter().position(|b| !b.is_skipped()).unwrap();
        r.baselines[i].goodput_bps *= 0.9;
        one_problem(&r, "goodput_bps");
    }

    #[test]
    fn model_goodput_inconsistent_with_model_fetch() {
        let mut r = sample_report();
        r.transfers[0].model_fetch_s *= 1.5;
        one_problem(&r, "model_goodput_bps");
    }

    #[test]
    fn stale_summary() {
        let mut r = sample_report();
        r.decision_summary[0].accuracy -= 0.25;
        one_problem(&r, "decision_summary entry");
        let mut r = sample_report();
        r.decision_summary[3].worst_regret += 1e-6;
        one_problem(&r, "decision_summary entry");
        let mut r = sample_report();
        r.decision_summary[3].worst_regret += 1e-12;
        assert_eq!(check(&r), Vec::<String>::new(), "within 1e-9");
        let mut r = sample_report();
        r.decision_summary.pop();
        one_problem(&r, "decision_summary has");
        let mut r = sample_report();
        // A measured time that flips the winner makes the stored summary stale.
        let d = &mut r.decisions[0];
        if d.chosen == "fetch" {
            d.measured_fetch_s = d.measured_recompute_s * 3.0;
        } else {
            d.measured_recompute_s = d.measured_fetch_s * 3.0;
        }
        // Its profile's entry and the "all" entry.
        problems(&r, "decision_summary entry", 2);
    }

    #[test]
    fn unknown_choice() {
        let mut r = sample_report();
        r.decisions[3].chosen = "split".into();
        r.decision_summary = summaries(&r.decisions);
        one_problem(&r, "chosen is \"split\"");
    }

    #[test]
    fn a_hedge_needs_its_measured_time_and_only_a_hedge_has_one() {
        let mut r = sample_report();
        r.decisions[3].chosen = "hedge".into();
        r.decisions[3].measured_hedge_s = Some(r.decisions[3].measured_fetch_s);
        r.decisions[3].hedge_winner = Some("fetch".into());
        r.decision_summary = summaries(&r.decisions);
        assert_eq!(check(&r), Vec::<String>::new());
        r.decisions[3].measured_hedge_s = None;
        r.decision_summary = summaries(&r.decisions);
        one_problem(&r, "a hedge without its measured time");
        r.decisions[3].measured_hedge_s = Some(f64::NAN);
        r.decision_summary = summaries(&r.decisions);
        one_problem(&r, "measured_hedge_s is NaN");
        let mut r = sample_report();
        r.decisions[0].measured_hedge_s = Some(1.0);
        one_problem(&r, "a measured hedge time on a");
    }

    #[test]
    fn bad_crossover() {
        let mut r = sample_report();
        r.decisions[0].modeled_crossover_tokens = Some(f64::NAN);
        one_problem(&r, "modeled_crossover_tokens");
    }

    #[test]
    fn split_recomputes_more_than_the_prefix() {
        let mut r = sample_report();
        r.splits[0].split_recompute_tokens = r.splits[0].prefix_tokens + 1;
        one_problem(&r, "more than the prefix");
    }

    #[test]
    fn bad_link() {
        let mut r = sample_report();
        r.transfers[0].link.rate_bps = 0.0;
        one_problem(&r, "rate_bps");
        let mut r = sample_report();
        r.splits[0].link.loss = 1.5;
        one_problem(&r, "loss");
    }
}
