//! Hedged migrations, end to end with real processes (two `kvferry daemon`s, two `kvferry
//! engine`s, QUIC + mutual TLS on loopback). Region B hedges every migration whose calibrated
//! bands overlap (`policy.hedge = "always"`, bands widened so they always do): the fetch and the
//! recompute start together and the first to finish wins.
//!
//! - A's egress to B is capped at 2 Mbit/s (B prices the fetch at that rate: A reports its cap
//!   in the query's load report), so the recompute wins: the receipt says recompute,
//!   hedged; the cancelled fetch left nothing in B's landing zone (nothing used, nothing
//!   reserved) and moved no byte into it, and the next turn in B equals a cold recompute.
//! - Uncapped, a long prefix is fetched faster than it is recomputed: the receipt says fetch,
//!   hedged, with the losing recompute's time accounted (`kvferry_hedge_wasted_milliseconds_total`)
//!   and the recompute cancelled in the engine (sent and acknowledged), and the next turn
//!   equals a cold recompute.
//!
//! In both, the hedge's legs ran at once, so neither calibrates the pure actions: B's
//! `GetLinks` shows no fetch sample for the link to A and no recompute sample for its engine;
//! the race calibrated engine-b's hedge interference instead (one hedge sample).
//!
//! - Priced with the largest interference (each leg at a fifth of its speed while the other
//!   runs), no race can beat the better pure action: the same bands do not hedge, and the
//!   decision says why.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvferry_proto::v1::{Action, GetLinksRequest, PolicyMode};

fn hedging_b(c: &mut kvferry_daemon::Config) {
    use kvferry_daemon::config::HedgeMode;
    c.policy.hedge = HedgeMode::Always;
    (c.policy.hedge_band_z, c.policy.hedge_min_gain, c.policy.hedge_min_gain_ms) = (1e6, 0.0, 0.0);
    // Small chunks, so that A's egress cap paces the transfer (its burst is a chunk).
    c.transfer.chunk_bytes = 65_536;
}

async fn landing(cl: &Cluster, state: &str) -> f64 {
    metric(&cl.metrics(1).await, &format!("kvferry_landing_zone_bytes{{state=\"{state}\"}}"))
}

/// What B's `GetLinks` says it learnt: fetch samples for the link to A, recompute samples for
/// engine-b, and engine-b's hedge interference with the hedges it was measured from.
struct Learnt {
    fetch: u32,
    recompute: u32,
    hedge_interference: f64,
    hedge_samples: u32,
}

async fn learnt_in_b(cl: &Cluster) -> Learnt {
    let links = cl.router(1).await.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let fetch = links.links.iter().find(|l| l.region == "region-a").map_or(0, |l| l.calibration_samples);
    let e = links.engines.iter().find(|e| e.engine_id == "engine-b").expect("engine-b's calibration");
    Learnt {
        fetch,
        recompute: e.calibration_samples,
        hedge_interference: e.hedge_interference,
        hedge_samples: e.hedge_samples,
    }
}

/// After one race: neither pure action calibrated (the legs ran at once), one sample of the
/// hedge interference instead.
async fn assert_the_race_calibrated_only_the_interference(cl: &Cluster) {
    let l = learnt_in_b(cl).await;
    assert_eq!((l.fetch, l.recompute), (0, 0), "a hedge's winner calibrated a pure action");
    let (i, n) = (l.hedge_interference, l.hedge_samples);
    assert!(n == 1 && (0.0..=4.0).contains(&i), "the race calibrated the hedge interference: {i} from {n}");
}

