//! The report as a Markdown document (`report.md`): header, transfer tables per profile,
//! baselines against kvferry, decisions and their summary, splits, notes. Figures are printed
//! with a fixed number of digits; a value that cannot be computed prints as `—`.

use std::fmt::Write as _;

use crate::report::{BaselinePoint, BenchReport, TransferPoint};
use crate::stats::{outcome, summaries};

const MIB: f64 = 1024.0 * 1024.0;

/// Renders `r` as a Markdown document (never panics, whatever the numbers).
pub fn markdown(r: &BenchReport) -> String {
    let mut s = String::new();
    header(r, &mut s);
    transfers(r, &mut s);
    baselines(r, &mut s);
    decisions(r, &mut s);
    splits(r, &mut s);
    notes(r, &mut s);
    s
}

fn header(r: &BenchReport, s: &mut String) {
    let _ = writeln!(s, "# kvferry bench\n");
    let _ = writeln!(s, "- command: `{}`", r.command.replace('`', "'"));
    let _ = writeln!(s, "- host: {}", cell(&r.host));
    let _ = writeln!(s, "- started: {} ({})", utc_date(r.started_unix), r.started_unix);
    let _ = writeln!(s, "- mode: {}", if r.quick { "quick" } else { "full" });
    if let Some(c) = &r.ceilings {
        let _ = writeln!(
            s,
            "- one core's ceilings, CPU s/GiB: memcpy {:.3}, AES-128-GCM {:.3}, XXH3-128 checksum {:.3}; a side's floor (each byte encrypted or decrypted, checksummed and copied once) {:.3}",
            c.memcpy_s_per_gib,
            c.aes128gcm_s_per_gib,
            c.checksum_s_per_gib,
            c.per_side_floor_s_per_gib()
        );
    }
    let _ = writeln!(
        s,
        "- points: {} transfers, {} baselines, {} decisions, {} splits\n",
        r.transfers.len(),
        r.baselines.len(),
        r.decisions.len(),
        r.splits.len()
    );
}

/// Profiles in first-seen order over the transfers (then anything only baselines mention).
fn profiles<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for n in names {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

fn transfers(r: &BenchReport, s: &mut String) {
    let _ = writeln!(s, "## Transfers\n");
    if r.transfers.is_empty() {
        let _ = writeln!(s, "No transfers.\n");
        return;
    }
    for prof in profiles(r.transfers.iter().map(|t| t.link.profile.as_str())) {
        let pts: Vec<&TransferPoint> = r.transfers.iter().filter(|t| t.link.profile == prof).collect();
        let l = &pts[0].link;
        let _ = writeln!(
            s,
            "### {} ({} Mbit/s, RTT {} ms, loss {} %)\n",
            cell(prof),
            f(l.rate_bps / 1e6, 0),
            f(l.rtt_s * 1e3, 1),
            f(l.loss * 100.0, 2)
        );
        let _ = writeln!(
            s,
            "| size MiB | wall s | goodput Mbit/s | % of link | modeled fetch s | measured ÷ modeled | \
             daemon predicted s | first layer s | CPU s/GiB src / tgt | staging MiB src / tgt | \
             engine load s | load CPU s/GiB | verified |"
        );
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|");
        for t in pts {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} |",
                f(t.session_bytes as f64 / MIB, 1),
                f(t.wall_s, 3),
                f(t.goodput_bps / 1e6, 1),
                pct(t.goodput_bps, t.link.rate_bps),
                f(t.model_fetch_s, 3),
                f(div(t.wall_s, t.model_fetch_s), 2),
                f(t.daemon_predicted_s, 3),
                f(t.first_layer_s, 3),
                f(t.cpu_s_per_gib_source, 2),
                f(t.cpu_s_per_gib_target, 2),
                f(t.staging_bytes_source as f64 / MIB, 1),
                f(t.staging_bytes_target as f64 / MIB, 1),
                f(t.load_s, 3),
                f(t.load_cpu_s_per_gib, 2),
                if t.verified { "yes" } else { "**NO**" }
            );
        }
        let _ = writeln!(s);
    }
}

