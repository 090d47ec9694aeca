//! A loss-tolerant congestion controller for dedicated long fat pipes (`[transfer] congestion =
//! "tolerant"`).
//!
//! A loss-based controller (CUBIC, NewReno) takes every lost packet for a full queue and cuts
//! its window. On a path that also drops packets at random — a lossy WAN segment, a policer
//! that sheds a fraction — that caps the flow at the Mathis bound, `MSS/RTT · 1.22/√p`: at
//! 0.1 % loss and 50 ms about 9 Mbit/s per window (`bench/results/bench-loss-cubic-vs-bbr.md`:
//! CUBIC carried 1 % of a lossy 1 Gbit/s link). quinn's BBR ignores random loss but leaves its
//! startup early and is marked experimental (74–84 % of the same link).
//!
//! This controller tells the two kinds of loss apart by how much is lost in a round trip.
//! Random loss at rate `p` costs a round about `p` of its packets; a full bottleneck queue drops
//! everything the window sends beyond it, which in slow start is up to half a round and in
//! congestion avoidance grows with every round the window keeps growing. The window is cut
//! (`× beta`) only when the bytes lost in the last two round trips exceed `loss_tolerance` of
//! the bytes sent and settled in them (acknowledged or lost), or when quinn declares persistent
//! congestion (every packet of a period lost: back to the minimum window, then slow start up to
//! the cut window). Below the tolerance a loss is retransmitted and the window is left alone.
//!
//! Slow start ends at the first cut or, before any loss, once the smoothed RTT has risen
//! `clamp(min_rtt/8, 4 ms, 16 ms)` above the path's minimum (HyStart++'s delay signal, RFC
//! 9406): the bottleneck's queue is filling, and one more doubling would overrun it and lose
//! up to a window — which, tolerated or not, is a window to retransmit. The daemon starts a
//! connection at the path's BDP, and beyond it slow start grows at half speed (1.5× a round
//! trip), so the window the late signal stops is within the BDP plus a queue of half a BDP.
//!
//! Growth: slow start (the window grows by what is acknowledged) up to `ssthresh`, then a
//! scalable increase of `max(1 MTU, growth · window)` per round trip, so that a window of
//! thousands of packets regains a cut in tens of round trips (Reno's one packet per round trip
//! would take thousands). Nothing grows while the sender is application-limited or on
//! acknowledgements of packets sent before the last cut.
//!
//! The tolerance is a statement about the path, set by its operator: a path whose random loss
//! exceeds it is treated as congested on every round, as CUBIC would treat it. The default,
//! 1 %, is ten times the 0.1 % of the bench's lossy profile and well below what a tail-drop
//! queue overrun loses. This is not a controller for a shared bottleneck with other traffic:
//! it keeps its rate through loss that would make TCP flows back off.
//!
//! [`Tolerant`] is the pure state machine (no clock, no I/O: every call is given `now`);
//! [`TolerantConfig`] is the quinn `ControllerFactory` and the adapter that feeds it.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::congestion::{Controller, ControllerFactory, ControllerMetrics};

/// The controller's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TolerantConfig {
    /// Window of a new connection, bytes.
    pub initial_window: u64,
    /// Fraction of the bytes settled over the last two round trips that may be lost before the
    /// loss counts as congestion (0 ≤ t < 1; 0 behaves like a loss-based controller).
    pub loss_tolerance: f64,
    /// Factor the window is cut by on congestion (0 < beta < 1).
    pub beta: f64,
    /// Relative window growth per round trip in congestion avoidance (> 0).
    pub growth: f64,
}

/// Largest window the controller grows to (4 GiB: far beyond any path's BDP).
pub const MAX_WINDOW: u64 = 4 << 30;

/// [`TolerantConfig::loss_tolerance`]'s default.
pub const DEFAULT_LOSS_TOLERANCE: f64 = 0.01;

impl Default for TolerantConfig {
    fn default() -> Self {
        Self { initial_window: 14_720, loss_tolerance: DEFAULT_LOSS_TOLERANCE, beta: 0.7, growth: 0.01 }
    }
}

impl TolerantConfig {
    /// The same parameters with out-of-range values brought into range (a NaN tolerance is
    /// none; beta into `[0.1, 0.95]`; growth into `[0.001, 1]`).
    fn sane(self) -> Self {
        let finite_or = |v: f64, d: f64| if v.is_finite() { v } else { d };
        Self {
            initial_window: self.initial_window,
            loss_tolerance: finite_or(self.loss_tolerance, 0.0).clamp(0.0, 0.5),
            beta: finite_or(self.beta, 0.7).clamp(0.1, 0.95),
            growth: finite_or(self.growth, 0.01).clamp(0.001, 1.0),
        }
    }
}

