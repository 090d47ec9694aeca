//! The decision's calibration, end to end with real processes (two `kvferry daemon`s, two
//! `kvferry engine`s, QUIC + mutual TLS on loopback): region B's engine reports a prefill
//! profile ten times too fast (`--profile-scale 0.1`, a deliberately wrong prior), and the
//! daemon's recompute predictions must come within a factor of 2 of the measured wall time
//! within [`N`] executed recomputes (the median of the next 6, so recomputes slowed by a busy
//! host do not decide), with the calibrated figures visible in `GetLinks` and
//! each prediction's band narrowing as samples accumulate. Fetches calibrate the link the same
//! way (its fitted fixed cost appears in `GetLinks`). A split calibrates its engine's split
//! interference from its measured time (visible in `GetLinks`), and a large interference
//! makes the daemon not split where it otherwise would.

mod common;

use common::{Cluster, RegionSpec, generate, migrate, request, tokens, wait_for_source};
use kvferry_proto::v1::{Action, Decision, GetLinksRequest, MigrateSessionRequest, Policy, PolicyMode};

/// Recomputes within which the wrong prior must be corrected.
const N: usize = 6;

fn recompute_candidate(d: &Decision) -> (f64, f64, u32) {
    let c = d.candidates.iter().find(|c| c.kind() == Action::Recompute).expect("a recompute candidate");
    (c.seconds, c.sd_s, c.calibration_samples)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wrong_prior_is_corrected_within_n_migrations() {
    let cluster = Cluster::start([
        RegionSpec::default(),
        RegionSpec { engine_args: vec!["--profile-scale".into(), "0.1".into()], ..RegionSpec::default() },
    ]);
    let (mut a, mut b) = (cluster.engine(0).await, cluster.router(1).await);
    // A registered engine is listed before any migration to it: its prior, no sample.
    let links = b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let fresh =
        links.engines.iter().find(|e| e.engine_id == "engine-b").unwrap_or_else(|| panic!("{links:?}"));
    assert_eq!(fresh.calibration_samples, 0, "{fresh:?}");
    assert!(fresh.linear_s_per_token > 0.0 && fresh.reported_linear_s_per_token > 0.0, "{fresh:?}");
    let mut ratios = Vec::new();
    let mut bands = Vec::new();
    for i in 0..N + 6 {
        // A fresh prefix each time (nothing cached in B), held by A so the model is asked.
        let convo = tokens(256 + 64 * (i % 4), 1000 + i as u64);
        generate(&mut a, &convo, true).await;
        let mut req = request(&format!("cal-{i}"), &convo, PolicyMode::Auto);
        wait_for_source(&mut b, &req).await;
        let plan = b.plan_migration(req.clone()).await.unwrap().into_inner();
        let (predicted, sd, samples) = recompute_candidate(&plan);
        assert_eq!(samples as usize, i, "one sample per executed recompute: {plan:?}");
        req.policy.as_mut().unwrap().mode = PolicyMode::Recompute as i32;
        let (_, receipt) = migrate(&mut b, req).await;
        assert_eq!(receipt.kind(), Action::Recompute, "{receipt:?}");
        let ratio = predicted / receipt.measured_s;
        eprintln!(
            "recompute {i}: {} tokens predicted {:.1} ms (sd {:.1} ms, {samples} samples), measured {:.1} ms, ratio {ratio:.2}",
            convo.len(),
            predicted * 1e3,
            sd * 1e3,
            receipt.measured_s * 1e3
        );
        ratios.push(ratio);
        bands.push(sd / predicted);
    }
    assert!(ratios[0] < 0.5, "the prior is 10x too fast, so the first prediction is far too low: {ratios:?}");
    let mut after: Vec<f64> = ratios[N..].to_vec();
    after.sort_by(f64::total_cmp);
    let median = (after[2] + after[3]) / 2.0;
    assert!(
        (0.5..=2.0).contains(&median),
        "after {N} samples, predictions are still off by more than 2x: {ratios:?}"
    );
    assert!(bands[N] < bands[0], "the band narrows as samples accumulate: {bands:?}");

    let links = b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let engine = links.engines.iter().find(|e| e.engine_id == "engine-b").expect("engine-b calibrated");
    assert_eq!(engine.calibration_samples as usize, N + 6, "{engine:?}");
    assert!(
        engine.linear_s_per_token + engine.fixed_s / 256.0 > 3.0 * engine.reported_linear_s_per_token,
        "the calibrated cost is well above the (too fast) reported profile: {engine:?}"
    );

    // Fetches calibrate the link: after a few, GetLinks shows a fitted fixed cost.
    for i in 0..3 {
        let convo = tokens(512, 2000 + i);
        generate(&mut a, &convo, true).await;
        let req = request(&format!("fetch-{i}"), &convo, PolicyMode::Fetch);
        wait_for_source(&mut b, &req).await;
        let (d, receipt) = migrate(&mut b, req).await;
        assert_eq!(receipt.kind(), Action::Fetch, "{d:?} {receipt:?}");
        assert_eq!((receipt.split_compute_leg_s, receipt.split_fetch_leg_s), (0.0, 0.0), "no split ran");
        let fetch = d.candidates.iter().find(|c| c.kind() == Action::Fetch).expect("a fetch candidate");
        assert_eq!(fetch.calibration_samples as u64, i, "{d:?}");
    }
    let links = b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let link = links.links.iter().find(|l| l.region == "region-a").expect("the link to A");
    assert_eq!(link.calibration_samples, 3, "{link:?}");
    assert!(link.fixed_ms > 0.0 && link.calibrated_goodput_gbps > 0.0, "{link:?}");
}

/// A migration of a 640-token prefix held by region A, its egress capped at a quarter of the
/// prefix: a full fetch is infeasible, so the choice is a split or a recompute.
async fn capped(cluster: &Cluster, session: &str, salt: u64) -> MigrateSessionRequest {
    let (mut a, mut b) = (cluster.engine(0).await, cluster.router(1).await);
    let convo = tokens(640, salt);
    generate(&mut a, &convo, true).await;
    let mut req = request(session, &convo, PolicyMode::Auto);
    wait_for_source(&mut b, &req).await;
    let bytes_per_token = b.plan_migration(req.clone()).await.unwrap().into_inner().bytes_per_token;
    req.policy = Some(Policy {
        mode: PolicyMode::Auto as i32,
        allow_split: true,
        max_egress_bytes: (bytes_per_token * 160.0) as u64,
        allow_hedge: false,
    });
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_executed_split_calibrates_the_split_interference() {
    let cluster = Cluster::start([RegionSpec::default(), RegionSpec::default()]);
    let mut b = cluster.router(1).await;
    let req = capped(&cluster, "split-cal", 4242).await;
    let (d, r) = migrate(&mut b, req).await;
    assert_eq!((d.kind(), r.kind()), (Action::Split, Action::Split), "{d:?} {r:?}");
    assert!(r.fallback.is_empty(), "{r:?}");
    // The receipt names both legs: each ended within the split's wall time, the later one near
    // its end, and the plan's prediction for each is the one the decision was made with.
    let (c, f) = (r.split_compute_leg_s, r.split_fetch_leg_s);
    assert!(c > 0.0 && f > 0.0 && c.max(f) <= r.wall_s, "{r:?}");
    assert!(r.wall_s - c.max(f) < 0.5 * r.wall_s, "the later leg bounds the split: {r:?}");
    assert!(r.predicted_compute_leg_s > 0.0 && r.predicted_fetch_leg_s > 0.0, "{r:?}");
    assert!(r.predicted_compute_leg_s.max(r.predicted_fetch_leg_s) <= r.predicted_s + 1e-9, "{r:?}");
    let links = b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let engine = links.engines.iter().find(|e| e.engine_id == "engine-b").expect("engine-b calibrated");
    // One split does not outvote the prior 0 (the median of 1, 1 and its slowdown).
    assert_eq!((engine.split_samples, engine.split_interference), (1, 0.0), "{engine:?}");
    // The split's scatter around the outcome it was predicted at: the prior (`[policy]
    // split_noise`, 3 %) holds two of the median's three places, so one split leaves it.
    assert!((engine.split_scatter - 0.03).abs() < 1e-12, "{engine:?}");
    // Its overhead, the wall beyond the later leg, measured and pooled with the prior
    // (`[policy] split_overhead_ms`, 0.5 ms by default) worth one split.
    let prior = kvferry_daemon::config::Config::default().policy.split_overhead_ms / 1000.0;
    let overhead = |r: &kvferry_proto::v1::Receipt| r.wall_s - r.split_compute_leg_s.max(r.split_fetch_leg_s);
    let want = (prior + overhead(&r)) / 2.0;
    assert!((engine.split_overhead_s - want).abs() < 1e-12, "{engine:?}: {want}");
    // A second does. Both were planned with 0 (the prior, then the anchored median), so each
    // slowdown is measured / predicted (at least 1), and the median of 1 and the two is the
    // smaller of them.
    let req = capped(&cluster, "split-cal-2", 4343).await;
    let (d2, r2) = migrate(&mut b, req).await;
    assert_eq!((d2.kind(), r2.kind()), (Action::Split, Action::Split), "{d2:?} {r2:?}");
    let links = b.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let engine = links.engines.iter().find(|e| e.engine_id == "engine-b").expect("engine-b calibrated");
    assert_eq!(engine.split_samples, 2, "{engine:?}");
    // The scatter: the median of the two splits' residuals (this link has no tail: one
    // outcome each) and the prior's, pooled with the prior worth eight splits.
    let resid = |r: &kvferry_proto::v1::Receipt| (r.measured_s / r.predicted_s - 1.0).abs();
    let mut v = [resid(&r), resid(&r2), 0.03 / 1.4826];
    v.sort_by(f64::total_cmp);
    let mad = 1.4826 * v[1];
    let want = ((8.0 * 0.03 * 0.03 + 2.0 * mad * mad) / 10.0).sqrt();
    assert!((engine.split_scatter - want).abs() < 1e-9, "{engine:?}: {want}");
    // The overhead: the prior and the median of the two (their mean), three to one.
    let want = (prior + 2.0 * (overhead(&r) + overhead(&r2)) / 2.0) / 3.0;
    assert!((engine.split_overhead_s - want).abs() < 1e-12, "{engine:?}: {want}");
    let slowdown = |r: &kvferry_proto::v1::Receipt| (r.measured_s / r.predicted_s).clamp(1.0, 5.0);
    let expected = slowdown(&r).min(slowdown(&r2)) - 1.0;
    assert!(
        (engine.split_interference - expected).abs() < 1e-9,
        "{engine:?} vs {expected} from {r:?} {r2:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_large_split_interference_rules_the_split_out() {
    let calm = Cluster::start([RegionSpec::default(), RegionSpec::default()]);
    let req = capped(&calm, "split-calm", 4343).await;
    let d = calm.router(1).await.plan_migration(req).await.unwrap().into_inner();
    assert_eq!(d.kind(), Action::Split, "without interference the capped prefix splits: {d:?}");
    drop(calm);
    let shared = RegionSpec { configure: Some(|c| c.policy.split_interference = 4.0), ..Default::default() };
    let busy = Cluster::start([RegionSpec::default(), shared]);
    let req = capped(&busy, "split-busy", 4343).await;
    let d = busy.router(1).await.plan_migration(req).await.unwrap().into_inner();
    assert_eq!(d.kind(), Action::Recompute, "each leg at 1/5 speed: no split beats recomputing: {d:?}");
    let links = busy.router(1).await.get_links(GetLinksRequest {}).await.unwrap().into_inner();
    let engine = links.engines.iter().find(|e| e.engine_id == "engine-b").expect("engine-b priced");
    assert_eq!((engine.split_interference, engine.split_samples), (4.0, 0), "{engine:?}");
}

/// `kvferry_split_cpu_share{part}` from a `/metrics` text.
fn cpu_share(metrics: &str, part: &str) -> f64 {
    common::metric(metrics, &format!("kvferry_split_cpu_share{{part=\"{part}\"}}"))
}

/// With `[policy] split_cpu_floor` on (the default; the other tests turn it off because they
/// run beside each other on a busy host), region B's daemon measures its host: with every core
/// spinning on other work, a split is planned with at least the interference the CPU shares
/// predict (`(other + prefill + fetch) / cores − 1`), visible in `/metrics`; its engine's
/// prefill cores and the fetch's CPU are then measured from a pure recompute and a pure fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_host_floors_the_split_interference() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let floored = RegionSpec { configure: Some(|c| c.policy.split_cpu_floor = true), ..Default::default() };
    let cluster = Cluster::start([RegionSpec::default(), floored]);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let stop = Arc::new(AtomicBool::new(false));
    let spinners: Vec<_> = (0..cores)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..10_000 {
                        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                    }
                }
            })
        })
        .collect();
    // The daemon's quietest window of the last 3 s must be one with the load running.
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let req = capped(&cluster, "split-floor", 4545).await;
    let d = cluster.router(1).await.plan_migration(req).await.unwrap().into_inner();
    let m = cluster.metrics(1).await;
    stop.store(true, Ordering::Relaxed);
    for s in spinners {
        s.join().unwrap();
    }
    let (n, other, prefill, floor) =
        (cpu_share(&m, "cores"), cpu_share(&m, "other"), cpu_share(&m, "prefill"), cpu_share(&m, "floor"));
    eprintln!("under load: {n} cores, other {other:.2}, prefill {prefill:.2}, floor {floor:.3}");
    assert_eq!(n, cores as f64, "{m}");
    assert!(other >= 0.75 * n, "every core spun on other work: {other} of {n} cores ({d:?})");
    assert_eq!(prefill, 1.0, "one core of prefill before any recompute was measured");
    assert!(floor >= 0.5 / n && floor <= 4.0, "the shares do not fit the cores: floor {floor} ({m})");
    assert!(d.reason.contains("split priced at interference"), "the decision says so: {}", d.reason);

    // A pure recompute and a pure fetch on the quiet host measure their CPU.
    let (mut a, mut b) = (cluster.engine(0).await, cluster.router(1).await);
    let convo = tokens(512, 4646);
    let (_, r) = migrate(&mut b, request("floor-recompute", &convo, PolicyMode::Recompute)).await;
    assert_eq!(r.kind(), Action::Recompute, "{r:?}");
    let convo = tokens(512, 4848);
    generate(&mut a, &convo, true).await;
    let req = request("floor-fetch", &convo, PolicyMode::Fetch);
    wait_for_source(&mut b, &req).await;
    let (_, f) = migrate(&mut b, req).await;
    assert_eq!(f.kind(), Action::Fetch, "{f:?}");
    let req = capped(&cluster, "split-floor-2", 4747).await;
    b.plan_migration(req).await.unwrap();
    let m = cluster.metrics(1).await;
    let (prefill, fetch) = (cpu_share(&m, "prefill"), cpu_share(&m, "fetch"));
    eprintln!("quiet: other {:.2}, prefill {prefill:.2}, fetch {fetch:.3}", cpu_share(&m, "other"));
    assert!(prefill > 0.0 && prefill <= n + 0.5, "the engine's prefill, measured: {prefill} ({m})");
    assert!(fetch.is_finite() && fetch >= 0.0, "the fetch's cores at the link's rate: {fetch} ({m})");
}