/// kvferry's transfer on the same profile whose size is nearest (in ratio) to `b.bytes`.
fn nearest_transfer<'a>(r: &'a BenchReport, b: &BaselinePoint) -> Option<&'a TransferPoint> {
    let dist = |t: &TransferPoint| {
        let (a, c) = (t.session_bytes.max(1) as f64, b.bytes.max(1) as f64);
        (a / c).ln().abs()
    };
    r.transfers.iter().filter(|t| t.link.profile == b.link.profile).min_by(|x, y| dist(x).total_cmp(&dist(y)))
}

fn baselines(r: &BenchReport, s: &mut String) {
    let _ = writeln!(s, "## Baselines\n");
    if r.baselines.is_empty() {
        let _ = writeln!(s, "No baselines.\n");
        return;
    }
    let _ = writeln!(
        s,
        "| profile | baseline | MiB | goodput Mbit/s | % of link | kvferry Mbit/s (MiB) | kvferry ÷ baseline | \
         CPU s send / recv | verified | note |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|:---:|---|");
    for b in &r.baselines {
        let skipped = b.is_skipped();
        let kv = if skipped { None } else { nearest_transfer(r, b) };
        let kv_cell = kv.map_or_else(
            || "—".to_owned(),
            |t| format!("{} ({})", f(t.goodput_bps / 1e6, 1), f(t.session_bytes as f64 / MIB, 0)),
        );
        let (good, pl, ratio, cpu) = if skipped {
            ("—".into(), "—".into(), "—".into(), "—".into())
        } else {
            (
                f(b.goodput_bps / 1e6, 1),
                pct(b.goodput_bps, b.link.rate_bps),
                kv.map_or_else(|| "—".into(), |t| f(div(t.goodput_bps, b.goodput_bps), 2)),
                format!("{} / {}", f(b.cpu_s_sender, 2), f(b.cpu_s_receiver, 2)),
            )
        };
        let verified = if skipped {
            "skipped"
        } else if b.verified {
            "yes"
        } else {
            "**NO**"
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {good} | {pl} | {kv_cell} | {ratio} | {cpu} | {verified} | {} |",
            cell(&b.link.profile),
            cell(&b.name),
            if skipped { "—".into() } else { f(b.bytes as f64 / MIB, 1) },
            cell(&b.note)
        );
    }
    let _ = writeln!(s);
}

