//! Recompute (prefill) cost at the target region.
//!
//! Two terms, each explicit:
//! - **weights**: forward FLOPs per token ≈ 2 × active parameters (Kaplan et al. 2020,
//!   arXiv 2001.08361, Table 1: C_forward ≈ 2N). For a mixture-of-experts model only the
//!   parameters a token is routed through count (Mixtral, arXiv 2401.04088 §1: 13B active of
//!   47B; DeepSeek-V3, arXiv 2412.19437: 37B active of 671B). This is the seed's linear term.
//! - **attention**: the QKᵀ and AV products, which the 2N rule leaves out. A query at position
//!   i attends to i+1 keys (causal mask), costing 2 × q_heads × (qk_head_dim + v_head_dim)
//!   FLOPs per key per layer (PaLM, arXiv 2204.02311, Appendix B counts the same two
//!   matmuls as 4·L·H·Q·T per token over a full context T). Summed over a prefix the term is
//!   quadratic, so per-token prefill cost rises with the context already cached.
//!
//! Time = FLOPs / (peak FLOP/s × MFU). No clock, no I/O: measured profiles enter as inputs.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, count, fraction, positive};

/// The attention dimensions that set the quadratic prefill term.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionShape {
    /// Layers with attention.
    pub layers: u32,
    /// Query heads (not KV heads: GQA shares K/V, not the score computation).
    pub q_heads: u32,
    /// Per-head dimension of queries and keys (MLA: nope + rope, e.g. 128 + 64).
    pub qk_head_dim: u32,
    /// Per-head dimension of values.
    pub v_head_dim: u32,
}

impl AttentionShape {
    /// FLOPs for one (query, key) pair summed over all layers and heads:
    /// 2 × layers × q_heads × (qk_head_dim + v_head_dim).
    pub fn flops_per_query_key(&self) -> f64 {
        2.0 * f64::from(self.layers)
            * f64::from(self.q_heads)
            * (f64::from(self.qk_head_dim) + f64::from(self.v_head_dim))
    }

    fn validate(&self) -> Result<(), ModelError> {
        count("attention.layers", self.layers.into())?;
        count("attention.q_heads", self.q_heads.into())?;
        count("attention.qk_head_dim", self.qk_head_dim.into())?;
        count("attention.v_head_dim", self.v_head_dim.into())?;
        Ok(())
    }
}

/// Knots of a [`SizeCorrection`].
pub const SIZE_KNOTS: usize = 12;
/// Least slope of a [`SizeCorrection`]'s ln(factor) against ln(seconds): above −1, so corrected
/// seconds still grow with the prefill (the split search relies on it).
pub const SIZE_CORRECTION_MIN_SLOPE: f64 = -0.5;
/// Largest |ln(factor)| a [`SizeCorrection`] holds (a factor within 1/4 … 4).
const SIZE_CORRECTION_MAX_LN: f64 = 1.386_294_361_119_890_6;

/// A calibrated correction to a prefill model's *shape*: a factor on the modeled seconds that
/// depends on how long the prefill is modeled to take, learnt from the residuals of recent
/// recomputes of a similar size ([`RecomputeCalibration::size_correction`]). An engine's cost
/// is rarely exactly `linear·n + attention·pairs` (batching makes long prefills cheaper per
/// token, caches make long contexts dearer per pair); this bends the fitted curve toward what
/// recomputes of that size took, and leaves sizes far from any sample alone.
///
/// Piecewise linear in ln(seconds) between evenly spaced knots, flat beyond the ends, with a
/// slope of at least [`SIZE_CORRECTION_MIN_SLOPE`]: corrected seconds grow with the prefill.
///
/// [`RecomputeCalibration::size_correction`]: crate::calibration::RecomputeCalibration::size_correction
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeCorrection {
    first_ln_s: f64,
    step_ln_s: f64,
    ln_factor: [f64; SIZE_KNOTS],
}

