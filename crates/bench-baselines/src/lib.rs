//! Baselines (being written).
