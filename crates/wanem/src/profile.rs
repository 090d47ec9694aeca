//! Link profiles: what one direction of the emulated path does to packets, plus named presets.
//!
//! # Conventions
//!
//! * A profile describes **one direction**. [`PathProfile`] pairs the A→B and B→A directions.
//! * In preset names and in the `rtt=` key, the time is the **round-trip time**: `100mbit-20ms`
//!   means RTT 20 ms, i.e. a one-way delay of 10 ms in each direction.
//! * Rates count **IP bytes** (the TUN device sees IP packets; no Ethernet framing), so TCP
//!   goodput through a 100 Mbit/s link is about 1448/1500 of it (~96.5 Mbit/s).
//! * The bottleneck queue holds `queue_bdps × rate × RTT` bytes, where RTT is twice this
//!   direction's one-way delay (a symmetric path is assumed), and never less than
//!   [`MIN_QUEUE_BYTES`]; a packet that does not fit is dropped (tail drop).
//! * Loss, reordering and jitter are applied independently per packet and per direction; a
//!   preset's loss (`-loss0.1` = 0.1 %) applies to each direction.

use std::fmt;
use std::time::Duration;

use crate::error::{Result, WanemError};

/// The smallest bottleneck queue, whatever the BDP: 64 KiB (about 43 full-size packets).
pub const MIN_QUEUE_BYTES: u64 = 64 * 1024;

/// What one direction of the emulated link does to packets.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkProfile {
    /// Bottleneck rate in bits per second of IP packets; `None` is unlimited (no queue).
    pub rate_bps: Option<u64>,
    /// Fixed one-way propagation delay.
    pub one_way_delay: Duration,
    /// Extra per-packet delay drawn uniformly from `[0, jitter]`. Jitter never reorders:
    /// a packet is not delivered before the one sent ahead of it.
    pub jitter: Duration,
    /// Probability in `[0, 1]` that a packet is lost (dropped before the queue).
    pub loss: f64,
    /// Probability in `[0, 1]` that a packet is held back by [`Self::reorder_extra`] so that
    /// the packets behind it overtake it.
    pub reorder: f64,
    /// How long a reordered packet is held back beyond its normal delivery time.
    pub reorder_extra: Duration,
    /// Bottleneck queue size in bandwidth-delay products (see the module doc).
    pub queue_bdps: f64,
}

impl Default for LinkProfile {
    fn default() -> Self {
        Self::clean()
    }
}

impl LinkProfile {
    /// A link that forwards everything at once: no delay, rate limit, loss or reordering.
    pub fn clean() -> Self {
        Self {
            rate_bps: None,
            one_way_delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            reorder: 0.0,
            reorder_extra: Duration::from_millis(1),
            queue_bdps: 1.0,
        }
    }

    /// A rate-limited link with the given round-trip time (one-way delay = `rtt / 2`).
    pub fn with_rtt(rate_bps: u64, rtt: Duration) -> Self {
        Self { rate_bps: Some(rate_bps), one_way_delay: rtt / 2, ..Self::clean() }
    }

    /// The bottleneck queue limit in bytes (`u64::MAX` when there is no rate limit).
    pub fn queue_limit_bytes(&self) -> u64 {
        let Some(rate) = self.rate_bps else { return u64::MAX };
        let rtt = 2.0 * self.one_way_delay.as_secs_f64();
        let bdp = rate as f64 / 8.0 * rtt;
        ((self.queue_bdps * bdp) as u64).max(MIN_QUEUE_BYTES)
    }

    /// Checks ranges; called by the emulator before it starts.
    pub fn validate(&self) -> Result<()> {
        let prob = |name: &str, p: f64| {
            if (0.0..=1.0).contains(&p) {
                Ok(())
            } else {
                Err(WanemError::Profile(format!("{name} {p} is outside [0, 1]")))
            }
        };
        prob("loss", self.loss)?;
        prob("reorder", self.reorder)?;
        if self.rate_bps == Some(0) {
            return Err(WanemError::Profile("rate 0: use None for unlimited".into()));
        }
        if !(self.queue_bdps.is_finite() && self.queue_bdps >= 0.0) {
            return Err(WanemError::Profile(format!("queue_bdps {}", self.queue_bdps)));
        }
        Ok(())
    }
}