/// The next turn in region B, warm and from scratch, must agree bit for bit.
async fn warm_equals_cold(cl: &Cluster, convo: &[u32]) {
    assert_warm_equals_cold(&mut cl.engine(1).await, convo, (convo.len() / 16 * 16) as u64).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_fetch_loses_the_hedge_and_leaves_nothing_visible() {
    let a = RegionSpec { configure: Some(|c| c.peers[0].max_egress_gbps = 0.002), ..Default::default() };
    let b = RegionSpec { configure: Some(hedging_b), ..Default::default() };
    let cl = Cluster::start([a, b]);
    let (mut eng_a, mut router_b) = (cl.engine(0).await, cl.router(1).await);
    // 1024 tokens = 1 MiB of KV: about 4 s at A's cap; the recompute takes well under that.
    let convo = tokens(1024, 31);
    generate(&mut eng_a, &convo, true).await;
    let req = request("s-hedge-slow", &convo, PolicyMode::Auto);
    wait_for_source(&mut router_b, &req).await;
    let fetched_before = metric(&cl.metrics(1).await, "kvferry_fetched_bytes_total");
    let (d, r) = migrate(&mut router_b, req).await;
    assert!(d.hedge && d.hedge_expected_s >= 0.0, "the decision hedges: {d:?}");
    // A's cap reached B in A's load report: the decision priced the fetch at 2 Mbit/s.
    let link = d.link.as_ref().expect("the link figures");
    assert!(link.goodput_gbps <= 0.002 * 1.0001, "the owner's egress cap is not priced: {link:?}");
    assert!(r.hedged && r.kind() == Action::Recompute, "the recompute finished first: {r:?}");
    assert_eq!((r.bytes_moved, r.tokens_ready), (0, 1024), "{r:?}");
    assert!(r.hedge_loser_s > 0.0, "{r:?}");
    assert_eq!(metric(&cl.metrics(1).await, "kvferry_fetched_bytes_total"), fetched_before);
    // The cancelled fetch's reservation is released and nothing of it was committed.
    let t = Instant::now();
    while landing(&cl, "reserved").await > 0.0 {
        assert!(t.elapsed() < Duration::from_secs(5), "the cancelled fetch's reservation stayed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(landing(&cl, "used").await, 0.0, "the cancelled fetch left blocks in the landing zone");
    let m = cl.metrics(1).await;
    assert_eq!(metric(&m, "kvferry_hedges_total{winner=\"recompute\"}"), 1.0);
    assert_the_race_calibrated_only_the_interference(&cl).await;
    warm_equals_cold(&cl, &convo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fast_fetch_wins_the_hedge_and_the_recompute_is_accounted() {
    let b = RegionSpec { configure: Some(hedging_b), ..Default::default() };
    let cl = Cluster::start([RegionSpec::default(), b]);
    let (mut eng_a, mut router_b) = (cl.engine(0).await, cl.router(1).await);
    // 4096 tokens: 4 MiB over loopback in milliseconds; recomputing them takes far longer.
    let convo = tokens(4096, 32);
    generate(&mut eng_a, &convo, true).await;
    let req = request("s-hedge-fast", &convo, PolicyMode::Auto);
    wait_for_source(&mut router_b, &req).await;
    let (d, r) = migrate(&mut router_b, req).await;
    assert!(d.hedge, "the decision hedges: {d:?}");
    assert!(r.hedged && r.kind() == Action::Fetch, "the fetch finished first: {r:?}");
    assert!(r.bytes_moved > 0 && r.tokens_ready == 4096 && r.hedge_loser_s > 0.0, "{r:?}");
    let m = cl.metrics(1).await;
    assert_eq!(metric(&m, "kvferry_hedges_total{winner=\"fetch\"}"), 1.0);
    assert!(metric(&m, "kvferry_hedge_wasted_milliseconds_total") >= 0.0);
    // The losing recompute was cancelled in the engine, and the engine acknowledged it.
    assert_eq!(metric(&m, "kvferry_recompute_cancels_total{state=\"sent\"}"), 1.0);
    let t = Instant::now();
    while metric(&cl.metrics(1).await, "kvferry_recompute_cancels_total{state=\"acknowledged\"}") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(10), "the engine never acknowledged the cancel");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_the_race_calibrated_only_the_interference(&cl).await;
    warm_equals_cold(&cl, &convo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_race_priced_with_heavy_interference_is_not_run() {
    fn priced_b(c: &mut kvferry_daemon::Config) {
        hedging_b(c);
        c.policy.hedge_interference = 4.0;
    }
    let b = RegionSpec { configure: Some(priced_b), ..Default::default() };
    let cl = Cluster::start([RegionSpec::default(), b]);
    let (mut eng_a, mut router_b) = (cl.engine(0).await, cl.router(1).await);
    let convo = tokens(1024, 33);
    generate(&mut eng_a, &convo, true).await;
    let req = request("s-hedge-priced", &convo, PolicyMode::Auto);
    wait_for_source(&mut router_b, &req).await;
    let (d, r) = migrate(&mut router_b, req).await;
    assert!(!d.hedge && d.reason.contains("not hedged"), "slowed 5x, a race cannot win: {d:?}");
    let l = learnt_in_b(&cl).await;
    assert_eq!((l.hedge_interference, l.hedge_samples), (4.0, 0), "the prior is what GetLinks reports");
    assert!(!r.hedged && r.tokens_ready == 1024, "{r:?}");
    assert_eq!(metric(&cl.metrics(1).await, "kvferry_hedges_total{winner=\"fetch\"}"), 0.0);
    warm_equals_cold(&cl, &convo).await;
}
