//! Carrying out a planned migration: fetch into the landing zone, tell the engine to
//! recompute, or both at once (split); with deadlines everywhere and a recompute fallback when
//! a fetch cannot finish (source down, deadline); before that fallback, a fetch whose source
//! failed is retried from the next holder the plan ranked (`Prepared::alternates`). Blocks
//! become visible only after their fetch returned `Ok` (every byte verified); a failed fetch
//! leaves nothing behind.
//!
//! A fetch that may fall back does not get the whole deadline: it ends early enough for the
//! target engine to recompute the prefix ([`fetch_deadline`]). A source that has sent no
//! verified byte for twice the peer idle timeout (one loss detection plus one reconnect
//! attempt) is taken as down and the fetch is abandoned at once.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvferry_model::migration::fallback_reserve_s;
use kvferry_model::{FetchObservation, MigrationAction, RecomputeObservation};
use kvferry_peer::{FetchReceipt, FetchSpec, RegionId, Transport};
use kvferry_proto::v1::{
    CancelRecompute, DaemonCommand, MigrationEvent, Progress, Receipt, Recompute, daemon_command,
    migration_event,
};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::Shared;
use crate::blockbuf::BlockShape;
use crate::catalog::{LandingSink, landed_blocks};
use crate::error::{DaemonError, Origin};
use crate::inflight::{self, Entered, FlightKey, Outcome};
use crate::plan::{Planned, Prepared, set_receipt_action};
use kvferry_pool::sync::LockExt;

type Events = mpsc::Sender<Result<MigrationEvent, Status>>;

/// Smallest fetch whose goodput feeds the link estimator.
const GOODPUT_SAMPLE_MIN_BYTES: u64 = 4 << 20;

/// `f`'s output and the seconds from `t0` until it was ready.
async fn timed<T>(t0: Instant, f: impl Future<Output = T>) -> (T, f64) {
    let out = f.await;
    (out, t0.elapsed().as_secs_f64())
}

