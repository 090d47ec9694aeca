//! Property and rule tests of the migration plan ([`kvferry_model::plan_migration`]): the rules
//! the daemon used to apply around `decide()` (already local, nothing to fetch, split
//! eligibility, tokens-less requests, the deadline), over random holdings, profiles, links,
//! loads and deadlines.

use kvferry_model::migration::{
    Holdings, Measured, MigrationPlan, PlanError, PlanReason, compute_utilization, fallback_reserve_s,
    fetch_utilization, plan_migration,
};
use kvferry_model::{ComputeModel, KvDtype, KvFootprint, MigrationAction, Mode, Policy, Reason};
use proptest::prelude::*;

fn kv() -> KvFootprint {
    KvFootprint::gqa(32, 8, 128, KvDtype::Bf16).unwrap()
}

fn measured(goodput_bps: f64, rtt_s: f64) -> Measured {
    Measured {
        kv: kv(),
        linear_s_per_token: 1e-4,
        attention_s_per_pair: 1e-9,
        goodput_bps,
        rtt_s,
        fetch_utilization: 0.0,
        compute_utilization: 0.0,
        recompute_correction: None,
        load_s_per_byte: 0.0,
        fetch_tail: kvferry_model::FetchTail::NONE,
    }
}

fn holdings(blocks: u64, local: u64, source: u64, has_tokens: bool) -> Holdings {
    Holdings { blocks, block_tokens: 16, local_blocks: local, source_blocks: source, has_tokens }
}

fn auto(allow_split: bool) -> Policy {
    Policy { allow_split, split_granularity: 16, ..Policy::default() }
}

const FOREVER: f64 = 1e9;

#[test]
fn a_fully_local_prefix_moves_nothing_even_without_a_source() {
    let p = plan_migration(&holdings(8, 8, 0, false), None, &auto(true), FOREVER).unwrap();
    assert_eq!(p.action, MigrationAction::AlreadyLocal);
    assert_eq!((p.fetch_from, p.fetch_end, p.recompute_tokens), (8, 8, 0));
    assert_eq!(p.reason.to_string(), "8 of 8 blocks are already ready in this region");
}

#[test]
fn a_partly_local_prefix_no_source_extends_is_already_local() {
    let p = plan_migration(&holdings(8, 3, 3, true), None, &auto(false), FOREVER).unwrap();
    assert_eq!(p.action, MigrationAction::AlreadyLocal);
    assert_eq!(p.reason, PlanReason::AlreadyLocal { local_blocks: 3, blocks: 8 });
}

#[test]
fn nothing_held_anywhere_recomputes_all_or_is_refused_without_tokens() {
    let p = plan_migration(&holdings(8, 0, 0, true), None, &auto(false), FOREVER).unwrap();
    assert_eq!(p.action, MigrationAction::Recompute);
    assert_eq!((p.recompute_tokens, p.model), (128, None));
    assert_eq!(p.reason.to_string(), "no peer holds this prefix");
    let e = plan_migration(&holdings(8, 0, 0, false), None, &auto(false), FOREVER).unwrap_err();
    assert_eq!(e, PlanError::CannotRecompute { reason: PlanReason::NoSourceHolds });
}

#[test]
fn a_source_without_figures_is_an_error_not_a_guess() {
    let e = plan_migration(&holdings(8, 0, 8, true), None, &auto(false), FOREVER).unwrap_err();
    assert_eq!(e, PlanError::NotMeasured);
}

#[test]
fn a_fast_link_fetches_the_blocks_beyond_the_local_ones() {
    let m = measured(100e9, 0.001);
    let p = plan_migration(&holdings(64, 4, 60, true), Some(&m), &auto(true), FOREVER).unwrap();
    assert_eq!(p.action, MigrationAction::Fetch);
    assert_eq!((p.fetch_from, p.fetch_end, p.recompute_tokens), (4, 60, 0));
    let d = p.model.unwrap();
    assert_eq!(p.predicted_s, d.fetch.seconds);
}

#[test]
fn a_fetch_that_misses_the_deadline_becomes_a_recompute() {
    let m = measured(100e9, 0.001);
    let free = plan_migration(&holdings(64, 0, 64, true), Some(&m), &auto(false), FOREVER).unwrap();
    assert_eq!(free.action, MigrationAction::Fetch);
    let remaining = free.predicted_s / 2.0;
    let p = plan_migration(&holdings(64, 0, 64, true), Some(&m), &auto(false), remaining).unwrap();
    assert_eq!(p.action, MigrationAction::Recompute);
    assert_eq!((p.fetch_end, p.recompute_tokens), (0, 64 * 16));
    assert!(matches!(p.reason, PlanReason::DeadlineForcesRecompute { .. }), "{:?}", p.reason);
    assert!(p.reason.to_string().contains("exceeds the"), "{}", p.reason);
    // Without tokens there is nothing to fall back to: the fetch stays.
    let p = plan_migration(&holdings(64, 0, 64, false), Some(&m), &auto(false), remaining).unwrap();
    assert_eq!(p.action, MigrationAction::Fetch);
}

