//! The migration plan: every rule that decides what a migration does, around [`decide`].
//! [`plan_migration`] takes plain values (block counts, the engine's measured profile, the
//! link figures, the loads, the time left) and returns what to execute ([`MigrationPlan`]):
//! the model's three actions plus *already local*. Pure like the rest of the crate; the daemon
//! only gathers the inputs and carries out the answer, matching on [`MigrationAction`]
//! exhaustively, so a new action is a compile error wherever it must be handled.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::compute::{ComputeModel, SizeCorrection};
use crate::decision::{Action, Decision, Mode, Policy, Queues, Reason, Scenario, decide};
use crate::error::ModelError;
use crate::kv::KvFootprint;
use crate::link::{FetchTail, LinkModel};
use crate::queue::QueueState;

/// The action a migration executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationAction {
    /// The prefix is already ready in this region; nothing moves.
    AlreadyLocal,
    /// Fetch blocks from the source region.
    Fetch,
    /// Recompute the prefix at the target.
    Recompute,
    /// Recompute `[0, k)` while fetching the rest.
    Split,
}

impl MigrationAction {
    /// Every action, in the order the API documents them.
    pub const ALL: [Self; 4] = [Self::Fetch, Self::Recompute, Self::Split, Self::AlreadyLocal];

    /// The action's name on the wire and in logs (`already_local`, `fetch`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AlreadyLocal => "already_local",
            Self::Fetch => "fetch",
            Self::Recompute => "recompute",
            Self::Split => "split",
        }
    }
}

impl From<Action> for MigrationAction {
    fn from(a: Action) -> Self {
        match a {
            Action::Fetch => Self::Fetch,
            Action::Recompute => Self::Recompute,
            Action::Split => Self::Split,
        }
    }
}

impl fmt::Display for MigrationAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the prefix stands before deciding, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holdings {
    /// Full blocks in the prefix.
    pub blocks: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Leading blocks already ready in this region.
    pub local_blocks: u64,
    /// Leading blocks the chosen source region holds (0: no source, or none that answered).
    pub source_blocks: u64,
    /// Whether the request carries the prefix's tokens; a prefix given only as block hashes
    /// cannot be recomputed.
    pub has_tokens: bool,
}

impl Holdings {
    /// Tokens of the whole prefix.
    pub fn total_tokens(&self) -> u64 {
        self.blocks * self.block_tokens
    }
}

/// The measured quantities the cost comparison needs, as plain numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// KV bytes per token of the target engine's layout.
    pub kv: KvFootprint,
    /// The target engine's prefill profile: `seconds(n) = linear·n + attention·n(n+1)/2`.
    pub linear_s_per_token: f64,
    pub attention_s_per_pair: f64,
    /// The link to the source: goodput, bits/s, and round trip, s.
    pub goodput_bps: f64,
    pub rtt_s: f64,
    /// Fetch-path load ([`fetch_utilization`]) and compute-path load ([`compute_utilization`]).
    pub fetch_utilization: f64,
    pub compute_utilization: f64,
    /// The calibrated shape correction of the profile ([`crate::calibrated`]); `None` when
    /// uncalibrated.
    pub recompute_correction: Option<SizeCorrection>,
    /// The target engine's seconds per KV byte to load fetched blocks into its pool
    /// ([`Scenario::load_s_per_byte`]); 0 until measured.
    pub load_s_per_byte: f64,
    /// The link's calibrated loss tail ([`crate::calibrated`]); [`FetchTail::NONE`] until
    /// a fetch from it came in late.
    pub fetch_tail: FetchTail,
}

/// Why a plan is what it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PlanReason {
    /// Every block, or at least as many as any source holds, is ready here.
    AlreadyLocal { local_blocks: u64, blocks: u64 },
    /// No source holds more than this region has.
    NoSourceHolds,
    /// The cost model's answer.
    Model(Reason),
    /// The model picked a fetch or a split predicted to end after the deadline.
    DeadlineForcesRecompute { model: Reason, predicted_s: f64, remaining_s: f64 },
}