/// Aborts a spawned task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the plan; returns the receipt.
pub async fn execute(
    shared: &Arc<Shared>,
    p: &Prepared,
    plan: &Planned,
    events: &Events,
) -> Result<Receipt, DaemonError> {
    let t0 = Instant::now();
    let bs = p.block_size as usize;
    let mut receipt = Receipt { predicted_s: plan.predicted_s, ..Default::default() };
    set_receipt_action(&mut receipt, plan.action);
    match plan.action {
        MigrationAction::Fetch | MigrationAction::Recompute if plan.hedge.is_some() => {
            hedge(shared, p, plan, events, &mut receipt).await?;
        }
        MigrationAction::AlreadyLocal => {
            receipt.tokens_ready = (p.local_blocks * bs) as u64;
            receipt.path = format!("{}: already in this region", shared.config.region);
        }
        MigrationAction::Recompute => {
            let n = recompute(shared, p, plan.recompute_tokens).await?;
            fill_recompute(shared, p, &mut receipt, n);
        }
        MigrationAction::Fetch => {
            let src = source_of(p)?;
            match fetch(FetchJob::alone(
                shared,
                p,
                events,
                &src,
                plan.fetch_from..plan.fetch_end,
                fetch_need_s(plan),
            ))
            .await
            {
                Ok(r) => fill_fetch(shared, &src, &mut receipt, &r, plan.fetch_end * bs),
                Err(e) => match fetch_from_alternates(shared, p, plan, events, &src, &e).await {
                    Some((alt, r)) => {
                        fill_fetch(shared, &alt, &mut receipt, &r, plan.fetch_end * bs);
                        receipt.fallback =
                            format!("fetch from {src} failed ({e}); fetched from {alt} instead");
                    }
                    None => fallback(shared, p, &mut receipt, e).await?,
                },
            }
        }
        MigrationAction::Split => {
            let k = plan.recompute_tokens;
            let src = source_of(p)?;
            let legs_t0 = Instant::now();
            let ((rec, rec_s), (fet, fet_s)) = tokio::join!(
                timed(legs_t0, recompute_leg(shared, p, k, Leg::Concurrent)),
                timed(
                    legs_t0,
                    fetch(
                        FetchJob::alone(
                            shared,
                            p,
                            events,
                            &src,
                            plan.fetch_from..plan.fetch_end,
                            fetch_need_s(plan)
                        )
                        .concurrent()
                    )
                )
            );
            // Which leg bound the split, against the legs the plan predicted: what a split's
            // prediction error is made of.
            receipt.split_compute_leg_s = rec_s;
            receipt.split_fetch_leg_s = fet_s;
            if let Some(m) = &plan.model {
                let pt = m.split.point;
                receipt.predicted_compute_leg_s = pt.compute_leg_seconds;
                receipt.predicted_fetch_leg_s = pt.fetch_leg_seconds;
                // The host's CPU shares (cores) as the floor reads them now.
                let floor = p
                    .figures
                    .as_ref()
                    .and_then(|f| shared.host_cpu.floor(&p.engine.engine_id, f.goodput_bps / 8.0));
                tracing::info!(session = ?p.session_id, recompute_tokens = k,
                    compute_leg_s = rec_s, fetch_leg_s = fet_s,
                    predicted_compute_leg_s = pt.compute_leg_seconds, predicted_fetch_leg_s = pt.fetch_leg_seconds,
                    interference = p.policy.split_interference,
                    cpu_other = floor.map(|f| f.other), cpu_prefill = floor.map(|f| f.compute),
                    cpu_fetch = floor.map(|f| f.fetch), cores = floor.map(|f| f.cores), "split legs");
            }
            match (rec, fet) {
                (Ok(_), Ok(r)) => {
                    fill_fetch(shared, &src, &mut receipt, &r, plan.fetch_end * bs);
                    receipt.path = format!(
                        "{} + {} engine {}: prefill [0, {k})",
                        receipt.path, shared.config.region, p.engine.engine_id
                    );
                }
                (Err(e), _) => return Err(e),
                (Ok(_), Err(e)) => fallback(shared, p, &mut receipt, e).await?,
            }
        }
    }
    receipt.wall_s = t0.elapsed().as_secs_f64();
    receipt.measured_s = receipt.wall_s;
    // The daemon's own calibrations compare what it executed, the transfer and the legs, with
    // their prediction: the engine's load of the fetched blocks, inside the plan's prediction,
    // comes after this receipt (at the engine's next step) and is learnt from the Load itself.
    let executed_predicted_s = receipt.predicted_s - plan.load_s;
    // An executed split (both legs, no fallback) calibrates this engine's split interference
    // against the whole migration's prediction, which was made with the interference in force.
    if plan.action == MigrationAction::Split
        && receipt.fallback.is_empty()
        && shared.config.policy.calibrate
        && executed_predicted_s > 0.0
    {
        let prior = shared.config.policy.split_interference;
        let used = p.policy.split_interference;
        shared.calib.observe_split(
            &p.engine.engine_id,
            prior,
            used,
            executed_predicted_s,
            receipt.measured_s,
        );
        // Its overhead, measured directly: the wall beyond the slower leg.
        shared.calib.observe_split_overhead(
            &p.engine.engine_id,
            shared.config.policy.split_overhead_ms / 1000.0,
            receipt.wall_s,
            receipt.split_compute_leg_s,
            receipt.split_fetch_leg_s,
        );
        // And its scatter, against the nearer of the two outcomes it was planned with (the
        // same executed part: the engine's load comes after).
        if let Some(m) = &plan.model {
            let pt = m.split.point;
            shared.calib.observe_split_outcome(
                &p.engine.engine_id,
                shared.config.policy.split_noise,
                pt.on_time_seconds - plan.load_s,
                pt.late_seconds - plan.load_s,
                receipt.measured_s,
            );
        }
    }
    // A hedge's wall is a race's, not the planned pure action's: it says nothing of that
    // prediction (the race calibrates the hedge interference instead).
    if receipt.fallback.is_empty()
        && !receipt.hedged
        && executed_predicted_s > 0.0
        && let Some((src, _)) = &p.source
    {
        shared.links.record_prediction(src, executed_predicted_s, receipt.measured_s);
        shared.metrics.last_prediction_error.set(prediction_error(executed_predicted_s, receipt.measured_s));
    }
    Ok(receipt)
}

/// When a hedge's winner made the prefix usable, `elapsed_s` after both legs started: a
/// recompute wrote the engine's pool as it ran; a fetch has landed and the engine's load of it,
/// `fetch_load_s` (what its prediction included), is still to come.
pub fn hedge_usable_s(winner: MigrationAction, elapsed_s: f64, fetch_load_s: f64) -> f64 {
    match winner {
        MigrationAction::Fetch => elapsed_s + fetch_load_s,
        _ => elapsed_s,
    }
}

fn fill_recompute(shared: &Shared, p: &Prepared, receipt: &mut Receipt, tokens: u64) {
    set_receipt_action(receipt, MigrationAction::Recompute);
    receipt.tokens_ready = tokens;
    receipt.path = format!("{} engine {}: local prefill", shared.config.region, p.engine.engine_id);
}

