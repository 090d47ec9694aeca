//! Turning a `MigrateSession` request into a decision: validate, find the target engine and
//! the source region's holdings, then evaluate the cost model with the live link figures and
//! the engine's measured prefill profile. Nothing here moves a KV byte.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_layout::BlockHash;
use kvferry_model::migration::{Holdings, Measured, compute_utilization, fetch_utilization};
use kvferry_model::{
    Decision as ModelDecision, FetchCalibration, HedgeDecision, HedgePolicy, KvFootprint, KvShape,
    MigrationAction, Mode, PlanReason, Policy, Prediction, RecomputeCalibration, plan_migration,
};
use kvferry_model::{HolderOffer, SourcePricing, rank_sources, ready_seconds};
use kvferry_proto::v1::{Candidate, Decision, Holding, LinkState, MigrateSessionRequest, PolicyMode};

use crate::Shared;
use crate::engine_api::hashes_for;
use crate::error::{DaemonError, Denial, Origin};
use crate::links::Figures;
use crate::registry::EngineEntry;
use kvferry_pool::sync::LockExt;

/// Longest `session_id` and `tenant` a request may carry, bytes (both are logged, escaped, with
/// every migration; a longer one is refused with INVALID_ARGUMENT).
pub const MAX_ID_BYTES: usize = 256;

/// A validated request with everything the decision and the executor need.
pub struct Prepared {
    pub session_id: String,
    pub tenant: String,
    pub engine: Arc<EngineEntry>,
    pub tokens: Vec<u32>,
    pub hashes: Vec<BlockHash>,
    pub block_size: u32,
    pub deadline: Instant,
    pub started: Instant,
    /// Leading blocks already ready here (engine pool or landing zone).
    pub local_blocks: usize,
    /// The region chosen as source and how many leading blocks it holds.
    pub source: Option<(String, u32)>,
    /// Why the source could not be asked, when it could not.
    pub source_note: Option<String>,
    /// The other holders, next best first (a failed fetch from the source tries them).
    pub alternates: Vec<(String, u32)>,
    /// Every region asked, best source first, for the decision.
    pub holdings: Vec<Holding>,
    /// Why this source, when several regions hold the prefix.
    pub source_choice: Option<String>,
    pub figures: Option<Figures>,
    /// The source's serving load, from its answer to the query.
    pub source_load: Option<kvferry_wire::frame::LoadReport>,
    pub policy: Policy,
    /// The source link's and the engine's calibrations as of the decision (`None` with
    /// `policy.calibrate = false`), and the engine load they are evaluated at.
    pub fetch_cal: Option<FetchCalibration>,
    pub recompute_cal: Option<RecomputeCalibration>,
    pub engine_load: f64,
    /// The engine's seconds per byte to load fetched blocks into its pool (0: not measured,
    /// or `policy.calibrate = false`).
    pub load_s_per_byte: f64,
    /// What a hedge may do here (`allow` false: no hedge for this request).
    pub hedge_policy: HedgePolicy,
    /// The CPU-share floor the split was priced with, where it raised the learnt interference
    /// ([`crate::hostcpu`]).
    pub split_floor: Option<crate::hostcpu::Floor>,
}

impl Prepared {
    /// Tokens of the whole prefix (its full blocks).
    pub fn total_tokens(&self) -> usize {
        self.hashes.len() * self.block_size as usize
    }

    /// Whether the request carried the prefix's tokens (only then can it be recomputed).
    pub fn has_tokens(&self) -> bool {
        has_tokens(self.tokens.len(), self.hashes.len(), self.block_size)
    }
}

/// Whether `tokens` token ids cover `blocks` full blocks of `block_size`: a request given only
/// as block hashes (or fewer tokens than its blocks) cannot be recomputed.
pub fn has_tokens(tokens: usize, blocks: usize, block_size: u32) -> bool {
    tokens >= blocks.saturating_mul(block_size as usize)
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("session", &self.session_id)
            .field("blocks", &self.hashes.len())
            .finish()
    }
}

/// The executable plan.
#[derive(Debug, Clone)]
pub struct Planned {
    pub action: MigrationAction,
    pub reason: String,
    pub model: Option<ModelDecision>,
    /// Blocks `[local, fetch_end)` to fetch, tokens `[0, recompute_tokens)` to recompute.
    pub fetch_from: usize,
    pub fetch_end: usize,
    pub recompute_tokens: usize,
    /// Until the engine can use the prefix: for a fetch or a split, the engine's load of the
    /// fetched blocks included (`load_s` of it).
    pub predicted_s: f64,
    pub load_s: f64,
    /// The calibrated predictions of the two pure actions, with their bands (when the model
    /// was asked and calibration is on).
    pub fetch_prediction: Option<Prediction>,
    pub recompute_prediction: Option<Prediction>,
    /// The engine's load of the fetch the model priced (the whole prefix wherever a hedge is
    /// possible), inside `fetch_prediction` and so inside a hedge's expected time when the
    /// fetch wins: what a fetch that won a race still needs before the engine can use it.
    pub fetch_load_s: f64,
    /// Run the other pure action beside `action` and keep the first to finish
    /// ([`kvferry_model::plan_hedge`]); the fetch leg takes blocks `[0, hedge_fetch_end)`.
    pub hedge: Option<HedgeDecision>,
    pub hedge_fetch_end: usize,
}