impl fmt::Display for PlanReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AlreadyLocal { local_blocks, blocks } => {
                write!(f, "{local_blocks} of {blocks} blocks are already ready in this region")
            }
            Self::NoSourceHolds => f.write_str("no peer holds this prefix"),
            Self::Model(r) => r.fmt(f),
            Self::DeadlineForcesRecompute { model, predicted_s, remaining_s } => write!(
                f,
                "{model}; but the predicted {predicted_s:.3} s exceeds the {remaining_s:.3} s left before the deadline, so recompute"
            ),
        }
    }
}

/// A plan the daemon cannot carry out, or inputs the model refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlanError {
    /// Recomputing is the only way, and the request carries no tokens.
    #[error("{reason}; and the request carries block hashes, not tokens, so the prefix cannot be recomputed")]
    CannotRecompute { reason: PlanReason },
    /// A source holds blocks, but nothing was measured about the link to it.
    #[error("source without link figures")]
    NotMeasured,
    /// The engine's prefill profile is not a valid compute model.
    #[error("engine profile: {0}")]
    Profile(ModelError),
    /// The link figures are not a valid link model.
    #[error("link figures: {0}")]
    Link(ModelError),
    /// The model refused the scenario.
    #[error("{0}")]
    Model(ModelError),
}

/// What to execute: which blocks to fetch, which tokens to recompute, the predicted time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MigrationPlan {
    pub action: MigrationAction,
    pub reason: PlanReason,
    /// The cost model's full answer, when it was asked.
    pub model: Option<Decision>,
    /// Blocks `[fetch_from, fetch_end)` are fetched (empty when nothing is).
    pub fetch_from: u64,
    pub fetch_end: u64,
    /// Tokens `[0, recompute_tokens)` are recomputed.
    pub recompute_tokens: u64,
    /// Predicted seconds until the prefix is ready (0 when the model was not asked).
    pub predicted_s: f64,
    /// The target engine's load of the fetched blocks inside `predicted_s` (0 when nothing is
    /// fetched): the transfer alone is predicted to take `predicted_s − load_s`.
    pub load_s: f64,
}

/// Compute-path utilization from the target engine's last load report: 0 when nothing was
/// queued (the engine starts a new job at once: a recent busy fraction is history, not a
/// queue), else its busy fraction, capped at 0.95.
pub fn compute_utilization(queue_depth: u32, utilization: f64) -> f64 {
    if queue_depth == 0 || !utilization.is_finite() {
        return 0.0;
    }
    utilization.clamp(0.0, 0.95)
}

/// Fetch-path utilization from a source's load report: its serving staging occupancy, capped
/// below 1 (an M/M/1 queue at 1 never drains); 0 without a bound.
pub fn fetch_utilization(staging_used: u64, staging_bound: u64) -> f64 {
    if staging_bound == 0 {
        return 0.0;
    }
    (staging_used as f64 / staging_bound as f64).clamp(0.0, 0.95)
}

/// Seconds a fetch that may fall back to recomputing `tokens` must leave before the deadline:
/// 1.5 × the engine's profile estimate (capped at a day) plus 250 ms for the command's round
/// trip. `None` when the profile gives no usable estimate.
pub fn fallback_reserve_s(linear_s_per_token: f64, attention_s_per_pair: f64, tokens: u64) -> Option<f64> {
    let compute = ComputeModel::from_measured(linear_s_per_token, attention_s_per_pair).ok()?;
    let estimate = compute.recompute_seconds(tokens);
    (estimate.is_finite() && estimate >= 0.0).then(|| (1.5 * estimate).min(86_400.0) + 0.25)
}

