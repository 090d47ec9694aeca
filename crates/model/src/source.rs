//! Choosing the source among several regions that hold a prefix: each holder is priced by how
//! soon the prefix would be ready here if fetched from it — its link's RTT and goodput (live
//! estimates, passed in), slowed by its serving load, plus the recompute of whatever it does not
//! hold — and the holders are ranked by that. Pure: the daemon passes the figures it measured.
//!
//! `ready = rtt + bytes(held beyond what is local) × 8 / (goodput × (1 − u)) + recompute(rest)`,
//! with `u` the holder's fetch-path utilization (its staging in use, from its answer to the
//! query) capped at 0.99, and the recompute linear in blocks (`recompute_s_per_block`: the
//! engine's measured linear term; the ranking needs an order, not the final plan, which
//! [`crate::plan_migration`] makes for the chosen source). A holder with no usable link
//! (goodput not positive, a figure not finite) is priced at infinity and ranked last.

use crate::link::{FetchTail, LinkModel};

/// One region's answer to "what do you hold of this prefix", with its link figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HolderOffer {
    /// Leading blocks of the prefix it holds.
    pub blocks_held: u64,
    /// Live RTT to it, seconds.
    pub rtt_s: f64,
    /// Goodput from it, bits/s (measured, or the configured expectation until measured).
    pub goodput_bps: f64,
    /// Its fetch-path utilization in [0, 1].
    pub fetch_utilization: f64,
}

/// What the prefix costs to finish, the same for every holder.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SourcePricing {
    /// Blocks in the prefix.
    pub blocks_total: u64,
    /// Leading blocks already ready here.
    pub local_blocks: u64,
    /// KV bytes of one block.
    pub bytes_per_block: f64,
    /// Seconds to recompute one block here.
    pub recompute_s_per_block: f64,
}

/// Predicted seconds until the prefix is ready when fetched from `o` (see the module doc).
pub fn ready_seconds(o: &HolderOffer, p: &SourcePricing) -> f64 {
    let held = o.blocks_held.min(p.blocks_total);
    let fetched = held.saturating_sub(p.local_blocks);
    let rest = p.blocks_total - held.max(p.local_blocks).min(p.blocks_total);
    let recompute = rest as f64 * p.recompute_s_per_block.max(0.0);
    if fetched == 0 {
        return recompute;
    }
    let u = if o.fetch_utilization.is_finite() { o.fetch_utilization.clamp(0.0, 0.99) } else { 0.0 };
    let goodput = o.goodput_bps * (1.0 - u);
    if !(goodput.is_finite() && goodput > 0.0 && o.rtt_s.is_finite() && o.rtt_s >= 0.0) {
        return f64::INFINITY;
    }
    let link =
        LinkModel { goodput_gbps: goodput / 1e9, rtt_s: o.rtt_s, wire_ratio: 1.0, tail: FetchTail::NONE };
    link.fetch_seconds(fetched, p.bytes_per_block) + recompute
}

/// Indices into `offers`, best source first: the soonest [`ready_seconds`]; ties go to the
/// holder of more blocks, then to the earlier offer (callers list holders in a fixed order,
/// so the choice is deterministic). Offers holding nothing beyond what is local are left out.
pub fn rank_sources(offers: &[HolderOffer], p: &SourcePricing) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..offers.len()).filter(|&i| offers[i].blocks_held > p.local_blocks).collect();
    let t: Vec<f64> = offers.iter().map(|o| ready_seconds(o, p)).collect();
    idx.sort_by(|&a, &b| {
        t[a].total_cmp(&t[b]).then(offers[b].blocks_held.cmp(&offers[a].blocks_held)).then(a.cmp(&b))
    });
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: SourcePricing = SourcePricing {
        blocks_total: 100,
        local_blocks: 0,
        bytes_per_block: 1e6,
        recompute_s_per_block: 0.01,
    };

    fn offer(blocks: u64, rtt_ms: f64, gbps: f64) -> HolderOffer {
        HolderOffer {
            blocks_held: blocks,
            rtt_s: rtt_ms / 1e3,
            goodput_bps: gbps * 1e9,
            fetch_utilization: 0.0,
        }
    }

    #[test]
    fn the_faster_link_wins_between_equal_holders() {
        // 100 MB: 10 Gbit/s × 80 ms = 0.16 s vs 1 Gbit/s × 20 ms = 0.82 s.
        let far_fat = offer(100, 80.0, 10.0);
        let near_thin = offer(100, 20.0, 1.0);
        assert!((ready_seconds(&far_fat, &P) - 0.16).abs() < 1e-9);
        assert!((ready_seconds(&near_thin, &P) - 0.82).abs() < 1e-9);
        assert_eq!(rank_sources(&[near_thin, far_fat], &P), vec![1, 0]);
    }

    #[test]
    fn a_small_prefix_goes_to_the_shorter_round_trip() {
        let p = SourcePricing { blocks_total: 1, ..P };
        assert_eq!(rank_sources(&[offer(1, 80.0, 10.0), offer(1, 20.0, 1.0)], &p), vec![1, 0]);
    }

    #[test]
    fn holding_less_costs_the_recompute_of_the_rest() {
        // 60 of 100 blocks over the fast link: 0.048 + 0.02 + 40 × 0.01 = 0.468 s, worse than all
        // 100 over a 2 Gbit/s link (0.42 s).
        let partial = offer(60, 20.0, 10.0);
        let whole = offer(100, 20.0, 2.0);
        assert!((ready_seconds(&partial, &P) - 0.468).abs() < 1e-9);
        assert_eq!(rank_sources(&[partial, whole], &P), vec![1, 0]);
    }

    #[test]
    fn a_loaded_holder_is_slower() {
        let idle = offer(100, 20.0, 5.0);
        let busy = HolderOffer { fetch_utilization: 0.9, ..offer(100, 20.0, 10.0) };
        // 10 Gbit/s at 90 % load leaves 1 Gbit/s.
        assert_eq!(rank_sources(&[busy, idle], &P), vec![1, 0]);
    }

    #[test]
    fn ties_go_to_more_blocks_then_to_order_and_useless_offers_are_left_out() {
        let p = SourcePricing { recompute_s_per_block: 0.0, local_blocks: 10, ..P };
        let a = offer(50, 20.0, 1.0);
        let b = offer(50, 20.0, 1.0);
        let nothing_new = offer(10, 1.0, 100.0);
        assert_eq!(rank_sources(&[a, nothing_new, b], &p), vec![0, 2]);
        let broken = HolderOffer { goodput_bps: f64::NAN, ..a };
        assert_eq!(ready_seconds(&broken, &p), f64::INFINITY);
        assert_eq!(rank_sources(&[broken, b], &p), vec![1, 0]);
    }
}
