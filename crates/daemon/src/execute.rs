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
use kvferry_peer::{FetchReceipt, FetchSpec, RegionId};
use kvferry_proto::v1::{
    DaemonCommand, MigrationEvent, Progress, Receipt, Recompute, daemon_command, migration_event,
};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::Shared;
use crate::blockbuf::BlockShape;
use crate::catalog::{LandingSink, landed_blocks};
use crate::error::DaemonError;
use crate::plan::{Planned, Prepared, set_receipt_action};
use kvferry_pool::sync::LockExt;

type Events = mpsc::Sender<Result<MigrationEvent, Status>>;

/// Smallest fetch whose goodput feeds the link estimator.
const GOODPUT_SAMPLE_MIN_BYTES: u64 = 4 << 20;

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
            match fetch(shared, p, &src, plan.fetch_from, plan.fetch_end, events).await {
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
            let (rec, fet) = tokio::join!(
                recompute(shared, p, k),
                fetch(shared, p, &src, plan.fetch_from, plan.fetch_end, events)
            );
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
    if receipt.fallback.is_empty()
        && receipt.predicted_s > 0.0
        && let Some((src, _)) = &p.source
    {
        shared.links.record_prediction(src, receipt.predicted_s, receipt.measured_s);
        let err = (receipt.predicted_s - receipt.measured_s).abs() / receipt.measured_s.max(1e-9);
        shared.metrics.last_prediction_error.set(err);
    }
    Ok(receipt)
}

fn fill_recompute(shared: &Shared, p: &Prepared, receipt: &mut Receipt, tokens: u64) {
    set_receipt_action(receipt, MigrationAction::Recompute);
    receipt.tokens_ready = tokens;
    receipt.path = format!("{} engine {}: local prefill", shared.config.region, p.engine.engine_id);
}

/// Runs a hedge: the fetch of blocks `[0, hedge_fetch_end)` and the recompute of the whole
/// prefix start together; the first to finish `Ok` is the migration's action and the other
/// is cancelled. A fetch dropped before it returned commits nothing (its landing reservation
/// is released; no block becomes visible). A recompute the engine already started finishes
/// there (the Engine API has no cancel), and the time it ran until the winner finished is
/// accounted as wasted (`hedge_loser_s`, `kvferry_hedge_wasted_milliseconds_total`). When the first
/// to finish failed, the other is awaited.
async fn hedge(
    shared: &Arc<Shared>,
    p: &Prepared,
    plan: &Planned,
    events: &Events,
    receipt: &mut Receipt,
) -> Result<(), DaemonError> {
    enum First {
        Fetch(Result<FetchReceipt, DaemonError>),
        Recompute(Result<u64, DaemonError>),
    }
    let bs = p.block_size as usize;
    let total = p.hashes.len() * bs;
    let started = Instant::now();
    let src = source_of(p)?;
    let fetch_leg = fetch(shared, p, &src, 0, plan.hedge_fetch_end, events);
    let recompute_leg = recompute(shared, p, total);
    tokio::pin!(fetch_leg, recompute_leg);
    receipt.hedged = true;
    let first = tokio::select! {
        f = &mut fetch_leg => First::Fetch(f),
        r = &mut recompute_leg => First::Recompute(r),
    };
    let loser_s = started.elapsed().as_secs_f64();
    let m = &shared.metrics;
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
            tracing::warn!(session = %p.session_id, error = %e, "hedge: the fetch failed; keeping the recompute");
            let n = recompute_leg.await?;
            fill_recompute(shared, p, receipt, n);
            m.hedges_recompute_won.inc();
        }
        First::Recompute(Err(e)) => {
            tracing::warn!(session = %p.session_id, error = %e, "hedge: the recompute failed; keeping the fetch");
            let r = fetch_leg.await?;
            fill_fetch(shared, &src, receipt, &r, plan.hedge_fetch_end * bs);
            set_receipt_action(receipt, MigrationAction::Fetch);
            m.hedges_fetch_won.inc();
        }
    }
    Ok(())
}