/// Decides a migration from what is where, what was measured and what the caller allows, with
/// `remaining_s` seconds left before its deadline. The rules around [`decide`]:
///
/// - **Already local**: every block is ready here, or some are and no source holds more.
/// - **Nothing to fetch**: no source holds more than is here → recompute everything.
/// - The model prices the blocks the source holds beyond the local ones, with M/M/1 waits
///   on a path only when it is loaded (each path's service rate: one migration of this size
///   per its idle cost). A split recomputes from token 0, so it is not offered with a local
///   prefix or without tokens; without tokens the mode is forced to fetch.
/// - **Deadline**: a fetch or split predicted to end after the deadline becomes a recompute
///   when the tokens allow one.
///
/// A recompute without tokens is refused ([`PlanError::CannotRecompute`]): when no source holds
/// the prefix, and when the model's only answer is a recompute (an egress cap that forbids the
/// fetch).
pub fn plan_migration(
    h: &Holdings,
    measured: Option<&Measured>,
    policy: &Policy,
    remaining_s: f64,
) -> Result<MigrationPlan, PlanError> {
    let bs = h.block_tokens.max(1);
    let total_tokens = h.total_tokens();
    let local = h.local_blocks;
    let held = h.source_blocks;
    if local == h.blocks || (local > 0 && held <= local) {
        return Ok(MigrationPlan {
            action: MigrationAction::AlreadyLocal,
            reason: PlanReason::AlreadyLocal { local_blocks: local, blocks: h.blocks },
            model: None,
            fetch_from: local,
            fetch_end: local,
            recompute_tokens: 0,
            predicted_s: 0.0,
            load_s: 0.0,
        });
    }
    let recompute_all = |reason: PlanReason, model: Option<Decision>, predicted_s: f64| MigrationPlan {
        action: MigrationAction::Recompute,
        reason,
        model,
        fetch_from: 0,
        fetch_end: 0,
        recompute_tokens: total_tokens,
        predicted_s,
        load_s: 0.0,
    };
    if held <= local {
        if !h.has_tokens {
            return Err(PlanError::CannotRecompute { reason: PlanReason::NoSourceHolds });
        }
        return Ok(recompute_all(PlanReason::NoSourceHolds, None, 0.0));
    }
    let m = measured.ok_or(PlanError::NotMeasured)?;
    let compute = ComputeModel::from_measured(m.linear_s_per_token, m.attention_s_per_pair)
        .map_err(PlanError::Profile)?
        .with_correction(m.recompute_correction);
    let link = LinkModel::new(m.goodput_bps / 1e9, m.rtt_s, 1.0)
        .and_then(|l| l.with_tail(m.fetch_tail))
        .map_err(PlanError::Link)?;
    let fetch_tokens = (held - local) * bs;
    let (fetch_rho, compute_rho) = (m.fetch_utilization, m.compute_utilization);
    let queues = (fetch_rho > 0.0 || compute_rho > 0.0).then(|| {
        let fetch_idle = link.fetch_seconds(fetch_tokens, m.kv.bytes_per_token()).max(1e-6);
        let compute_idle = compute.recompute_seconds(fetch_tokens).max(1e-6);
        Queues {
            fetch: QueueState { utilization: fetch_rho, service_rate: 1.0 / fetch_idle },
            compute: QueueState { utilization: compute_rho, service_rate: 1.0 / compute_idle },
        }
    });
    let scenario = Scenario {
        kv: m.kv,
        compute,
        link,
        prefix_tokens: fetch_tokens,
        queues,
        load_s_per_byte: m.load_s_per_byte,
    };
    let mut policy = *policy;
    // Split points are on the block grid: a block is fetched or recomputed whole.
    policy.split_granularity = bs;
    if local > 0 || !h.has_tokens {
        policy.allow_split = false;
    }
    if !h.has_tokens {
        policy.mode = Mode::Fetch;
    }
    let d = decide(&scenario, &policy).map_err(PlanError::Model)?;
    if !h.has_tokens && d.action == Action::Recompute {
        return Err(PlanError::CannotRecompute { reason: PlanReason::Model(d.reason) });
    }
    let plan = match d.action {
        Action::Fetch => MigrationPlan {
            action: MigrationAction::Fetch,
            reason: PlanReason::Model(d.reason),
            model: Some(d),
            fetch_from: local,
            fetch_end: held,
            recompute_tokens: 0,
            predicted_s: d.fetch.seconds,
            load_s: fetch_tokens as f64 * d.load_seconds_per_token,
        },
        Action::Recompute => recompute_all(PlanReason::Model(d.reason), Some(d), d.recompute.seconds),
        Action::Split => {
            let k = d.split.point.recompute_tokens;
            MigrationPlan {
                action: MigrationAction::Split,
                reason: PlanReason::Model(d.reason),
                model: Some(d),
                fetch_from: k / bs,
                fetch_end: held,
                recompute_tokens: k,
                predicted_s: d.split.point.seconds,
                load_s: d.split.point.load_seconds,
            }
        }
    };
    if plan.action != MigrationAction::Recompute && plan.predicted_s > remaining_s && h.has_tokens {
        let reason = PlanReason::DeadlineForcesRecompute {
            model: d.reason,
            predicted_s: plan.predicted_s,
            remaining_s,
        };
        return Ok(recompute_all(reason, Some(d), d.recompute.seconds));
    }
    Ok(plan)
}