/// Runs a hedge: the fetch of blocks `[0, hedge_fetch_end)` and the recompute of the whole
/// prefix start together; the first to finish `Ok` is the migration's action and the other
/// is cancelled. A fetch dropped before it returned commits nothing (its landing reservation
/// is released; no block becomes visible). A dropped recompute is cancelled in the engine
/// (`CancelRecompute`), and the time it ran until the winner finished is accounted as wasted (`hedge_loser_s`, `kvferry_hedge_wasted_milliseconds_total`). When the first
/// to finish failed, the other is awaited. Neither leg calibrates the pure actions: they ran
/// concurrently; a clean race calibrates the engine's hedge interference instead.
async fn hedge(
    shared: &Arc<Shared>,
    p: &Prepared,
    plan: &Planned,
    events: &Events,
    receipt: &mut Receipt,
) -> Result<(), DaemonError> {
    enum First {
        Fetch(Result<Fetched, DaemonError>),
        Recompute(Result<u64, DaemonError>),
    }
    let bs = p.block_size as usize;
    let total = p.hashes.len() * bs;
    let started = Instant::now();
    let src = source_of(p)?;
    // Both legs run at once, so neither time is what the action costs alone: the winner's
    // measurement is not fed to the fetch or recompute calibration (on a shared host the
    // other leg slowed it; fed as a pure sample it would skew the next predictions).
    let fetch_leg =
        fetch(FetchJob::alone(shared, p, events, &src, 0..plan.hedge_fetch_end, fetch_need_s(plan)).racing());
    let recompute_leg = recompute_leg(shared, p, total, Leg::Concurrent);
    tokio::pin!(fetch_leg, recompute_leg);
    receipt.hedged = true;
    let first = tokio::select! {
        f = &mut fetch_leg => First::Fetch(f),
        r = &mut recompute_leg => First::Recompute(r),
    };
    let loser_s = started.elapsed().as_secs_f64();
    let m = &shared.metrics;
    // A clean race (the first to finish succeeded) is one sample of this engine's hedge
    // interference: the winner's time until the engine can use the prefix against the race's
    // expected minimum, which was priced with the interference then in force and, for the
    // fetch, with the engine's load after it (a fetch that won has landed, not been loaded:
    // its load is added as it was priced). A race whose first leg failed is not one.
    let winner = match &first {
        First::Fetch(Ok(_)) => Some(MigrationAction::Fetch),
        First::Recompute(Ok(_)) => Some(MigrationAction::Recompute),
        _ => None,
    };
    if let Some(usable_s) = winner.map(|w| hedge_usable_s(w, loser_s, plan.fetch_load_s))
        && shared.config.policy.calibrate
        && let Some(h) = plan.hedge.filter(|h| h.expected_s > 0.0)
    {
        // Anchored, until its samples outvote it, on what this race was priced with (the
        // split's estimate or the configured prior before the engine's first hedge).
        shared.calib.observe_hedge(
            &p.engine.engine_id,
            p.hedge_policy.fetch_interference,
            p.hedge_policy.fetch_interference,
            h.expected_s,
            usable_s,
        );
    }
    match first {
        First::Fetch(Ok(r)) => {
            fill_fetch(shared, &src, receipt, &r, plan.hedge_fetch_end * bs);
            set_receipt_action(receipt, MigrationAction::Fetch);
            receipt.hedge_loser_s = loser_s;
            m.hedges_fetch_won.inc();
            m.hedge_wasted_ms.add((loser_s * 1e3) as u64);
        }
        First::Recompute(Ok(n)) => {
            fill_recompute(shared, p, receipt, n);
            receipt.hedge_loser_s = loser_s;
            m.hedges_recompute_won.inc();
        }
        First::Fetch(Err(e)) => {
            tracing::warn!(session = ?p.session_id, error = %e, "hedge: the fetch failed; keeping the recompute");
            let n = recompute_leg.await?;
            fill_recompute(shared, p, receipt, n);
            m.hedges_recompute_won.inc();
        }
        First::Recompute(Err(e)) => {
            tracing::warn!(session = ?p.session_id, error = %e, "hedge: the recompute failed; keeping the fetch");
            let r = fetch_leg.await?;
            fill_fetch(shared, &src, receipt, &r, plan.hedge_fetch_end * bs);
            set_receipt_action(receipt, MigrationAction::Fetch);
            m.hedges_fetch_won.inc();
        }
    }
    Ok(())
}

fn source_of(p: &Prepared) -> Result<String, DaemonError> {
    p.source.as_ref().map(|(s, _)| s.clone()).ok_or_else(|| DaemonError::internal("fetch without a source"))
}

/// A fetch from the chosen source failed: tries the other holders that hold the whole planned
/// range, next best first, while the fetch deadline leaves time (not after a deadline error:
/// then no time is left for another transfer). Returns the holder that served and its receipt.
async fn fetch_from_alternates(
    shared: &Arc<Shared>,
    p: &Prepared,
    plan: &Planned,
    events: &Events,
    failed: &str,
    e: &DaemonError,
) -> Option<(String, Fetched)> {
    if matches!(e, DaemonError::Deadline(_)) {
        return None;
    }
    for (alt, held) in &p.alternates {
        if (*held as usize) < plan.fetch_end || fetch_deadline(p, fetch_need_s(plan)) <= Instant::now() {
            continue;
        }
        tracing::warn!(session = ?p.session_id, failed, error = %e, next = %alt, "fetch failed; trying the next holder");
        match fetch(FetchJob::alone(
            shared,
            p,
            events,
            alt,
            plan.fetch_from..plan.fetch_end,
            fetch_need_s(plan),
        ))
        .await
        {
            Ok(r) => return Some((alt.clone(), r)),
            Err(e2) => {
                tracing::warn!(session = ?p.session_id, source = %alt, error = %e2, "the next holder failed too")
            }
        }
    }
    None
}