fn source_of(p: &Prepared) -> Result<String, DaemonError> {
    p.source
        .as_ref()
        .map(|(s, _)| s.clone())
        .ok_or_else(|| DaemonError::Internal("fetch without a source".into()))
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
) -> Option<(String, FetchReceipt)> {
    if matches!(e, DaemonError::Deadline(_)) {
        return None;
    }
    for (alt, held) in &p.alternates {
        if (*held as usize) < plan.fetch_end || fetch_deadline(p) <= Instant::now() {
            continue;
        }
        tracing::warn!(session = %p.session_id, failed, error = %e, next = %alt, "fetch failed; trying the next holder");
        match fetch(shared, p, alt, plan.fetch_from, plan.fetch_end, events).await {
            Ok(r) => return Some((alt.clone(), r)),
            Err(e2) => {
                tracing::warn!(session = %p.session_id, source = %alt, error = %e2, "the next holder failed too")
            }
        }
    }
    None
}

fn fill_fetch(shared: &Shared, src: &str, receipt: &mut Receipt, r: &FetchReceipt, ready_tokens: usize) {
    receipt.tokens_ready = ready_tokens as u64;
    receipt.bytes_moved = r.bytes;
    receipt.goodput_gbps = r.goodput_bps / 1e9;
    receipt.reconnects = r.reconnects;
    receipt.first_layer_s = r.first_layer.map_or(0.0, |d| d.as_secs_f64());
    receipt.path = format!(
        "{src} pool -> QUIC (mutual TLS, {} streams) -> {} landing zone",
        shared.config.transfer.streams, shared.config.region
    );
    shared.metrics.bytes_fetched.add(r.bytes);
    shared.metrics.last_goodput_gbps.set(r.goodput_bps / 1e9);
}

/// A fetch failed: recompute instead if the request allows it and time remains.
async fn fallback(
    shared: &Shared,
    p: &Prepared,
    receipt: &mut Receipt,
    e: DaemonError,
) -> Result<(), DaemonError> {
    shared.metrics.fallbacks.inc();
    let total = p.hashes.len() * p.block_size as usize;
    if p.tokens.len() < total {
        return Err(e);
    }
    tracing::warn!(session = %p.session_id, error = %e, "fetch failed; recomputing instead");
    let n = recompute(shared, p, total).await?;
    set_receipt_action(receipt, MigrationAction::Recompute);
    receipt.fallback = format!("fetch failed ({e}); recomputed instead");
    receipt.tokens_ready = n;
    receipt.bytes_moved = 0;
    receipt.path =
        format!("{} engine {}: local prefill (fallback)", shared.config.region, p.engine.engine_id);
    Ok(())
}

/// Tells the target engine to prefill `tokens[..n]` and waits for it, within the deadline.
/// A completed recompute's wall time (command to acknowledgement) feeds the engine's
/// calibration.
async fn recompute(shared: &Shared, p: &Prepared, n: usize) -> Result<u64, DaemonError> {
    if n == 0 {
        return Ok(0);
    }
    let started = Instant::now();
    let sender =
        p.engine.commands.locked().clone().ok_or_else(|| {
            DaemonError::Unavailable(format!("engine {} is not attached", p.engine.engine_id))
        })?;
    let (tx, rx) = oneshot::channel();
    let key = format!("{}#{:x}", p.session_id, rand::random::<u64>());
    p.engine.recompute_waiters.locked().insert(key.clone(), tx);
    // However this ends (answer, deadline, or a hedge dropping it), the waiter goes.
    struct Forget<'a>(&'a crate::registry::EngineEntry, &'a str);
    impl Drop for Forget<'_> {
        fn drop(&mut self) {
            self.0.recompute_waiters.locked().remove(self.1);
        }
    }
    let _forget = Forget(&p.engine, &key);
    let cmd = DaemonCommand {
        command: Some(daemon_command::Command::Recompute(Recompute {
            session_id: key.clone(),
            tenant: p.tenant.clone(),
            token_ids: p.tokens[..n.min(p.tokens.len())].to_vec(),
        })),
    };
    sender.send(Ok(cmd)).await.map_err(|_| DaemonError::Unavailable("engine detached".into()))?;
    let remaining = p.deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    match tokio::time::timeout(remaining, rx).await {
        Ok(Ok(Ok(tokens))) => {
            if shared.config.policy.calibrate {
                let obs = RecomputeObservation {
                    new_tokens: n as u64,
                    cached_tokens: 0,
                    load: p.engine_load,
                    seconds: started.elapsed().as_secs_f64(),
                };
                let profile = *p.engine.profile.locked();
                shared.calib.observe_recompute(&p.engine.engine_id, profile, obs);
            }
            Ok(tokens)
        }
        Ok(Ok(Err(e))) => Err(DaemonError::Internal(format!("engine recompute failed: {e}"))),
        Ok(Err(_)) => Err(DaemonError::Unavailable("engine detached during recompute".into())),
        Err(_) => {
            Err(DaemonError::Deadline("the engine did not finish recomputing before the deadline".into()))
        }
    }
}

