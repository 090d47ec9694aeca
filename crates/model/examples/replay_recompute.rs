//! Replays recorded recompute traces through [`RecomputeCalibration`] and prints the bench's
//! prediction-error figures: each pure recompute predicted before it is observed.
//!
//! `cargo run --release -p kvferry-model --example replay_recompute -- TRACES.json`
//! (TRACES from `bench/results/recompute-replay-*/extract.py`). Environment: `REPLAY_ALL=1`
//! scores the loaded-host profile too (as the bench does), `REPLAY_VERBOSE=1` prints every
//! scored point, `REPLAY_SHAPE_SD` / `REPLAY_SCALE_SD` override [`RecomputeSpread`]'s.

use std::collections::BTreeMap;

use kvferry_model::calibration::{FitConfig, RecomputeSpread};
use kvferry_model::{ComputeModel, RecomputeCalibration, RecomputeObservation};
use serde::Deserialize;

#[derive(Deserialize)]
struct Sample {
    session: String,
    n: u64,
    wall: f64,
}

#[derive(Deserialize)]
struct Trace {
    dir: String,
    profile: String,
    a: f64,
    b: f64,
    samples: Vec<Sample>,
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len();
    if m % 2 == 1 { v[m / 2] } else { (v[m / 2 - 1] + v[m / 2]) / 2.0 }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: replay_recompute TRACES.json")?;
    let traces: Vec<Trace> = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let all = std::env::var_os("REPLAY_ALL").is_some();
    let verbose = std::env::var_os("REPLAY_VERBOSE").is_some();
    let spread = RecomputeSpread::default();
    let cfg = FitConfig::default();
    let env = |k: &str, d: f64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let spread = RecomputeSpread {
        shape: env("REPLAY_SHAPE_SD", spread.shape),
        scale: env("REPLAY_SCALE_SD", spread.scale),
        ..spread
    };
    // run -> errors after >= 10 samples; bucket -> errors.
    let mut per_run: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut buckets: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for t in &traces {
        let idle = !t.profile.contains("cpu-load");
        let run = t.dir.split("/runs/").next().unwrap_or(&t.dir).to_owned();
        let profile = ComputeModel::from_measured(t.a, t.b)?;
        let mut cal = RecomputeCalibration::new(&profile, spread, cfg)?;
        for s in &t.samples {
            if s.session.contains("dq-recompute") {
                let p = cal.predict(s.n, 0, 0.0)?;
                let err = s.wall / p.seconds - 1.0;
                if verbose {
                    println!(
                        "{} {} n={} samples={} {:.3}/{:.3} {:+.1}%",
                        run,
                        t.profile,
                        s.n,
                        p.samples,
                        s.wall,
                        p.seconds,
                        100.0 * err
                    );
                }
                let bucket = match p.samples {
                    0 => "0",
                    1..=2 => "1-2",
                    3..=9 => "3-9",
                    _ => "10+",
                };
                if all || idle {
                    buckets.entry(bucket).or_default().push(err.abs());
                    if p.samples >= 10 {
                        per_run.entry(run.clone()).or_default().push(err.abs());
                    }
                }
            }
            cal.observe(RecomputeObservation {
                new_tokens: s.n,
                cached_tokens: 0,
                load: 0.0,
                seconds: s.wall,
            })?;
        }
    }
    let which = if all { "every profile" } else { "idle profiles (REPLAY_ALL=1: every profile)" };
    println!("{which}; median |measured / predicted - 1| of pure recomputes, predicted before observed");
    for (b, mut v) in buckets {
        println!("  samples {b:>4}: n={:3} median {:.1} %", v.len(), 100.0 * median(&mut v));
    }
    let mut worst = 0.0f64;
    for (run, mut v) in per_run {
        let m = median(&mut v);
        worst = worst.max(m);
        println!("  {run}: after 10+ samples n={} median {:.1} %", v.len(), 100.0 * m);
    }
    println!("  worst run: {:.1} %", 100.0 * worst);
    Ok(())
}