/// A receipt for a completed fetch. A joined fetch moved nothing itself: `bytes_moved` 0,
/// `shared_fetch`, and its bytes are not counted again in `kvferry_fetched_bytes_total`.
fn fill_fetch(shared: &Shared, src: &str, receipt: &mut Receipt, f: &Fetched, ready_tokens: usize) {
    let r = &f.receipt;
    receipt.tokens_ready = ready_tokens as u64;
    receipt.goodput_gbps = r.goodput_bps / 1e9;
    receipt.reconnects = r.reconnects;
    receipt.first_layer_s = r.first_layer.map_or(0.0, |d| d.as_secs_f64());
    let path = format!("{src} pool -> {} -> {} landing zone", wire_path(&r.link), shared.config.region);
    receipt.transport = r.link.transport.name().into();
    receipt.congestion = r.link.congestion.clone();
    if f.joined {
        receipt.bytes_moved = 0;
        receipt.shared_fetch = true;
        receipt.path = format!("joined an in-flight fetch: {path}");
        return;
    }
    receipt.bytes_moved = r.bytes;
    receipt.path = path;
    shared.metrics.bytes_fetched.add(r.bytes);
    shared.metrics.last_goodput_gbps.set(r.goodput_bps / 1e9);
}

/// The wire leg of a receipt's path: which transport, over how many channels, which
/// congestion controller.
pub fn wire_path(l: &kvferry_peer::LinkInfo) -> String {
    match l.transport {
        Transport::Quic if l.stripes > 1 => {
            format!("QUIC (mutual TLS, {} connections × {} streams, {})", l.stripes, l.channels, l.congestion)
        }
        Transport::Quic => format!("QUIC (mutual TLS, {} streams, {})", l.channels, l.congestion),
        Transport::Tcp => format!("TCP (TLS 1.3, mutual TLS, {} connections, {})", l.channels, l.congestion),
    }
}

/// A fetch failed: recompute instead if the request allows it and time remains.
async fn fallback(
    shared: &Shared,
    p: &Prepared,
    receipt: &mut Receipt,
    e: DaemonError,
) -> Result<(), DaemonError> {
    shared.metrics.fallbacks.inc();
    if !p.has_tokens() {
        return Err(e);
    }
    tracing::warn!(session = ?p.session_id, error = %e, "fetch failed; recomputing instead");
    let n = recompute(shared, p, p.total_tokens()).await?;
    record_fallback(receipt, &e, n, &format!("{} engine {}", shared.config.region, p.engine.engine_id));
    Ok(())
}

/// A receipt after a failed fetch was replaced by a recompute of `tokens_ready` tokens by
/// `engine` (named `<region> engine <id>`): what ran is a recompute, nothing moved.
fn record_fallback(receipt: &mut Receipt, e: &DaemonError, tokens_ready: u64, engine: &str) {
    set_receipt_action(receipt, MigrationAction::Recompute);
    receipt.fallback = format!("fetch failed ({e}); recomputed instead");
    receipt.tokens_ready = tokens_ready;
    receipt.bytes_moved = 0;
    receipt.path = format!("{engine}: local prefill (fallback)");
}

/// Relative error of a prediction against the measured time (the measured time floored at
/// 1 ns, so an instant migration does not divide by zero).
pub fn prediction_error(predicted_s: f64, measured_s: f64) -> f64 {
    (predicted_s - measured_s).abs() / measured_s.max(1e-9)
}

/// The goodput sample a fetch gives, as seconds on the wire for its bytes: the round trip of
/// the request taken out (the model adds the RTT separately), only from transfers of at least
/// `GOODPUT_SAMPLE_MIN_BYTES` (smaller ones measure fixed costs, not the pipe).
pub fn goodput_sample_s(bytes: u64, wall: Duration, rtt: Duration) -> Option<f64> {
    (bytes >= GOODPUT_SAMPLE_MIN_BYTES).then(|| (wall.as_secs_f64() - rtt.as_secs_f64()).max(1e-6))
}

/// How long a source may send no verified byte before the fetch is abandoned: one loss
/// detection (the idle timeout) plus one reconnect attempt.
pub fn silent_limit(idle_timeout: Duration) -> Duration {
    2 * idle_timeout
}

/// Tells the target engine to prefill `tokens[..n]` and waits for it, within the deadline.
/// A completed recompute's wall time (command to acknowledgement) feeds the engine's
/// calibration. A recompute nobody waits for any more — past its deadline, or dropped (the
/// losing leg of a hedge) — is cancelled (`CancelRecompute`): the engine stops spending its
/// compute on it.
async fn recompute(shared: &Shared, p: &Prepared, n: usize) -> Result<u64, DaemonError> {
    recompute_leg(shared, p, n, Leg::Alone).await
}

/// Whether an action runs alone or beside the other one (a split's legs): a leg that ran
/// concurrently measures the pure action slowed by the other, so it does not feed that
/// action's calibration (the split's outcome calibrates the interference instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leg {
    Alone,
    Concurrent,
}

