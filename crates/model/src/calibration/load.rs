//! The target engine's load of fetched blocks: what a fetch costs after its last byte lands.
//!
//! A recompute writes the engine's pool as it prefills; a fetch's blocks land in the daemon's
//! landing zone and the engine copies them into its pool at its next step (`Engine.Load`). That
//! copy is part of what a fetch costs before the engine can decode: the bench measured 0.07–0.16
//! s for a 64 MiB load after 0.65–0.75 s fetches at 1 Gbit/s (10–20 %), so a decision that
//! leaves it out favours fetching near the crossover. [`LoadCalibration`] learns its rate per
//! engine from the loads the daemon serves: the median seconds per byte of the last
//! [`LOAD_WINDOW`] loads of at least [`MIN_LOAD_BYTES`] (a small load is mostly the call's fixed
//! cost; the median ignores the odd load into pages the engine had never touched, which on this
//! project's VM costs ~10× a warm one).
//!
//! Pure: the daemon measures, this module keeps the window and answers.

use std::collections::VecDeque;

use super::{CalibrationError, sample_seconds};

/// Loads the estimate is the median of.
pub const LOAD_WINDOW: usize = 8;
/// Smallest load that is a sample (1 MiB).
pub const MIN_LOAD_BYTES: u64 = 1 << 20;

/// One engine's load rate.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadCalibration {
    /// Seconds per byte of the last loads, oldest first.
    window: VecDeque<f64>,
    /// The window's median, kept by `observe` (the decision path reads it without allocating).
    median: Option<f64>,
    samples: u64,
}

impl LoadCalibration {
    /// No sample yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds in a load of `bytes` that took `seconds`. A load below [`MIN_LOAD_BYTES`] is
    /// ignored (`Ok(false)`); a non-finite, non-positive or implausible duration is refused and
    /// leaves the state unchanged.
    pub fn observe(&mut self, bytes: u64, seconds: f64) -> Result<bool, CalibrationError> {
        let seconds = sample_seconds("load seconds", seconds)?;
        if bytes < MIN_LOAD_BYTES {
            return Ok(false);
        }
        let mut v = super::push_recent(&mut self.window, LOAD_WINDOW, seconds / bytes as f64);
        self.median = Some(super::median_of(&mut v));
        self.samples += 1;
        Ok(true)
    }

    /// Seconds per byte: the median of the window; `None` before the first sample.
    pub fn s_per_byte(&self) -> Option<f64> {
        self.median
    }

    /// Loads folded in so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_median_of_recent_loads_ignores_small_ones_and_outliers() {
        let mut c = LoadCalibration::new();
        assert_eq!(c.s_per_byte(), None);
        assert!(!c.observe(MIB - 1, 0.5).unwrap(), "a small load is not a sample");
        assert_eq!(c.s_per_byte(), None);
        // 1 ms per MiB, with one load into fresh pages at 10x.
        for (mib, s) in [(64, 0.064), (256, 2.56), (16, 0.016), (4, 0.004)] {
            assert!(c.observe(mib * MIB, s).unwrap());
        }
        let r = c.s_per_byte().unwrap();
        assert!((r * MIB as f64 - 1e-3).abs() < 1e-12, "{r}");
        assert_eq!(c.samples(), 4);
    }

    #[test]
    fn the_window_follows_a_change_within_its_length() {
        let mut c = LoadCalibration::new();
        for _ in 0..LOAD_WINDOW {
            c.observe(8 * MIB, 0.008).unwrap();
        }
        for _ in 0..LOAD_WINDOW / 2 + 1 {
            c.observe(8 * MIB, 0.024).unwrap();
        }
        let r = c.s_per_byte().unwrap() * MIB as f64;
        assert!((r - 3e-3).abs() < 1e-12, "the median moved to the new rate: {r}");
    }

    #[test]
    fn degenerate_durations_are_refused_and_change_nothing() {
        let mut c = LoadCalibration::new();
        c.observe(MIB, 0.001).unwrap();
        let before = c.clone();
        for s in [f64::NAN, f64::INFINITY, -1.0, 0.0, crate::calibration::MAX_SAMPLE_SECONDS * 2.0] {
            assert!(c.observe(4 * MIB, s).is_err(), "{s}");
        }
        assert_eq!(c, before);
    }
}
