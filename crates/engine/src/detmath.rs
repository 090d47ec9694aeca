//! Deterministic scalar math: a SplitMix64 PRNG and `exp`/`ln`/`sin`/`cos` built only from
//! IEEE-754 `+ - * /`, `round` and bit manipulation, with a fixed number of terms. Platform
//! `libm` results may differ between machines (and regions); these do not, so two engines on
//! different hosts compute bit-identical KV. Accuracy is "good enough for a reference model",
//! not correctly rounded. Rust never contracts `a * b + c` into an FMA on its own, so the
//! expressions below evaluate the same everywhere.

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, well-mixed 64-bit generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`, exactly representable (24 random bits), so identical on every
    /// platform.
    pub fn next_sym_f32(&mut self) -> f32 {
        let u = (self.next_u64() >> 40) as f32 * (1.0 / 16_777_216.0);
        u * 2.0 - 1.0
    }

    /// Uniform integer in `[lo, hi)`; `hi > lo`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo)
    }
}

const LN2_HI_F32: f32 = 0.693_145_75;
const LN2_LO_F32: f32 = 1.428_606_8e-6;

/// `e^x` in f32 (relative error ~1e-7). Returns 0 below -87.3 and +inf above 88.7.
pub fn exp_f32(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < -87.3 {
        return 0.0;
    }
    if x > 88.7 {
        return f32::INFINITY;
    }
    let k = (x * std::f32::consts::LOG2_E).round();
    let r = x - k * LN2_HI_F32 - k * LN2_LO_F32;
    // Taylor to degree 7 on |r| <= 0.35.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let k = k as i32;
    // k in [-126, 128]: split the scale in two steps so 2^k never leaves the normal range.
    let half = k / 2;
    p * pow2_f32(half) * pow2_f32(k - half)
}

fn pow2_f32(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

fn pow2_f64(k: i64) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// `e^x` in f64 for `|x| < 700` (Taylor, 24 terms after range reduction).
pub fn exp_f64(x: f64) -> f64 {
    // fdlibm's split of ln 2: the high part has its low 32 bits zero, so k * LN2_HI is exact.
    const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
    let x = x.clamp(-700.0, 700.0);
    let k = (x * std::f64::consts::LOG2_E).round();
    let r = x - k * LN2_HI - k * LN2_LO;
    let mut term = 1.0;
    let mut sum = 1.0;
    for i in 1..24 {
        term = term * r / f64::from(i);
        sum += term;
    }
    let k = k as i64;
    let half = k / 2;
    sum * pow2_f64(half) * pow2_f64(k - half)
}

/// Natural logarithm of a positive, finite, normal `x` (atanh series, 30 terms).
pub fn ln_f64(x: f64) -> f64 {
    debug_assert!(x > 0.0 && x.is_finite());
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52));
    if m > std::f64::consts::SQRT_2 {
        m /= 2.0;
        e += 1;
    }
    let f = (m - 1.0) / (m + 1.0);
    let f2 = f * f;
    let mut pow = f;
    let mut sum = 0.0;
    for i in 0..30 {
        sum += pow / f64::from(2 * i + 1);
        pow *= f2;
    }
    e as f64 * std::f64::consts::LN_2 + 2.0 * sum
}

/// `(sin a, cos a)` in f64: reduce modulo 2π (two-constant Cody–Waite), then Taylor with a
/// fixed 32 terms on `[-π, π]`.
pub fn sin_cos_f64(a: f64) -> (f64, f64) {
    const TWO_PI_HI: f64 = std::f64::consts::TAU;
    const TWO_PI_LO: f64 = 2.449_293_598_294_706_4e-16;
    let n = (a / TWO_PI_HI).round();
    let r = a - n * TWO_PI_HI - n * TWO_PI_LO;
    let r2 = r * r;
    // sin: r - r^3/3! + ...; cos: 1 - r^2/2! + ...
    let (mut s_term, mut c_term) = (r, 1.0);
    let (mut s, mut c) = (r, 1.0);
    for i in 1..32 {
        let i = f64::from(i);
        s_term = -s_term * r2 / ((2.0 * i) * (2.0 * i + 1.0));
        c_term = -c_term * r2 / ((2.0 * i - 1.0) * (2.0 * i));
        s += s_term;
        c += c_term;
    }
    (s, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_close_to_libm() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (ours, std) = (exp_f32(x), x.exp());
            assert!(((ours - std) / std).abs() < 4e-7, "exp({x}) = {ours} vs {std}");
            x += 0.173;
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-100.0), 0.0);
    }

    #[test]
    fn f64_functions_close_to_libm() {
        for x in [1.0001, 2.0, 10.0, 10_000.0, 500_000.0, 0.3] {
            assert!((ln_f64(x) - x.ln()).abs() < 1e-13, "ln {x}");
        }
        for x in [-30.0, -1.0, 0.0, 0.5, 20.0] {
            assert!(((exp_f64(x) - x.exp()) / x.exp()).abs() < 1e-14, "exp {x}");
        }
        for a in [0.0, 1.0, -2.5, 3.0, 100.0, 4096.0, 131_071.5] {
            let (s, c) = sin_cos_f64(a);
            assert!((s - a.sin()).abs() < 1e-9 && (c - a.cos()).abs() < 1e-9, "sincos {a}");
        }
    }

    #[test]
    fn prng_is_pinned() {
        // SplitMix64 reference outputs for seed 0.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let v = SplitMix64::new(7).next_sym_f32();
        assert!((-1.0..1.0).contains(&v));
    }
}