/// The RTT figures an acknowledgement carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rtt {
    /// Smoothed RTT (RFC 6298).
    pub smoothed: Duration,
    /// Smallest RTT seen on the path.
    pub min: Duration,
}

impl Rtt {
    /// True when the smoothed RTT is `clamp(min/8, 4 ms, 16 ms)` or more above the minimum.
    pub fn queueing(&self) -> bool {
        if self.min.is_zero() {
            return false;
        }
        let eta = (self.min / 8).clamp(Duration::from_millis(4), Duration::from_millis(16));
        self.smoothed >= self.min.saturating_add(eta)
    }
}

/// Bytes acknowledged and lost in one round-trip bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Round {
    acked: u64,
    lost: u64,
}

/// The controller's state (pure: the caller passes the time and the smoothed RTT).
#[derive(Debug, Clone)]
pub struct Tolerant {
    cfg: TolerantConfig,
    mtu: u64,
    window: u64,
    ssthresh: u64,
    /// Packets sent at or before this did not see the last cut: their losses cannot cut again,
    /// their acknowledgements do not grow the window.
    recovery_start: Option<Instant>,
    /// The current round's bucket, when it started, and the previous round's bucket.
    round_start: Instant,
    current: Round,
    previous: Round,
    /// Acknowledged bytes not yet turned into congestion-avoidance growth.
    avoidance_acked: u64,
    /// The smoothed RTT of the last acknowledgement (quinn passes none with a loss).
    rtt: Duration,
    /// Congestion cuts so far, losses tolerated so far (for metrics and tests).
    cuts: u64,
    tolerated: u64,
}

impl Tolerant {
    /// A fresh controller at `now` on a path of `mtu` bytes.
    pub fn new(cfg: TolerantConfig, now: Instant, mtu: u16) -> Self {
        let cfg = cfg.sane();
        let mtu = u64::from(mtu.max(1));
        Self {
            window: cfg.initial_window.max(2 * mtu),
            cfg,
            mtu,
            ssthresh: u64::MAX,
            recovery_start: None,
            round_start: now,
            current: Round::default(),
            previous: Round::default(),
            avoidance_acked: 0,
            rtt: Duration::from_millis(100),
            cuts: 0,
            tolerated: 0,
        }
    }

    /// Bytes that may be in flight.
    pub fn window(&self) -> u64 {
        self.window
    }

    /// The slow-start threshold (`u64::MAX` until the first cut).
    pub fn ssthresh(&self) -> u64 {
        self.ssthresh
    }

