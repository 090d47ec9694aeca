//! The prefill cost profile: `seconds(c, n) = a·n + b·(n·c + n(n+1)/2)` for computing `n`
//! new tokens after `c` cached ones (`a`: per-token linear work — projections, MLP; `b`: per
//! attended (query, key) pair). Fitting (relative least squares on measured points, both
//! coefficients kept non-negative), prediction, and the EWMA refresh from served prefills.
//! The measuring loop itself lives on the engine (`Engine::measure_profile`); the crate's
//! only clock is [`Stopwatch`] (wall or thread CPU time), so everything else here is pure and
//! testable.

use std::time::Instant;

/// Attended (query, key) pairs when computing `n` tokens after `c` cached ones (causal):
/// `n·c + n(n+1)/2`.
pub fn attention_pairs(context: usize, tokens: usize) -> f64 {
    let (c, n) = (context as f64, tokens as f64);
    n * c + n * (n + 1.0) / 2.0
}

/// One measured prefill: `tokens` new tokens after `context` cached ones took `seconds`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProfilePoint {
    /// Tokens already in the cache.
    pub context: usize,
    /// Tokens computed.
    pub tokens: usize,
    /// Wall time (median of repeats when calibrating).
    pub seconds: f64,
}

/// Weighted normal-equation sums of the 2-feature least squares (weights `1/y²`, i.e. the
/// fit minimises relative error), averaged over points.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums {
    s11: f64,
    s12: f64,
    s22: f64,
    s1y: f64,
    s2y: f64,
}

impl Sums {
    /// One point's contribution with weight `1 / w_ref²`, where `w_ref` is the reference
    /// model's prediction for the point (or the measured time when there is no reference).
    /// Weighting by a fixed reference (not by the observation) keeps the fit linear in the
    /// times: if every time doubles, the fitted coefficients double.
    fn of(p: &ProfilePoint, reference: Option<(f64, f64)>) -> Option<Sums> {
        if p.tokens == 0 || !(p.seconds > 0.0 && p.seconds.is_finite()) {
            return None;
        }
        let (f1, f2, y) = (p.tokens as f64, attention_pairs(p.context, p.tokens), p.seconds);
        let scale = match reference {
            Some((a, b)) if a * f1 + b * f2 > 0.0 => a * f1 + b * f2,
            _ => y,
        };
        let w = 1.0 / (scale * scale);
        Some(Sums { s11: w * f1 * f1, s12: w * f1 * f2, s22: w * f2 * f2, s1y: w * f1 * y, s2y: w * f2 * y })
    }

    fn mean(points: &[ProfilePoint], reference: Option<(f64, f64)>) -> Option<Sums> {
        let usable: Vec<Sums> = points.iter().filter_map(|p| Sums::of(p, reference)).collect();
        if usable.is_empty() {
            return None;
        }
        let k = 1.0 / usable.len() as f64;
        Some(usable.iter().fold(Sums::default(), |acc, s| acc.scaled_add(1.0, *s, k)))
    }

    fn scaled_add(self, k: f64, o: Sums, ko: f64) -> Sums {
        Sums {
            s11: k * self.s11 + ko * o.s11,
            s12: k * self.s12 + ko * o.s12,
            s22: k * self.s22 + ko * o.s22,
            s1y: k * self.s1y + ko * o.s1y,
            s2y: k * self.s2y + ko * o.s2y,
        }
    }

    /// `(a, b) >= 0` minimising the weighted squared error.
    fn solve(&self) -> Option<(f64, f64)> {
        let det = self.s11 * self.s22 - self.s12 * self.s12;
        if det > 1e-9 * self.s11 * self.s22 {
            let a = (self.s1y * self.s22 - self.s2y * self.s12) / det;
            let b = (self.s11 * self.s2y - self.s12 * self.s1y) / det;
            if a >= 0.0 && b >= 0.0 {
                return Some((a, b));
            }
        }
        // Boundary solutions: the better of b = 0 and a = 0.
        let only_a = (self.s11 > 0.0).then(|| (self.s1y / self.s11, 0.0));
        let only_b = (self.s22 > 0.0).then(|| (0.0, self.s2y / self.s22));
        let err = |(a, b): (f64, f64)| {
            // Σw(y - a f1 - b f2)² up to the constant Σw y².
            a * a * self.s11 + b * b * self.s22 + 2.0 * a * b * self.s12
                - 2.0 * a * self.s1y
                - 2.0 * b * self.s2y
        };
        match (only_a, only_b) {
            (Some(x), Some(y)) => Some(if err(x) <= err(y) { x } else { y }),
            (x, y) => x.or(y),
        }
    }
}