#[test]
fn without_tokens_the_mode_is_forced_to_fetch() {
    // A link so slow that recompute would win in auto mode.
    let m = measured(1e6, 0.3);
    let with = plan_migration(&holdings(64, 0, 64, true), Some(&m), &auto(false), FOREVER).unwrap();
    assert_eq!(with.action, MigrationAction::Recompute);
    let without = plan_migration(&holdings(64, 0, 64, false), Some(&m), &auto(false), FOREVER).unwrap();
    assert_eq!(without.action, MigrationAction::Fetch);
    assert_eq!(without.reason, PlanReason::Model(Reason::Forced { mode: Mode::Fetch }));
}

#[test]
fn without_tokens_an_egress_cap_that_forbids_the_fetch_is_refused() {
    // Regression: a hashes-only request whose cap forbids the fetch used to plan a recompute of
    // an empty token list.
    let m = measured(1e10, 0.01);
    let capped = Policy { max_wire_bytes: Some(1.0), ..auto(false) };
    let e = plan_migration(&holdings(64, 0, 64, false), Some(&m), &capped, FOREVER).unwrap_err();
    let PlanError::CannotRecompute { reason: PlanReason::Model(Reason::EgressCap { cap, .. }) } = e else {
        panic!("{e:?}")
    };
    assert_eq!(cap, 1.0);
    assert!(e.to_string().contains("cannot be recomputed"), "{e}");
    // With the tokens the same request recomputes.
    let p = plan_migration(&holdings(64, 0, 64, true), Some(&m), &capped, FOREVER).unwrap();
    assert_eq!((p.action, p.recompute_tokens), (MigrationAction::Recompute, 64 * 16));
}

#[test]
fn a_split_is_offered_only_from_token_zero() {
    // Fetching a token takes about as long as recomputing it: half and half wins.
    let m = measured(kv().bytes_per_token() * 8.0 / 1e-4, 0.001);
    let p = plan_migration(&holdings(64, 0, 64, true), Some(&m), &auto(true), FOREVER).unwrap();
    assert_eq!(p.action, MigrationAction::Split);
    assert_eq!(p.recompute_tokens, p.fetch_from * 16);
    assert!(p.fetch_from > 0 && p.fetch_end == 64, "{p:?}");
    // With a local prefix, or without tokens, or not allowed: no split.
    for (h, policy) in [
        (holdings(64, 1, 64, true), auto(true)),
        (holdings(64, 0, 64, false), auto(true)),
        (holdings(64, 0, 64, true), auto(false)),
    ] {
        let p = plan_migration(&h, Some(&m), &policy, FOREVER).unwrap();
        assert_ne!(p.action, MigrationAction::Split, "{h:?} {policy:?}");
    }
}

#[test]
fn utilizations_price_only_queued_work() {
    // Busy a moment ago but nothing queued now: a new recompute starts at once.
    assert_eq!(compute_utilization(0, 0.9), 0.0);
    assert_eq!(compute_utilization(2, 0.6), 0.6);
    assert_eq!(compute_utilization(9, 1.0), 0.95);
    assert_eq!(compute_utilization(1, f64::NAN), 0.0);
    assert_eq!(compute_utilization(1, -1.0), 0.0);
    assert_eq!(fetch_utilization(5, 0), 0.0);
    assert_eq!(fetch_utilization(1, 4), 0.25);
    assert_eq!(fetch_utilization(9, 4), 0.95);
}

#[test]
fn the_fallback_reserve_is_the_models_prefill_estimate() {
    let c = ComputeModel::from_measured(1e-4, 1e-9).unwrap();
    let r = fallback_reserve_s(1e-4, 1e-9, 4096).unwrap();
    assert!((r - (1.5 * c.recompute_seconds(4096) + 0.25)).abs() < 1e-12, "{r}");
    assert_eq!(fallback_reserve_s(1e3, 0.0, u64::MAX / 2), Some(86_400.25));
    assert_eq!(fallback_reserve_s(0.0, 0.0, 10), None);
}

fn arb_measured() -> impl Strategy<Value = Measured> {
    (
        1e-7..1e-2f64,
        prop_oneof![Just(0.0), 1e-12..1e-6f64],
        1e6..400e9f64,
        0.0..0.4f64,
        0.0..0.95f64,
        0.0..0.95f64,
    )
        .prop_map(|(lin, att, g, rtt, fr, cr)| Measured {
            kv: kv(),
            linear_s_per_token: lin,
            attention_s_per_pair: att,
            goodput_bps: g,
            rtt_s: rtt,
            fetch_utilization: fr,
            compute_utilization: cr,
            recompute_correction: None,
            load_s_per_byte: 0.0,
            fetch_tail: kvferry_model::FetchTail::NONE,
        })
}

