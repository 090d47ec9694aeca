//! Queueing delay on the fetch path and on the target's compute pool (M/M/1).
//!
//! `Wq = ρ / (μ (1 − ρ))`: the expected time in queue, excluding own service, of a
//! memoryless single-server queue at utilization ρ and service rate μ (the seed's
//! `mm1_wait_seconds`; Kleinrock, Queueing Systems Vol. 1, §3.2). It inverts in closed form:
//! `ρ = W μ / (1 + W μ)`, which is how the crossover utilization is computed here instead of
//! the seed's bisection.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, non_negative, positive, utilization};

/// Load on one resource: its utilization and how fast it drains.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QueueState {
    /// Utilization ρ in [0, 1).
    pub utilization: f64,
    /// Service rate μ in requests per second.
    pub service_rate: f64,
}

impl QueueState {
    /// Validated constructor.
    pub fn new(utilization_: f64, service_rate: f64) -> Result<Self, ModelError> {
        utilization("utilization", utilization_)?;
        positive("service_rate", service_rate)?;
        Ok(Self { utilization: utilization_, service_rate })
    }

    /// Expected wait before service starts.
    pub fn wait_seconds(&self) -> f64 {
        wait_unchecked(self.utilization, self.service_rate)
    }
}

/// Expected M/M/1 queueing wait, validated: ρ in [0, 1), μ > 0.
pub fn mm1_wait_seconds(rho: f64, service_rate: f64) -> Result<f64, ModelError> {
    utilization("utilization", rho)?;
    positive("service_rate", service_rate)?;
    Ok(wait_unchecked(rho, service_rate))
}

fn wait_unchecked(rho: f64, mu: f64) -> f64 {
    if rho == 0.0 {
        return 0.0;
    }
    rho / (mu * (1.0 - rho))
}

/// The utilization at which the expected wait equals `wait_s` (the inverse of
/// [`mm1_wait_seconds`]): `ρ = W μ / (1 + W μ)`. Always in [0, 1).
pub fn mm1_utilization_for_wait(wait_s: f64, service_rate: f64) -> Result<f64, ModelError> {
    non_negative("wait_seconds", wait_s)?;
    positive("service_rate", service_rate)?;
    let wm = wait_s * service_rate;
    Ok(wm / (1.0 + wm))
}

/// The seed's composite route latency: KV cost plus the queueing wait on the path it uses.
pub fn route_total_latency(kv_cost_s: f64, rho: f64, service_rate: f64) -> Result<f64, ModelError> {
    Ok(kv_cost_s + mm1_wait_seconds(rho, service_rate)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_assertions_on_the_wait() {
        let mu = 20.0;
        let waits: Vec<f64> =
            [0.0, 0.5, 0.8, 0.95, 0.99].iter().map(|&r| mm1_wait_seconds(r, mu).unwrap()).collect();
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert_eq!(mm1_wait_seconds(0.0, mu).unwrap(), 0.0);
        assert!(mm1_wait_seconds(0.99, mu).unwrap() > mm1_wait_seconds(0.5, mu).unwrap() * 5.0);
    }

    #[test]
    fn the_seed_rejects_what_we_reject() {
        // The seed asserts 0 <= rho < 1.
        for bad in [-0.1, 1.0, 1.5, f64::NAN] {
            assert!(mm1_wait_seconds(bad, 20.0).is_err(), "{bad}");
        }
        assert!(matches!(
            mm1_wait_seconds(0.5, 0.0),
            Err(ModelError::NotPositive { field: "service_rate", .. })
        ));
        assert!(route_total_latency(1.0, 1.0, 20.0).is_err());
    }

    #[test]
    fn inverse_round_trips() {
        for rho in [0.0, 1e-9, 0.1, 0.5, 0.7255, 0.99, 0.999_999] {
            let w = mm1_wait_seconds(rho, 20.0).unwrap();
            let back = mm1_utilization_for_wait(w, 20.0).unwrap();
            assert!((back - rho).abs() < 1e-9, "{rho} -> {w} -> {back}");
        }
    }
}