/// The host's CPU counters at the start or end of a pure action: what [`crate::hostcpu`]
/// learns the fetch's CPU per byte and the engine's prefill cores from. `None` (nothing
/// learnt) for a leg beside the other, with `[policy] split_cpu_floor` off, or while another
/// migration runs in this daemon: the host's CPU would be the sum of both, charged to one.
fn cpu_reading(shared: &Shared, leg: Leg) -> Option<crate::hostcpu::Reading> {
    let in_flight = (shared.config.limits.max_concurrent_migrations as usize)
        .saturating_sub(shared.migrations.available_permits());
    (leg == Leg::Alone && shared.config.policy.split_cpu_floor && in_flight <= 1)
        .then(|| shared.host_cpu.read())
        .flatten()
}

async fn recompute_leg(shared: &Shared, p: &Prepared, n: usize, leg: Leg) -> Result<u64, DaemonError> {
    if n == 0 {
        return Ok(0);
    }
    let started = Instant::now();
    let cpu_start = cpu_reading(shared, leg);
    let sender = p.engine.commands.locked().clone().ok_or_else(|| {
        DaemonError::unavailable(Origin::Engine, format!("engine {} is not attached", p.engine.engine_id))
    })?;
    let (tx, rx) = oneshot::channel();
    let key = format!("{}#{:x}", p.session_id, rand::random::<u64>());
    p.engine.recompute_waiters.locked().insert(key.clone(), tx);
    // However this ends, the waiter goes; unless the engine answered (deadline, or a hedge
    // dropping this leg), the engine is told to cancel. Best effort, never blocking: a full
    // command queue means a detached engine soon.
    struct Abandon<'a> {
        engine: &'a crate::registry::EngineEntry,
        key: &'a str,
        sender: &'a mpsc::Sender<Result<DaemonCommand, Status>>,
        metrics: &'a crate::metrics::Metrics,
        answered: bool,
    }
    impl Drop for Abandon<'_> {
        fn drop(&mut self) {
            self.engine.recompute_waiters.locked().remove(self.key);
            if self.answered {
                return;
            }
            let cancel = DaemonCommand {
                command: Some(daemon_command::Command::Cancel(CancelRecompute {
                    session_id: self.key.to_owned(),
                })),
            };
            if self.sender.try_send(Ok(cancel)).is_ok() {
                self.metrics.recompute_cancels.inc();
                tracing::info!(recompute = ?self.key, "recompute abandoned: told the engine to cancel it");
            }
        }
    }
    let cmd = DaemonCommand {
        command: Some(daemon_command::Command::Recompute(Recompute {
            session_id: key.clone(),
            tenant: p.tenant.clone(),
            token_ids: p.tokens[..n.min(p.tokens.len())].to_vec(),
        })),
    };
    let mut guard =
        Abandon { engine: &p.engine, key: &key, sender: &sender, metrics: &shared.metrics, answered: false };
    if sender.send(Ok(cmd)).await.is_err() {
        guard.answered = true; // nothing reached the engine: nothing to cancel
        return Err(DaemonError::unavailable(Origin::Engine, "engine detached"));
    }
    let remaining = p.deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let answer = tokio::time::timeout(remaining, rx).await;
    // Answered, or its waiter dropped (the engine detached: its stream is gone, and the engine
    // that registers again never heard of this recompute): nothing to cancel.
    guard.answered = answer.is_ok();
    drop(guard);
    match answer {
        Ok(Ok(Ok(tokens))) => {
            if shared.config.policy.calibrate && leg == Leg::Alone {
                let obs = RecomputeObservation {
                    new_tokens: n as u64,
                    cached_tokens: 0,
                    load: p.engine_load,
                    seconds: started.elapsed().as_secs_f64(),
                };
                let profile = *p.engine.profile.locked();
                shared.calib.observe_recompute(&p.engine.engine_id, profile, obs);
            }
            if let (Some(a), Some(b)) = (cpu_start, cpu_reading(shared, leg)) {
                shared.host_cpu.observe_recompute(&p.engine.engine_id, &a, &b);
            }
            Ok(tokens)
        }
        Ok(Ok(Err(e))) => {
            Err(DaemonError::internal(format!("engine recompute failed: {e}")).at(Origin::Engine))
        }
        Ok(Err(_)) => Err(DaemonError::unavailable(Origin::Engine, "engine detached during recompute")),
        Err(_) => Err(DaemonError::deadline("the engine did not finish recomputing before the deadline")),
    }
}

/// A fetch's receipt, and whether it was another migration's fetch this one joined.
#[derive(Debug, Clone)]
struct Fetched {
    receipt: FetchReceipt,
    joined: bool,
}

/// One fetch to carry out: blocks `[from, end)` of the prepared migration `p` from `src` into
/// the landing zone, progress reported on `events`, run alone or as a leg beside a recompute
/// ([`Leg`]).
#[derive(Clone, Copy)]
struct FetchJob<'a> {
    shared: &'a Arc<Shared>,
    p: &'a Prepared,
    events: &'a Events,
    src: &'a str,
    from: usize,
    end: usize,
    leg: Leg,
    /// Whether the fetch, run to its end whatever else finished, tells the link's loss tail if
    /// it was late: alone, or a split's leg; not a hedge's (it is only seen when it wins).
    tail_event: bool,
    /// Seconds this fetch must be left at least before a fallback reserve applies
    /// ([`fetch_need_s`]).
    need_s: f64,
}

