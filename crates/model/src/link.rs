//! Fetch cost over the WAN: one round trip plus the payload at the link's goodput.
//!
//! `fetch = rtt + tokens × bytes_per_token × wire_ratio × 8 / goodput` (the seed's
//! `fetch_seconds`, with `wire_ratio` = bytes on the wire per byte in memory, so that a codec
//! — compression below 1.0, framing overhead above — enters the crossover). Goodput and RTT are
//! inputs: in the daemon they come from the live link estimator, never from constants.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, non_negative, positive};

/// The link between the region that holds the prefix and the region that needs it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    /// Application goodput in Gbit/s (10⁹ bit/s).
    pub goodput_gbps: f64,
    /// Round-trip time in seconds.
    pub rtt_s: f64,
    /// Bytes on the wire per byte of KV in memory (1.0 = no codec).
    pub wire_ratio: f64,
}

impl LinkModel {
    /// Validated constructor; `wire_ratio` 1.0 reproduces the seed.
    pub fn new(goodput_gbps: f64, rtt_s: f64, wire_ratio: f64) -> Result<Self, ModelError> {
        positive("goodput_gbps", goodput_gbps)?;
        non_negative("rtt_s", rtt_s)?;
        positive("wire_ratio", wire_ratio)?;
        Ok(Self { goodput_gbps, rtt_s, wire_ratio })
    }

    /// Goodput in bits per second.
    pub fn bits_per_second(&self) -> f64 {
        self.goodput_gbps * 1e9
    }

    /// Bytes that cross the WAN for `tokens` tokens.
    pub fn wire_bytes(&self, tokens: u64, bytes_per_token: f64) -> f64 {
        tokens as f64 * bytes_per_token * self.wire_ratio
    }

    /// Seconds per token of payload (the seed's `transfer_per_token`).
    pub fn seconds_per_token(&self, bytes_per_token: f64) -> f64 {
        bytes_per_token * self.wire_ratio * 8.0 / self.bits_per_second()
    }

    /// Seconds to fetch `tokens` tokens: one RTT (request → first byte) plus serialization at
    /// goodput. Fetching nothing costs nothing (no request is sent).
    pub fn fetch_seconds(&self, tokens: u64, bytes_per_token: f64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let payload_bits = tokens as f64 * bytes_per_token * self.wire_ratio * 8.0;
        self.rtt_s + payload_bits / self.bits_per_second()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_fetch_times() {
        let l = LinkModel::new(100.0, 0.070, 1.0).unwrap();
        assert_eq!(format!("{:.2}", l.fetch_seconds(1000, 327_680.0) * 1e3), "96.21");
        assert_eq!(format!("{:.2}", l.fetch_seconds(8000, 327_680.0) * 1e3), "279.72");
        assert_eq!(format!("{:.2}", l.seconds_per_token(327_680.0) * 1e6), "26.21");
        let weak = LinkModel::new(5.0, 0.070, 1.0).unwrap();
        assert_eq!(format!("{:.2}", weak.seconds_per_token(327_680.0) * 1e6), "524.29");
    }

    #[test]
    fn a_codec_scales_the_payload_not_the_rtt() {
        let plain = LinkModel::new(10.0, 0.05, 1.0).unwrap();
        let half = LinkModel::new(10.0, 0.05, 0.5).unwrap();
        let p = plain.fetch_seconds(4096, 1e5) - 0.05;
        let h = half.fetch_seconds(4096, 1e5) - 0.05;
        assert!((p - 2.0 * h).abs() < 1e-12);
        assert_eq!(half.wire_bytes(10, 100.0), 500.0);
        assert_eq!(plain.fetch_seconds(0, 1e5), 0.0);
    }

    #[test]
    fn invalid_links_are_named() {
        assert!(matches!(
            LinkModel::new(0.0, 0.0, 1.0),
            Err(ModelError::NotPositive { field: "goodput_gbps", .. })
        ));
        assert!(matches!(LinkModel::new(1.0, -1.0, 1.0), Err(ModelError::Negative { field: "rtt_s", .. })));
        assert!(matches!(
            LinkModel::new(1.0, 0.0, f64::INFINITY),
            Err(ModelError::NotFinite { field: "wire_ratio", .. })
        ));
    }
}
