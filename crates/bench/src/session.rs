//! Driving one migration through the router API: seed a session in region A, wait until
//! region B can see it, migrate it with a policy, verify the bytes that landed.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvferry_bench_report::{DecisionPoint, LinkSpec};
use kvferry_daemon::hostcpu;
use kvferry_proto::v1::migration_client::MigrationClient;
use kvferry_proto::v1::reference_engine_client::ReferenceEngineClient;
use kvferry_proto::v1::{
    Action, Decision, MigrateSessionRequest, Policy, PolicyMode, PrefixDigestResponse, PrefixRequest,
    Receipt, migration_event,
};
use tonic::transport::Channel;

/// The tenant every bench session belongs to.
pub const TENANT: &str = "tenant-bench";
/// The reference engine's default vocabulary.
pub const VOCAB: u32 = 1024;

/// `n` token ids of the reference engine's vocabulary (`seed` picks the conversation).
pub fn prompt(n: usize, seed: u64) -> Vec<u32> {
    kvferry_engine_node::prompt(n, VOCAB, seed)
}

/// What a bench request allows beside its mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Allow {
    pub split: bool,
    /// Ask for a hedge (the bench daemons' `policy.hedge` is `on_request`).
    pub hedge: bool,
}

impl Allow {
    /// Neither split nor hedge: one pure action.
    pub const PURE: Allow = Allow { split: false, hedge: false };
    /// The split allowed, no hedge.
    pub const SPLIT: Allow = Allow { split: true, hedge: false };
}

fn request(session: &str, tokens: &[u32], mode: PolicyMode, allow: Allow) -> MigrateSessionRequest {
    MigrateSessionRequest {
        session_id: session.to_owned(),
        tenant: TENANT.into(),
        token_ids: tokens.to_vec(),
        source_region: "region-a".into(),
        deadline_ms: 900_000,
        policy: Some(Policy {
            mode: mode as i32,
            allow_split: allow.split,
            max_egress_bytes: 0,
            allow_hedge: allow.hedge,
        }),
        ..Default::default()
    }
}

/// Stores synthetic KV for `tokens` in the engine (see `ReferenceEngine.Fill`).
pub async fn fill(
    engine: &mut ReferenceEngineClient<Channel>,
    tokens: &[u32],
) -> anyhow::Result<PrefixDigestResponse> {
    let r = engine.fill(PrefixRequest { tenant: TENANT.into(), token_ids: tokens.to_vec() }).await?;
    Ok(r.into_inner())
}

/// The digest of the prefix the engine can take from its region (see `PrefixDigest`).
pub async fn digest(
    engine: &mut ReferenceEngineClient<Channel>,
    tokens: &[u32],
) -> anyhow::Result<PrefixDigestResponse> {
    let r = engine.prefix_digest(PrefixRequest { tenant: TENANT.into(), token_ids: tokens.to_vec() }).await?;
    Ok(r.into_inner())
}