/// Both directions of an emulated path.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PathProfile {
    /// Applied to packets from namespace A to namespace B.
    pub ab: LinkProfile,
    /// Applied to packets from namespace B to namespace A.
    pub ba: LinkProfile,
}

/// The named presets, for `--profile` and the bench (RTT in the name).
pub const PRESETS: &[&str] =
    &["clean", "100mbit-20ms", "100mbit-100ms", "1gbit-50ms", "1gbit-150ms", "1gbit-50ms-loss0.1"];

impl PathProfile {
    /// The same profile in both directions.
    pub fn symmetric(link: LinkProfile) -> Self {
        Self { ab: link.clone(), ba: link }
    }

    /// A named preset from [`PRESETS`].
    pub fn preset(name: &str) -> Option<Self> {
        let ms = Duration::from_millis;
        let link = match name {
            "clean" => LinkProfile::clean(),
            "100mbit-20ms" => LinkProfile::with_rtt(100_000_000, ms(20)),
            "100mbit-100ms" => LinkProfile::with_rtt(100_000_000, ms(100)),
            "1gbit-50ms" => LinkProfile::with_rtt(1_000_000_000, ms(50)),
            "1gbit-150ms" => LinkProfile::with_rtt(1_000_000_000, ms(150)),
            "1gbit-50ms-loss0.1" => {
                LinkProfile { loss: 0.001, ..LinkProfile::with_rtt(1_000_000_000, ms(50)) }
            }
            _ => return None,
        };
        Some(Self::symmetric(link))
    }

    /// Parses a preset name, or a comma-separated `key=value` list applied to both directions:
    /// `rate=1gbit,rtt=50ms,jitter=1ms,loss=0.1%,reorder=0.5%,reorder_extra=2ms,queue=1`
    /// (`delay=` sets the one-way delay instead of `rtt=`; `rate=0` or `rate=inf` is
    /// unlimited). A preset name may lead the list and be overridden: `1gbit-50ms,loss=1%`.
    pub fn parse(spec: &str) -> Result<Self> {
        let mut link = LinkProfile::clean();
        for (i, item) in spec.split(',').map(str::trim).filter(|s| !s.is_empty()).enumerate() {
            let Some((key, value)) = item.split_once('=') else {
                match (i, Self::preset(item)) {
                    (0, Some(p)) => {
                        link = p.ab;
                        continue;
                    }
                    (_, Some(_)) => {
                        return Err(WanemError::Profile(format!(
                            "preset {item:?} after the first item of {spec:?}: a preset may only lead a \
                             profile (separate profiles with ';')"
                        )));
                    }
                    _ => {
                        return Err(WanemError::Profile(format!(
                            "unknown preset {item:?} (known: {})",
                            PRESETS.join(", ")
                        )));
                    }
                }
            };
            let bad = |what: &str| WanemError::Profile(format!("{key}={value}: {what}"));
            match key.trim() {
                "rate" => link.rate_bps = parse_rate(value).ok_or_else(|| bad("bad rate"))?,
                "rtt" => link.one_way_delay = parse_duration(value).ok_or_else(|| bad("time"))? / 2,
                "delay" => link.one_way_delay = parse_duration(value).ok_or_else(|| bad("time"))?,
                "jitter" => link.jitter = parse_duration(value).ok_or_else(|| bad("time"))?,
                "loss" => link.loss = parse_prob(value).ok_or_else(|| bad("probability"))?,
                "reorder" => link.reorder = parse_prob(value).ok_or_else(|| bad("probability"))?,
                "reorder_extra" => {
                    link.reorder_extra = parse_duration(value).ok_or_else(|| bad("time"))?;
                }
                "queue" => link.queue_bdps = value.trim().parse().map_err(|_| bad("number"))?,
                _ => return Err(bad("unknown key")),
            }
        }
        link.validate()?;
        Ok(Self::symmetric(link))
    }
}