/// Parses `grpc-timeout` (`<digits><unit>`, unit one of H M S m u n).
pub fn grpc_timeout(v: &str) -> Option<Duration> {
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// What a hedge may do for request `r` on engine `engine_id`. Both legs are priced with the
/// engine's hedge interference ([`crate::calib::Calibrations::hedge_interference`]): on a host
/// where the CPU prefill and the transfer share cores, a race of the two is slower than the
/// faster of them alone, and an unpriced hedge loses to the better pure action.
fn hedge_policy_of(shared: &Shared, r: &MigrateSessionRequest, engine_id: &str) -> HedgePolicy {
    use crate::config::HedgeMode;
    let c = &shared.config.policy;
    let asked = r.policy.is_some_and(|p| p.allow_hedge);
    let interference = if c.calibrate {
        shared.calib.hedge_interference(engine_id, c.hedge_interference)
    } else {
        c.hedge_interference
    };
    HedgePolicy {
        allow: c.calibrate
            && match c.hedge {
                HedgeMode::Off => false,
                HedgeMode::OnRequest => asked,
                HedgeMode::Always => true,
            },
        band_z: c.hedge_band_z,
        fetch_interference: interference,
        recompute_interference: interference,
        min_gain: c.hedge_min_gain,
        min_gain_s: c.hedge_min_gain_ms / 1000.0,
        max_wasted_compute_s: (c.hedge_max_wasted_compute_ms > 0.0)
            .then(|| c.hedge_max_wasted_compute_ms / 1000.0),
    }
}

/// A request's time budget: the tightest of its `deadline_ms`, the caller's grpc-timeout and
/// its absolute `deadline_unix_ms` (against `now_unix_ms`); `default` when it names none.
/// Zero means "unset" for both request fields.
pub fn request_budget(
    deadline_ms: u64,
    transport_timeout: Option<Duration>,
    deadline_unix_ms: u64,
    now_unix_ms: u64,
    default: Duration,
) -> Duration {
    let budget = match (deadline_ms, transport_timeout) {
        (0, None) => default,
        (0, Some(t)) => t,
        (ms, None) => Duration::from_millis(ms),
        (ms, Some(t)) => Duration::from_millis(ms).min(t),
    };
    if deadline_unix_ms > 0 {
        budget.min(Duration::from_millis(deadline_unix_ms.saturating_sub(now_unix_ms)))
    } else {
        budget
    }
}

fn policy_of(shared: &Shared, r: &MigrateSessionRequest, block_size: u32) -> Policy {
    let p = r.policy.unwrap_or_default();
    Policy {
        mode: match PolicyMode::try_from(p.mode).unwrap_or(PolicyMode::Auto) {
            PolicyMode::Auto => Mode::Auto,
            PolicyMode::Fetch => Mode::Fetch,
            PolicyMode::Recompute => Mode::Recompute,
        },
        allow_split: p.allow_split,
        max_wire_bytes: (p.max_egress_bytes > 0).then_some(p.max_egress_bytes as f64),
        split_overhead_s: shared.config.policy.split_overhead_ms / 1000.0,
        split_min_gain: shared.config.policy.split_min_gain,
        split_granularity: u64::from(block_size.max(1)),
        split_interference: 0.0, // per engine: set in `prepare_with` once the engine is known
        split_tolerance: shared.config.policy.split_tolerance,
        split_min_confidence: shared.config.policy.split_min_confidence,
        split_noise: 0.0, // per engine, learnt from the prior: set in `prepare_with` too
    }
}

/// Validates a request and gathers the inputs of the decision (asks the source region what
/// it holds). `transport_timeout` is the caller's grpc-timeout, if any.
pub async fn prepare(
    shared: &Arc<Shared>,
    r: &MigrateSessionRequest,
    transport_timeout: Option<Duration>,
) -> Result<Prepared, DaemonError> {
    prepare_with(shared, r, transport_timeout, false).await
}

/// [`prepare`]; with `ask_when_local`, the candidate holders are asked even when the whole
/// prefix is ready here (the residency view reports every region).
pub async fn prepare_with(
    shared: &Arc<Shared>,
    r: &MigrateSessionRequest,
    transport_timeout: Option<Duration>,
    ask_when_local: bool,
) -> Result<Prepared, DaemonError> {
    let started = Instant::now();
    if r.session_id.is_empty() || r.session_id.len() > MAX_ID_BYTES {
        return Err(DaemonError::invalid(format!(
            "session_id must be 1 to {MAX_ID_BYTES} bytes, got {}",
            r.session_id.len()
        )));
    }
    if r.tenant.is_empty() || r.tenant.len() > MAX_ID_BYTES {
        return Err(DaemonError::invalid(format!(
            "tenant must be 1 to {MAX_ID_BYTES} bytes, got {}",
            r.tenant.len()
        )));
    }
    let max = shared.config.limits.max_tokens;
    if r.token_ids.is_empty() && r.block_hashes.is_empty() {
        return Err(DaemonError::invalid("token_ids (or block_hashes) must not be empty"));
    }
    if r.token_ids.len() as u64 > max || r.block_hashes.len() as u64 * 16 > max {
        return Err(DaemonError::exhausted(format!("the prefix exceeds limits.max_tokens = {max}"))
            .at(Origin::Request)
            .retry(false));
    }
    let now_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let budget = request_budget(
        r.deadline_ms,
        transport_timeout,
        r.deadline_unix_ms,
        now_unix_ms,
        Duration::from_millis(shared.config.limits.default_deadline_ms),
    );
    if budget < Duration::from_millis(1) {
        return Err(DaemonError::deadline("the request's deadline has already expired"));
    }
    let deadline = started + budget;
    let digest: Option<[u8; 32]> = match r.layout_fingerprint.len() {
        0 => None,
        32 => r.layout_fingerprint.as_slice().try_into().ok(),
        n => return Err(DaemonError::invalid(format!("layout_fingerprint is {n} bytes, not 32"))),
    };
    let engine = shared.registry.target(&r.target_engine, &r.model_id, None).ok_or_else(|| {
        if shared.registry.all().is_empty() {
            // Temporary: no engine has registered yet (they re-register after a daemon
            // restart, and reconnect after a cut), so a retry may find one.
            DaemonError::unavailable(
                crate::error::Origin::Engine,
                "no engine has registered with this region's daemon yet",
            )
        } else {
            DaemonError::not_found(format!("no engine for model {:?} in this region", r.model_id))
        }
    })?;
    if let Some(d) = digest
        && d != engine.digest
    {
        return Err(DaemonError::precondition(format!(
            "layout fingerprint mismatch: the request's differs from engine {}'s ({})",
            engine.engine_id,
            engine.fingerprint.digest()
        )));
    }
    if !r.source_region.is_empty() && shared.links.peer(&r.source_region).is_none() {
        return Err(DaemonError::not_found(format!("unknown region {:?}", r.source_region)));
    }
    if let Some(bad) = r.source_regions.iter().find(|s| shared.links.peer(s).is_none()) {
        return Err(DaemonError::not_found(format!("unknown region {bad:?} in source_regions")));
    }
    // A named source this region may not exchange the tenant's blocks with: refused before
    // the peer is asked anything.
    if !r.source_region.is_empty()
        && !shared.links.peer(&r.source_region).is_some_and(|p| p.allows(&r.tenant))
    {
        shared.metrics.tenant_denied_fetch.inc();
        return Err(tenant_not_allowed(&r.source_region, &r.tenant));
    }
    let block_size = engine.layout.spec().block_size;
    let hashes: Vec<BlockHash> = if r.token_ids.is_empty() {
        r.block_hashes
            .iter()
            .map(|b| {
                <[u8; 32]>::try_from(b.as_slice())
                    .map_err(|_| DaemonError::invalid(format!("a block hash is {} bytes, not 32", b.len())))
            })
            .collect::<Result<_, _>>()?
    } else {
        hashes_for(&r.tenant, &r.token_ids, block_size)
    };
    if hashes.is_empty() {
        return Err(DaemonError::invalid(format!("the prefix holds no full block of {block_size} tokens")));
    }
    let local_blocks = hashes
        .iter()
        .take_while(|h| {
            engine.block_of(&r.tenant, h).is_some()
                || shared.landing.get(&r.tenant, h).is_some_and(|l| l.fingerprint == engine.digest)
        })
        .count();
    let mut policy = policy_of(shared, r, block_size);
    policy.split_interference =
        shared.calib.split_interference(&engine.engine_id, shared.config.policy.split_interference);
    if shared.config.policy.calibrate {
        policy.split_overhead_s = shared.calib.split_overhead(&engine.engine_id, policy.split_overhead_s).0;
    }
    policy.split_noise = if shared.config.policy.calibrate {
        shared.calib.split_scatter(&engine.engine_id, shared.config.policy.split_noise).0
    } else {
        shared.config.policy.split_noise
    };
    // The load the recompute calibration is evaluated at (and its sample recorded with): the
    // compute path's utilization by the cost model's rule — a busy fraction counts only while
    // something is queued. The engine's trailing busy fraction alone is history: right after a
    // recompute (this daemon's own) it read ~1 on an idle engine, and the load coefficient no
    // sample had pinned down gave those predictions bands of ±200–300 % (bench, 2026-12-03),
    // which made racing the two actions look cheap.
    let engine_load = {
        let l = engine.load.locked();
        compute_utilization(l.queue_depth, l.utilization)
    };

    let hedge_policy = hedge_policy_of(shared, r, &engine.engine_id);
    let mut p = Prepared {
        session_id: r.session_id.clone(),
        tenant: r.tenant.clone(),
        engine,
        tokens: r.token_ids.clone(),
        hashes,
        block_size,
        deadline,
        started,
        local_blocks,
        source: None,
        source_note: None,
        alternates: Vec::new(),
        holdings: Vec::new(),
        source_choice: None,
        figures: None,
        source_load: None,
        policy,
        fetch_cal: None,
        recompute_cal: None,
        engine_load,
        load_s_per_byte: 0.0,
        hedge_policy,
        split_floor: None,
    };
    if local_blocks == p.hashes.len() && !ask_when_local {
        return Ok(p);
    }
    let regions: Vec<String> = if r.source_region.is_empty() && !r.source_regions.is_empty() {
        let mut v = r.source_regions.clone();
        v.sort();
        v.dedup();
        v
    } else if r.source_region.is_empty() {
        shared.links.regions()
    } else if shared.links.peer(&r.source_region).is_some() {
        vec![r.source_region.clone()]
    } else {
        return Err(DaemonError::not_found(format!("unknown region {:?}", r.source_region)));
    };
    // Peers whose allow-list does not name the tenant are not asked (a query would tell them
    // which of the tenant's prefixes exist here); they are listed as not reachable, with why.
    let (regions, barred): (Vec<String>, Vec<String>) =
        regions.into_iter().partition(|g| shared.links.peer(g).is_some_and(|p| p.allows(&r.tenant)));
    let mut holdings = Vec::new();
    for region in barred {
        shared.metrics.tenant_denied_fetch.inc();
        let note = format!("{region} not asked: peers[].tenants does not name this tenant");
        holdings.push(Holding { region, reachable: false, note, ..Default::default() });
    }
    // Ask the candidates concurrently; bound the wait so a dead region still leaves time to act.
    let ask_until =
        Instant::now() + (deadline.saturating_duration_since(Instant::now()) / 3).min(Duration::from_secs(3));
    let mut asks = Vec::new();
    for region in regions {
        let shared = shared.clone();
        let (tenant, digest, hashes) = (p.tenant.clone(), p.engine.digest, p.hashes.clone());
        asks.push(tokio::spawn(async move {
            let peer = shared.links.peer(&region).cloned();
            let Some(peer) = peer else {
                let e = DaemonError::internal(format!("{region} unreachable: not a configured peer"));
                return (region, Err(e));
            };
            let id = match kvferry_peer::RegionId::new(&shared.config.trust_domain, &region) {
                Ok(id) => id,
                Err(e) => {
                    let e = DaemonError::precondition(format!("{region} unreachable: {e}")).at(Origin::Local);
                    return (region, Err(e));
                }
            };
            let res = shared.node.query(&id, peer.addr, &tenant, digest, hashes, ask_until).await;
            if let Ok(h) = &res {
                shared.links.record_rtt(&region, h.rtt.as_secs_f64());
            }
            let res = res.map_err(|e| DaemonError::from_query(&region, &e));
            (region, res)
        }));
    }
    let mut answers = Vec::new();
    let mut notes = Vec::new();
    for a in asks {
        let Ok((region, res)) = a.await else { continue };
        match res {
            Ok(h) => answers.push((region, h.blocks_held, h.load)),
            // The named source refused the tenant by its policy: the request's answer.
            Err(e @ DaemonError::Denied(..)) if region == r.source_region => return Err(e),
            Err(e) => {
                let note = e.reason().to_owned();
                holdings.push(Holding { region, reachable: false, note: note.clone(), ..Default::default() });
                notes.push(note);
            }
        }
    }
    choose_source(shared, &mut p, answers, holdings);
    // A split is planned with at least the slowdown this host's CPU shares predict: the other
    // work here, the engine's prefill and the fetch's CPU at the chosen link's rate.
    if shared.config.policy.split_cpu_floor
        && let Some(fig) = &p.figures
        && let Some(floor) = shared.host_cpu.floor(&p.engine.engine_id, fig.goodput_bps / 8.0)
    {
        shared.metrics.split_floor(&floor);
        if floor.interference > p.policy.split_interference {
            // Per plan, so debug (a router's band probes plan many times a second); the
            // decision's reason and `kvferry_split_cpu_share` carry it at every level.
            tracing::debug!(
                floor = floor.interference,
                learnt = p.policy.split_interference,
                other = floor.other,
                prefill = floor.compute,
                fetch = floor.fetch,
                cores = floor.cores,
                "a split is priced at the host's CPU-share floor"
            );
            p.policy.split_interference = floor.interference;
            p.split_floor = Some(floor);
        }
    }
    if shared.config.policy.calibrate {
        if let (Some((region, _)), Some(fig)) = (&p.source, &p.figures) {
            p.fetch_cal = shared.calib.fetch(region, fig);
        }
        let profile = *p.engine.profile.locked();
        p.recompute_cal = shared.calib.recompute(&p.engine.engine_id, profile);
        p.load_s_per_byte = shared.calib.load_s_per_byte(&p.engine.engine_id);
    }
    if !notes.is_empty() {
        p.source_note = Some(notes.join("; "));
    }
    Ok(p)
}

/// PERMISSION_DENIED for a request naming `region` as its source for `tenant` when
/// `peers[].tenants` of that peer does not name the tenant.
pub fn tenant_not_allowed(region: &str, tenant: &str) -> DaemonError {
    DaemonError::denied(
        Origin::Request,
        Denial::TenantNotAllowedForPeer,
        format!("this region does not exchange tenant {tenant:?}'s blocks with {region} (peers[].tenants)"),
    )
}

/// Ranks the holders that answered by how soon each would make the prefix ready here
/// ([`kvferry_model::rank_sources`], with each one's live link figures and serving load) and
/// records the best as the source, the others as alternates, and all in `holdings`
/// (`unreachable`: the regions that did not answer, listed last).
fn choose_source(
    shared: &Shared,
    p: &mut Prepared,
    answers: Vec<(String, u32, Option<kvferry_wire::frame::LoadReport>)>,
    unreachable: Vec<Holding>,
) {
    let bs = u64::from(p.block_size);
    let bytes_per_block = footprint(&p.engine).map_or(0.0, |f| f.bytes_per_token()) * bs as f64;
    let prof = *p.engine.profile.locked();
    let pricing = SourcePricing {
        blocks_total: p.hashes.len() as u64,
        local_blocks: p.local_blocks as u64,
        bytes_per_block,
        recompute_s_per_block: prof.linear_s_per_token * bs as f64,
    };
    let offers: Vec<HolderOffer> = answers
        .iter()
        .map(|(region, held, load)| {
            // The holder's own egress cap (from its answer) bounds what its link can give.
            let f = shared.links.figures(region).map(|f| capped(f, load.as_ref()));
            HolderOffer {
                blocks_held: u64::from(*held),
                rtt_s: f.map_or(f64::INFINITY, |f| f.rtt_s),
                goodput_bps: f.map_or(0.0, |f| f.goodput_bps),
                fetch_utilization: load
                    .as_ref()
                    .map_or(0.0, |l| fetch_utilization(l.staging_used, l.staging_bound)),
            }
        })
        .collect();
    let ranked = rank_sources(&offers, &pricing);
    let holding = |i: usize| Holding {
        region: answers[i].0.clone(),
        tokens: u64::from(answers[i].1) * bs,
        reachable: true,
        predicted_s: ready_seconds(&offers[i], &pricing),
        note: String::new(),
    };
    p.holdings = ranked.iter().map(|&i| holding(i)).collect();
    // Regions that answered but hold nothing new, then the unreachable ones.
    p.holdings.extend((0..answers.len()).filter(|i| !ranked.contains(i)).map(holding));
    p.holdings.extend(unreachable);
    let Some(&best) = ranked.first() else { return };
    p.source = Some((answers[best].0.clone(), answers[best].1));
    p.source_load = answers[best].2;
    p.figures = shared.links.figures(&answers[best].0).map(|f| capped(f, answers[best].2.as_ref()));
    p.alternates = ranked[1..].iter().map(|&i| (answers[i].0.clone(), answers[i].1)).collect();
    if ranked.len() > 1 {
        let others: Vec<String> = p.holdings[1..ranked.len()]
            .iter()
            .map(|h| format!("{} {:.3} s", h.region, h.predicted_s))
            .collect();
        p.source_choice = Some(format!(
            "source {} of {} holders: ready in {:.3} s over its link, vs {}",
            p.holdings[0].region,
            ranked.len(),
            p.holdings[0].predicted_s,
            others.join(", ")
        ));
    }
}

/// The KV footprint of an engine's layout.
pub fn footprint(e: &EngineEntry) -> Result<KvFootprint, DaemonError> {
    let s = e.layout.spec();
    let bytes_per_token = e
        .layout
        .bytes_per_block(0..e.layout.num_layers())
        .map_err(|x| DaemonError::internal(x.to_string()))? as f64
        / f64::from(s.block_size);
    let elements = 2.0 * f64::from(s.layers) * f64::from(s.kv_heads) * f64::from(s.head_dim);
    KvFootprint::new(
        KvShape::Gqa { layers: s.layers, kv_heads: s.kv_heads, head_dim: s.head_dim },
        bytes_per_token / elements,
    )
    .map_err(|x| DaemonError::internal(x.to_string()))
}

/// The link figures priced at no more than the source's egress cap toward this region (from
/// its load report; 0: none), whatever the link could carry.
pub fn capped(mut f: Figures, load: Option<&kvferry_wire::frame::LoadReport>) -> Figures {
    if let Some(cap) = load.map(|l| l.egress_cap_bps).filter(|&c| c > 0) {
        f.goodput_bps = f.goodput_bps.min(cap as f64);
    }
    f
}

/// Tokens the model prices: the source's blocks beyond the local ones.
fn priced_tokens(p: &Prepared) -> u64 {
    let held = p.source.as_ref().map_or(0, |(_, n)| u64::from(*n));
    held.saturating_sub(p.local_blocks as u64) * u64::from(p.block_size)
}

/// The plain inputs of the cost comparison: the engine's layout and profile, the link
/// figures, both paths' loads, with the calibrations applied
/// ([`kvferry_model::calibrated`]). `None` when nothing was measured about a source.
fn measured(p: &Prepared) -> Result<Option<Measured>, DaemonError> {
    let Some(fig) = p.figures else { return Ok(None) };
    let prof = *p.engine.profile.locked();
    let compute_utilization = {
        let l = p.engine.load.locked();
        compute_utilization(l.queue_depth, l.utilization)
    };
    // The engine's fixed cost per step spread over the priced prefix, as the calibration
    // spreads its own (which replaces this when there is one).
    let priced = priced_tokens(p);
    let fixed_per_token = if priced > 0 { prof.fixed_s / priced as f64 } else { 0.0 };
    let m = Measured {
        kv: footprint(&p.engine)?,
        linear_s_per_token: prof.linear_s_per_token + fixed_per_token,
        attention_s_per_pair: prof.attention_s_per_pair,
        goodput_bps: fig.goodput_bps,
        rtt_s: fig.rtt_s,
        fetch_utilization: source_utilization(p),
        compute_utilization,
        recompute_correction: None,
        load_s_per_byte: p.load_s_per_byte,
        fetch_tail: kvferry_model::FetchTail::NONE,
    };
    kvferry_model::calibrated(&m, p.fetch_cal.as_ref(), p.recompute_cal.as_ref(), p.engine_load, priced)
        .map(Some)
        .map_err(|e| DaemonError::internal(format!("calibration: {e}")))
}

/// The calibrated predictions (mean and band) of fetching and of recomputing what the model
/// priced, when the model was asked, and the engine's load inside the fetch's.
fn predictions(p: &Prepared, model: Option<&ModelDecision>) -> (Option<Prediction>, Option<Prediction>, f64) {
    let (Some(d), Some(fig)) = (model, p.figures) else { return (None, None, 0.0) };
    let tokens = priced_tokens(p);
    let bytes = (tokens as f64 * d.bytes_per_token) as u64;
    // The engine's load of the fetched blocks follows the transfer (a fetch's cost until the
    // engine can use them, as the model prices it).
    let load_s = bytes as f64 * p.load_s_per_byte;
    let fetch = p
        .fetch_cal
        .as_ref()
        .and_then(|c| c.predict(bytes, fig.rtt_s).ok())
        .map(|f| Prediction { seconds: f.seconds + load_s, ..f });
    let recompute = p.recompute_cal.as_ref().and_then(|c| c.predict(tokens, 0, p.engine_load).ok());
    (fetch, recompute, load_s)
}

/// The source's fetch-path utilization from its answer to the query (0 without one).
fn source_utilization(p: &Prepared) -> f64 {
    p.source_load.as_ref().map_or(0.0, |l| fetch_utilization(l.staging_used, l.staging_bound))
}

/// Decides: gathers the plain inputs and applies [`kvferry_model::plan_migration`].
pub fn decide(p: &Prepared) -> Result<Planned, DaemonError> {
    let holdings = Holdings {
        blocks: p.hashes.len() as u64,
        block_tokens: u64::from(p.block_size),
        local_blocks: p.local_blocks as u64,
        source_blocks: p.source.as_ref().map_or(0, |(_, n)| u64::from(*n)),
        has_tokens: p.has_tokens(),
    };
    let remaining_s = p.deadline.saturating_duration_since(Instant::now()).as_secs_f64();
    let reason = |r: &PlanReason| match (r, &p.source_note, &p.source_choice) {
        (PlanReason::NoSourceHolds, Some(n), _) => format!("{r} ({n})"),
        (_, _, Some(c)) => format!("{r}; {c}"),
        _ => r.to_string(),
    };
    let plan = plan_migration(&holdings, measured(p)?.as_ref(), &p.policy, remaining_s)
        .map_err(|e| DaemonError::from_plan(&e, reason))?;
    let (fetch_prediction, recompute_prediction, fetch_load_s) = predictions(p, plan.model.as_ref());
    let weighed = kvferry_model::consider_hedge(
        &plan,
        &holdings,
        fetch_prediction.as_ref(),
        recompute_prediction.as_ref(),
        &p.hedge_policy,
    );
    let hedge = weighed.filter(|h| h.choice == kvferry_model::HedgeChoice::Hedge);
    // A hedge weighed and declined says why (the hedged reason is added by `to_proto`).
    let not_hedged = weighed.filter(|_| hedge.is_none()).map(|h| format!("; not hedged: {}", h.reason));
    let floored = p.split_floor.filter(|_| p.policy.allow_split).map(|f| {
        format!(
            "; split priced at interference {:.2}, this host's CPU shares (other {:.2} + prefill {:.2} + fetch {:.2} cores on {})",
            f.interference, f.other, f.compute, f.fetch, f.cores
        )
    });
    let declined = plan
        .model
        .as_ref()
        .filter(|_| plan.action != MigrationAction::Split)
        .and_then(|d| d.split.declined)
        .map(|x| {
            format!(
                "; split declined: {:.1}% faster in expectation ({} recomputed, {:.2} ms) but not predictable: its fetch leg late with probability {:.2} ({:.2} ms on time, {:.2} late), the splits' scatter ±{:.1}%, within {:.0}% with probability {:.2} (needs {:.2})",
                x.gain * 100.0,
                x.point.recompute_tokens,
                x.point.seconds * 1e3,
                x.point.late_probability,
                x.point.on_time_seconds * 1e3,
                x.point.late_seconds * 1e3,
                x.point.noise * 100.0,
                p.policy.split_tolerance * 100.0,
                x.confidence,
                p.policy.split_min_confidence
            )
        });
    Ok(Planned {
        fetch_prediction,
        recompute_prediction,
        fetch_load_s,
        hedge,
        hedge_fetch_end: holdings.source_blocks as usize,
        action: plan.action,
        reason: reason(&plan.reason)
            + floored.as_deref().unwrap_or("")
            + declined.as_deref().unwrap_or("")
            + not_hedged.as_deref().unwrap_or(""),
        model: plan.model,
        fetch_from: plan.fetch_from as usize,
        fetch_end: plan.fetch_end as usize,
        recompute_tokens: plan.recompute_tokens as usize,
        predicted_s: plan.predicted_s,
        load_s: plan.load_s,
    })
}

/// The wire form of an action (the typed `kind` beside each string `action`).
pub fn action_to_proto(a: MigrationAction) -> kvferry_proto::v1::Action {
    use kvferry_proto::v1::Action as P;
    match a {
        MigrationAction::AlreadyLocal => P::AlreadyLocal,
        MigrationAction::Fetch => P::Fetch,
        MigrationAction::Recompute => P::Recompute,
        MigrationAction::Split => P::Split,
    }
}

/// Sets a receipt's action, as text and typed.
pub fn set_receipt_action(r: &mut kvferry_proto::v1::Receipt, a: MigrationAction) {
    r.action = a.as_str().to_owned();
    r.kind = action_to_proto(a).into();
}

fn candidate(a: MigrationAction, c: kvferry_model::Candidate, band: Option<Prediction>) -> Candidate {
    Candidate {
        action: a.as_str().into(),
        seconds: c.seconds,
        gpu_seconds: c.gpu_seconds,
        wire_bytes: c.wire_bytes,
        feasible: c.feasible,
        kind: action_to_proto(a).into(),
        sd_s: band.map_or(0.0, |b| b.sd_s()),
        calibration_samples: band.map_or(0, |b| b.samples.min(u64::from(u32::MAX)) as u32),
        late_probability: band.map_or(0.0, |b| b.tail_probability),
        late_delay_s: band.map_or(0.0, |b| b.tail_delay_s),
    }
}

/// A split's wire form, with its two outcomes: its fetch leg on time or late.
fn split_candidate(pt: &kvferry_model::SplitPoint, c: kvferry_model::Candidate) -> Candidate {
    Candidate {
        sd_s: pt.sd_s(),
        late_probability: pt.late_probability,
        late_delay_s: if pt.late_probability > 0.0 { pt.late_seconds - pt.on_time_seconds } else { 0.0 },
        ..candidate(MigrationAction::Split, c, None)
    }
}

/// The wire form of a decision.
pub fn to_proto(p: &Prepared, planned: &Planned) -> Decision {
    let fig = p.figures;
    let mut out = Decision {
        action: planned.action.as_str().to_owned(),
        kind: action_to_proto(planned.action).into(),
        reason: match &planned.hedge {
            Some(h) => format!("{}; hedged: {}", planned.reason, h.reason),
            None => planned.reason.clone(),
        },
        hedge: planned.hedge.is_some(),
        hedge_expected_s: planned.hedge.map_or(0.0, |h| h.expected_s),
        hedge_p_fetch_wins: planned.hedge.map_or(0.0, |h| h.p_fetch_wins),
        source_region: p.source.as_ref().map(|(r, _)| r.clone()).unwrap_or_default(),
        source_tokens: p.source.as_ref().map_or(0, |(_, n)| u64::from(*n) * u64::from(p.block_size)),
        local_tokens: (p.local_blocks * p.block_size as usize) as u64,
        split_recompute_tokens: if planned.action == MigrationAction::Split {
            planned.recompute_tokens as u64
        } else {
            0
        },
        link: fig.map(|f| {
            let mut l = link_state(p.source.as_ref().map(|(r, _)| r.as_str()).unwrap_or(""), &f, true);
            l.fetch_utilization = source_utilization(p);
            l
        }),
        holdings: p.holdings.clone(),
        ..Default::default()
    };
    if let Some(d) = &planned.model {
        out.crossover_tokens = d.crossover_tokens;
        out.recompute_s_per_token = d.recompute_seconds_per_token;
        out.bytes_per_token = d.bytes_per_token;
        out.load_s_per_token = d.load_seconds_per_token;
        let split = kvferry_model::Candidate {
            seconds: d.split.point.seconds,
            gpu_seconds: d.split.gpu_seconds,
            wire_bytes: d.split.wire_bytes,
            feasible: d.split.point.is_real_split(),
        };
        let recompute = kvferry_model::Candidate { wire_bytes: 0.0, feasible: true, ..d.recompute };
        out.candidates = vec![
            candidate(MigrationAction::Fetch, d.fetch, planned.fetch_prediction),
            candidate(MigrationAction::Recompute, recompute, planned.recompute_prediction),
            split_candidate(&d.split.point, split),
        ];
        out.declined_split = d.split.declined.filter(|_| planned.action != MigrationAction::Split).map(|x| {
            let c = kvferry_model::Candidate {
                seconds: x.point.seconds,
                gpu_seconds: x.gpu_seconds,
                wire_bytes: x.wire_bytes,
                feasible: true,
            };
            split_candidate(&x.point, c)
        });
    }
    out
}

/// The wire form of a link's figures.
pub fn link_state(region: &str, f: &Figures, connected: bool) -> LinkState {
    LinkState {
        region: region.to_owned(),
        rtt_ms: f.rtt_s * 1e3,
        goodput_gbps: f.goodput_bps / 1e9,
        age_s: if f.age_s.is_finite() { f.age_s } else { -1.0 },
        confidence: f.confidence,
        fetch_utilization: 0.0,
        prediction_error: f.prediction_error,
        connected,
        samples: f.samples.min(u64::from(u32::MAX)) as u32,
        ..Default::default()
    }
}

/// Adds a link's calibrated fetch figures to its wire form.
pub fn with_calibration(mut l: LinkState, e: &kvferry_model::calibration::FetchEstimate) -> LinkState {
    l.fixed_ms = e.fixed_s * 1e3;
    l.fixed_sd_ms = e.fixed_sd_s * 1e3;
    l.fixed_rtts = e.fixed_rtts.unwrap_or(0.0);
    l.calibrated_goodput_gbps = e.goodput_gbps.unwrap_or(0.0);
    l.per_byte_relative_sd = if e.per_byte_s > 0.0 { e.per_byte_sd_s / e.per_byte_s } else { 0.0 };
    l.fetch_noise = e.noise;
    if let Some(t) = e.tail.filter(|t| t.hazard_per_packet > 0.0) {
        l.late_hazard_per_packet = t.hazard_per_packet;
        l.late_delay_rtts = t.delay_rtts;
        l.late_fraction = t.late_fraction;
    }
    l.calibration_samples = e.samples.min(u64::from(u32::MAX)) as u32;
    l
}

/// The wire form of an engine's recompute calibration.
pub fn engine_calibration(
    engine_id: &str,
    reported: crate::registry::Profile,
    e: &kvferry_model::calibration::RecomputeEstimate,
    (split_interference, split_samples, split_scatter, split_overhead_s): (f64, u64, f64, f64),
    (hedge_interference, hedge_samples): (f64, u64),
    (load_s_per_byte, load_samples): (f64, u64),
) -> kvferry_proto::v1::EngineCalibration {
    kvferry_proto::v1::EngineCalibration {
        engine_id: engine_id.to_owned(),
        linear_s_per_token: e.linear_s_per_token,
        attention_s_per_pair: e.attention_s_per_pair,
        fixed_s: e.fixed_s,
        noise: e.noise,
        calibration_samples: e.samples.min(u64::from(u32::MAX)) as u32,
        reported_linear_s_per_token: reported.linear_s_per_token,
        reported_attention_s_per_pair: reported.attention_s_per_pair,
        reported_fixed_s: reported.fixed_s,
        load_factor: e.load_factor,
        split_interference,
        split_samples: split_samples.min(u64::from(u32::MAX)) as u32,
        hedge_interference,
        hedge_samples: hedge_samples.min(u64::from(u32::MAX)) as u32,
        load_s_per_byte,
        load_samples: load_samples.min(u64::from(u32::MAX)) as u32,
        split_scatter,
        split_overhead_s,
    }
}

#[cfg(test)]
mod tests {
    use super::{action_to_proto, grpc_timeout, has_tokens, request_budget, set_receipt_action};
    use kvferry_model::MigrationAction;
    use std::time::Duration;

    #[test]
    fn the_budget_is_the_tightest_deadline_the_request_names() {
        let (ms, default) = (Duration::from_millis, Duration::from_secs(30));
        assert_eq!(request_budget(0, None, 0, 1_000, default), default);
        assert_eq!(request_budget(500, None, 0, 1_000, default), ms(500));
        assert_eq!(request_budget(0, Some(ms(700)), 0, 1_000, default), ms(700));
        assert_eq!(request_budget(500, Some(ms(700)), 0, 1_000, default), ms(500));
        assert_eq!(request_budget(900, Some(ms(700)), 0, 1_000, default), ms(700));
        // an absolute deadline 250 ms from now
        assert_eq!(request_budget(0, None, 1_250, 1_000, default), ms(250));
        assert_eq!(request_budget(100, None, 1_250, 1_000, default), ms(100));
        // already past: nothing left (the caller refuses it with DEADLINE_EXCEEDED)
        assert_eq!(request_budget(500, None, 900, 1_000, default), Duration::ZERO);
    }

    #[test]
    fn grpc_timeouts_parse_with_every_unit() {
        assert_eq!(grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(grpc_timeout("4S"), Some(Duration::from_secs(4)));
        assert_eq!(grpc_timeout("5m"), Some(Duration::from_millis(5)));
        assert_eq!(grpc_timeout("6u"), Some(Duration::from_micros(6)));
        assert_eq!(grpc_timeout("7n"), Some(Duration::from_nanos(7)));
        for bad in ["", "S", "10", "10x", "-1S", "1.5S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_a_request_with_every_token_can_be_recomputed() {
        assert!(has_tokens(64, 4, 16));
        assert!(has_tokens(70, 4, 16), "a partial last block is fine");
        assert!(!has_tokens(63, 4, 16));
        assert!(!has_tokens(0, 4, 16), "block hashes only");
    }

    #[test]
    fn the_typed_action_names_the_same_action_as_the_string() {
        for a in MigrationAction::ALL {
            let p = action_to_proto(a);
            assert_eq!(p.as_str_name(), format!("ACTION_{}", a.as_str().to_uppercase()));
            let mut r = kvferry_proto::v1::Receipt::default();
            set_receipt_action(&mut r, a);
            assert_eq!((r.action.as_str(), r.kind()), (a.as_str(), p));
        }
    }
}
