//! Fixed-order f32 kernels of the forward pass: dot/matvec, RMSNorm, RoPE, SiLU, softmax
//! weights and argmax. Every reduction runs left to right in one thread, so a result depends
//! only on its inputs (never on batch size, chunking or scheduling) — the property that makes
//! migrated KV and recomputed KV bit-identical.

use crate::detmath::{exp_f32, ln_f64, sin_cos_f64};

/// RMSNorm epsilon.
pub const RMS_EPS: f32 = 1e-5;

/// `Σ a[i] * b[i]`, accumulated left to right from 0.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        acc += x * y;
    }
    acc
}

/// `out[r] = Σ_c w[r * cols + c] * x[c]` for a row-major `[rows][cols]` matrix
/// (`cols = x.len()`, `rows = out.len()`).
pub fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    debug_assert_eq!(w.len(), cols * out.len());
    for (o, row) in out.iter_mut().zip(w.chunks_exact(cols)) {
        *o = dot(row, x);
    }
}

/// `out = x / sqrt(mean(x²) + eps) * gain`.
pub fn rmsnorm(x: &[f32], gain: &[f32], out: &mut [f32]) {
    let ss = dot(x, x);
    let inv = 1.0 / (ss / x.len() as f32 + RMS_EPS).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(gain) {
        *o = v * inv * g;
    }
}

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_f32(-x))
}

/// In place: `s[j] = exp(s[j] - max) / Σ exp(...)`.
pub fn softmax(s: &mut [f32]) {
    let mut m = f32::NEG_INFINITY;
    for &v in s.iter() {
        if v > m {
            m = v;
        }
    }
    let mut sum = 0.0f32;
    for v in s.iter_mut() {
        *v = exp_f32(*v - m);
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in s.iter_mut() {
        *v *= inv;
    }
}

/// Index of the largest value (first one on ties; NaN compares as largest, via total order).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if x.total_cmp(&v[best]).is_gt() {
            best = i;
        }
    }
    best
}

/// RoPE inverse frequencies `theta^(-2i/head_dim)`, `i in 0..head_dim/2`, in f64.
pub fn rope_inv_freq(theta: f64, head_dim: usize) -> Vec<f64> {
    let ln_theta = ln_f64(theta);
    (0..head_dim / 2)
        .map(|i| crate::detmath::exp_f64(-((2 * i) as f64) / head_dim as f64 * ln_theta))
        .collect()
}

/// `(cos, sin)` tables for position `pos`, each `inv_freq.len()` long.
pub fn rope_tables(pos: usize, inv_freq: &[f64], cos: &mut [f32], sin: &mut [f32]) {
    for ((f, c), s) in inv_freq.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
        let (sv, cv) = sin_cos_f64(pos as f64 * f);
        *c = cv as f32;
        *s = sv as f32;
    }
}

/// Rotate-half RoPE (Llama/NeoX) on one head vector in place: pairs `(i, i + d/2)`.
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_behave() {
        let mut out = [0.0; 2];
        matvec(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[1.0, 0.5, -1.0], &mut out);
        assert_eq!(out, [-1.0, 0.5]);
        let mut s = [1.0, 1.0, f32::NEG_INFINITY];
        softmax(&mut s);
        assert_eq!(s, [0.5, 0.5, 0.0]);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        let mut n = [0.0; 2];
        rmsnorm(&[3.0, 4.0], &[1.0, 2.0], &mut n);
        assert!((n[0] - 3.0 / 12.5f32.sqrt()).abs() < 1e-6);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
    }

    #[test]
    fn rope_at_zero_is_identity_and_preserves_norm() {
        let f = rope_inv_freq(10_000.0, 8);
        assert_eq!(f[0], 1.0);
        let (mut c, mut s) = ([0.0; 4], [0.0; 4]);
        rope_tables(0, &f, &mut c, &mut s);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let orig = x;
        rope(&mut x, &c, &s);
        assert_eq!(x, orig);
        rope_tables(37, &f, &mut c, &mut s);
        rope(&mut x, &c, &s);
        assert!((dot(&x, &x) - dot(&orig, &orig)).abs() < 1e-3);
        assert_ne!(x, orig);
    }
}
