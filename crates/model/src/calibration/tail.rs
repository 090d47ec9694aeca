//! The loss tail of one peer's fetches: how likely a fetch is to come in about a round trip
//! late, learnt from which of its recent fetches did.
//!
//! On a path that loses packets at random, a fetch shorter than the path's window of data has
//! no later packets to hide a retransmission behind: a loss anywhere in it costs about one
//! more RTT, and its time is two-valued, not spread in proportion to its size
//! (`bench/results/lossy-small-fetches-2026-12-06/`: at 0.1 % loss, 57–100 % of 16–64-token
//! fetches came in 0.9–1.2 RTTs late, as `1 − (1 − p)^packets` predicts). A Gaussian fit of
//! the time follows the last few coin flips instead; this module learns the coin.
//!
//! Each short fetch (its on-time prediction within [`SHORT_RTTS`] RTTs, where a round trip
//! stands out of the noise) is one event. At every update each event's extra over the
//! caller's current on-time line ([`OnTime`]), in RTTs, is recomputed, and the extras are split
//! in two (weighted 1-D two-means). The tail is **on** only where they form two modes the way
//! a loss does: the upper one at least [`MIN_GAP_RTTS`] and at most [`MAX_GAP_RTTS`] above
//! the lower, narrow (sd within [`MAX_LATE_SPREAD_RTTS`]), each of a few events' weight, and
//! at least [`MIN_ON_TIME_FRACTION`] of the weight on time. A line that is off by a fixed cost (one
//! mode), a link that slows down (extras spread in proportion to size) or rare outliers
//! (beyond the gap) leave it off, and the caller's fit follows them as before.
//!
//! With the tail on, an event is late when it is closer to the upper mode; the hazard per
//! packet `h` is the maximum-likelihood fit of `P(late) = 1 − e^(−h·n)` over the events'
//! packets `n`, each weighed `forgettingⁱ` by age (the log-likelihood is concave in `h`;
//! solved by bisection on its derivative), and the delay is the gap between the modes,
//! shrunk toward one RTT. A path that loses nothing has no tail, so its predictions are the
//! plain fit's.
//!
//! Owns: the events and the fit. Must not: read clocks, or fit the on-time line (the caller's
//! [`FetchCalibration`](super::FetchCalibration) does, from samples this module has said how
//! to correct).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Fetches whose on-time prediction is within this many RTTs are events (a round trip stands
/// out of a 10 % relative noise); longer ones are charged the tail's expectation only.
pub const SHORT_RTTS: f64 = 4.0;
/// Below this RTT (a loopback path) no tail is learnt or charged.
pub const MIN_RTT_S: f64 = 1e-3;
/// The least gap between the two modes, RTTs: a loss's late branch sits about a round trip
/// above the on-time one; noise around one mode splits it far less.
pub const MIN_GAP_RTTS: f64 = 0.6;
/// The largest gap, RTTs: a loss costs about one RTT (two for two in a row); a wider gap is
/// outliers the caller's robust fit bounds.
pub const MAX_GAP_RTTS: f64 = 2.5;
/// The late mode's largest sd, RTTs: lost packets delay by about the same round trip whatever
/// the size; a slower link spreads the excess in proportion to size.
pub const MAX_LATE_SPREAD_RTTS: f64 = 0.35;
/// The least forgetting-weighted fraction of on-time events (a lower mode of one event long
/// forgotten is no mode). Not more: a path where 95 % of short fetches lose a packet still
/// has its two modes, and switching the tail off would leave the on-time line alone to
/// price them.
pub const MIN_ON_TIME_FRACTION: f64 = 0.01;
/// Events kept.
const WINDOW: usize = 128;
/// The fewest events, and the least weight in each mode, before two modes are believed (two
/// fetches a round trip apart are as likely noise).
const MIN_EVENTS: usize = 8;
const MIN_MODE_WEIGHT: f64 = 1.0;
/// Weight ratio between consecutive events: an effective memory of ~65 fetches, slower than
/// the time fit's (a loss rate is a property of the path; each event is one coin flip).
const FORGETTING: f64 = 0.97;
/// The delay's prior, in RTTs, and how many late events it is worth.
const PRIOR_DELAY_RTTS: f64 = 1.0;
const PRIOR_DELAY_WEIGHT: f64 = 1.0;
/// The hazard's search range, per packet (`1 − e^(−50)`: certain loss).
const MAX_HAZARD: f64 = 50.0;
const MIN_HAZARD: f64 = 1e-12;

