//! A small, seedable pseudo-random generator (SplitMix64) for loss, jitter and reordering.
//!
//! Statistical quality is ample for Bernoulli trials and uniform jitter; it is not meant for
//! anything cryptographic. Seeding is explicit so a run can be replayed.

/// SplitMix64 (Steele, Lea, Flood 2014): one 64-bit state, one add and a mix per draw.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A seed from the clock and the process id, for runs that need not be reproducible.
    pub fn entropy_seed() -> u64 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut r = Rng::new(nanos ^ (u64::from(std::process::id()) << 32));
        r.next_u64()
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw from `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// True with probability `p` (`p <= 0` never, `p >= 1` always).
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.next_f64() < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chance_matches_probability() {
        let mut r = Rng::new(7);
        let n = 200_000;
        let hits = (0..n).filter(|_| r.chance(0.01)).count() as f64;
        // Binomial sd = sqrt(n p (1-p)) ~ 44.5; allow 5 sd.
        assert!((hits - 2000.0).abs() < 225.0, "hits {hits}");
        let mean: f64 = (0..n).map(|_| r.next_f64()).sum::<f64>() / f64::from(n);
        assert!((mean - 0.5).abs() < 0.01);
    }

    #[test]
    fn extremes() {
        let mut r = Rng::new(1);
        assert!((0..1000).all(|_| !r.chance(0.0)));
        assert!((0..1000).all(|_| r.chance(1.0)));
    }
}
