//! The decision: fetch, recompute, or split, with every candidate's predicted cost and the
//! reason the winner won.
//!
//! [`decide`] is the single entry point the daemon and the CLI call. It is a pure function of a
//! [`Scenario`] (what the model, link and queues look like now) and a [`Policy`] (what the
//! caller allows). It allocates nothing and runs in well under a microsecond
//! (`cargo bench -p kvferry-model`), so it can run on every `MigrateSession` and `PlanMigration`.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::compute::ComputeModel;
use crate::crossover::{crossover_tokens_with_load, crossover_utilization};
use crate::error::{ModelError, count, fraction, non_negative, positive, utilization};
use crate::kv::KvFootprint;
use crate::link::LinkModel;
use crate::queue::QueueState;
use crate::split::{SplitInputs, SplitPoint};

/// Load on the two resources the actions consume.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Queues {
    /// The cross-region fetch path (KV-transfer link or store).
    pub fetch: QueueState,
    /// The target region's prefill compute pool.
    pub compute: QueueState,
}

/// The inputs of one decision, as measured now.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Scenario {
    /// KV bytes per token.
    pub kv: KvFootprint,
    /// Target-region prefill speed.
    pub compute: ComputeModel,
    /// Link from the region that holds the prefix.
    pub link: LinkModel,
    /// Tokens of cached prefix the source region holds for this session.
    pub prefix_tokens: u64,
    /// M/M/1 load terms; `None` means both paths idle (the first seed script).
    pub queues: Option<Queues>,
    /// Seconds per KV byte for the target engine to load fetched blocks into its pool once
    /// they have landed (0: free, or not measured yet). A recompute writes its pool directly;
    /// a fetch's blocks are copied in at the engine's next step, so this is part of what a
    /// fetch (and a split's fetched part) costs before the engine can decode.
    #[serde(default)]
    pub load_s_per_byte: f64,
}

impl Scenario {
    /// Re-checks every field (structs may have been built by hand or deserialized).
    pub fn validate(&self) -> Result<(), ModelError> {
        KvFootprint::new(self.kv.shape, self.kv.element_bytes)?;
        let c = &self.compute;
        ComputeModel::new(c.active_params, c.peak_flops, c.mfu, c.attention)?;
        self.link.validate()?;
        count("prefix_tokens", self.prefix_tokens)?;
        non_negative("load_s_per_byte", self.load_s_per_byte)?;
        if let Some(q) = &self.queues {
            utilization("fetch_utilization", q.fetch.utilization)?;
            positive("fetch_service_rate", q.fetch.service_rate)?;
            utilization("compute_utilization", q.compute.utilization)?;
            positive("compute_service_rate", q.compute.service_rate)?;
        }
        Ok(())
    }
}

/// Which action the caller wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Pick the fastest allowed action.
    #[default]
    Auto,
    /// Fetch unless a hard limit (egress cap) forbids it.
    Fetch,
    /// Always recompute.
    Recompute,
}

/// What the caller allows, and the split's price.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    /// Auto, or a forced action.
    pub mode: Mode,
    /// Whether a split may be the decision (it needs an engine that can take one).
    pub allow_split: bool,
    /// Hard cap on bytes sent over the WAN for this migration.
    pub max_wire_bytes: Option<f64>,
    /// Fixed extra seconds of a real split (an extra scheduling round and the merge).
    pub split_overhead_s: f64,
    /// Smallest relative gain over the better pure action for a split to be chosen.
    pub split_min_gain: f64,
    /// Split points are multiples of this many tokens (the engine's block size).
    pub split_granularity: u64,
    /// Relative slowdown of each leg of a real split while the other runs on shared
    /// resources (0: none; the daemon learns it from executed splits).
    #[serde(default)]
    pub split_interference: f64,
    /// A real split is chosen only if the model predicts its time within this fraction
    /// ([`crate::split::SplitPoint::confidence`])...
    #[serde(default = "default_split_tolerance")]
    pub split_tolerance: f64,
    /// ...with at least this probability. On a lossy path a short fetch leg is on time or a
    /// round trip late; a split whose gain rides on that coin is a gamble the daemon does not
    /// commit two paths to (a hedge is the tool for one). 0 admits every split.
    #[serde(default)]
    pub split_min_confidence: f64,
    /// Relative scatter (sd) of a split's completion around the outcome it comes in at (0:
    /// exact; the daemon learns it from executed splits, [`crate::calibration::SplitScatter`]).
    /// Counted in the split's confidence: a split predicted at the edge of the tolerance is
    /// inside it only about half the time.
    #[serde(default)]
    pub split_noise: f64,
}