impl SizeCorrection {
    /// Knots from `ln(first_s)` every `step_ln_s`, ln(factor) from `ln_factor_at(ln seconds)`,
    /// clamped to a factor within 1/4 … 4 and, knot by knot, to the least slope. `None` when
    /// `first_s` or `step_ln_s` is not finite and positive, or a value is not finite.
    pub fn from_fn(first_s: f64, step_ln_s: f64, ln_factor_at: impl Fn(f64) -> f64) -> Option<Self> {
        if !(first_s.is_finite() && first_s > 0.0 && step_ln_s.is_finite() && step_ln_s > 0.0) {
            return None;
        }
        let first_ln_s = first_s.ln();
        let mut ln_factor = [0.0; SIZE_KNOTS];
        for i in 0..SIZE_KNOTS {
            let v = ln_factor_at(first_ln_s + i as f64 * step_ln_s);
            if !v.is_finite() {
                return None;
            }
            let v = v.clamp(-SIZE_CORRECTION_MAX_LN, SIZE_CORRECTION_MAX_LN);
            ln_factor[i] =
                if i == 0 { v } else { v.max(ln_factor[i - 1] + SIZE_CORRECTION_MIN_SLOPE * step_ln_s) };
        }
        Some(Self { first_ln_s, step_ln_s, ln_factor })
    }

    /// The factor on a prefill modeled at `modeled_s` seconds (1 for 0 or non-finite).
    pub fn factor(&self, modeled_s: f64) -> f64 {
        if !(modeled_s.is_finite() && modeled_s > 0.0) {
            return 1.0;
        }
        let x = (modeled_s.ln() - self.first_ln_s) / self.step_ln_s;
        let last = SIZE_KNOTS - 1;
        let ln_f = if x <= 0.0 {
            self.ln_factor[0]
        } else if x >= last as f64 {
            self.ln_factor[last]
        } else {
            let i = x.floor() as usize;
            let t = x - i as f64;
            self.ln_factor[i] * (1.0 - t) + self.ln_factor[i + 1] * t
        };
        ln_f.exp()
    }
}

/// How fast the target region prefills.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ComputeModel {
    /// Parameters each token passes through (dense: all; MoE: active).
    pub active_params: f64,
    /// Accelerator peak, FLOP/s (dense BF16 for the presets).
    pub peak_flops: f64,
    /// Model FLOPs utilization achieved by prefill, in (0, 1].
    pub mfu: f64,
    /// The attention term; `None` reproduces the seed's linear model.
    pub attention: Option<AttentionShape>,
    /// A calibrated shape correction ([`SizeCorrection`]); `None` for a model from first
    /// principles or an uncalibrated profile. Runtime state: never serialized.
    #[serde(skip)]
    pub correction: Option<SizeCorrection>,
}

impl ComputeModel {
    /// Validated constructor.
    pub fn new(
        active_params: f64,
        peak_flops: f64,
        mfu: f64,
        attention: Option<AttentionShape>,
    ) -> Result<Self, ModelError> {
        positive("active_params", active_params)?;
        positive("peak_flops", peak_flops)?;
        fraction("mfu", mfu)?;
        if let Some(a) = &attention {
            a.validate()?;
        }
        Ok(Self { active_params, peak_flops, mfu, attention, correction: None })
    }

    /// The same model with a calibrated shape correction (or none).
    pub fn with_correction(self, correction: Option<SizeCorrection>) -> Self {
        Self { correction, ..self }
    }

    /// A compute model from a measured prefill profile
    /// `seconds(c, n) = linear·n + attention·(n·c + n(n+1)/2)` (what an engine reports when it
    /// registers). Expressed exactly in this type's terms: a nominal 1-layer, 1-head attention
    /// shape (4 FLOPs per query-key pair) sets the effective FLOP/s to `4 / attention`, and the
    /// active parameters follow from `linear`. With `attention = 0` the term is off.
    pub fn from_measured(linear_s_per_token: f64, attention_s_per_pair: f64) -> Result<Self, ModelError> {
        positive("linear_s_per_token", linear_s_per_token)?;
        crate::error::non_negative("attention_s_per_pair", attention_s_per_pair)?;
        if attention_s_per_pair == 0.0 {
            let flops = 1e15;
            return Self::new(linear_s_per_token * flops / 2.0, flops, 1.0, None);
        }
        let flops = 4.0 / attention_s_per_pair;
        let unit = AttentionShape { layers: 1, q_heads: 1, qk_head_dim: 1, v_head_dim: 1 };
        Self::new(linear_s_per_token * flops / 2.0, flops, 1.0, Some(unit))
    }