/// The caller's on-time line, which every event's extra is measured against.
pub trait OnTime {
    /// Expected seconds of an on-time fetch of `bytes` at RTT `rtt_s`.
    fn seconds(&self, bytes: f64, rtt_s: f64) -> f64;
    /// The path's window at RTT `rtt_s`, bytes (the packets that can delay a fetch's end).
    fn window_bytes(&self, rtt_s: f64) -> f64;
}

/// One short fetch as measured.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TailEvent {
    bytes: f64,
    rtt_s: f64,
    seconds: f64,
}

/// What the window says now.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TailState {
    hazard: f64,
    delay_rtts: f64,
    late_fraction: f64,
    /// Extras above this (RTTs over the line) are late; +∞ while the tail is off.
    threshold_rtts: f64,
    /// Where the on-time mode sits above the caller's line, RTTs (0 while the tail is off).
    on_time_rtts: f64,
}

impl TailState {
    const OFF: Self = Self {
        hazard: 0.0,
        delay_rtts: PRIOR_DELAY_RTTS,
        late_fraction: 0.0,
        threshold_rtts: f64::INFINITY,
        on_time_rtts: 0.0,
    };
}

/// The learnt tail of one peer's fetches.
#[derive(Debug, Clone, PartialEq)]
pub struct TailCalibration {
    events: VecDeque<TailEvent>,
    state: TailState,
}

impl Default for TailCalibration {
    fn default() -> Self {
        Self::new()
    }
}

/// The tail's figures, as `GetLinks` exports them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TailEstimate {
    /// Hazard per packet (`−ln(1 − p)`, ≈ the per-packet loss probability `p` when small);
    /// 0 while the tail is off.
    pub hazard_per_packet: f64,
    /// Seconds a late fetch takes beyond an on-time one, in RTTs.
    pub delay_rtts: f64,
    /// Short fetches in the window.
    pub events: u64,
    /// Their forgetting-weighted fraction that came in late (0 while the tail is off).
    pub late_fraction: f64,
}

impl TailCalibration {
    /// No events: no tail.
    pub fn new() -> Self {
        Self { events: VecDeque::new(), state: TailState::OFF }
    }