impl<'a> FetchJob<'a> {
    /// The fetch of `blocks` from `src`, run alone.
    fn alone(
        shared: &'a Arc<Shared>,
        p: &'a Prepared,
        events: &'a Events,
        src: &'a str,
        blocks: std::ops::Range<usize>,
        need_s: f64,
    ) -> Self {
        Self {
            shared,
            p,
            events,
            src,
            from: blocks.start,
            end: blocks.end,
            leg: Leg::Alone,
            tail_event: true,
            need_s,
        }
    }

    /// The same fetch as a split's leg, beside a recompute.
    fn concurrent(self) -> Self {
        Self { leg: Leg::Concurrent, ..self }
    }

    /// The same fetch as a hedge's leg, racing a recompute.
    fn racing(self) -> Self {
        Self { leg: Leg::Concurrent, tail_event: false, ..self }
    }
}

/// Carries out `job`, or joins a fetch of its blocks already in flight ([`crate::inflight`]):
/// the same verified result or the same typed error without moving the bytes again. A joiner
/// waits until its own fetch deadline; a leader that was dropped (or failed on its own,
/// shorter deadline) is replaced by a new leader.
async fn fetch(job: FetchJob<'_>) -> Result<Fetched, DaemonError> {
    let FetchJob { shared, p, src, from, end, need_s, .. } = job;
    let want = FlightKey {
        source: src.to_owned(),
        tenant: p.tenant.clone(),
        fingerprint: p.engine.digest,
        hashes: p.hashes[from..end].to_vec(),
    };
    loop {
        let join = match shared.flights.enter(want.clone()) {
            Entered::Lead(lead) => {
                let r = fetch_now(job).await;
                lead.finish(&r);
                return r.map(|receipt| Fetched { receipt, joined: false });
            }
            Entered::Join(join) => join,
        };
        tracing::info!(session = ?p.session_id, source = %src, blocks = end - from,
            "joining the in-flight fetch of the same blocks");
        let until = fetch_deadline(p, need_s);
        match tokio::time::timeout_at(until.into(), join.outcome()).await {
            Ok(Outcome::Done(Ok(receipt))) => {
                shared.metrics.fetches_joined.inc();
                return Ok(Fetched { receipt, joined: true });
            }
            Ok(Outcome::Done(Err(e))) if !inflight::lead_again_after(&e, Instant::now() < until) => {
                shared.metrics.fetches_joined.inc();
                return Err(e);
            }
            Ok(Outcome::Done(Err(_)) | Outcome::Abandoned) => continue,
            Err(_) => {
                return Err(DaemonError::deadline(
                    "the in-flight fetch this migration joined did not finish before its deadline",
                ));
            }
        }
    }
}

