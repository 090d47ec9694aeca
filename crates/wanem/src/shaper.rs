//! The link model, sans-IO: given a packet's arrival time and size, decide whether it is
//! lost, tail-dropped at the bottleneck queue, or delivered at some later instant.
//!
//! Order of effects per packet (one direction): random loss → bottleneck (a FIFO served at
//! `rate_bps`, holding at most the profile's queue limit in bytes, tail drop) → one-way delay
//! plus jitter (never reordering) → optional hold-back (reordering).
//!
//! The bottleneck is modelled exactly rather than with a polled token bucket: the link is
//! busy until `busy_until`; a packet arriving at `t` starts serialising at
//! `max(t, busy_until)` and leaves `len * 8 / rate` later. The bytes queued at `t` are
//! `(busy_until - t) * rate / 8`. This is a token bucket with a one-packet burst, fed by a
//! byte-bounded tail-drop queue, without a timer per token.

use std::time::{Duration, Instant};

use crate::profile::LinkProfile;
use crate::rng::Rng;

/// What happens to one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Dropped by random loss.
    Lost,
    /// Dropped because the bottleneck queue was full (tail drop).
    QueueFull,
    /// Delivered at this instant, in order with the packets before it.
    Deliver(Instant),
    /// Delivered at this instant, held back so that later packets may overtake it.
    DeliverReordered(Instant),
}

/// One direction's link state.
#[derive(Debug)]
pub struct Shaper {
    profile: LinkProfile,
    queue_limit: u64,
    rng: Rng,
    /// When the bottleneck finishes sending what it already holds.
    busy_until: Option<Instant>,
    /// The latest in-order delivery time handed out (delivery never goes before it).
    floor: Option<Instant>,
}

impl Shaper {
    /// A shaper for `profile`, drawing randomness from `seed`.
    pub fn new(profile: LinkProfile, seed: u64) -> Self {
        let queue_limit = profile.queue_limit_bytes();
        Self { profile, queue_limit, rng: Rng::new(seed), busy_until: None, floor: None }
    }

    /// The profile this shaper applies.
    pub fn profile(&self) -> &LinkProfile {
        &self.profile
    }

    /// Bytes waiting for (or being serialised onto) the bottleneck at `now`.
    pub fn queued_bytes(&self, now: Instant) -> u64 {
        match (self.profile.rate_bps, self.busy_until) {
            (Some(rate), Some(busy)) if busy > now => {
                let ns = (busy - now).as_nanos();
                (ns * u128::from(rate) / 8 / 1_000_000_000) as u64
            }
            _ => 0,
        }
    }

    /// Decides the fate of a `len`-byte packet that arrived at `now`.
    pub fn on_packet(&mut self, now: Instant, len: usize) -> Verdict {
        if self.rng.chance(self.profile.loss) {
            return Verdict::Lost;
        }
        let left_bottleneck = match self.profile.rate_bps {
            None => now,
            Some(rate) => {
                if self.queued_bytes(now) + len as u64 > self.queue_limit {
                    return Verdict::QueueFull;
                }
                let start = self.busy_until.map_or(now, |b| b.max(now));
                let tx_ns = (len as u128 * 8 * 1_000_000_000).div_ceil(u128::from(rate));
                let done = start + Duration::from_nanos(tx_ns as u64);
                self.busy_until = Some(done);
                done
            }
        };
        let mut at = left_bottleneck + self.profile.one_way_delay;
        if !self.profile.jitter.is_zero() {
            at += self.profile.jitter.mul_f64(self.rng.next_f64());
        }
        if let Some(floor) = self.floor {
            at = at.max(floor);
        }
        if self.rng.chance(self.profile.reorder) {
            return Verdict::DeliverReordered(at + self.profile.reorder_extra);
        }
        self.floor = Some(at);
        Verdict::Deliver(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deliver_time(v: Verdict) -> Instant {
        match v {
            Verdict::Deliver(t) | Verdict::DeliverReordered(t) => t,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn delay_only() {
        let p = LinkProfile { one_way_delay: Duration::from_millis(10), ..LinkProfile::clean() };
        let mut s = Shaper::new(p, 1);
        let t0 = Instant::now();
        assert_eq!(s.on_packet(t0, 1500), Verdict::Deliver(t0 + Duration::from_millis(10)));
        assert_eq!(s.queued_bytes(t0), 0);
    }

    #[test]
    fn rate_serialises_and_tail_drops() {
        // 12 Mbit/s: a 1500-byte packet takes exactly 1 ms. Queue floor 64 KiB.
        let p = LinkProfile { rate_bps: Some(12_000_000), ..LinkProfile::clean() };
        let mut s = Shaper::new(p, 1);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(deliver_time(s.on_packet(t0, 1500)), t0 + ms(1));
        assert_eq!(deliver_time(s.on_packet(t0, 1500)), t0 + ms(2));
        assert_eq!(s.queued_bytes(t0), 3000);
        // Fill to the 65536-byte limit: 43 packets fit (64500 bytes), the 44th does not.
        let mut accepted = 2;
        while let Verdict::Deliver(_) = s.on_packet(t0, 1500) {
            accepted += 1;
        }
        assert_eq!(accepted, 43);
        // After the link has drained for a while, packets fit again.
        assert!(matches!(s.on_packet(t0 + ms(10), 1500), Verdict::Deliver(_)));
        // An idle link starts at arrival time.
        let later = t0 + Duration::from_secs(1);
        assert_eq!(deliver_time(s.on_packet(later, 1500)), later + ms(1));
    }

    #[test]
    fn long_run_rate_is_exact() {
        let p = LinkProfile { rate_bps: Some(100_000_000), ..LinkProfile::clean() };
        let mut s = Shaper::new(p, 1);
        let t0 = Instant::now();
        let mut last = t0;
        for i in 0..10_000u32 {
            // Offer 200 Mbit/s: a 1500-byte packet every 60 µs.
            let now = t0 + Duration::from_micros(60) * i;
            if let Verdict::Deliver(t) = s.on_packet(now, 1500) {
                last = t;
            }
        }
        // Everything accepted drains at 100 Mbit/s; the queue (64 KiB) sheds the rest.
        let secs = (last - t0).as_secs_f64();
        assert!((secs - 0.6).abs() < 0.01, "{secs}");
    }

    #[test]
    fn jitter_never_reorders_and_reorder_does() {
        let p = LinkProfile {
            one_way_delay: Duration::from_millis(5),
            jitter: Duration::from_millis(2),
            reorder: 0.1,
            ..LinkProfile::clean()
        };
        let mut s = Shaper::new(p, 9);
        let t0 = Instant::now();
        let (mut prev, mut reordered) = (t0, 0);
        for i in 0..10_000u32 {
            match s.on_packet(t0 + Duration::from_micros(10) * i, 100) {
                Verdict::Deliver(t) => {
                    assert!(t >= prev);
                    prev = t;
                }
                Verdict::DeliverReordered(_) => reordered += 1,
                v => panic!("{v:?}"),
            }
        }
        assert!((800..1200).contains(&reordered), "{reordered}");
    }

    #[test]
    fn loss_rate() {
        let p = LinkProfile { loss: 0.05, ..LinkProfile::clean() };
        let mut s = Shaper::new(p, 3);
        let t0 = Instant::now();
        let lost = (0..20_000).filter(|_| s.on_packet(t0, 100) == Verdict::Lost).count();
        // n p = 1000, sd ~ 30.8.
        assert!((850..1150).contains(&lost), "{lost}");
    }
}
