//! `kvferry plan --sweep`: where the crossover lies on the operator's link — the decision over
//! prefix lengths × bandwidths, as a table or CSV.
//!
//! Pure formatting over [`kvferry_model::decide`]; the operator's own `--gbps` and
//! `--prefix-tokens`, when given, are added to the grid and marked.

use kvferry_model::{Action, Policy, Scenario, decide};

/// What the sweep needs of the resolved flags (this module knows nothing of the flags, so it
/// does not depend on `plan`).
#[derive(Debug, Clone, Copy)]
pub struct SweepInputs {
    /// The operator's scenario: its prefix and link are the marked point of the grid.
    pub scenario: Scenario,
    pub policy: Policy,
    /// Whether --prefix-tokens was given (then it joins the grid).
    pub prefix_given: bool,
    /// Whether --gbps was given (then it joins the grid).
    pub gbps_given: bool,
}

const PREFIXES: [u64; 12] = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16_384, 32_768, 65_536, 131_072];
const GBPS: [f64; 9] = [1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0];

fn grid(r: &SweepInputs) -> (Vec<u64>, Vec<f64>) {
    let mut prefixes = PREFIXES.to_vec();
    if r.prefix_given && !prefixes.contains(&r.scenario.prefix_tokens) {
        prefixes.push(r.scenario.prefix_tokens);
        prefixes.sort_unstable();
    }
    let mut gbps = GBPS.to_vec();
    let own = r.scenario.link.goodput_gbps;
    if r.gbps_given && !gbps.contains(&own) {
        gbps.push(own);
        gbps.sort_by(f64::total_cmp);
    }
    (prefixes, gbps)
}

fn at(r: &SweepInputs, p: u64, gbps: f64) -> Scenario {
    let mut s = r.scenario;
    s.prefix_tokens = p;
    s.link.goodput_gbps = gbps;
    s
}

fn letter(a: Action) -> &'static str {
    match a {
        Action::Fetch => "F",
        Action::Recompute => "R",
        Action::Split => "S",
    }
}

/// Renders the sweep.
pub fn run(r: &SweepInputs, csv: bool) -> anyhow::Result<String> {
    let (prefixes, gbps) = grid(r);
    let mut o = String::new();
    if csv {
        o += "prefix_tokens,gbps,rtt_ms,fetch_seconds,recompute_seconds,split_seconds,split_recompute_tokens,decision\n";
        for &p in &prefixes {
            for &g in &gbps {
                let d = decide(&at(r, p, g), &r.policy)?;
                o += &format!(
                    "{p},{g},{},{:.6},{:.6},{:.6},{},{}\n",
                    r.scenario.link.rtt_s * 1e3,
                    d.fetch.seconds,
                    d.recompute.seconds,
                    d.split.point.seconds,
                    d.split.point.recompute_tokens,
                    d.action
                );
            }
        }
        return Ok(o);
    }
    o += &format!(
        "kvferry plan --sweep: decision by prefix length (rows) and goodput in Gbit/s (columns), RTT {:.1} ms\n",
        r.scenario.link.rtt_s * 1e3
    );
    o += "F = fetch, R = recompute, S = split (only with --allow-split); * marks your --gbps / --prefix-tokens\n\n";
    o += &format!("{:>9} ", "tokens");
    for &g in &gbps {
        let mark = if r.gbps_given && g == r.scenario.link.goodput_gbps { "*" } else { "" };
        o += &format!("{:>7}", format!("{g}{mark}"));
    }
    o += "   recompute_ms\n";
    for &p in &prefixes {
        let mark = if r.prefix_given && p == r.scenario.prefix_tokens { "*" } else { "" };
        o += &format!("{:>9} ", format!("{p}{mark}"));
        let mut rec = 0.0;
        for &g in &gbps {
            let d = decide(&at(r, p, g), &r.policy)?;
            rec = d.recompute.seconds;
            o += &format!("{:>7}", letter(d.action));
        }
        o += &format!("   {:>12.2}\n", rec * 1e3);
    }
    o += "\ncrossover (tokens above which fetch wins, idle paths):\n";
    for &g in &gbps {
        let d = decide(&at(r, PREFIXES[0], g), &r.policy)?;
        let x = d.crossover_tokens.map_or("never".to_owned(), |x| format!("{x:.0}"));
        o += &format!("  {:>7} Gbit/s: {x}\n", g);
    }
    Ok(o)
}
