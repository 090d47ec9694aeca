//! Fetch cost over the WAN: one round trip plus the payload at the link's goodput.
//!
//! `fetch = rtt + tokens × bytes_per_token × wire_ratio × 8 / goodput` (the seed's
//! `fetch_seconds`, with `wire_ratio` = bytes on the wire per byte in memory, so that a codec
//! — compression below 1.0, framing overhead above — enters the crossover). Goodput and RTT are
//! inputs: in the daemon they come from the live link estimator, never from constants.
//!
//! A lossy path adds a **tail** ([`FetchTail`]): a fetch shorter than the path's window of
//! data has no later packets to hide a retransmission behind, so one lost packet anywhere in it
//! costs about one more round trip. The fetch is then late with probability `1 − e^(−h·n)` for
//! its `n` packets (capped at the window's; beyond it a loss is repaired while later data
//! flows) and hazard `h` per packet, and [`LinkModel::fetch_seconds`] charges the expected
//! delay. Without a tail (every link the seed and the uncalibrated daemon build) it is 0.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, non_negative, positive};

/// Payload bytes of one QUIC datagram on a 1,500-byte path (about 94 %). Only the window cap
/// depends on it: a hazard is fitted and applied in the same packets.
pub const PACKET_PAYLOAD_BYTES: f64 = 1400.0;

/// How likely a fetch is to come in late because a packet of it was lost, and by how much.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct FetchTail {
    /// Hazard per packet, `−ln(1 − p)` for a per-packet loss probability `p` (0: no tail).
    pub hazard_per_packet: f64,
    /// Bytes beyond which a loss no longer delays the end (the path's bandwidth-delay product).
    pub window_bytes: f64,
    /// Seconds a late fetch takes beyond an on-time one (about one RTT).
    pub delay_s: f64,
}

impl FetchTail {
    /// No tail: every fetch on time.
    pub const NONE: Self = Self { hazard_per_packet: 0.0, window_bytes: 0.0, delay_s: 0.0 };

    /// Checks every field (finite, non-negative).
    pub fn validate(&self) -> Result<(), ModelError> {
        non_negative("tail.hazard_per_packet", self.hazard_per_packet)?;
        non_negative("tail.window_bytes", self.window_bytes)?;
        non_negative("tail.delay_s", self.delay_s)?;
        Ok(())
    }

    /// Packets of a fetch of `wire_bytes` that can delay its end: the request and the payload
    /// up to the window.
    pub fn packets(&self, wire_bytes: f64) -> f64 {
        packets(wire_bytes, self.window_bytes)
    }

    /// Probability that a fetch of `wire_bytes` loses a packet that delays its end (0 for
    /// nothing fetched). Non-decreasing in `wire_bytes` and in the hazard.
    pub fn late_probability(&self, wire_bytes: f64) -> f64 {
        if wire_bytes.is_nan() || wire_bytes <= 0.0 || self.hazard_per_packet <= 0.0 {
            return 0.0;
        }
        (-(-self.hazard_per_packet * self.packets(wire_bytes)).exp_m1()).clamp(0.0, 1.0)
    }

    /// Expected seconds the tail adds to a fetch of `wire_bytes`.
    pub fn expected_delay_s(&self, wire_bytes: f64) -> f64 {
        self.delay_s * self.late_probability(wire_bytes)
    }
}

/// Packets of a fetch of `wire_bytes` that can delay its end with a window of `window_bytes`:
/// the request and the payload up to the window.
pub fn packets(wire_bytes: f64, window_bytes: f64) -> f64 {
    1.0 + wire_bytes.clamp(0.0, window_bytes.max(0.0)) / PACKET_PAYLOAD_BYTES
}

/// The link between the region that holds the prefix and the region that needs it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    /// Application goodput in Gbit/s (10⁹ bit/s).
    pub goodput_gbps: f64,
    /// Round-trip time in seconds.
    pub rtt_s: f64,
    /// Bytes on the wire per byte of KV in memory (1.0 = no codec).
    pub wire_ratio: f64,
    /// The loss tail ([`FetchTail::NONE`] unless calibrated).
    #[serde(default)]
    pub tail: FetchTail,
}