/// Waits until the target daemon's plan sees `want` tokens held by the source (the source
/// engine reports stored blocks asynchronously), returning that plan.
pub async fn wait_for_holdings(
    mig: &mut MigrationClient<Channel>,
    tokens: &[u32],
    want: u64,
    timeout: Duration,
) -> anyhow::Result<Decision> {
    let end = Instant::now() + timeout;
    loop {
        let d = mig
            .plan_migration(request("plan-probe", tokens, PolicyMode::Auto, Allow::PURE))
            .await?
            .into_inner();
        if d.source_tokens >= want {
            return Ok(d);
        }
        if Instant::now() > end {
            bail!(
                "region-b never saw {want} tokens held in region-a (last plan: {} tokens)",
                d.source_tokens
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The daemon's decision alone (nothing moves).
pub async fn plan(
    mig: &mut MigrationClient<Channel>,
    tokens: &[u32],
    allow: Allow,
) -> anyhow::Result<Decision> {
    Ok(mig.plan_migration(request("plan", tokens, PolicyMode::Auto, allow)).await?.into_inner())
}

/// What one MigrateSession answered.
#[derive(Debug, Clone)]
pub struct Migrated {
    pub decision: Decision,
    pub receipt: Receipt,
    /// Wall time the router saw, seconds.
    pub router_s: f64,
}

/// Runs MigrateSession to its receipt.
pub async fn migrate(
    mig: &mut MigrationClient<Channel>,
    session: &str,
    tokens: &[u32],
    mode: PolicyMode,
    allow: Allow,
) -> anyhow::Result<Migrated> {
    let t0 = Instant::now();
    let mut stream = mig.migrate_session(request(session, tokens, mode, allow)).await?.into_inner();
    let (mut decision, mut receipt) = (None, None);
    while let Some(ev) = stream.message().await? {
        match ev.event {
            Some(migration_event::Event::Decision(d)) => decision = Some(d),
            Some(migration_event::Event::Receipt(r)) => receipt = Some(r),
            _ => {}
        }
    }
    Ok(Migrated {
        decision: decision.context("MigrateSession sent no decision")?,
        receipt: receipt.context("MigrateSession ended without a receipt")?,
        router_s: t0.elapsed().as_secs_f64(),
    })
}

/// The two pure runs behind one decision point: `fetch_of` migrated by fetch and
/// `recompute_of` by recompute (different contents, so that neither run warms the other),
/// sessions `{tag}-fetch-{seed}` and `{tag}-recompute-{seed}`. Each must have run as asked,
/// without a fallback, with all but `slack` of its `n` tokens ready.
pub async fn pure_runs(
    mig: &mut MigrationClient<Channel>,
    (tag, seed): (&str, u64),
    fetch_of: &[u32],
    recompute_of: &[u32],
    n: u64,
    slack: u64,
) -> anyhow::Result<(Migrated, Migrated)> {
    let fetched =
        migrate(mig, &format!("{tag}-fetch-{seed}"), fetch_of, PolicyMode::Fetch, Allow::PURE).await?;
    let recomputed =
        migrate(mig, &format!("{tag}-recompute-{seed}"), recompute_of, PolicyMode::Recompute, Allow::PURE)
            .await?;
    for (kind, what, m) in [(Action::Fetch, "fetch", &fetched), (Action::Recompute, "recompute", &recomputed)]
    {
        if m.receipt.kind() != kind || !m.receipt.fallback.is_empty() || m.receipt.tokens_ready + slack < n {
            bail!(
                "{tag}: {what} of {n} tokens ended as {} with {} tokens ready (fallback: {})",
                m.receipt.action,
                m.receipt.tokens_ready,
                m.receipt.fallback
            );
        }
    }
    Ok((fetched, recomputed))
}

/// The host's CPU steal so far, seconds summed over its CPUs: the time its virtual CPUs were
/// ready but the hypervisor ran something else (the daemon's `/proc/stat` reading). `None`
/// where it cannot be read.
pub fn host_steal_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let steal = hostcpu::parse_host_ticks(&stat)?.steal?;
    Some(steal as f64 / hostcpu::ticks_per_second())
}

/// The predicted seconds of `action` among a decision's candidates.
pub fn predicted(d: &Decision, action: &str) -> Option<f64> {
    d.candidates.iter().find(|c| c.action == action).map(|c| c.seconds)
}

/// Calibration samples behind the decision's prediction of `action` (0 when none).
pub fn samples(d: &Decision, action: &str) -> u32 {
    d.candidates.iter().find(|c| c.action == action).map_or(0, |c| c.calibration_samples)
}

/// The sd of one outcome the decision gave `action`'s prediction (0 when none).
pub fn sd(d: &Decision, action: &str) -> f64 {
    d.candidates.iter().find(|c| c.action == action).map_or(0.0, |c| c.sd_s)
}

/// One point of the decision sweep on `link`: what the daemon chose (`chosen`, as the report
/// records it) for an `n`-token prefix under decision `d`, the two predictions and
/// calibration sample counts behind it, and the measured walls of the pure fetch and the pure
/// recompute.
pub fn decision_point(
    link: &LinkSpec,
    n: u64,
    chosen: String,
    d: &Decision,
    fetched: &Migrated,
    recomputed: &Migrated,
) -> DecisionPoint {
    DecisionPoint {
        link: link.clone(),
        prefix_tokens: n,
        chosen,
        predicted_fetch_s: predicted(d, "fetch").unwrap_or(f64::NAN),
        predicted_recompute_s: predicted(d, "recompute").unwrap_or(f64::NAN),
        measured_fetch_s: fetched.receipt.wall_s,
        measured_recompute_s: recomputed.receipt.wall_s,
        fetch_load_s: 0.0,
        modeled_crossover_tokens: d.crossover_tokens,
        fetch_samples: samples(d, "fetch"),
        recompute_samples: samples(d, "recompute"),
        predicted_fetch_sd_s: sd(d, "fetch"),
        predicted_recompute_sd_s: sd(d, "recompute"),
        predicted_fetch_late_p: d
            .candidates
            .iter()
            .find(|c| c.action == "fetch")
            .map_or(0.0, |c| c.late_probability),
        measured_hedge_s: None,
        hedge_winner: None,
    }
}

/// Records what the daemon did with a decision it planned as a hedge, executed on a
/// conversation of its own (`run`, policy auto with the hedge allowed): a hedge that ran is
/// judged by its own wall time and names the action that finished first; where the daemon,
/// re-planning at execution, chose one pure action instead, that action is the choice (and the
/// pure measurements judge it).
pub fn record_hedge(p: &mut DecisionPoint, run: &Migrated) -> anyhow::Result<()> {
    let r = &run.receipt;
    if !r.fallback.is_empty() {
        bail!("the hedged migration of {} tokens fell back: {}", p.prefix_tokens, r.fallback);
    }
    if r.hedged {
        p.chosen = "hedge".into();
        p.measured_hedge_s = Some(r.wall_s);
        p.hedge_winner = Some(r.action.clone());
    } else {
        p.chosen = run.decision.action.clone();
    }
    Ok(())
}

/// One line on the hedge at a decision point: how the hedged run went and what the daemon
/// expected of it (its reason's `hedged:` part), or why it did not hedge (the `not hedged:`
/// part).
pub fn hedge_note(p: &DecisionPoint, d: &Decision) -> String {
    match (p.measured_hedge_s, &p.hedge_winner) {
        (Some(s), Some(w)) => match d.reason.split_once("; hedged: ") {
            Some((_, why)) => format!("hedged: {w} finished first, {s:.3} s; {why}"),
            None => format!("hedged: {w} finished first, {s:.3} s"),
        },
        _ if d.hedge => format!("planned a hedge; at execution the daemon chose {}", p.chosen),
        _ => d
            .reason
            .split_once("not hedged: ")
            .map_or("no hedge weighed".into(), |(_, r)| format!("not hedged: {r}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_steal_is_read_and_only_grows() {
        let line = "cpu  5381179 2283 1526221 6492695 29971 0 23464 19214 0 0\ncpu0 1 2 3 4\n";
        assert_eq!(hostcpu::parse_host_ticks(line).and_then(|t| t.steal), Some(19214));
        let now = host_steal_s().expect("/proc/stat readable here");
        assert!(now >= 0.0 && host_steal_s().unwrap() >= now, "steal only grows");
    }

    fn point(hedge: Option<(f64, &str)>) -> DecisionPoint {
        DecisionPoint {
            link: LinkSpec { profile: "p".into(), rate_bps: 1e9, rtt_s: 0.05, loss: 0.0 },
            prefix_tokens: 32,
            chosen: "hedge".into(),
            predicted_fetch_s: 0.073,
            predicted_recompute_s: 0.055,
            measured_fetch_s: 0.073,
            measured_recompute_s: 0.058,
            fetch_load_s: 0.0,
            modeled_crossover_tokens: Some(46.0),
            fetch_samples: 3,
            recompute_samples: 3,
            predicted_fetch_sd_s: 0.0,
            predicted_recompute_sd_s: 0.0,
            predicted_fetch_late_p: 0.0,
            measured_hedge_s: hedge.map(|h| h.0),
            hedge_winner: hedge.map(|h| h.1.to_owned()),
        }
    }

    #[test]
    fn a_hedge_note_says_how_it_went_and_what_the_daemon_expected() {
        let d = Decision {
            reason: "model: recompute; hedged: the bands straddle the crossover: hedging is expected to take 50.00 ms vs 55.00 ms".into(),
            hedge: true,
            ..Decision::default()
        };
        let ran = hedge_note(&point(Some((0.076, "fetch"))), &d);
        assert_eq!(
            ran,
            "hedged: fetch finished first, 0.076 s; the bands straddle the crossover: hedging is expected to take 50.00 ms vs 55.00 ms"
        );
        let replanned = hedge_note(&point(None), &d);
        assert!(replanned.starts_with("planned a hedge; at execution the daemon chose hedge"), "{replanned}");
        let no = Decision {
            reason: "model: fetch; not hedged: the bands do not overlap".into(),
            ..Decision::default()
        };
        assert_eq!(hedge_note(&point(None), &no), "not hedged: the bands do not overlap");
        let plain = Decision { reason: "model: fetch".into(), ..Decision::default() };
        assert_eq!(
            hedge_note(&point(Some((0.07, "recompute"))), &plain),
            "hedged: recompute finished first, 0.070 s"
        );
    }
}
