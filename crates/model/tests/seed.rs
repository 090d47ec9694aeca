//! Every number and assertion the seed's two scripts print or make
//! (`../shared/seeds/region-replica-routing.md`: `wan_kv_crossover.py`, `wan_routing_score.py`),
//! at their printed precision, plus the closed-form crossover utilization checked against the
//! seed's own bisection.

use kvferry_model::{
    ComputeModel, KvDtype, KvFootprint, LinkModel, QueueState, crossover_tokens, crossover_utilization,
    mm1_wait_seconds, route_total_latency,
};

const PARAMS: f64 = 70e9;
const TFLOPS: f64 = 989e12;
const MFU: f64 = 0.40;
const RTT_S: f64 = 0.070;

fn bpt() -> f64 {
    KvFootprint::gqa(80, 8, 128, KvDtype::Bf16).unwrap().bytes_per_token()
}
fn compute() -> ComputeModel {
    ComputeModel::new(PARAMS, TFLOPS, MFU, None).unwrap()
}
fn link(gbps: f64, rtt_s: f64) -> LinkModel {
    LinkModel::new(gbps, rtt_s, 1.0).unwrap()
}
fn fmt2(x: f64) -> String {
    format!("{x:.2}")
}

// ---- wan_kv_crossover.py ----

#[test]
fn bytes_per_token_is_320_kib() {
    assert_eq!(bpt(), 327_680.0);
    assert_eq!(format!("{:.1}", bpt() / 1024.0), "320.0");
}

#[test]
fn per_token_rates() {
    assert_eq!(fmt2(compute().linear_seconds_per_token() * 1e6), "353.89");
    assert_eq!(fmt2(link(5.0, RTT_S).seconds_per_token(bpt()) * 1e6), "524.29");
    assert_eq!(fmt2(link(100.0, RTT_S).seconds_per_token(bpt()) * 1e6), "26.21");
}

#[test]
fn weak_link_has_no_crossover() {
    let weak = link(5.0, RTT_S);
    assert_eq!(crossover_tokens(bpt(), &compute(), &weak), None);
    assert!(weak.seconds_per_token(bpt()) > compute().linear_seconds_per_token());
}

#[test]
fn fast_link_crossover_214_and_427_at_double_rtt() {
    let c = compute();
    let l = crossover_tokens(bpt(), &c, &link(100.0, RTT_S)).unwrap();
    assert!(l > 0.0);
    assert_eq!(format!("{l:.0}"), "214");
    assert!(link(100.0, RTT_S).seconds_per_token(bpt()) < c.linear_seconds_per_token());
    let l2 = crossover_tokens(bpt(), &c, &link(100.0, 2.0 * RTT_S)).unwrap();
    assert_eq!(format!("{l2:.0}"), "427");
    assert!(l2 > l);
}

#[test]
fn recompute_below_the_crossover_fetch_above() {
    let c = compute();
    let fast = link(100.0, RTT_S);
    let l = crossover_tokens(bpt(), &c, &fast).unwrap();
    // The seed's int(L * 0.5) and int(L * 2.0).
    let short = (l * 0.5) as u64;
    let long = (l * 2.0) as u64;
    assert!(c.recompute_seconds(short) < fast.fetch_seconds(short, bpt()));
    assert!(fast.fetch_seconds(long, bpt()) < c.recompute_seconds(long));
}

#[test]
fn printed_times() {
    let c = compute();
    let fast = link(100.0, RTT_S);
    assert_eq!(fmt2(c.recompute_seconds(1000) * 1e3), "353.89");
    assert_eq!(fmt2(fast.fetch_seconds(1000, bpt()) * 1e3), "96.21");
    assert_eq!(fmt2(c.recompute_seconds(8000) * 1e3), "2831.14");
    assert_eq!(fmt2(fast.fetch_seconds(8000, bpt()) * 1e3), "279.72");
}

// ---- wan_routing_score.py ----

const MU: f64 = 20.0;
const PREFIX: u64 = 600;