/// Whether to hedge `plan`: start the other pure action beside it and keep whichever finishes
/// first. Only a pure fetch or recompute of the whole prefix is hedged (nothing ready here,
/// the tokens at hand, a fetch the egress cap allows and a source that holds every block),
/// with both calibrated predictions; then [`hedge`](fn@crate::calibration::hedge) decides.
/// `Some` only when it answers [`HedgeChoice::Hedge`](crate::HedgeChoice::Hedge).
pub fn plan_hedge(
    plan: &MigrationPlan,
    h: &Holdings,
    fetch: Option<&crate::Prediction>,
    recompute: Option<&crate::Prediction>,
    policy: &crate::HedgePolicy,
) -> Option<crate::HedgeDecision> {
    consider_hedge(plan, h, fetch, recompute, policy).filter(|d| d.choice == crate::HedgeChoice::Hedge)
}

/// What [`hedge`](fn@crate::calibration::hedge) answered for `plan`, hedge or not (its reason says
/// why not); `None` where no hedge was weighed at all (policy off, not a pure whole-prefix
/// action, a prediction missing).
pub fn consider_hedge(
    plan: &MigrationPlan,
    h: &Holdings,
    fetch: Option<&crate::Prediction>,
    recompute: Option<&crate::Prediction>,
    policy: &crate::HedgePolicy,
) -> Option<crate::HedgeDecision> {
    let pure = matches!(plan.action, MigrationAction::Fetch | MigrationAction::Recompute);
    let fetch_allowed = plan.model.is_some_and(|d| d.fetch.feasible);
    if !policy.allow
        || !pure
        || !fetch_allowed
        || h.local_blocks > 0
        || !h.has_tokens
        || h.source_blocks < h.blocks
    {
        return None;
    }
    crate::hedge(fetch?, recompute?, policy).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_the_model_and_serde() {
        for a in [Action::Fetch, Action::Recompute, Action::Split] {
            assert_eq!(MigrationAction::from(a).as_str(), a.to_string());
        }
        for a in MigrationAction::ALL {
            assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{a}\""));
        }
    }

    fn measured() -> Measured {
        Measured {
            kv: KvFootprint::new(crate::KvShape::Gqa { layers: 4, kv_heads: 2, head_dim: 64 }, 2.0).unwrap(),
            linear_s_per_token: 1e-3,
            attention_s_per_pair: 0.0,
            goodput_bps: 1e9,
            rtt_s: 0.05,
            fetch_utilization: 0.0,
            compute_utilization: 0.0,
            recompute_correction: None,
            load_s_per_byte: 0.0,
            fetch_tail: FetchTail::NONE,
        }
    }

    fn holdings(local: u64, source: u64, has_tokens: bool) -> Holdings {
        Holdings { blocks: 16, block_tokens: 16, local_blocks: local, source_blocks: source, has_tokens }
    }

    fn wide(seconds: f64) -> crate::Prediction {
        crate::Prediction::gaussian(seconds, 0.5 * seconds, 0.2 * seconds, 1)
    }

    #[test]
    fn a_hedge_needs_a_pure_whole_prefix_action_and_both_bands() {
        let allow = crate::HedgePolicy { allow: true, ..crate::HedgePolicy::default() };
        let h = holdings(0, 16, true);
        let plan = plan_migration(&h, Some(&measured()), &Policy::default(), 60.0).unwrap();
        let (f, r) = (wide(0.25), wide(0.26));
        let d = plan_hedge(&plan, &h, Some(&f), Some(&r), &allow).expect("straddling bands hedge");
        assert!(d.expected_s < f.seconds.min(r.seconds));
        // Each missing condition: no hedge.
        assert!(plan_hedge(&plan, &h, Some(&f), Some(&r), &crate::HedgePolicy::default()).is_none());
        assert!(plan_hedge(&plan, &h, None, Some(&r), &allow).is_none());
        assert!(plan_hedge(&plan, &h, Some(&f), None, &allow).is_none());
        for other in [holdings(2, 16, true), holdings(0, 8, true), holdings(0, 16, false)] {
            assert!(plan_hedge(&plan, &other, Some(&f), Some(&r), &allow).is_none(), "{other:?}");
        }
        let exact = crate::Prediction::exact;
        assert!(
            plan_hedge(&plan, &h, Some(&exact(0.25)), Some(&exact(0.26)), &allow).is_none(),
            "clear bands"
        );
        let capped = Policy { max_wire_bytes: Some(1.0), ..Policy::default() };
        let under_cap = plan_migration(&h, Some(&measured()), &capped, 60.0).unwrap();
        assert!(
            plan_hedge(&under_cap, &h, Some(&f), Some(&r), &allow).is_none(),
            "the egress cap forbids the fetch"
        );
        let local = MigrationPlan { action: MigrationAction::AlreadyLocal, ..plan };
        assert!(plan_hedge(&local, &h, Some(&f), Some(&r), &allow).is_none());
    }

    #[test]
    fn a_hedge_weighed_and_declined_says_why_and_one_never_weighed_is_none() {
        let allow = crate::HedgePolicy { allow: true, ..crate::HedgePolicy::default() };
        let h = holdings(0, 16, true);
        let plan = plan_migration(&h, Some(&measured()), &Policy::default(), 60.0).unwrap();
        let exact = crate::Prediction::exact;
        let d = consider_hedge(&plan, &h, Some(&exact(0.25)), Some(&exact(0.5)), &allow).expect("weighed");
        assert_eq!(d.choice, crate::HedgeChoice::Fetch);
        assert!(matches!(d.reason, crate::calibration::HedgeReason::Clear { .. }), "{:?}", d.reason);
        assert!(d.reason.to_string().contains("do not overlap"), "{}", d.reason);
        let (f, r) = (wide(0.25), wide(0.26));
        let hedged = consider_hedge(&plan, &h, Some(&f), Some(&r), &allow).expect("weighed");
        assert_eq!(Some(hedged), plan_hedge(&plan, &h, Some(&f), Some(&r), &allow));
        // Not weighed: the policy is off, or a prediction is missing.
        assert!(consider_hedge(&plan, &h, Some(&f), Some(&r), &crate::HedgePolicy::default()).is_none());
        assert!(consider_hedge(&plan, &h, None, Some(&r), &allow).is_none());
    }
}