fn default_split_tolerance() -> f64 {
    0.15
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            mode: Mode::Auto,
            allow_split: false,
            max_wire_bytes: None,
            // The daemon's `[policy] split_overhead_ms` default (the benches' splits measured
            // 0.0–0.2 ms beyond their slower leg, `calibration::overhead`).
            split_overhead_s: 0.0005,
            split_min_gain: 0.05,
            split_granularity: 16,
            split_interference: 0.0,
            split_tolerance: default_split_tolerance(),
            split_min_confidence: 0.9,
            split_noise: 0.0,
        }
    }
}

impl Policy {
    fn validate(&self) -> Result<(), ModelError> {
        if let Some(cap) = self.max_wire_bytes {
            non_negative("max_wire_bytes", cap)?;
        }
        non_negative("split_overhead_s", self.split_overhead_s)?;
        non_negative("split_min_gain", self.split_min_gain)?;
        if self.split_min_gain > 0.0 {
            fraction("split_min_gain", self.split_min_gain)?;
        }
        count("split_granularity", self.split_granularity)?;
        non_negative("split_interference", self.split_interference)?;
        non_negative("split_tolerance", self.split_tolerance)?;
        non_negative("split_min_confidence", self.split_min_confidence)?;
        non_negative("split_noise", self.split_noise)?;
        if self.split_min_confidence > 0.0 {
            fraction("split_min_confidence", self.split_min_confidence)?;
        }
        Ok(())
    }
}

/// The actions a migration can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Fetch the whole prefix from the source region.
    Fetch,
    /// Recompute the whole prefix at the target.
    Recompute,
    /// Recompute `[0, k)` while fetching `[k, P)`.
    Split,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Fetch => "fetch",
            Action::Recompute => "recompute",
            Action::Split => "split",
        })
    }
}

/// One pure action's predicted cost and what it consumes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Predicted seconds until the prefix is ready at the target, queueing included.
    pub seconds: f64,
    /// Target-GPU seconds the action spends.
    pub gpu_seconds: f64,
    /// Bytes the action sends over the WAN.
    pub wire_bytes: f64,
    /// False when a hard limit (the egress cap) forbids it.
    pub feasible: bool,
}

/// The best split and what it would consume.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SplitCandidate {
    /// The best point on the block grid (an endpoint when no real split helps).
    pub point: SplitPoint,
    /// Target-GPU seconds of the recompute leg.
    pub gpu_seconds: f64,
    /// WAN bytes of the fetch leg.
    pub wire_bytes: f64,
    /// `1 − split / best feasible pure action` (0 when the split degenerates to a pure action).
    pub gain: f64,
    /// The split that would have won on expected time but is not predictable enough to take
    /// (`Policy::split_min_confidence`), where there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub declined: Option<DeclinedSplit>,
}

/// A split left out because its time is not predictable: a coin flip between its fetch leg's
/// outcomes, or an outcome at the edge of the band given the splits' scatter (see
/// [`Policy::split_min_confidence`], [`Policy::split_noise`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeclinedSplit {
    /// The point, with its two outcomes.
    pub point: SplitPoint,
    /// Its expected gain over the better pure action.
    pub gain: f64,
    /// What it would have consumed, as [`SplitCandidate`]'s.
    pub gpu_seconds: f64,
    pub wire_bytes: f64,
    /// Probability that its time lands within `Policy::split_tolerance` of its expectation.
    pub confidence: f64,
}