#[test]
fn costs_at_600_tokens() {
    assert_eq!(fmt2(link(100.0, RTT_S).fetch_seconds(PREFIX, bpt()) * 1e3), "85.73");
    assert_eq!(fmt2(compute().recompute_seconds(PREFIX) * 1e3), "212.34");
}

#[test]
fn wait_is_monotone_and_diverges() {
    let waits: Vec<f64> =
        [0.0, 0.5, 0.8, 0.95, 0.99].iter().map(|&r| mm1_wait_seconds(r, MU).unwrap()).collect();
    let mut sorted = waits.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(waits, sorted);
    assert_eq!(mm1_wait_seconds(0.0, MU).unwrap(), 0.0);
    assert!(mm1_wait_seconds(0.99, MU).unwrap() > mm1_wait_seconds(0.5, MU).unwrap() * 5.0);
}

#[test]
fn equal_utilization_reduces_to_the_plain_crossover() {
    let f = link(100.0, RTT_S).fetch_seconds(PREFIX, bpt());
    let r = compute().recompute_seconds(PREFIX);
    let r1 = route_total_latency(f, 0.5, MU).unwrap();
    let r2 = route_total_latency(r, 0.5, MU).unwrap();
    assert!(r1 < r2, "{r1} {r2}");
}

/// The seed's `crossover_utilization`, bisection and all.
fn seed_bisection(rtt_s: f64, idle_util: f64) -> Option<f64> {
    let fetch = link(100.0, rtt_s).fetch_seconds(PREFIX, bpt());
    let recompute = compute().recompute_seconds(PREFIX);
    let target = recompute + mm1_wait_seconds(idle_util, MU).unwrap() - fetch;
    if target <= 0.0 {
        return None;
    }
    let (mut lo, mut hi) = (0.0_f64, 0.999_999_f64);
    for _ in 0..80 {
        let mid = 0.5 * (lo + hi);
        if mm1_wait_seconds(mid, MU).unwrap() >= target {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let _ = lo;
    Some(hi)
}

fn closed_form(rtt_s: f64, idle_util: f64) -> Option<f64> {
    let fetch = link(100.0, rtt_s).fetch_seconds(PREFIX, bpt());
    let recompute = compute().recompute_seconds(PREFIX);
    crossover_utilization(fetch, recompute, &QueueState::new(idle_util, MU).unwrap(), MU)
}

#[test]
fn crossover_utilization_0_7255_and_0_6602() {
    let xu = closed_form(RTT_S, 0.1).unwrap();
    assert!(0.0 < xu && xu < 1.0);
    assert_eq!(format!("{xu:.4}"), "0.7255");
    let slow = closed_form(RTT_S * 1.5, 0.1).unwrap();
    assert_eq!(format!("{slow:.4}"), "0.6602");
    assert!(slow < xu);
}

#[test]
fn closed_form_agrees_with_the_seed_bisection() {
    for rtt in [0.0, 0.01, 0.035, 0.07, 0.105, 0.14, 0.2] {
        for idle in [0.0, 0.1, 0.3, 0.5, 0.8] {
            let a = closed_form(rtt, idle);
            let b = seed_bisection(rtt, idle);
            match (a, b) {
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-9, "rtt {rtt} idle {idle}: {a} vs {b}"),
                (None, None) => {}
                other => panic!("rtt {rtt} idle {idle}: {other:?}"),
            }
        }
    }
}

#[test]
fn loads_around_the_threshold_flip_the_answer() {
    let xu = closed_form(RTT_S, 0.1).unwrap();
    let fetch = link(100.0, RTT_S).fetch_seconds(PREFIX, bpt());
    let recompute = compute().recompute_seconds(PREFIX);
    let below = route_total_latency(fetch, xu * 0.95, MU).unwrap();
    let above = route_total_latency(fetch, xu + (1.0 - xu) * 0.5, MU).unwrap();
    let idle_total = recompute + mm1_wait_seconds(0.1, MU).unwrap();
    assert!(below < idle_total && idle_total < above, "{below} {idle_total} {above}");
}