    /// Effective FLOP/s.
    pub fn effective_flops(&self) -> f64 {
        self.peak_flops * self.mfu
    }

    /// Seconds per token of the weights term (the seed's `recompute_per_token`).
    pub fn linear_seconds_per_token(&self) -> f64 {
        2.0 * self.active_params / self.effective_flops()
    }

    /// Seconds per (query, key) pair of the attention term; 0 when attention is off.
    pub fn attention_seconds_per_pair(&self) -> f64 {
        self.attention.map_or(0.0, |a| a.flops_per_query_key() / self.effective_flops())
    }

    /// Seconds to prefill `tokens` tokens starting from an empty cache.
    pub fn recompute_seconds(&self, tokens: u64) -> f64 {
        self.recompute_span_seconds(0, tokens)
    }

    /// Seconds to prefill `tokens` new tokens on top of `cached` tokens already in the cache.
    ///
    /// Linear term: `tokens × 2N / (peak × mfu)` (evaluated in the seed's order so that its
    /// printed numbers reproduce bit-for-bit). Attention term: the new tokens at positions
    /// `cached..cached+tokens` attend to `cached + tokens·(tokens+1)/2 / tokens` keys on average.
    ///
    /// With a [`SizeCorrection`], the sum is multiplied by its factor at the sum.
    pub fn recompute_span_seconds(&self, cached: u64, tokens: u64) -> f64 {
        let n = tokens as f64;
        let linear = n * (2.0 * self.active_params) / self.effective_flops();
        let modeled = match self.attention {
            None => linear,
            Some(a) => {
                let c = cached as f64;
                // Σ_{i=c}^{c+n-1} (i + 1) = n·c + n(n+1)/2
                let pairs = n * c + n * (n + 1.0) / 2.0;
                linear + pairs * a.flops_per_query_key() / self.effective_flops()
            }
        };
        match &self.correction {
            None => modeled,
            Some(c) => modeled * c.factor(modeled),
        }
    }