/// Why the winner won.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// Fetching is predicted faster.
    FetchFaster { fetch_s: f64, recompute_s: f64 },
    /// Recomputing is predicted no slower (ties go to recompute: no egress, no remote dependency).
    RecomputeFaster { fetch_s: f64, recompute_s: f64 },
    /// The split beats the better pure action by at least the policy's minimum gain.
    SplitFaster { split_s: f64, best_pure_s: f64, gain: f64, min_gain: f64 },
    /// Fetching would exceed the egress cap.
    EgressCap { fetch_wire_bytes: f64, cap: f64 },
    /// The caller forced this action.
    Forced { mode: Mode },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Reason::FetchFaster { fetch_s, recompute_s } => write!(
                f,
                "fetch is predicted faster: {:.2} ms vs {:.2} ms to recompute",
                fetch_s * 1e3,
                recompute_s * 1e3
            ),
            Reason::RecomputeFaster { fetch_s, recompute_s } => write!(
                f,
                "recompute is predicted no slower: {:.2} ms vs {:.2} ms to fetch",
                recompute_s * 1e3,
                fetch_s * 1e3
            ),
            Reason::SplitFaster { split_s, best_pure_s, gain, min_gain } => write!(
                f,
                "split is predicted {:.1}% faster than the better pure action ({:.2} ms vs {:.2} ms; threshold {:.1}%)",
                gain * 100.0,
                split_s * 1e3,
                best_pure_s * 1e3,
                min_gain * 100.0
            ),
            Reason::EgressCap { fetch_wire_bytes, cap } => {
                write!(f, "fetching needs {fetch_wire_bytes:.0} WAN bytes, over the {cap:.0}-byte egress cap")
            }
            Reason::Forced { mode } => write!(f, "forced by policy ({mode:?})"),
        }
    }
}

/// The full answer: the action, the reason, and every candidate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// What to do.
    pub action: Action,
    /// Why.
    pub reason: Reason,
    /// Pure fetch.
    pub fetch: Candidate,
    /// Pure recompute.
    pub recompute: Candidate,
    /// The best split (always reported, chosen only when allowed and worth it).
    pub split: SplitCandidate,
    /// KV bytes per token in memory.
    pub bytes_per_token: f64,
    /// Recompute seconds per token, weights term only (the seed's rate).
    pub recompute_seconds_per_token: f64,
    /// Transfer seconds per token on this link.
    pub transfer_seconds_per_token: f64,
    /// The target engine's seconds per token to load fetched KV into its pool.
    #[serde(default)]
    pub load_seconds_per_token: f64,
    /// Prefix length above which fetch wins on idle paths; `None` if it never does.
    pub crossover_tokens: Option<f64>,
    /// Fetch-path utilization above which recompute wins (only with queue inputs).
    pub crossover_utilization: Option<f64>,
}