/// Fetches blocks `[from, end)` from `src` into the landing zone. A completed fetch's
/// wall time (request to the last verified block landed) feeds the link's calibration.
async fn fetch(
    shared: &Arc<Shared>,
    p: &Prepared,
    src: &str,
    from: usize,
    end: usize,
    events: &Events,
) -> Result<FetchReceipt, DaemonError> {
    let started = Instant::now();
    let src = src.to_owned();
    let peer = shared.links.peer(&src).cloned().ok_or_else(|| DaemonError::NotFound(src.clone()))?;
    let id =
        RegionId::new(&shared.config.trust_domain, &src).map_err(|e| DaemonError::Internal(e.to_string()))?;
    let shape = BlockShape::of(&p.engine.layout).map_err(DaemonError::Internal)?;
    let hashes = p.hashes[from..end].to_vec();
    let total = shape.block_bytes() * hashes.len() as u64;
    let reservation = shared.landing.reserve(total).map_err(|e| DaemonError::Exhausted(e.to_string()))?;
    let sink = Arc::new(LandingSink::new(shape.clone(), hashes.len()));
    let spec = FetchSpec {
        tenant: p.tenant.clone(),
        fingerprint: p.engine.digest,
        hashes: hashes.clone(),
        layers: shape.layers(),
        bytes_per_block_layer: shape.layer_bytes(0),
        deadline: fetch_deadline(p),
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
                if events.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
        })
    });
    let silent_limit = 2 * Duration::from_millis(shared.config.transfer.idle_timeout_ms);
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
            return Err(DaemonError::Unavailable(format!(
                "fetch from {src}: no verified byte for {:.1} s (source down?)",
                silent.as_secs_f64()
            )));
        }
    };
    drop(progress);
    let r = result.map_err(|e| match e {
        kvferry_wire::WireError::DeadlineExceeded => {
            DaemonError::Deadline("the fetch did not finish before the deadline".into())
        }
        other => DaemonError::Unavailable(format!("fetch from {src}: {other}")),
    })?;
    if r.blocks as usize != hashes.len() {
        return Err(DaemonError::Unavailable(format!(
            "{src} served {} of {} blocks",
            r.blocks,
            hashes.len()
        )));
    }
    let sink =
        Arc::try_unwrap(sink).map_err(|_| DaemonError::Internal("landing sink still shared".into()))?;
    shared
        .landing
        .commit(reservation, landed_blocks(&p.tenant, p.engine.digest, &hashes, sink.into_blocks()));
    // Goodput samples from transfers big enough to measure the pipe rather than the fixed costs,
    // with the request's round trip taken out (the model adds the RTT separately).
    if r.bytes >= GOODPUT_SAMPLE_MIN_BYTES {
        let secs = (r.wall.as_secs_f64() - r.rtt.as_secs_f64()).max(1e-6);
        shared.links.record_goodput(&src, r.bytes, secs);
    }
    shared.links.record_rtt(&src, r.rtt.as_secs_f64());
    if shared.config.policy.calibrate
        && let Some(fig) = p.figures
    {
        let obs = FetchObservation {
            wire_bytes: r.bytes,
            seconds: started.elapsed().as_secs_f64(),
            rtt_s: r.rtt.as_secs_f64(),
        };
        shared.calib.observe_fetch(&src, &fig, obs);
    }
    Ok(r)
}

/// The deadline a fetch gets: the request's, less the time a fallback recompute of the whole
/// prefix would need ([`fallback_reserve_s`]: 1.5 × the model's estimate from the engine's
/// measured profile, plus 250 ms for the command's round trip), when the request allows a
/// fallback and it fits; else the request's.
pub fn fetch_deadline(p: &Prepared) -> Instant {
    let total = p.hashes.len() * p.block_size as usize;
    if p.tokens.len() < total {
        return p.deadline;
    }
    let prof = *p.engine.profile.locked();
    let Some(reserve) = fallback_reserve_s(prof.linear_s_per_token, prof.attention_s_per_pair, total as u64)
    else {
        return p.deadline;
    };
    match p.deadline.checked_sub(Duration::from_secs_f64(reserve)) {
        Some(d) if d > Instant::now() => d,
        _ => p.deadline,
    }
}