    /// Marginal seconds of the token at position `position` (0-based): grows with position
    /// when attention is on.
    pub fn seconds_for_token_at(&self, position: u64) -> f64 {
        self.recompute_span_seconds(position, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed() -> ComputeModel {
        ComputeModel::new(70e9, 989e12, 0.40, None).unwrap()
    }

    fn reference_engine() -> ComputeModel {
        ComputeModel::from_measured(7e-4, 1.05e-5).unwrap()
    }

    #[test]
    fn a_size_correction_keeps_prefill_cost_growing() {
        // A wild correction: ln(factor) swinging by ±3 (clamped to ±ln 4) four times per e-fold.
        let c = SizeCorrection::from_fn(1e-3, 0.3, |x| 3.0 * (4.0 * x).sin()).unwrap();
        let m = reference_engine().with_correction(Some(c));
        let mut last = 0.0;
        for n in 1..3000u64 {
            let s = m.recompute_seconds(n);
            assert!(s > last, "{n}: {s} after {last}");
            last = s;
        }
        for x in c.ln_factor {
            assert!(x.abs() <= SIZE_CORRECTION_MAX_LN + 1e-12, "{x}");
        }
        for w in c.ln_factor.windows(2) {
            assert!(w[1] - w[0] >= SIZE_CORRECTION_MIN_SLOPE * 0.3 - 1e-12, "{w:?}");
        }
    }

    #[test]
    fn a_size_correction_is_flat_beyond_its_knots_and_refuses_bad_input() {
        let c = SizeCorrection::from_fn(0.01, 0.5, |x| 0.1 * (x - 0.01f64.ln())).unwrap();
        let last = 0.01 * (0.5 * (SIZE_KNOTS - 1) as f64).exp();
        assert!((c.factor(0.01) - 1.0).abs() < 1e-12);
        assert_eq!(c.factor(1e-6), c.factor(0.01));
        assert_eq!(c.factor(1e6), c.factor(last));
        assert!((c.factor(last) - (0.1 * 0.5 * (SIZE_KNOTS - 1) as f64).exp()).abs() < 1e-9);
        // Between knots: linear in ln(seconds).
        let mid = 0.01 * 0.25f64.exp();
        assert!((c.factor(mid).ln() - 0.025).abs() < 1e-9);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(c.factor(bad), 1.0);
            assert!(SizeCorrection::from_fn(bad, 0.5, |_| 0.0).is_none());
            assert!(SizeCorrection::from_fn(0.01, bad, |_| 0.0).is_none());
        }
        assert!(SizeCorrection::from_fn(0.01, 0.5, |_| f64::NAN).is_none());
        // No correction, or one at factor 1, is the model itself.
        let m = reference_engine();
        let flat = SizeCorrection::from_fn(0.01, 0.5, |_| 0.0);
        assert_eq!(m.with_correction(flat).recompute_seconds(500), m.recompute_seconds(500));
        assert_eq!(m.with_correction(None), m);
    }

    #[test]
    fn linear_is_the_seed() {
        let m = seed();
        assert_eq!(format!("{:.2}", m.linear_seconds_per_token() * 1e6), "353.89");
        assert_eq!(format!("{:.2}", m.recompute_seconds(1000) * 1e3), "353.89");
        assert_eq!(m.recompute_span_seconds(5000, 10), m.recompute_seconds(10));
    }

    #[test]
    fn attention_makes_per_token_cost_rise_with_context() {
        let a = AttentionShape { layers: 80, q_heads: 64, qk_head_dim: 128, v_head_dim: 128 };
        let m = ComputeModel::new(70e9, 989e12, 0.4, Some(a)).unwrap();
        assert!(m.seconds_for_token_at(100_000) > m.seconds_for_token_at(1000));
        assert!(m.seconds_for_token_at(1000) > m.linear_seconds_per_token());
        // Quadratic: doubling the prefix more than doubles the time.
        assert!(m.recompute_seconds(64_000) > 2.0 * m.recompute_seconds(32_000));
        // Spans add up: [0, a) + [a, a+b) == [0, a+b).
        let whole = m.recompute_seconds(3000);
        let parts = m.recompute_seconds(1200) + m.recompute_span_seconds(1200, 1800);
        assert!((whole - parts).abs() < 1e-12 * whole);
        // At 128k context on Llama-3.1-70B shapes attention outweighs the weights:
        // 2·L·H·2d·T(T+1)/2 vs 2N·T  =>  ratio = L·H·2d·(T+1) / (2N) ≈ 1.198 at T = 128k.
        let t = 128_000;
        let lin = t as f64 * m.linear_seconds_per_token();
        let ratio = (m.recompute_seconds(t) - lin) / lin;
        assert!((ratio - 1.1984).abs() < 0.001, "{ratio}");
    }

    #[test]
    fn a_measured_profile_round_trips() {
        let m = ComputeModel::from_measured(2.5e-4, 3e-9).unwrap();
        assert!((m.linear_seconds_per_token() - 2.5e-4).abs() < 1e-18);
        assert!((m.attention_seconds_per_pair() - 3e-9).abs() < 1e-22);
        let want = 2.5e-4 * 100.0 + 3e-9 * (100.0 * 50.0 + 100.0 * 101.0 / 2.0);
        assert!((m.recompute_span_seconds(50, 100) - want).abs() < 1e-12);
        let lin = ComputeModel::from_measured(1e-3, 0.0).unwrap();
        assert!(lin.attention.is_none());
        assert!((lin.recompute_seconds(10) - 1e-2).abs() < 1e-15);
        assert!(ComputeModel::from_measured(0.0, 1e-9).is_err());
        assert!(ComputeModel::from_measured(1e-3, -1.0).is_err());
    }

    #[test]
    fn invalid_inputs_are_named() {
        assert!(matches!(
            ComputeModel::new(0.0, 1e12, 0.4, None),
            Err(ModelError::NotPositive { field: "active_params", .. })
        ));
        assert!(matches!(
            ComputeModel::new(1e9, 1e12, 1.5, None),
            Err(ModelError::FractionOutOfRange { field: "mfu", .. })
        ));
        assert!(matches!(
            ComputeModel::new(1e9, f64::NAN, 0.5, None),
            Err(ModelError::NotFinite { field: "peak_flops", .. })
        ));
        let a = AttentionShape { layers: 1, q_heads: 0, qk_head_dim: 1, v_head_dim: 1 };
        assert!(matches!(
            ComputeModel::new(1e9, 1e12, 0.5, Some(a)),
            Err(ModelError::ZeroCount { field: "attention.q_heads", .. })
        ));
    }
}