/// Weight of one served prefill in the EWMA refresh.
pub const EWMA_ALPHA: f64 = 0.1;
/// Share of the calibration sums that is always kept as a prior, so a stream of same-shaped
/// prefills cannot make the fit singular.
pub const CALIBRATION_PRIOR: f64 = 0.05;

/// A measured prefill cost model, as the engine reports it when it registers.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillProfile {
    /// Seconds per computed token (linear term).
    pub a_linear_s_per_token: f64,
    /// Seconds per attended (query, key) pair (attention term).
    pub b_attention_s_per_pair: f64,
    /// The calibration points the fit started from.
    pub points: Vec<ProfilePoint>,
    /// Served prefills folded in since calibration.
    pub observations: u64,
    reference: (f64, f64),
    calibration: Sums,
    ewma: Sums,
}

impl PrefillProfile {
    /// Fits the model to `points`; `None` when no point is usable (zero tokens or non-positive
    /// time).
    pub fn fit(points: Vec<ProfilePoint>) -> Option<Self> {
        // Relative least squares (weights 1/y²), then the sums re-expressed with the fitted
        // model as the fixed weight reference for later observations.
        let (a0, b0) = Sums::mean(&points, None)?.solve()?;
        let reference = (a0, b0);
        let calibration = Sums::mean(&points, Some(reference))?;
        let (a, b) = calibration.solve()?;
        Some(PrefillProfile {
            a_linear_s_per_token: a,
            b_attention_s_per_pair: b,
            points,
            observations: 0,
            reference,
            calibration,
            ewma: calibration,
        })
    }

    /// Predicted seconds to compute `tokens` new tokens after `context` cached ones.
    pub fn predict(&self, context: usize, tokens: usize) -> f64 {
        self.a_linear_s_per_token * tokens as f64
            + self.b_attention_s_per_pair * attention_pairs(context, tokens)
    }

    /// Predicted marginal cost of one more token at context `context`.
    pub fn per_token_at(&self, context: usize) -> f64 {
        self.predict(context, 1)
    }

    /// Folds a served prefill into the fit (EWMA of the normal equations, with the
    /// calibration kept as a prior). Unusable observations are ignored.
    pub fn observe(&mut self, context: usize, tokens: usize, seconds: f64) {
        let Some(s) = Sums::of(&ProfilePoint { context, tokens, seconds }, Some(self.reference)) else {
            return;
        };
        self.ewma = self.ewma.scaled_add(1.0 - EWMA_ALPHA, s, EWMA_ALPHA);
        self.observations += 1;
        let blended = self.ewma.scaled_add(1.0, self.calibration, CALIBRATION_PRIOR);
        if let Some((a, b)) = blended.solve() {
            self.a_linear_s_per_token = a;
            self.b_attention_s_per_pair = b;
        }
    }
}

/// How `Engine::measure_profile` calibrates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileOptions {
    /// Context lengths to measure at.
    pub contexts: Vec<usize>,
    /// Tokens computed per measured chunk.
    pub chunk: usize,
    /// Timed repeats per context (the median is kept).
    pub repeats: usize,
    /// Clock to measure with (also used for served prefills afterwards).
    pub clock: ProfileClock,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        ProfileOptions {
            contexts: vec![0, 256, 512, 1024],
            chunk: 64,
            repeats: 3,
            clock: ProfileClock::default(),
        }
    }
}

/// Which clock a profile is measured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProfileClock {
    /// Wall time: what a caller waits, including time the thread was not scheduled.
    Wall,
    /// CPU time of the calling thread (Linux/Unix `CLOCK_THREAD_CPUTIME_ID`; wall time
    /// elsewhere): the compute cost itself, immune to other processes competing for the
    /// cores. The default, because this engine computes on the CPU it may share.
    #[default]
    ThreadCpu,
}