/// Fetches `job`'s blocks into the landing zone. A completed fetch's wall time (request to
/// the last verified block landed) feeds the link's calibration when it ran alone, and only
/// its loss tail when it was a split's leg.
async fn fetch_now(job: FetchJob<'_>) -> Result<FetchReceipt, DaemonError> {
    let FetchJob { shared, p, events, src, from, end, leg, tail_event, need_s } = job;
    let started = Instant::now();
    let cpu_start = cpu_reading(shared, leg);
    let src = src.to_owned();
    let peer = shared.links.peer(&src).cloned().ok_or_else(|| DaemonError::not_found(src.clone()))?;
    let id =
        RegionId::new(&shared.config.trust_domain, &src).map_err(|e| DaemonError::internal(e.to_string()))?;
    let shape = BlockShape::of(&p.engine.layout).map_err(DaemonError::internal)?;
    let hashes = p.hashes[from..end].to_vec();
    let total = shape.block_bytes() * hashes.len() as u64;
    let reservation = shared.landing.reserve(total).map_err(|e| DaemonError::exhausted(e.to_string()))?;
    let sink = Arc::new(LandingSink::new(shape.clone(), shared.landing.clone(), hashes.len()));
    let spec = FetchSpec {
        tenant: p.tenant.clone(),
        fingerprint: p.engine.digest,
        hashes: hashes.clone(),
        layers: shape.layers(),
        bytes_per_block_layer: shape.layer_bytes(0),
        deadline: fetch_deadline(p, need_s),
    };
    let _active = shared.links.begin(&src);
    // Aborted when this future ends or is dropped (a hedge cancels a fetch by dropping it):
    // the reporter holds a sender of the migration's stream, which must close with the work.
    let progress = AbortOnDrop({
        let (landed, events) = (sink.landed_bytes.clone(), events.clone());
        let t0 = Instant::now();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let ev = MigrationEvent {
                    event: Some(migration_event::Event::Progress(Progress {
                        bytes_done: landed.load(Ordering::Relaxed),
                        bytes_total: total,
                        elapsed_s: t0.elapsed().as_secs_f64(),
                    })),
                };
                // Progress is advisory: when the router is not reading, events are dropped
                // rather than queued (the decision and the receipt are never dropped).
                match events.try_send(Ok(ev)) {
                    Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
                    Err(mpsc::error::TrySendError::Closed(_)) => return,
                }
            }
        })
    });
    let silent_limit = silent_limit(Duration::from_millis(shared.config.transfer.idle_timeout_ms));
    let watchdog = {
        let landed = sink.landed_bytes.clone();
        async move {
            let (mut last, mut since) = (landed.load(Ordering::Relaxed), Instant::now());
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let now = landed.load(Ordering::Relaxed);
                if now != last {
                    (last, since) = (now, Instant::now());
                } else if since.elapsed() >= silent_limit {
                    return since.elapsed();
                }
            }
        }
    };
    let result = tokio::select! {
        r = shared.node.fetch(&id, peer.addr, spec, sink.clone()) => r,
        silent = watchdog => {
            tracing::warn!(source = %src, silent_s = silent.as_secs_f64(), landed = sink.landed_bytes.load(Ordering::Relaxed),
                "no verified byte from the source; abandoning the fetch");
            return Err(DaemonError::unavailable(Origin::Peer, format!(
                "fetch from {src}: no verified byte for {:.1} s (source down?)",
                silent.as_secs_f64()
            )));
        }
    };
    drop(progress);
    let r = result.map_err(|e| DaemonError::from_fetch(&src, &e))?;
    if r.blocks as usize != hashes.len() {
        return Err(DaemonError::unavailable(
            Origin::Peer,
            format!("{src} served {} of {} blocks", r.blocks, hashes.len()),
        ));
    }
    let sink = Arc::try_unwrap(sink).map_err(|_| DaemonError::internal("landing sink still shared"))?;
    shared
        .landing
        .commit(reservation, landed_blocks(&p.tenant, p.engine.digest, &hashes, sink.into_blocks()));
    if let Some(secs) = goodput_sample_s(r.bytes, r.wall, r.rtt) {
        shared.links.record_goodput(&src, r.bytes, secs);
    }
    shared.links.record_rtt(&src, r.rtt.as_secs_f64());
    if let (Some(a), Some(b)) = (cpu_start, cpu_reading(shared, leg)) {
        shared.host_cpu.observe_fetch(&a, &b, r.bytes);
    }
    if shared.config.policy.calibrate
        && let Some(fig) = p.figures
    {
        let obs = FetchObservation {
            wire_bytes: r.bytes,
            seconds: started.elapsed().as_secs_f64(),
            rtt_s: r.rtt.as_secs_f64(),
        };
        match (leg, tail_event) {
            (Leg::Alone, _) => shared.calib.observe_fetch(&src, &fig, obs),
            // A split's fetch leg: whether it was late is the link's, its time is shared.
            (Leg::Concurrent, true) => shared.calib.observe_fetch_leg(&src, &fig, obs),
            (Leg::Concurrent, false) => {}
        }
    }
    Ok(r)
}

/// How long a planned fetch must be left before a fallback reserve may shorten it: twice its
/// predicted seconds (the calibrated prediction where there is one, else the plan's).
pub fn fetch_need_s(plan: &Planned) -> f64 {
    let s = plan.fetch_prediction.as_ref().map_or(plan.predicted_s, |f| f.seconds);
    if s.is_finite() && s > 0.0 { 2.0 * s } else { 0.0 }
}

/// The deadline a fetch gets: the request's, less the time a fallback recompute of the whole
/// prefix would need ([`fallback_reserve_s`]: 1.5 × the model's estimate from the engine's
/// measured profile, plus 250 ms for the command's round trip), when the request allows a
/// fallback and the fetch keeps at least `need_s` ([`fetch_need_s`]); else the request's.
pub fn fetch_deadline(p: &Prepared, need_s: f64) -> Instant {
    if !p.has_tokens() {
        return p.deadline;
    }
    let prof = *p.engine.profile.locked();
    let reserve =
        fallback_reserve_s(prof.linear_s_per_token, prof.attention_s_per_pair, p.total_tokens() as u64);
    fetch_deadline_at(p.deadline, Instant::now(), reserve, need_s)
}

/// The rule of [`fetch_deadline`] on plain values: `deadline` less `reserve_s` when that still
/// leaves the fetch `need_s` after `now`; else (no reserve, or no room for both) `deadline`
/// itself. A reserve that would leave a fetch less than it needs only turns a slow success
/// into a failure followed by a recompute that the plan already judged slower (a 1 GiB fetch
/// predicted at 9 s was once given 3 s, then fell back to a 600 s recompute).
pub fn fetch_deadline_at(deadline: Instant, now: Instant, reserve_s: Option<f64>, need_s: f64) -> Instant {
    let Some(reserve) = reserve_s.filter(|r| r.is_finite() && *r >= 0.0) else { return deadline };
    let need = Duration::from_secs_f64(if need_s.is_finite() { need_s.clamp(0.0, 86_400.0) } else { 0.0 });
    match deadline.checked_sub(Duration::from_secs_f64(reserve)) {
        Some(d) if d > now + need => d,
        _ => deadline,
    }
}

#[cfg(test)]
mod tests {
    //! The executor's rules on plain values (the driver around them is exercised end to end
    //! by crates/cli/tests: fetch, recompute, split, fallback, a killed source).
    use super::*;