    /// Learns from one short fetch of `bytes` at RTT `rtt_s` that took `seconds`, against the
    /// caller's on-time `line` as it stands. Returns how many RTTs to take off the sample
    /// before the caller fits it: the delay when it is late and the tail is on, else `None`.
    /// Non-finite or non-positive inputs are ignored (`None`).
    pub fn observe(&mut self, bytes: f64, rtt_s: f64, seconds: f64, line: &impl OnTime) -> Option<f64> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(ok(bytes) && rtt_s.is_finite() && rtt_s >= MIN_RTT_S && ok(seconds) && seconds > 0.0) {
            return None;
        }
        while self.events.len() >= WINDOW {
            self.events.pop_front();
        }
        self.events.push_back(TailEvent { bytes, rtt_s, seconds });
        self.refit(line);
        let extra = (seconds - line.seconds(bytes, rtt_s)) / rtt_s;
        (extra > self.state.threshold_rtts).then_some(self.state.delay_rtts)
    }

    /// Re-measures every event against `line` (the caller's fit moved) and refits.
    pub fn refit(&mut self, line: &impl OnTime) {
        let mut ev: Vec<(f64, f64, f64)> = self
            .weighted()
            .map(|(e, w)| {
                let extra = (e.seconds - line.seconds(e.bytes, e.rtt_s)) / e.rtt_s;
                (extra, crate::link::packets(e.bytes, line.window_bytes(e.rtt_s)), w)
            })
            .collect();
        self.state = fit_state(&mut ev, self.state.hazard > 0.0);
    }

    /// Hazard per packet (0 while the tail is off).
    pub fn hazard_per_packet(&self) -> f64 {
        self.state.hazard
    }

    /// Where the on-time mode sits above the caller's line, RTTs: about 0 once the line has
    /// learnt from the corrected samples, about −1 RTT just after the tail came on over a line
    /// that had absorbed the late ones. A prediction adds it, so the tail's expectation is
    /// never counted on top of a line that already holds it. 0 while the tail is off.
    pub fn on_time_rtts(&self) -> f64 {
        self.state.on_time_rtts
    }

    /// Extra of a late fetch, in RTTs (1 until the tail is on).
    pub fn delay_rtts(&self) -> f64 {
        self.state.delay_rtts
    }

    /// The figures.
    pub fn estimate(&self) -> TailEstimate {
        TailEstimate {
            hazard_per_packet: self.state.hazard,
            delay_rtts: self.state.delay_rtts,
            events: self.events.len() as u64,
            late_fraction: self.state.late_fraction,
        }
    }

    /// Events, newest first, with their forgetting weights.
    fn weighted(&self) -> impl Iterator<Item = (&TailEvent, f64)> {
        self.events.iter().rev().scan(1.0, |w, e| {
            let out = (e, *w);
            *w *= FORGETTING;
            Some(out)
        })
    }
}

/// The tail from events `(extra RTTs, packets, weight)`: the two modes, whether they are a
/// loss's, and if so the hazard and the delay. Sorts `ev` by extra. A tail that `was_on`
/// stays on without the least weight per mode (hysteresis: the on-time line was fitted with
/// the late samples taken down, so switching off on a run of late coin flips would price
/// them at the on-time time); the modes' shape must still hold.
fn fit_state(ev: &mut [(f64, f64, f64)], was_on: bool) -> TailState {
    if ev.len() < MIN_EVENTS && !was_on {
        return TailState::OFF;
    }
    ev.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Weighted two-means in one dimension: the split maximizing the between-class variance.
    let (total_w, total_we) = ev.iter().fold((0.0, 0.0), |(w, we), &(e, _, x)| (w + x, we + x * e));
    let (mut best, mut split) = (-1.0, 0);
    let (mut w_lo, mut we_lo) = (0.0, 0.0);
    for (i, &(e, _, w)) in ev.iter().enumerate().take(ev.len() - 1) {
        w_lo += w;
        we_lo += w * e;
        let w_hi = total_w - w_lo;
        if w_hi <= 0.0 || ev[i + 1].0 <= e {
            continue;
        }
        let gap = (total_we - we_lo) / w_hi - we_lo / w_lo;
        let score = w_lo * w_hi * gap * gap;
        if score > best {
            (best, split) = (score, i + 1);
        }
    }
    if split == 0 {
        return TailState::OFF;
    }
    let (lo, hi) = ev.split_at(split);
    let sums = |s: &[(f64, f64, f64)]| s.iter().fold((0.0, 0.0), |(w, we), &(e, _, x)| (w + x, we + x * e));
    let ((w_lo, we_lo), (w_hi, we_hi)) = (sums(lo), sums(hi));
    let (m_lo, m_hi) = (we_lo / w_lo, we_hi / w_hi);
    let var_hi = hi.iter().map(|&(e, _, w)| w * (e - m_hi).powi(2)).sum::<f64>() / w_hi;
    let gap = m_hi - m_lo;
    let two_modes = (MIN_GAP_RTTS..=MAX_GAP_RTTS).contains(&gap)
        && var_hi.sqrt() <= MAX_LATE_SPREAD_RTTS
        && (was_on || w_lo.min(w_hi) >= MIN_MODE_WEIGHT)
        && w_lo / total_w >= MIN_ON_TIME_FRACTION;
    if !two_modes {
        return TailState::OFF;
    }
    let threshold_rtts = 0.5 * (m_lo + m_hi);
    TailState {
        hazard: max_likelihood_hazard(lo, hi),
        delay_rtts: (PRIOR_DELAY_RTTS * PRIOR_DELAY_WEIGHT + gap * w_hi) / (PRIOR_DELAY_WEIGHT + w_hi),
        late_fraction: w_hi / total_w,
        threshold_rtts,
        on_time_rtts: m_lo,
    }
}