/// The crate's one clock.
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch {
    clock: ProfileClock,
    wall: Instant,
    cpu: Option<f64>,
}

impl Stopwatch {
    /// Starts now.
    pub fn start(clock: ProfileClock) -> Self {
        let cpu = match clock {
            ProfileClock::ThreadCpu => thread_cpu_seconds(),
            ProfileClock::Wall => None,
        };
        Stopwatch { clock, wall: Instant::now(), cpu }
    }

    /// Seconds since start on the chosen clock (wall time if the CPU clock is unavailable).
    pub fn seconds(&self) -> f64 {
        match (self.clock, self.cpu, thread_cpu_seconds()) {
            (ProfileClock::ThreadCpu, Some(t0), Some(t1)) => t1 - t0,
            _ => self.wall.elapsed().as_secs_f64(),
        }
    }
}

/// CPU time consumed by the calling thread, in seconds.
#[cfg(unix)]
fn thread_cpu_seconds() -> Option<f64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec that outlives the call; clock_gettime writes
    // only into it and has no other preconditions.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}

#[cfg(not(unix))]
fn thread_cpu_seconds() -> Option<f64> {
    None
}

/// Median of a non-empty slice (mean of the middle two for even lengths).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 { v[m] } else { (v[m - 1] + v[m]) / 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synth(a: f64, b: f64) -> Vec<ProfilePoint> {
        [0, 256, 512, 1024]
            .iter()
            .map(|&c| ProfilePoint { context: c, tokens: 64, seconds: a * 64.0 + b * attention_pairs(c, 64) })
            .collect()
    }

    #[test]
    fn fit_recovers_exact_coefficients() {
        let p = PrefillProfile::fit(synth(2e-5, 3e-8)).unwrap();
        assert!((p.a_linear_s_per_token / 2e-5 - 1.0).abs() < 1e-9);
        assert!((p.b_attention_s_per_pair / 3e-8 - 1.0).abs() < 1e-9);
        assert!(p.per_token_at(1024) > p.per_token_at(0));
        let want = 2e-5 * 700.0 + 3e-8 * attention_pairs(100, 700);
        assert!((p.predict(100, 700) / want - 1.0).abs() < 1e-9);
    }

    #[test]
    fn fit_clamps_to_non_negative() {
        // Cost falling with context would need b < 0: clamp to b = 0.
        let pts = vec![
            ProfilePoint { context: 0, tokens: 64, seconds: 2.0 },
            ProfilePoint { context: 1024, tokens: 64, seconds: 1.0 },
        ];
        let p = PrefillProfile::fit(pts).unwrap();
        assert_eq!(p.b_attention_s_per_pair, 0.0);
        assert!(p.a_linear_s_per_token > 0.0);
        assert!(PrefillProfile::fit(vec![ProfilePoint { context: 0, tokens: 0, seconds: 1.0 }]).is_none());
    }

    #[test]
    fn observe_tracks_a_slowdown() {
        let mut p = PrefillProfile::fit(synth(2e-5, 3e-8)).unwrap();
        let before = p.predict(512, 64);
        for _ in 0..60 {
            for c in [0, 512, 1024] {
                p.observe(c, 64, 2.0 * (2e-5 * 64.0 + 3e-8 * attention_pairs(c, 64)));
            }
        }
        let ratio = p.predict(512, 64) / before;
        assert!(ratio > 1.9 && ratio <= 2.0, "ratio {ratio}");
        assert_eq!(p.observations, 180);
        p.observe(0, 0, 1.0);
        p.observe(0, 5, f64::NAN);
        assert_eq!(p.observations, 180);
    }

    #[test]
    fn thread_cpu_clock_counts_work_not_sleep() {
        let w = Stopwatch::start(ProfileClock::ThreadCpu);
        std::thread::sleep(std::time::Duration::from_millis(30));
        let mut x = 0u64;
        for i in 0..200_000u64 {
            x = std::hint::black_box(x.wrapping_add(i));
        }
        assert!(w.seconds() < 0.025, "sleep was counted: {}", w.seconds());
        assert!(w.seconds() > 0.0);
        assert!(Stopwatch::start(ProfileClock::Wall).seconds() >= 0.0);
    }

    #[test]
    fn median_works() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