impl fmt::Display for LinkProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rate_bps {
            Some(r) => write!(f, "rate {:.1} Mbit/s", r as f64 / 1e6)?,
            None => write!(f, "rate unlimited")?,
        }
        write!(
            f,
            ", one-way {:.3} ms, jitter {:.3} ms, loss {}%, reorder {}%, queue {} BDP",
            self.one_way_delay.as_secs_f64() * 1e3,
            self.jitter.as_secs_f64() * 1e3,
            self.loss * 100.0,
            self.reorder * 100.0,
            self.queue_bdps
        )
    }
}

/// `100mbit`, `1gbit`, `1.5gbit`, `500kbit`, `12000000` (bit/s); `0`/`inf` → unlimited.
fn parse_rate(s: &str) -> Option<Option<u64>> {
    let s = s.trim().to_ascii_lowercase();
    if s == "0" || s == "inf" || s == "unlimited" {
        return Some(None);
    }
    let (num, mult) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
        .iter()
        .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n, *m)))
        .unwrap_or((s.as_str(), 1.0));
    let v: f64 = num.trim().parse().ok()?;
    (v.is_finite() && v > 0.0).then_some(Some((v * mult) as u64))
}

/// `10ms`, `1.5ms`, `250us`, `2s`, `0`.
fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, mult) = [("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9), ("s", 1.0)]
        .iter()
        .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n, *m)))
        .unwrap_or((s, 1.0));
    let v: f64 = num.trim().parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| Duration::from_secs_f64(v * mult))
}

/// `1%` or `0.01`.
fn parse_prob(s: &str) -> Option<f64> {
    let s = s.trim();
    let v = match s.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().ok()? / 100.0,
        None => s.parse().ok()?,
    };
    (0.0..=1.0).contains(&v).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_use_rtt_convention() {
        for name in PRESETS {
            assert!(PathProfile::preset(name).is_some(), "{name}");
        }
        let p = PathProfile::preset("100mbit-20ms").unwrap();
        assert_eq!(p.ab.one_way_delay, Duration::from_millis(10));
        assert_eq!(p.ab.rate_bps, Some(100_000_000));
        // 1 BDP = 100e6 / 8 * 0.020 = 250 kB.
        assert_eq!(p.ab.queue_limit_bytes(), 250_000);
        let l = PathProfile::preset("1gbit-50ms-loss0.1").unwrap();
        assert_eq!(l.ba.loss, 0.001);
        assert_eq!(PathProfile::preset("clean").unwrap().ab.queue_limit_bytes(), u64::MAX);
    }

    #[test]
    fn parse_specs() {
        let p = PathProfile::parse("rate=1gbit,rtt=50ms,loss=0.1%,jitter=500us,queue=2").unwrap();
        assert_eq!(p.ab.rate_bps, Some(1_000_000_000));
        assert_eq!(p.ab.one_way_delay, Duration::from_millis(25));
        assert_eq!(p.ab.jitter, Duration::from_micros(500));
        assert!((p.ab.loss - 0.001).abs() < 1e-12);
        assert_eq!(p.ab.queue_limit_bytes(), 12_500_000);
        let q = PathProfile::parse("1gbit-150ms,loss=1%").unwrap();
        assert_eq!(q.ab.one_way_delay, Duration::from_millis(75));
        assert_eq!(q.ab.loss, 0.01);
        assert_eq!(PathProfile::parse("rate=inf,delay=5ms").unwrap().ab.rate_bps, None);
        assert!(PathProfile::parse("loss=2").is_err());
        assert!(PathProfile::parse("nope").is_err());
        assert!(PathProfile::parse("rate=1gbit,color=red").is_err());
        assert!(PathProfile::parse("rate=-3mbit").is_err());
        // A comma list of presets (profiles are `;`-separated) says so, not "unknown preset".
        let e = PathProfile::parse("100mbit-20ms,1gbit-50ms").unwrap_err().to_string();
        assert!(e.contains("may only lead") && e.contains("';'"), "{e}");
    }

    #[test]
    fn small_bdp_gets_queue_floor() {
        let p = LinkProfile::with_rtt(10_000_000, Duration::from_millis(1));
        assert_eq!(p.queue_limit_bytes(), MIN_QUEUE_BYTES);
    }
}
