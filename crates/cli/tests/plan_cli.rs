//! `kvferry plan` as a user runs it: the real binary, its stdout, stderr and exit code.

use std::process::{Command, Output};

const SEED: &[&str] = &[
    "plan",
    "--layers",
    "80",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--dtype-bytes",
    "2",
    "--params",
    "70e9",
    "--tflops",
    "989",
    "--mfu",
    "0.4",
    "--gbps",
    "100",
    "--rtt-ms",
    "70",
];

fn kvferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvferry")).args(args).output().expect("run kvferry")
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = kvferry(args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn seed_with(extra: &[&str]) -> Vec<&'static str> {
    let mut v: Vec<&'static str> = SEED.to_vec();
    for e in extra {
        v.push(Box::leak(e.to_string().into_boxed_str()));
    }
    v
}

/// The 70B preset on an H100 at 40 % MFU over the seed's link, for an 8000-token prefix, then
/// `extra`.
fn preset_70b<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    "plan --model llama-3.1-70b --gpu h100-sxm --mfu 0.4 --gbps 100 --rtt-ms 70 --prefix-tokens 8000"
        .split(' ')
        .chain(extra.iter().copied())
        .collect()
}

#[test]
fn plain_flags_are_the_seed() {
    let v = json(&seed_with(&["--prefix-tokens", "8000", "--json"]));
    assert_eq!(v["bytes_per_token"], 327_680.0);
    assert_eq!(format!("{:.2}", v["recompute_seconds"].as_f64().unwrap() * 1e3), "2831.14");
    assert_eq!(format!("{:.2}", v["fetch_seconds"].as_f64().unwrap() * 1e3), "279.72");
    assert_eq!(format!("{:.0}", v["crossover_tokens"].as_f64().unwrap()), "214");
    assert_eq!(v["decision"], "fetch");
    assert!(v["split"]["seconds"].as_f64().unwrap() > 0.0);
    assert!(v["split"]["gain_over_best_pure"].as_f64().is_some());
    assert!(v["crossover_utilization"].is_null());

    let v = json(&seed_with(&["--prefix-tokens", "1000", "--json"]));
    assert_eq!(format!("{:.2}", v["fetch_seconds"].as_f64().unwrap() * 1e3), "96.21");
    assert_eq!(format!("{:.2}", v["recompute_seconds"].as_f64().unwrap() * 1e3), "353.89");
}

#[test]
fn weak_link_never_fetches_and_split_needs_permission() {
    let mut args = seed_with(&["--prefix-tokens", "8000", "--json"]);
    let i = args.iter().position(|a| *a == "--gbps").unwrap();
    args[i + 1] = "5";
    let v = json(&args);
    assert!(v["crossover_tokens"].is_null());
    assert_eq!(v["decision"], "recompute");
    args.push("--allow-split");
    assert_eq!(json(&args)["decision"], "split");
}

#[test]
fn queue_terms_give_the_seed_threshold() {
    let v = json(&seed_with(&[
        "--prefix-tokens",
        "600",
        "--compute-util",
        "0.1",
        "--service-rate",
        "20",
        "--json",
    ]));
    assert_eq!(format!("{:.2}", v["fetch_seconds"].as_f64().unwrap() * 1e3), "85.73");
    assert_eq!(format!("{:.4}", v["crossover_utilization"].as_f64().unwrap()), "0.7255");
}

#[test]
fn presets_turn_on_attention() {
    let v = json(&preset_70b(&["--json"]));
    assert_eq!(v["bytes_per_token"], 327_680.0);
    // 70.6B params and the attention term: slower than the seed's 2831.14 ms.
    assert!(v["recompute_seconds"].as_f64().unwrap() > 2.9);
    assert!(v["inputs"]["scenario"]["compute"]["attention"].is_object());
    let off = json(&preset_70b(&["--attention", "off", "--params", "70e9", "--json"]));
    assert_eq!(format!("{:.2}", off["recompute_seconds"].as_f64().unwrap() * 1e3), "2831.14");
}

#[test]
fn human_output_explains_itself() {
    let out = kvferry(&seed_with(&["--prefix-tokens", "8000"]));
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "320.0 KiB/token",
        "353.89 us/token",
        "26.21 us/token",
        "279.72 ms",
        "2831.14 ms",
        "214 tokens",
        "FETCH",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn sweep_table_and_csv() {
    let out = kvferry(&seed_with(&["--sweep"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("100*") && text.contains("crossover"), "{text}");
    let out = kvferry(&seed_with(&["--sweep", "--csv"]));
    let csv = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert!(rows[0].starts_with("prefix_tokens,gbps"));
    // 12 prefixes x 9 bandwidths (100 is already on the grid), plus the header.
    assert_eq!(rows.len(), 1 + 12 * 9);
    // At 5 Gbit/s fetch never wins; at 100 Gbit/s and 8192 tokens it does.
    assert!(rows.iter().any(|r| r.starts_with("8192,100,") && r.ends_with(",fetch")));
    assert!(rows.iter().filter(|r| r.contains(",5,")).all(|r| r.ends_with(",recompute")));
}

#[test]
fn bad_input_is_one_line_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["--gbps", "-1"], "--gbps must be > 0"),
        (&["--gbps", "nan"], "--gbps must be a finite number"),
        (&["--gbps", "fast"], "--gbps must be a number"),
        (&["--gbps", "0"], "--gbps must be > 0"),
        (&["--mfu", "1.5"], "--mfu must be in (0, 1]"),
        (&["--rtt-ms", "-3"], "--rtt-ms must be >= 0"),
        (&["--layers", "0"], "--layers must be >= 1"),
        (&["--prefix-tokens", "-5"], "--prefix-tokens must be a whole number"),
        (&["--fetch-util", "1", "--service-rate", "20"], "--fetch-util must be in [0, 1)"),
        (&["--compute-util", "0.5"], "--service-rate is required"),
        (&["--model", "gpt-9"], "--model unknown model preset"),
        (&["--gpu", "tpu-v9"], "--gpu unknown gpu preset"),
        (&["--params", "inf"], "--params must be a finite number"),
        (&["--bogus"], "unexpected argument '--bogus'"),
    ];
    for (extra, expect) in cases {
        // Replace rather than repeat flags the seed set already holds.
        let mut args: Vec<&str> = Vec::new();
        let mut i = 0;
        while i < SEED.len() {
            if i + 1 < SEED.len() && extra.contains(&SEED[i]) {
                i += 2;
                continue;
            }
            args.push(SEED[i]);
            i += 1;
        }
        if !extra.contains(&"--prefix-tokens") {
            args.extend(["--prefix-tokens", "100"]);
        }
        args.extend(extra.iter());
        let out = kvferry(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{extra:?}: {err}");
        assert!(err.contains(expect), "{extra:?}: expected {expect:?} in {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // A missing required flag.
    let out = kvferry(&["plan", "--layers", "80"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("is required"), "{err}");
}