    #[test]
    fn a_hedge_won_by_a_fetch_is_usable_only_after_the_engines_load() {
        // A fetch that won has landed; the load its prediction included is still to come.
        assert_eq!(hedge_usable_s(MigrationAction::Fetch, 0.25, 0.125), 0.375);
        // A recompute that won wrote the pool as it ran: its time is when it is usable.
        assert_eq!(hedge_usable_s(MigrationAction::Recompute, 0.25, 0.125), 0.25);
        // Before any load was learnt the fetch's time is its landing.
        assert_eq!(hedge_usable_s(MigrationAction::Fetch, 0.25, 0.0), 0.25);
    }

    #[test]
    fn a_fetch_leaves_the_reserve_before_the_deadline_when_there_is_room() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(10);
        assert_eq!(fetch_deadline_at(deadline, now, Some(4.0), 0.0), deadline - Duration::from_secs(4));
        // no usable estimate: the whole deadline
        assert_eq!(fetch_deadline_at(deadline, now, None, 0.0), deadline);
        assert_eq!(fetch_deadline_at(deadline, now, Some(f64::NAN), 0.0), deadline);
        assert_eq!(fetch_deadline_at(deadline, now, Some(-1.0), 0.0), deadline);
        // no room for the reserve: the fetch gets the whole deadline rather than none
        assert_eq!(fetch_deadline_at(deadline, now, Some(10.0), 0.0), deadline);
        assert_eq!(fetch_deadline_at(deadline, now, Some(60.0), 0.0), deadline);
        // the reserve the model gives for a real profile fits a generous deadline
        let reserve = fallback_reserve_s(1e-4, 1e-9, 4096);
        let d = fetch_deadline_at(deadline, now, reserve, 0.0);
        assert!(d < deadline && d > now, "{reserve:?}");
    }

    #[test]
    fn a_reserve_never_leaves_a_fetch_less_than_it_needs() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(900);
        // The bench's case: a 1 GiB fetch predicted at 9 s (needs 18 s) against a 897 s
        // fallback reserve — 3 s would be left, so the fetch keeps the whole deadline.
        assert_eq!(fetch_deadline_at(deadline, now, Some(897.0), 18.0), deadline);
        // With room for both, the reserve applies.
        assert_eq!(fetch_deadline_at(deadline, now, Some(800.0), 18.0), deadline - Duration::from_secs(800));
        // Monotone: more need never gives a fetch less time; the result is never past the
        // deadline nor (with a reserve applied) closer to now than the need.
        for reserve in [0.0, 1.0, 50.0, 450.0, 880.0, 899.0, 2000.0] {
            let mut last = now;
            for need in [0.0, 1.0, 10.0, 100.0, 500.0, 1000.0, f64::NAN, f64::INFINITY] {
                let d = fetch_deadline_at(deadline, now, Some(reserve), need);
                assert!(d <= deadline);
                if need.is_finite() {
                    assert!(d >= last, "reserve {reserve}, need {need}");
                    assert!(d == deadline || d >= now + Duration::from_secs_f64(need));
                    last = d;
                }
            }
        }
    }

    #[test]
    fn goodput_is_sampled_only_from_big_transfers_without_the_round_trip() {
        let ms = Duration::from_millis;
        assert_eq!(goodput_sample_s(GOODPUT_SAMPLE_MIN_BYTES - 1, ms(500), ms(50)), None);
        let s = goodput_sample_s(GOODPUT_SAMPLE_MIN_BYTES, ms(500), ms(50)).unwrap();
        assert!((s - 0.45).abs() < 1e-12, "{s}");
        // a round trip longer than the wall time (clock granularity) still gives a positive time
        assert_eq!(goodput_sample_s(64 << 20, ms(10), ms(20)), Some(1e-6));
    }

    #[test]
    fn prediction_error_is_relative_to_the_measured_time() {
        assert_eq!(prediction_error(1.5, 1.0), 0.5);
        assert_eq!(prediction_error(0.5, 1.0), 0.5);
        assert_eq!(prediction_error(2.0, 2.0), 0.0);
        assert!(prediction_error(1.0, 0.0).is_finite());
    }

    #[test]
    fn a_source_is_given_up_after_two_idle_timeouts() {
        assert_eq!(silent_limit(Duration::from_millis(10_000)), Duration::from_secs(20));
    }

    #[test]
    fn a_fallback_receipt_says_recompute_and_why() {
        let mut r = Receipt { bytes_moved: 99, ..Default::default() };
        set_receipt_action(&mut r, MigrationAction::Fetch);
        let e = DaemonError::unavailable(crate::error::Origin::Peer, "fetch from a: connection: reset");
        record_fallback(&mut r, &e, 592, "region-b engine e0");
        assert_eq!((r.action.as_str(), r.kind()), ("recompute", kvferry_proto::v1::Action::Recompute));
        assert_eq!((r.tokens_ready, r.bytes_moved), (592, 0));
        assert_eq!(
            r.fallback,
            "fetch failed (unavailable: fetch from a: connection: reset); recomputed instead"
        );
        assert_eq!(r.path, "region-b engine e0: local prefill (fallback)");
    }
}