fn decisions(r: &BenchReport, s: &mut String) {
    let _ = writeln!(s, "## Decisions\n");
    if r.decisions.is_empty() {
        let _ = writeln!(s, "No decisions.\n");
    } else {
        let _ = writeln!(
            s,
            "| profile | prefix tokens | chosen | predicted fetch s | predicted recompute s | \
             measured fetch s | measured recompute s | winner | regret % | modeled crossover tokens |"
        );
        let _ = writeln!(s, "|---|---:|---|---:|---:|---:|---:|---|---:|---:|");
        for d in &r.decisions {
            let o = outcome(d);
            let label = match (d.chosen.as_str(), d.measured_hedge_s) {
                ("hedge", Some(h)) => {
                    format!("hedge ({} first, {} s)", cell(d.hedge_winner.as_deref().unwrap_or("?")), f(h, 3))
                }
                _ => cell(&d.chosen),
            };
            let chosen = if o.correct { label } else { format!("**{label}**") };
            let _ = writeln!(
                s,
                "| {} | {} | {chosen} | {} | {} | {} | {} | {} | {} | {} |",
                cell(&d.link.profile),
                d.prefix_tokens,
                f(d.predicted_fetch_s, 3),
                f(d.predicted_recompute_s, 3),
                f(d.measured_fetch_s, 3),
                f(d.measured_recompute_s, 3),
                o.winner.as_str(),
                f(o.regret * 100.0, 1),
                d.modeled_crossover_tokens.map_or_else(|| "never".into(), |c| f(c, 0)),
            );
        }
        let _ = writeln!(
            s,
            "\nA **bold** choice measured slower than the other action; a hedge (both started, \
             the first to finish kept) is bold when it took more than {:.0} % over the faster one.\n",
            crate::stats::HEDGE_TOLERANCE * 100.0
        );
    }
    // The stored summary is what the bench wrote; recompute if it is missing.
    let computed;
    let summary = if r.decision_summary.is_empty() && !r.decisions.is_empty() {
        computed = summaries(&r.decisions);
        &computed
    } else {
        &r.decision_summary
    };
    if summary.is_empty() {
        return;
    }
    let buckets = crate::stats::error_by_samples(&r.decisions);
    if !buckets.is_empty() {
        let _ = writeln!(s, "### Prediction error against calibration samples\n");
        let _ = writeln!(s, "| action | samples | n | median abs(measured / predicted - 1) % |");
        let _ = writeln!(s, "|---|---|---:|---:|");
        for b in &buckets {
            let range = match (b.samples_lo, b.samples_hi) {
                (lo, hi) if lo == hi => lo.to_string(),
                (lo, u32::MAX) => format!("{lo}+"),
                (lo, hi) => format!("{lo}-{hi}"),
            };
            let _ =
                writeln!(s, "| {} | {range} | {} | {} |", b.action, b.n, f(b.median_abs_error * 100.0, 1));
        }
        let _ = writeln!(s);
    }
    let bands = crate::stats::band_coverage(&r.decisions);
    if !bands.is_empty() {
        let _ = writeln!(s, "### Prediction bands against outcomes\n");
        let _ = writeln!(
            s,
            "| action | n | within 1 sd % | within 2 sd % | median abs(measured - predicted) / sd |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|");
        for b in &bands {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                b.action,
                b.n,
                f(b.within_1sd * 100.0, 1),
                f(b.within_2sd * 100.0, 1),
                f(b.median_z, 2)
            );
        }
        let _ = writeln!(
            s,
            "\nA Gaussian band holds 68 % of outcomes within 1 sd and 95 % within 2 (median 0.67 sd).\n"
        );
    }
    let _ = writeln!(s, "### Decision quality\n");
    let _ = writeln!(s, "| profile | n | accuracy % | mean regret % | worst regret % |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|");
    for q in summary {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} |",
            cell(&q.profile),
            q.n,
            f(q.accuracy * 100.0, 1),
            f(q.mean_regret * 100.0, 1),
            f(q.worst_regret * 100.0, 1)
        );
    }
    let _ = writeln!(s);
}

fn splits(r: &BenchReport, s: &mut String) {
    let _ = writeln!(s, "## Splits\n");
    if r.splits.is_empty() {
        let _ = writeln!(s, "No splits.\n");
        return;
    }
    let _ = writeln!(
        s,
        "| profile | prefix tokens | recompute tokens | predicted split s | measured split s | \
         measured fetch s | measured recompute s | split ÷ best pure | late leg vs its prediction | host steal CPU s |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|");
    for p in &r.splits {
        let best = p.measured_fetch_s.min(p.measured_recompute_s);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(&p.link.profile),
            p.prefix_tokens,
            p.split_recompute_tokens,
            f(p.predicted_split_s, 3),
            f(p.measured_split_s, 3),
            f(p.measured_fetch_s, 3),
            f(p.measured_recompute_s, 3),
            f(div(p.measured_split_s, best), 2),
            p.late_leg().map_or("—".to_owned(), |l| format!("{} {:+.0}%", l.name, l.error() * 100.0)),
            p.host_steal_s.map_or("—".to_owned(), |x| f(x, 3))
        );
    }
    let _ = writeln!(s);
}

fn notes(r: &BenchReport, s: &mut String) {
    let _ = writeln!(s, "## Notes\n");
    if r.notes.is_empty() {
        let _ = writeln!(s, "None.");
    }
    for n in &r.notes {
        let _ = writeln!(s, "- {}", n.replace('\n', " "));
    }
}

/// `v` with `digits` decimals, `—` when not finite.
fn f(v: f64, digits: usize) -> String {
    if v.is_finite() { format!("{v:.digits$}") } else { "—".into() }
}

/// `a / b`, NaN when `b` is 0 or either is not finite.
fn div(a: f64, b: f64) -> f64 {
    if b == 0.0 || !a.is_finite() || !b.is_finite() { f64::NAN } else { a / b }
}

/// `part` as a percentage of `whole`, one decimal.
fn pct(part: f64, whole: f64) -> String {
    f(div(part, whole) * 100.0, 1)
}