/// Evaluates a scenario under a policy.
pub fn decide(s: &Scenario, policy: &Policy) -> Result<Decision, ModelError> {
    s.validate()?;
    policy.validate()?;

    let bpt = s.kv.bytes_per_token();
    let p = s.prefix_tokens;
    let (fetch_wait, compute_wait) =
        s.queues.map_or((0.0, 0.0), |q| (q.fetch.wait_seconds(), q.compute.wait_seconds()));

    let load_per_token = bpt * s.load_s_per_byte;
    let fetch_idle = s.link.fetch_seconds(p, bpt) + p as f64 * load_per_token;
    let recompute_idle = s.compute.recompute_seconds(p);
    let fetch_bytes = s.link.wire_bytes(p, bpt);
    let fetch = Candidate {
        seconds: fetch_wait + fetch_idle,
        gpu_seconds: 0.0,
        wire_bytes: fetch_bytes,
        feasible: policy.max_wire_bytes.is_none_or(|cap| fetch_bytes <= cap),
    };
    let recompute = Candidate {
        seconds: compute_wait + recompute_idle,
        gpu_seconds: recompute_idle,
        wire_bytes: 0.0,
        feasible: true,
    };

    // The egress cap bounds the fetch leg, so it sets the smallest recompute leg.
    let min_recompute_tokens = match policy.max_wire_bytes {
        None => 0,
        Some(cap) => {
            let per_token = bpt * s.link.wire_ratio;
            let fetchable = (cap / per_token).floor();
            if fetchable >= p as f64 { 0 } else { p - fetchable as u64 }
        }
    };
    let inputs = SplitInputs {
        compute: &s.compute,
        link: &s.link,
        bytes_per_token: bpt,
        prefix_tokens: p,
        granularity: policy.split_granularity,
        min_recompute_tokens,
        compute_wait_s: compute_wait,
        fetch_wait_s: fetch_wait,
        overhead_s: policy.split_overhead_s,
        interference: policy.split_interference,
        load_s_per_token: load_per_token,
        tolerance: policy.split_tolerance,
        min_confidence: policy.split_min_confidence,
        noise: policy.split_noise,
    };
    let point = inputs.best();
    let best_pure = if fetch.feasible { fetch.seconds.min(recompute.seconds) } else { recompute.seconds };
    let gain_of = |pt: &SplitPoint| if pt.is_real_split() { 1.0 - pt.seconds / best_pure } else { 0.0 };
    let gain = gain_of(&point);
    // Target-GPU seconds and WAN bytes of a split point.
    let consumes = |pt: &SplitPoint| {
        (s.compute.recompute_seconds(pt.recompute_tokens), s.link.wire_bytes(pt.fetch_tokens, bpt))
    };
    // Only a link with a tail, or a scatter, has splits the filter can leave out.
    let declined = (policy.allow_split
        && policy.split_min_confidence > 0.0
        && (s.link.tail.hazard_per_packet > 0.0 || policy.split_noise > 0.0))
        .then(|| SplitInputs { min_confidence: 0.0, ..inputs }.best())
        .filter(|free| {
            free.is_real_split()
                && free.seconds < point.seconds
                && gain_of(free) >= policy.split_min_gain
                && gain_of(free) > gain
        })
        .map(|free| {
            let (gpu_seconds, wire_bytes) = consumes(&free);
            DeclinedSplit {
                point: free,
                gain: gain_of(&free),
                gpu_seconds,
                wire_bytes,
                confidence: free.confidence(policy.split_tolerance),
            }
        });
    let (gpu_seconds, wire_bytes) = consumes(&point);
    let split = SplitCandidate { point, gpu_seconds, wire_bytes, gain, declined };

    let (action, reason) = choose(policy, &fetch, &recompute, &split, best_pure);

    let crossover_utilization = s
        .queues
        .and_then(|q| crossover_utilization(fetch_idle, recompute_idle, &q.compute, q.fetch.service_rate));
    Ok(Decision {
        action,
        reason,
        fetch,
        recompute,
        split,
        bytes_per_token: bpt,
        recompute_seconds_per_token: s.compute.linear_seconds_per_token(),
        transfer_seconds_per_token: s.link.seconds_per_token(bpt),
        load_seconds_per_token: load_per_token,
        crossover_tokens: crossover_tokens_with_load(bpt, &s.compute, &s.link, load_per_token),
        crossover_utilization,
    })
}

fn choose(
    policy: &Policy,
    fetch: &Candidate,
    recompute: &Candidate,
    split: &SplitCandidate,
    best_pure: f64,
) -> (Action, Reason) {
    let cap_reason = || Reason::EgressCap {
        fetch_wire_bytes: fetch.wire_bytes,
        cap: policy.max_wire_bytes.unwrap_or(f64::INFINITY),
    };
    match policy.mode {
        Mode::Recompute => return (Action::Recompute, Reason::Forced { mode: Mode::Recompute }),
        Mode::Fetch if fetch.feasible => return (Action::Fetch, Reason::Forced { mode: Mode::Fetch }),
        Mode::Fetch => return (Action::Recompute, cap_reason()),
        Mode::Auto => {}
    }
    if policy.allow_split && split.point.is_real_split() && split.gain >= policy.split_min_gain {
        return (
            Action::Split,
            Reason::SplitFaster {
                split_s: split.point.seconds,
                best_pure_s: best_pure,
                gain: split.gain,
                min_gain: policy.split_min_gain,
            },
        );
    }
    if !fetch.feasible {
        return (Action::Recompute, cap_reason());
    }
    let (f, r) = (fetch.seconds, recompute.seconds);
    if f < r {
        (Action::Fetch, Reason::FetchFaster { fetch_s: f, recompute_s: r })
    } else {
        (Action::Recompute, Reason::RecomputeFaster { fetch_s: f, recompute_s: r })
    }
}
