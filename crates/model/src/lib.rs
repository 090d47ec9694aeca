//! kvferry's cost model: should the region that now serves a session **fetch** its cached KV
//! prefix from the region that holds it, **recompute** it locally, or **split** the prefix
//! between the two?
//!
//! Pure: no I/O, no clock, no async, no allocation on the decision path. Every input is a
//! measured or configured number passed in; the daemon feeds live link and load figures, the
//! CLI feeds flags. The seed's two scripts (`wan_kv_crossover.py`, `wan_routing_score.py`) are
//! reproduced exactly when the extensions are off: the attention term (`ComputeModel::attention
//! = None`), MLA/MoE shapes, dtype and codec ratio (`wire_ratio = 1.0`), and the split.
//!
//! Module map:
//! - [`kv`]: bytes per token (GQA and MLA, any dtype).
//! - [`compute`]: prefill seconds (weights term, optional attention term).
//! - [`link`]: fetch seconds (RTT + payload at goodput, codec ratio).
//! - [`queue`]: M/M/1 waits and their closed-form inverse.
//! - [`crossover`]: crossover prefix length and crossover utilization.
//! - [`split`]: the Cake-style split search.
//! - [`decision`]: [`decide`], the single entry point.
//! - [`migration`]: the rules around [`decide`] that make a migration's plan
//!   ([`plan_migration`]: already local, nothing to fetch, deadline; [`MigrationAction`]).
//! - [`source`]: ranking several holders of a prefix by how soon each makes it ready.
//! - [`presets`]: model shapes and accelerator peaks with sources.
//! - [`calibration`]: fetch and recompute costs learnt online from measured outcomes, with
//!   uncertainty bands, and the hedging rule.

pub mod calibration;
pub mod compute;
pub mod crossover;
pub mod decision;
pub mod error;
pub mod kv;
pub mod link;
pub mod migration;
pub mod presets;
pub mod queue;
pub mod source;
pub mod split;

pub use calibration::{
    CalibrationError, FetchCalibration, FetchObservation, HedgeChoice, HedgeDecision, HedgePolicy,
    Prediction, RecomputeCalibration, RecomputeObservation, calibrated, hedge,
};
pub use compute::{AttentionShape, ComputeModel, SizeCorrection};
pub use crossover::{crossover_tokens, crossover_tokens_with_load, crossover_utilization};
pub use decision::{
    Action, Candidate, Decision, DeclinedSplit, Mode, Policy, Queues, Reason, Scenario, SplitCandidate,
    decide,
};
pub use error::ModelError;
pub use kv::{KvDtype, KvFootprint, KvShape};
pub use link::{FetchBranches, FetchTail, LinkModel};
pub use migration::{
    MigrationAction, MigrationPlan, PlanError, PlanReason, consider_hedge, plan_hedge, plan_migration,
};
pub use queue::{QueueState, mm1_utilization_for_wait, mm1_wait_seconds, route_total_latency};
pub use source::{HolderOffer, SourcePricing, rank_sources, ready_seconds};
pub use split::{SplitInputs, SplitPoint};
