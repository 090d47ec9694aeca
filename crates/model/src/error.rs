//! Typed errors for invalid model inputs.
//!
//! Every constructor and entry point of this crate validates its inputs and reports the
//! offending field by name, so callers (the CLI, the daemon's gRPC edge) can map an error to
//! the flag or message field it came from without parsing strings.

use thiserror::Error;

/// An input the cost model refuses. `field` is the model's name for the input
/// (`"goodput_gbps"`, `"mfu"`, …); callers translate it to their own vocabulary.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ModelError {
    /// The value must be a finite number (not NaN, not infinite).
    #[error("{field} must be a finite number, got {value}")]
    NotFinite { field: &'static str, value: f64 },
    /// The value must be strictly greater than zero.
    #[error("{field} must be > 0, got {value}")]
    NotPositive { field: &'static str, value: f64 },
    /// The value must be zero or greater.
    #[error("{field} must be >= 0, got {value}")]
    Negative { field: &'static str, value: f64 },
    /// A utilization must lie in [0, 1): an M/M/1 queue at rho >= 1 has no steady state.
    #[error("{field} must be in [0, 1) (an M/M/1 queue at utilization >= 1 never drains), got {value}")]
    UtilizationOutOfRange { field: &'static str, value: f64 },
    /// A fraction such as MFU or a codec ratio must lie in (0, 1].
    #[error("{field} must be in (0, 1], got {value}")]
    FractionOutOfRange { field: &'static str, value: f64 },
    /// An integer shape parameter must be at least 1.
    #[error("{field} must be >= 1, got {value}")]
    ZeroCount { field: &'static str, value: u64 },
    /// A model or accelerator preset name that is not in the table.
    #[error("unknown {kind} preset {name:?}; known: {known}")]
    UnknownPreset { kind: &'static str, name: String, known: String },
}

/// Checks that `value` is finite and > 0.
pub fn positive(field: &'static str, value: f64) -> Result<f64, ModelError> {
    finite(field, value)?;
    if value <= 0.0 {
        return Err(ModelError::NotPositive { field, value });
    }
    Ok(value)
}

/// Checks that `value` is finite and >= 0.
pub fn non_negative(field: &'static str, value: f64) -> Result<f64, ModelError> {
    finite(field, value)?;
    if value < 0.0 {
        return Err(ModelError::Negative { field, value });
    }
    Ok(value)
}

/// Checks that `value` is a utilization in [0, 1).
pub fn utilization(field: &'static str, value: f64) -> Result<f64, ModelError> {
    finite(field, value)?;
    if !(0.0..1.0).contains(&value) {
        return Err(ModelError::UtilizationOutOfRange { field, value });
    }
    Ok(value)
}

/// Checks that `value` is a fraction in (0, 1].
pub fn fraction(field: &'static str, value: f64) -> Result<f64, ModelError> {
    finite(field, value)?;
    if !(value > 0.0 && value <= 1.0) {
        return Err(ModelError::FractionOutOfRange { field, value });
    }
    Ok(value)
}

/// Checks that a count is at least 1.
pub fn count(field: &'static str, value: u64) -> Result<u64, ModelError> {
    if value == 0 {
        return Err(ModelError::ZeroCount { field, value });
    }
    Ok(value)
}

fn finite(field: &'static str, value: f64) -> Result<f64, ModelError> {
    if !value.is_finite() {
        return Err(ModelError::NotFinite { field, value });
    }
    Ok(value)
}