impl LinkModel {
    /// Validated constructor; `wire_ratio` 1.0 reproduces the seed.
    pub fn new(goodput_gbps: f64, rtt_s: f64, wire_ratio: f64) -> Result<Self, ModelError> {
        positive("goodput_gbps", goodput_gbps)?;
        non_negative("rtt_s", rtt_s)?;
        positive("wire_ratio", wire_ratio)?;
        Ok(Self { goodput_gbps, rtt_s, wire_ratio, tail: FetchTail::NONE })
    }

    /// This link with a loss tail (validated).
    pub fn with_tail(self, tail: FetchTail) -> Result<Self, ModelError> {
        tail.validate()?;
        Ok(Self { tail, ..self })
    }

    /// Checks every field, the tail's included.
    pub fn validate(&self) -> Result<(), ModelError> {
        Self::new(self.goodput_gbps, self.rtt_s, self.wire_ratio)?;
        self.tail.validate()
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
    /// goodput, plus the tail's expected delay. Fetching nothing costs nothing (no request is
    /// sent).
    pub fn fetch_seconds(&self, tokens: u64, bytes_per_token: f64) -> f64 {
        self.fetch_branches(tokens, bytes_per_token).mean_s()
    }

    /// The two outcomes [`Self::fetch_seconds`] averages: on time, or the tail's delay late,
    /// and how likely the late one is. Fetching nothing: 0, never late.
    pub fn fetch_branches(&self, tokens: u64, bytes_per_token: f64) -> FetchBranches {
        if tokens == 0 {
            return FetchBranches::default();
        }
        let wire_bytes = self.wire_bytes(tokens, bytes_per_token);
        FetchBranches {
            on_time_s: self.rtt_s + wire_bytes * 8.0 / self.bits_per_second(),
            delay_s: self.tail.delay_s,
            late_probability: self.tail.late_probability(wire_bytes),
        }
    }
}

/// A fetch's two outcomes on a path with a tail ([`LinkModel::fetch_branches`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FetchBranches {
    /// Seconds when no packet that could delay the end is lost.
    pub on_time_s: f64,
    /// Extra seconds when one is.
    pub delay_s: f64,
    /// Probability of the late outcome.
    pub late_probability: f64,
}

impl FetchBranches {
    /// Seconds of the late outcome (`on_time_s` where the fetch cannot be late).
    pub fn late_s(&self) -> f64 {
        if self.late_probability > 0.0 { self.on_time_s + self.delay_s } else { self.on_time_s }
    }

    /// The expected seconds: the on-time outcome plus the expected delay.
    pub fn mean_s(&self) -> f64 {
        self.on_time_s + self.delay_s * self.late_probability
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
    fn a_tail_charges_its_expected_delay_and_stops_at_the_window() {
        let bare = LinkModel::new(1.0, 0.05, 1.0).unwrap();
        let p = 0.001_f64;
        let tail = FetchTail { hazard_per_packet: -(1.0 - p).ln(), window_bytes: 6.25e6, delay_s: 0.05 };
        let lossy = bare.with_tail(tail).unwrap();
        assert_eq!(lossy.fetch_seconds(0, 65_536.0), 0.0);
        // 64 tokens of 64 KiB: ~3,000 packets, late with probability 1 − 0.999^n.
        let bytes = 64.0 * 65_536.0;
        let n = 1.0 + bytes / PACKET_PAYLOAD_BYTES;
        let q = 1.0 - (1.0 - p).powf(n);
        assert!((tail.late_probability(bytes) - q).abs() < 1e-12);
        let extra = lossy.fetch_seconds(64, 65_536.0) - bare.fetch_seconds(64, 65_536.0);
        assert!((extra - 0.05 * q).abs() < 1e-12, "{extra}");
        // Beyond the window the chance no longer grows; the expected delay is bounded by one.
        assert_eq!(tail.late_probability(1e9), tail.late_probability(6.25e6));
        assert!(tail.expected_delay_s(1e12) <= tail.delay_s);
        let mut last = 0.0;
        for tokens in [1_u64, 2, 16, 64, 256, 4096, 1 << 20] {
            let t = lossy.fetch_seconds(tokens, 65_536.0);
            assert!(t >= last && t >= bare.fetch_seconds(tokens, 65_536.0));
            last = t;
        }
        assert_eq!(FetchTail::NONE.expected_delay_s(1e9), 0.0);
        assert!(bare.with_tail(FetchTail { delay_s: f64::NAN, ..tail }).is_err());
        assert!(bare.with_tail(FetchTail { hazard_per_packet: -1.0, ..tail }).is_err());
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