/// Text safe inside a table cell: no pipes, no line breaks.
fn cell(t: &str) -> String {
    t.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// `YYYY-MM-DD HH:MM:SS UTC` of a Unix time (proleptic Gregorian, no time zone database).
fn utc_date(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", secs / 3600, secs / 60 % 60, secs % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{BenchReport, DecisionSummary};
    use crate::sample::sample_report;

    fn empty() -> BenchReport {
        BenchReport::default()
    }

    #[test]
    fn dates() {
        assert_eq!(utc_date(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_date(1_767_225_600), "2026-01-01 00:00:00 UTC");
        assert_eq!(utc_date(951_827_696), "2000-02-29 12:34:56 UTC");
    }

    #[test]
    fn empty_report_renders() {
        let md = markdown(&empty());
        assert!(md.starts_with("# kvferry bench"));
        assert!(md.contains("No transfers."));
        assert!(md.contains("No baselines."));
        assert!(md.contains("No decisions."));
        assert!(md.contains("No splits."));
        assert!(md.contains("1970-01-01"));
    }

    #[test]
    fn sample_has_every_row() {
        let r = sample_report();
        let md = markdown(&r);
        assert!(md.contains("`kvferry bench --quick --out bench-out`"));
        assert!(md.contains("2 CPUs, 7.7 GiB"));
        assert!(md.contains("2026-01-01 00:00:00 UTC"));
        for p in ["10gbit-10ms", "1gbit-50ms", "100mbit-100ms-loss"] {
            assert!(md.contains(&format!("### {p} (")), "{p}");
        }
        let rows = |prefix: &str| md.lines().filter(|l| l.starts_with(prefix)).count();
        // 9 transfer rows: sizes 64 / 256 / 1024 MiB.
        assert_eq!(rows("| 64.0 |") + rows("| 256.0 |") + rows("| 1024.0 |"), 9);
        // 9 baseline rows, 4 × 3 decision rows, 3 + 1 summary rows, 2 split rows, all start with a
        // profile.
        let by_profile = md
            .lines()
            .filter(|l| l.starts_with("| 10gbit") || l.starts_with("| 1gbit") || l.starts_with("| 100mbit"))
            .count();
        assert_eq!(by_profile, 9 + 12 + 3 + 2);
        assert!(md.contains("| all | 12 | 91.7 |"));
        assert!(md.contains("skipped: UCX"));
        assert!(md.contains("| nixl-ucx-tcp | — | — | — | — | — | — | skipped | skipped: UCX"));
        assert!(md.contains("**fetch**"), "the wrong decision is bold");
        assert!(md.contains("| never |"));
        for n in &r.notes {
            assert!(md.contains(&format!("- {n}")));
        }
    }

    #[test]
    fn baseline_ratio_uses_nearest_kvferry_size() {
        let r = sample_report();
        let md = markdown(&r);
        let b = &r.baselines[0]; // quinn-defaults on 10gbit, 256 MiB.
        let t = &r.transfers[1]; // kvferry 256 MiB on 10gbit.
        let want = format!(
            "| {} ({}) | {} |",
            f(t.goodput_bps / 1e6, 1),
            "256",
            f(t.goodput_bps / b.goodput_bps, 2)
        );
        assert!(md.contains(&want), "{want}\n{md}");
    }

    #[test]
    fn odd_values_do_not_panic() {
        let mut r = sample_report();
        r.transfers[0].wall_s = f64::NAN;
        r.transfers[1].model_fetch_s = 0.0;
        r.baselines[0].goodput_bps = 0.0;
        r.baselines[1].note = "a | b\nc".into();
        r.decisions[0].chosen = "???".into();
        r.decision_summary = vec![DecisionSummary {
            profile: "x".into(),
            n: 0,
            accuracy: f64::NAN,
            mean_regret: 0.0,
            worst_regret: 0.0,
        }];
        r.splits[0].measured_fetch_s = 0.0;
        r.splits[0].measured_recompute_s = 0.0;
        let md = markdown(&r);
        assert!(md.contains("a \\| b c"));
        assert!(md.contains("**???**"));
    }

    #[test]
    fn missing_summary_is_computed() {
        let mut r = sample_report();
        r.decision_summary.clear();
        assert!(markdown(&r).contains("| all | 12 | 91.7 |"));
    }
}
