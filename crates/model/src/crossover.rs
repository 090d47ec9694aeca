//! Where fetching starts to win: the crossover prefix length, and the fetch-path utilization
//! above which recomputing wins despite a cheaper idle link.
//!
//! Both are closed forms. With the linear compute model the crossover is the seed's
//! `rtt / (r − t)` (r, t = recompute and transfer seconds per token; none when r ≤ t). With the
//! attention term, recompute(P) = r·P + q·P(P+1)/2 and the crossover is the positive root of
//! `q/2·P² + (r + q/2 − t)·P − rtt = 0`; it always exists, because quadratic recompute
//! eventually loses to any finite link.

use crate::compute::ComputeModel;
use crate::link::LinkModel;
use crate::queue::{QueueState, mm1_utilization_for_wait};

/// Prefix length (tokens, fractional) above which fetching beats recomputing on an idle
/// path; `None` when fetching never wins (linear model with transfer ≥ recompute per token).
pub fn crossover_tokens(bytes_per_token: f64, compute: &ComputeModel, link: &LinkModel) -> Option<f64> {
    crossover_tokens_with_load(bytes_per_token, compute, link, 0.0)
}

/// [`crossover_tokens`] where each fetched token also costs `load_s_per_token` to load into
/// the target engine's pool (a per-token cost on the fetch side, like the transfer's).
pub fn crossover_tokens_with_load(
    bytes_per_token: f64,
    compute: &ComputeModel,
    link: &LinkModel,
    load_s_per_token: f64,
) -> Option<f64> {
    let r = compute.linear_seconds_per_token();
    let t = link.seconds_per_token(bytes_per_token) + load_s_per_token.max(0.0);
    let q = compute.attention_seconds_per_pair();
    let rtt = link.rtt_s;
    if q == 0.0 {
        if r <= t {
            return None;
        }
        return Some(rtt / (r - t));
    }
    let b = r + q / 2.0 - t;
    let disc = (b * b + 2.0 * q * rtt).sqrt();
    // Two algebraically equal forms; pick the one without cancellation.
    Some(if b > 0.0 { 2.0 * rtt / (b + disc) } else { (disc - b) / q })
}

/// Utilization of the fetch path above which recomputing on the target's compute queue wins,
/// given the idle costs of both actions. `None` when recompute wins even on an idle fetch
/// path. Closed form of the seed's bisection: the fetch path may add at most
/// `W = recompute + compute_wait − fetch` of queueing, reached at `ρ = Wμ / (1 + Wμ)`.
pub fn crossover_utilization(
    fetch_s: f64,
    recompute_s: f64,
    compute_queue: &QueueState,
    fetch_service_rate: f64,
) -> Option<f64> {
    let headroom = recompute_s + compute_queue.wait_seconds() - fetch_s;
    if headroom.is_nan() || headroom <= 0.0 {
        return None;
    }
    mm1_utilization_for_wait(headroom, fetch_service_rate).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::AttentionShape;

    #[test]
    fn quadratic_root_is_a_root() {
        let a = AttentionShape { layers: 80, q_heads: 64, qk_head_dim: 128, v_head_dim: 128 };
        let c = ComputeModel::new(70e9, 989e12, 0.4, Some(a)).unwrap();
        for (gbps, rtt) in [(5.0, 0.07), (1.0, 0.15), (100.0, 0.07), (100.0, 0.0), (0.1, 0.02)] {
            let l = LinkModel::new(gbps, rtt, 1.0).unwrap();
            let p = crossover_tokens(327_680.0, &c, &l).expect("quadratic recompute always crosses");
            let rec = |x: f64| {
                c.linear_seconds_per_token() * x + c.attention_seconds_per_pair() * x * (x + 1.0) / 2.0
            };
            let fet = |x: f64| rtt + l.seconds_per_token(327_680.0) * x;
            let gap = (rec(p) - fet(p)).abs();
            assert!(gap <= 1e-9 * fet(p).max(1e-9), "gbps {gbps} rtt {rtt}: P {p} gap {gap}");
        }
    }
}