    /// Cuts taken and losses tolerated so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.cuts, self.tolerated)
    }

    fn minimum_window(&self) -> u64 {
        2 * self.mtu
    }

    /// Starts a new round bucket once a smoothed RTT has passed since the current one began.
    fn roll(&mut self, now: Instant) {
        let rtt = self.rtt.max(Duration::from_millis(1));
        let elapsed = now.saturating_duration_since(self.round_start);
        if elapsed >= rtt {
            // More than two rounds without an event: the older bucket is history too.
            self.previous = if elapsed >= rtt.saturating_mul(2) { Round::default() } else { self.current };
            self.current = Round::default();
            self.round_start = now;
        }
    }

    /// Lost ÷ settled over the current and the previous round since the last cut, the
    /// denominator at least one window (so that the first loss after a cut, or on a
    /// connection that has sent little, is weighed against a round trip's worth of bytes).
    pub fn loss_fraction(&self) -> f64 {
        let lost = self.current.lost.saturating_add(self.previous.lost);
        let settled =
            lost.saturating_add(self.current.acked).saturating_add(self.previous.acked).max(self.window);
        if settled == 0 { 0.0 } else { lost as f64 / settled as f64 }
    }

    fn sent_before_cut(&self, sent: Instant) -> bool {
        self.recovery_start.is_some_and(|r| sent <= r)
    }

    /// `bytes` acknowledged at `now`, of packets sent at `sent`; `rtt` the smoothed and the
    /// minimum RTT.
    pub fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool, rtt: Rtt) {
        self.rtt = rtt.smoothed;
        self.roll(now);
        self.current.acked = self.current.acked.saturating_add(bytes);
        if app_limited || self.sent_before_cut(sent) {
            return;
        }
        if self.window < self.ssthresh && rtt.queueing() {
            // The queue is building: slow start is over, without a cut.
            tracing::debug!(
                window = self.window,
                smoothed_ms = rtt.smoothed.as_secs_f64() * 1e3,
                min_ms = rtt.min.as_secs_f64() * 1e3,
                "tolerant congestion controller: RTT rising, slow start ends"
            );
            self.ssthresh = self.window;
        }
        if self.window < self.ssthresh {
            // Beyond the initial window (the path's BDP as the daemon knows it) at half speed:
            // the queue's signal comes a round trip late, and a doubling in that round trip
            // would overrun a queue of one BDP.
            let step = if self.window >= self.cfg.initial_window { bytes / 2 } else { bytes };
            self.window =
                self.window.saturating_add(step).min(self.ssthresh.max(self.window)).min(MAX_WINDOW);
            if self.window < self.ssthresh {
                return;
            }
        }
        // Congestion avoidance: a window's worth acknowledged is one round trip's growth (at
        // most one step per call: quinn acknowledges in batches far smaller than a window).
        self.avoidance_acked = self.avoidance_acked.saturating_add(bytes);
        if self.avoidance_acked >= self.window {
            self.avoidance_acked = (self.avoidance_acked - self.window).min(self.window);
            let step = ((self.window as f64 * self.cfg.growth) as u64).max(self.mtu);
            self.window = self.window.saturating_add(step).min(MAX_WINDOW);
        }
    }

    /// `lost_bytes` declared lost at `now`, the newest of them sent at `sent`; `persistent` when
    /// quinn found persistent congestion.
    pub fn on_loss(&mut self, now: Instant, sent: Instant, persistent: bool, lost_bytes: u64) {
        self.roll(now);
        if persistent {
            // Everything sent over a period was lost (a path that went dark): start again from
            // the minimum window, and slow-start back to the cut the window would have taken
            // (ending at a threshold of the minimum would leave a fat pipe crawling back at one
            // MTU a round trip).
            let threshold = ((self.window as f64 * self.cfg.beta) as u64).max(self.minimum_window());
            self.cut_to(now, self.minimum_window());
            self.ssthresh = threshold;
            return;
        }
        if self.sent_before_cut(sent) {
            // The tail of the loss that caused the last cut, detected late: it neither cuts
            // again nor counts toward the next cut.
            return;
        }
        self.current.lost = self.current.lost.saturating_add(lost_bytes);
        if lost_bytes > 0 && self.loss_fraction() <= self.cfg.loss_tolerance {
            self.tolerated += 1;
            return;
        }
        let cut = ((self.window as f64 * self.cfg.beta) as u64).max(self.minimum_window());
        tracing::debug!(
            window = self.window,
            cut,
            loss_fraction = self.loss_fraction(),
            tolerated = self.tolerated,
            "tolerant congestion controller: loss above the tolerance, window cut"
        );
        self.cut_to(now, cut);
    }

    fn cut_to(&mut self, now: Instant, window: u64) {
        // The losses that caused this cut do not count toward the next one.
        self.current = Round::default();
        self.previous = Round::default();
        self.window = window;
        self.ssthresh = window.max(self.minimum_window());
        self.recovery_start = Some(now);
        self.avoidance_acked = 0;
        self.cuts += 1;
    }

    /// The path's MTU changed.
    pub fn on_mtu(&mut self, mtu: u16) {
        self.mtu = u64::from(mtu.max(1));
        self.window = self.window.max(self.minimum_window());
    }
}

/// quinn's view of a [`Tolerant`] controller.
#[derive(Debug, Clone)]
struct Adapter(Tolerant);