/// Derivative of the weighted log-likelihood in the hazard `h`, with one on-time pseudo event
/// of one packet (so a window of late events only still has a finite answer):
/// `Σ w·n/(e^(h·n) − 1)` over late events `− Σ w·n` over on-time ones. Strictly decreasing.
fn score(on_time: &[(f64, f64, f64)], late: &[(f64, f64, f64)], h: f64) -> f64 {
    let up: f64 = late.iter().map(|&(_, n, w)| w * n / (h * n).exp_m1()).sum();
    let down: f64 = on_time.iter().map(|&(_, n, w)| w * n).sum();
    up - down - 1.0
}

/// The root of [`score`], by bisection in `ln h`.
fn max_likelihood_hazard(on_time: &[(f64, f64, f64)], late: &[(f64, f64, f64)]) -> f64 {
    let f = |h: f64| score(on_time, late, h);
    if f(MIN_HAZARD) <= 0.0 {
        return MIN_HAZARD;
    }
    if f(MAX_HAZARD) >= 0.0 {
        return MAX_HAZARD;
    }
    let (mut lo, mut hi) = (MIN_HAZARD.ln(), MAX_HAZARD.ln());
    for _ in 0..80 {
        let mid = 0.5 * (lo + hi);
        if f(mid.exp()) > 0.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (0.5 * (lo + hi)).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic coin (64-bit LCG), so the test is reproducible.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// One RTT plus the payload at 1 Gbit/s.
    struct Line;
    impl OnTime for Line {
        fn seconds(&self, bytes: f64, rtt_s: f64) -> f64 {
            rtt_s + bytes * 8e-9
        }
        fn window_bytes(&self, rtt_s: f64) -> f64 {
            rtt_s / 8e-9
        }
    }

    const RTT: f64 = 0.05;
    const SIZES: [f64; 5] = [1e6, 2e6, 3e6, 4e6, 6e6];

    /// Feeds `n` fetches whose time is the line times `1 + 2 %` noise plus `extra(i, bytes)`.
    fn feed(t: &mut TailCalibration, rng: &mut Lcg, n: usize, extra: impl Fn(usize, f64, f64) -> f64) {
        for i in 0..n {
            let bytes = SIZES[i % SIZES.len()];
            let noise = 1.0 + 0.02 * (rng.next() - 0.5) * 3.4;
            t.observe(bytes, RTT, Line.seconds(bytes, RTT) * noise + extra(i, bytes, rng.next()), &Line);
        }
    }

    #[test]
    fn noise_alone_is_no_tail() {
        let mut t = TailCalibration::new();
        feed(&mut t, &mut Lcg(1), 200, |_, _, _| 0.0);
        assert_eq!(
            t.estimate(),
            TailEstimate { hazard_per_packet: 0.0, delay_rtts: 1.0, events: 128, late_fraction: 0.0 }
        );
        // Broken inputs are ignored.
        let before = t.clone();
        for (b, r, s) in [
            (f64::NAN, RTT, 0.1),
            (1e6, 0.0, 0.1),
            (1e6, RTT, f64::INFINITY),
            (-1.0, RTT, 0.1),
            (1e6, RTT, 0.0),
        ] {
            assert_eq!(t.observe(b, r, s, &Line), None);
        }
        assert_eq!(t, before);
    }

    #[test]
    fn the_hazard_recovers_a_random_loss_rate() {
        for (p, seed) in [(0.001_f64, 1_u64), (0.001, 7), (0.0003, 3), (0.002, 5)] {
            let h = -(1.0 - p).ln();
            let mut t = TailCalibration::new();
            let mut rng = Lcg(seed);
            let mut fits = Vec::new();
            for round in 0..40 {
                feed(&mut t, &mut rng, 10, |_, bytes, u| {
                    let n = crate::link::packets(bytes, Line.window_bytes(RTT));
                    if u < 1.0 - (-h * n).exp() { RTT * 1.05 } else { 0.0 }
                });
                if round >= 10 {
                    fits.push(t.hazard_per_packet());
                }
            }
            fits.sort_by(f64::total_cmp);
            let median = fits[fits.len() / 2];
            assert!((median / h - 1.0).abs() < 0.35, "p {p}: median fit {median} vs {h}");
            assert!((t.delay_rtts() - 1.05).abs() < 0.1, "{}", t.delay_rtts());
        }
    }

    #[test]
    fn a_late_fetch_is_taken_down_by_the_delay() {
        let mut t = TailCalibration::new();
        let mut rng = Lcg(9);
        feed(&mut t, &mut rng, 60, |i, _, _| if i % 3 == 0 { 0.9 * RTT } else { 0.0 });
        let d = t.delay_rtts();
        assert!((d - 0.9).abs() < 0.05, "{d}");
        assert_eq!(t.observe(2e6, RTT, Line.seconds(2e6, RTT) + 0.9 * RTT, &Line), Some(t.delay_rtts()));
        assert_eq!(t.observe(2e6, RTT, Line.seconds(2e6, RTT), &Line), None);
        assert!((t.estimate().late_fraction - 0.33).abs() < 0.05, "{:?}", t.estimate());
    }

    #[test]
    fn lateness_that_is_not_a_loss_is_no_tail() {
        // A line off by a fixed cost: one mode (at half an RTT, or a whole one).
        for off in [0.5, 1.0] {
            let mut t = TailCalibration::new();
            feed(&mut t, &mut Lcg(2), 100, |_, _, _| off * RTT);
            assert_eq!(t.hazard_per_packet(), 0.0, "{off}");
        }
        // A link that slows to a quarter: the excess grows with size, it is not one RTT.
        let mut t = TailCalibration::new();
        feed(&mut t, &mut Lcg(3), 40, |_, _, _| 0.0);
        feed(&mut t, &mut Lcg(4), 30, |_, bytes, _| 3.0 * bytes * 8e-9);
        assert_eq!(t.hazard_per_packet(), 0.0);
        // Rare outliers three times as slow: beyond a loss's gap.
        let mut t = TailCalibration::new();
        feed(
            &mut t,
            &mut Lcg(5),
            200,
            |i, bytes, _| if i % 20 == 7 { 2.0 * Line.seconds(bytes, RTT) } else { 0.0 },
        );
        assert_eq!(t.hazard_per_packet(), 0.0);
        // Every fetch late but a few: lateness with too few on time is a fixed cost.
        let mut t = TailCalibration::new();
        feed(&mut t, &mut Lcg(6), 200, |i, _, _| if i % 50 == 0 { 0.0 } else { RTT });
        assert_eq!(t.hazard_per_packet(), 0.0);
    }

    #[test]
    fn more_late_events_mean_a_higher_hazard() {
        let mut t = TailCalibration::new();
        feed(&mut t, &mut Lcg(8), 40, |i, _, _| if i % 8 == 0 { RTT } else { 0.0 });
        let mut last = t.hazard_per_packet();
        assert!(last > 0.0);
        for k in 0..10 {
            feed(&mut t, &mut Lcg(100 + k), 1, |_, _, _| RTT);
            let h = t.hazard_per_packet();
            assert!(h >= last, "{h} < {last}");
            last = h;
        }
    }
}