fn arb_holdings() -> impl Strategy<Value = Holdings> {
    (1u64..512, prop::sample::select(vec![1u64, 16, 64]), any::<bool>()).prop_flat_map(
        |(blocks, bs, tokens)| {
            (0..=blocks, 0..=blocks).prop_map(move |(local, source)| Holdings {
                blocks,
                block_tokens: bs,
                local_blocks: local,
                source_blocks: source,
                has_tokens: tokens,
            })
        },
    )
}

fn arb_policy() -> impl Strategy<Value = Policy> {
    (
        prop::sample::select(vec![Mode::Auto, Mode::Fetch, Mode::Recompute]),
        any::<bool>(),
        prop::option::of(0.0..1e10f64),
    )
        .prop_map(|(mode, allow_split, cap)| Policy {
            mode,
            allow_split,
            max_wire_bytes: cap,
            ..Policy::default()
        })
}

/// What must hold of every plan, whatever the inputs.
fn check(h: &Holdings, policy: &Policy, remaining_s: f64, p: &MigrationPlan) -> Result<(), TestCaseError> {
    let total = h.total_tokens();
    prop_assert!(p.fetch_from <= p.fetch_end && p.recompute_tokens <= total, "{p:?}");
    let already = h.local_blocks == h.blocks || (h.local_blocks > 0 && h.source_blocks <= h.local_blocks);
    prop_assert_eq!(p.action == MigrationAction::AlreadyLocal, already);
    match p.action {
        MigrationAction::AlreadyLocal => {
            prop_assert_eq!(
                (p.fetch_from, p.fetch_end, p.recompute_tokens),
                (h.local_blocks, h.local_blocks, 0)
            );
        }
        MigrationAction::Fetch => {
            // Fetches exactly what the source holds beyond what is here, in time.
            prop_assert_eq!(
                (p.fetch_from, p.fetch_end, p.recompute_tokens),
                (h.local_blocks, h.source_blocks, 0)
            );
            prop_assert!(p.predicted_s <= remaining_s || !h.has_tokens);
            prop_assert!(p.model.is_some());
        }
        MigrationAction::Recompute => {
            // A recompute needs the tokens.
            prop_assert!(h.has_tokens, "{p:?}");
            prop_assert_eq!((p.fetch_from, p.fetch_end, p.recompute_tokens), (0, 0, total));
        }
        MigrationAction::Split => {
            // Only from token 0, with tokens, when allowed; the legs meet on the block grid.
            prop_assert!(h.local_blocks == 0 && h.has_tokens && policy.allow_split);
            prop_assert_eq!(p.recompute_tokens, p.fetch_from * h.block_tokens);
            prop_assert!(p.fetch_from > 0 && p.fetch_from < p.fetch_end && p.fetch_end == h.source_blocks);
            prop_assert!(p.predicted_s <= remaining_s);
        }
    }
    if let PlanReason::DeadlineForcesRecompute { predicted_s, .. } = p.reason {
        prop_assert!(p.action == MigrationAction::Recompute && predicted_s > remaining_s && h.has_tokens);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Every plan is executable as stated: consistent ranges, the right rule for the holdings.
    #[test]
    fn every_plan_is_consistent(h in arb_holdings(), m in arb_measured(), policy in arb_policy(),
                                remaining in prop_oneof![Just(FOREVER), 0.0..5.0f64]) {
        match plan_migration(&h, Some(&m), &policy, remaining) {
            Ok(p) => check(&h, &policy, remaining, &p)?,
            Err(PlanError::CannotRecompute { reason }) => {
                prop_assert!(!h.has_tokens);
                // Nothing to fetch, or the egress cap forbids the fetch.
                let capped = matches!(reason, PlanReason::Model(Reason::EgressCap { .. }));
                prop_assert!(h.source_blocks <= h.local_blocks || capped, "{reason:?}");
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }

    /// A plan does not depend on the split granularity the caller passed: splits are on the
    /// block grid.
    #[test]
    fn splits_are_on_the_block_grid(h in arb_holdings(), m in arb_measured(), g in 1u64..1000) {
        let a = Policy { allow_split: true, split_granularity: g, ..Policy::default() };
        let b = Policy { split_granularity: h.block_tokens, ..a };
        prop_assert_eq!(plan_migration(&h, Some(&m), &a, FOREVER), plan_migration(&h, Some(&m), &b, FOREVER));
    }

    /// More time before the deadline never turns a fetch into a recompute.
    #[test]
    fn more_time_never_forces_a_recompute(h in arb_holdings(), m in arb_measured(), t in 0.0..2.0f64, more in 0.0..2.0f64) {
        let policy = Policy::default();
        if let (Ok(a), Ok(b)) = (plan_migration(&h, Some(&m), &policy, t), plan_migration(&h, Some(&m), &policy, t + more))
            && a.action == MigrationAction::Fetch
        {
            prop_assert_eq!(b.action, MigrationAction::Fetch);
        }
    }
}