impl Controller for Adapter {
    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.0.on_ack(now, sent, bytes, app_limited, Rtt { smoothed: rtt.get(), min: rtt.min() });
    }

    fn on_congestion_event(&mut self, now: Instant, sent: Instant, persistent: bool, lost_bytes: u64) {
        self.0.on_loss(now, sent, persistent, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.0.on_mtu(new_mtu);
    }

    fn window(&self) -> u64 {
        self.0.window()
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut m = ControllerMetrics::default();
        m.congestion_window = self.0.window();
        m.ssthresh = Some(self.0.ssthresh());
        m
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }

    fn initial_window(&self) -> u64 {
        self.0.cfg.initial_window
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

impl ControllerFactory for TolerantConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(Adapter(Tolerant::new(*self, now, current_mtu)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MTU: u16 = 1452;
    const RTT: Rtt = Rtt { smoothed: Duration::from_millis(50), min: Duration::from_millis(50) };

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    fn cfg(window: u64) -> TolerantConfig {
        TolerantConfig { initial_window: window, ..TolerantConfig::default() }
    }

    /// Drives `rounds` round trips of a full window each, losing `loss` of every round's bytes,
    /// and returns the controller.
    fn drive(c: &mut Tolerant, base: Instant, rounds: u64, loss: f64) {
        for r in 0..rounds {
            let now = at(base, 50 * (r + 1));
            // Acknowledged a round trip after they left, 10 ms after the last round's events.
            let sent = at(base, 50 * r + 10);
            let w = c.window();
            let lost = (w as f64 * loss) as u64;
            // Acknowledgements in ten batches, the loss declared halfway.
            for i in 0..10 {
                c.on_ack(now + Duration::from_millis(i), sent, (w - lost) / 10, false, RTT);
                if i == 5 && lost > 0 {
                    c.on_loss(now + Duration::from_millis(i), sent, false, lost);
                }
            }
        }
    }

    #[test]
    fn random_loss_below_the_tolerance_never_cuts_and_the_window_keeps_growing() {
        let base = Instant::now();
        let mut c = Tolerant::new(cfg(6_000_000), base, MTU);
        c.ssthresh = 6_000_000; // in congestion avoidance from the start
        drive(&mut c, base, 40, 0.001);
        let (cuts, tolerated) = c.counts();
        assert_eq!(cuts, 0);
        assert_eq!(tolerated, 40);
        assert!(c.window() > 6_000_000 * 13 / 10, "~1 % per round for 40 rounds: {}", c.window());
    }

    #[test]
    fn a_queue_overrun_cuts_once_per_round_trip_by_beta() {
        let base = Instant::now();
        let mut c = Tolerant::new(cfg(6_000_000), base, MTU);
        c.ssthresh = 6_000_000;
        drive(&mut c, base, 1, 0.05);
        assert_eq!(c.counts().0, 1);
        assert_eq!(c.window(), (6_000_000f64 * 0.7) as u64);
        assert_eq!(c.loss_fraction(), 0.0, "a cut starts the count afresh");
        // More losses of packets sent before the cut: no second cut.
        c.on_loss(at(base, 70), at(base, 40), false, 500_000);
        assert_eq!(c.counts().0, 1);
        // Acknowledgements of packets sent before the cut do not grow the window either.
        let w = c.window();
        c.on_ack(at(base, 71), at(base, 40), 1_000_000, false, RTT);
        assert_eq!(c.window(), w);
    }

    #[test]
    fn slow_start_overshoot_ends_slow_start() {
        let base = Instant::now();
        let mut c = Tolerant::new(cfg(64_000), base, MTU);
        drive(&mut c, base, 6, 0.0);
        let before = c.window();
        // Beyond the initial window, 1.5× a round: 1.5⁶ ≈ 11.4.
        assert!((64_000 * 11..64_000 * 12).contains(&before), "slow start: {before}");
        drive(&mut c, at(base, 300), 1, 0.3);
        assert_eq!(c.counts().0, 1);
        // Cut by beta from where slow start had taken it when the loss was declared.
        assert!(c.window() < before * 142 / 100 * 7 / 10 + 1 && c.ssthresh() == c.window());
        // In congestion avoidance now: a round grows the window by about 1 %, not 2×.
        let w = c.window();
        drive(&mut c, at(base, 400), 1, 0.0);
        assert!(c.window() <= w + w / 50 + u64::from(MTU), "{} → {}", w, c.window());
    }

    #[test]
    fn a_rising_rtt_ends_slow_start_without_a_cut() {
        let base = Instant::now();
        let mut c = Tolerant::new(cfg(1_000_000), base, MTU);
        let queued = Rtt { smoothed: Duration::from_millis(56), min: Duration::from_millis(50) };
        assert!(!queued.queueing(), "6 ms over 50: below min/8 = 6.25 ms");
        c.on_ack(at(base, 50), at(base, 1), 100_000, false, queued);
        assert_eq!(c.window(), 1_050_000, "still in slow start (at half speed beyond the initial window)");
        let queued = Rtt { smoothed: Duration::from_millis(57), min: Duration::from_millis(50) };
        c.on_ack(at(base, 51), at(base, 2), 100_000, false, queued);
        assert_eq!((c.ssthresh(), c.window(), c.counts().0), (1_050_000, 1_050_000, 0));
        // From here a round trip grows the window by about 1 %.
        c.on_ack(at(base, 100), at(base, 60), 1_050_000, false, queued);
        assert_eq!(c.window(), 1_060_500);
        // The 4 ms floor and 16 ms ceiling of the threshold.
        let ms = Duration::from_millis;
        assert!(!Rtt { smoothed: ms(4), min: ms(1) }.queueing());
        assert!(Rtt { smoothed: ms(5), min: ms(1) }.queueing());
        assert!(!Rtt { smoothed: ms(215), min: ms(200) }.queueing());
        assert!(Rtt { smoothed: ms(216), min: ms(200) }.queueing());
        assert!(!Rtt { smoothed: ms(5), min: Duration::ZERO }.queueing());
    }

    #[test]
    fn zero_tolerance_cuts_on_every_loss_like_a_loss_based_controller() {
        let base = Instant::now();
        let mut c = Tolerant::new(TolerantConfig { loss_tolerance: 0.0, ..cfg(1_000_000) }, base, MTU);
        c.ssthresh = 1_000_000;
        drive(&mut c, base, 5, 0.001);
        assert_eq!(c.counts(), (5, 0));
        assert!(c.window() < 1_000_000 / 4);
    }

    #[test]
    fn one_loss_right_after_a_cut_is_weighed_against_a_window() {
        let base = Instant::now();
        let mut c = Tolerant::new(cfg(6_000_000), base, MTU);
        c.ssthresh = 6_000_000;
        drive(&mut c, base, 1, 0.05);
        assert_eq!(c.counts().0, 1);
        // The overrun's tail, detected after the cut: not counted toward the next cut.
        c.on_loss(at(base, 110), at(base, 40), false, 200_000);
        assert_eq!((c.counts(), c.loss_fraction()), ((1, 0), 0.0));
        // Packets sent after the cut: one lost before anything is acknowledged.
        c.on_loss(at(base, 120), at(base, 100), false, 1452);
        assert_eq!(c.counts(), (1, 1), "tolerated: 1452 of a 4.2 MB window");
    }

    #[test]
    fn persistent_congestion_falls_to_the_minimum_window() {
        let base = Instant::now();
        let mut c = Tolerant::new(cfg(1_000_000), base, MTU);
        c.on_loss(at(base, 10), at(base, 5), true, 1);
        assert_eq!((c.window(), c.ssthresh()), (2 * u64::from(MTU), 700_000));
        // And slow-starts back: each acknowledged byte of a packet sent since grows the window.
        c.on_ack(at(base, 70), at(base, 20), 10_000, false, RTT);
        assert_eq!(c.window(), 2 * u64::from(MTU) + 10_000);
        // And the window never goes below it after an MTU change.
        c.on_mtu(1200);
        assert!(c.window() >= 2400);
    }

    #[test]
    fn application_limited_acknowledgements_do_not_grow_the_window() {
        let base = Instant::now();
        let mut c = Tolerant::new(cfg(100_000), base, MTU);
        c.on_ack(at(base, 50), at(base, 1), 100_000, true, RTT);
        assert_eq!(c.window(), 100_000);
    }

    #[test]
    fn old_rounds_age_out_of_the_loss_fraction() {
        let base = Instant::now();
        let mut c = Tolerant::new(TolerantConfig { loss_tolerance: 0.5, ..cfg(0) }, base, MTU);
        c.on_ack(at(base, 1), at(base, 0), 3000, true, RTT);
        c.on_loss(at(base, 2), at(base, 0), false, 2000);
        assert_eq!((c.loss_fraction(), c.counts()), (0.4, (0, 1)));
        c.on_ack(at(base, 60), at(base, 55), 3000, true, RTT);
        assert_eq!(c.loss_fraction(), 0.25, "the previous round still counts");
        c.on_ack(at(base, 200), at(base, 190), 3000, true, RTT);
        assert_eq!(c.loss_fraction(), 0.0, "two rounds later it is history");
    }

    #[test]
    fn nonsense_parameters_are_brought_into_range() {
        let base = Instant::now();
        let bad = TolerantConfig { initial_window: 0, loss_tolerance: f64::NAN, beta: 7.0, growth: -1.0 };
        let mut c = Tolerant::new(bad, base, 0);
        assert!(c.window() >= 2);
        c.on_loss(at(base, 1), at(base, 0), false, 10);
        assert!(c.window() >= 2 && c.counts().0 == 1, "no tolerance: a loss cuts");
        c.on_ack(at(base, 100), at(base, 50), u64::MAX, false, RTT);
        assert!(c.window() >= 2);
    }
}
