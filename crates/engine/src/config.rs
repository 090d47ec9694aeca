//! `ModelConfig`: the shape of the reference transformer (layers, width, heads, GQA KV heads,
//! head dim, FFN width, vocabulary, RoPE base, weight seed, KV storage dtype), its validation
//! and its stable model fingerprint. Owns no weights and no memory.

use sha2::{Digest, Sha256};

use crate::error::ConfigError;

/// Element type of the KV cache as stored in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE f32, little-endian, 4 bytes.
    F32,
    /// bfloat16 (upper half of an f32, round-to-nearest-even on store), little-endian, 2 bytes.
    Bf16,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }

    /// Lowercase name (`"f32"`, `"bf16"`), as layout descriptors spell it.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
        }
    }

    fn tag(self) -> u8 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::Bf16 => 1,
        }
    }
}

/// Shape of the reference decoder-only transformer. Weights follow from it (incl. `seed`)
/// deterministically, see [`crate::Weights::generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Transformer layers.
    pub layers: usize,
    /// Residual stream width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA: `heads` must be a multiple).
    pub kv_heads: usize,
    /// Per-head dimension (even, for RoPE).
    pub head_dim: usize,
    /// SwiGLU intermediate width.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RoPE base (e.g. 10000).
    pub rope_theta: f64,
    /// Seed of the weight PRNG.
    pub seed: u64,
    /// KV cache element type.
    pub kv_dtype: KvDtype,
}

impl ModelConfig {
    /// A small config for examples and tests (2 layers, hidden 64, 4 heads, 2 KV heads).
    pub fn tiny(seed: u64) -> Self {
        ModelConfig {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            vocab: 256,
            rope_theta: 10_000.0,
            seed,
            kv_dtype: KvDtype::F32,
        }
    }

    /// Checks every field; `Ok` means every derived size fits `usize`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(ConfigError::GqaGroups { heads: self.heads, kv_heads: self.kv_heads });
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ConfigError::OddHeadDim(self.head_dim));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(ConfigError::RopeTheta(self.rope_theta));
        }
        let q = self.heads.checked_mul(self.head_dim).ok_or(ConfigError::Overflow { what: "q width" })?;
        let mats = [
            (q, "wq"),
            (self.ffn, "ffn weights"),
            (self.vocab, "embeddings"),
            (self.kv_heads * self.head_dim, "kv width"),
        ];
        for (rows, what) in mats {
            rows.checked_mul(self.hidden).ok_or(ConfigError::Overflow { what })?;
        }
        Ok(())
    }

    /// Query width `heads * head_dim`.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// KV width per token per layer per plane, `kv_heads * head_dim`.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Stable SHA-256 digest of every field (seed and KV dtype included), versioned. Two
    /// engines with equal fingerprints compute bit-identical KV for the same tokens.
    pub fn model_fingerprint(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"kvferry-engine/model/v1");
        for v in [self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.ffn, self.vocab] {
            h.update((v as u64).to_le_bytes());
        }
        h.update(self.rope_theta.to_bits().to_le_bytes());
        h.update(self.seed.to_le_bytes());
        h.update([self.kv_dtype.tag()]);
        h.finalize().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_catches_each_field() {
        assert_eq!(ModelConfig::tiny(1).validate(), Ok(()));
        let mut c = ModelConfig::tiny(1);
        c.kv_heads = 3;
        assert_eq!(c.validate(), Err(ConfigError::GqaGroups { heads: 4, kv_heads: 3 }));
        let mut c = ModelConfig::tiny(1);
        c.head_dim = 15;
        assert_eq!(c.validate(), Err(ConfigError::OddHeadDim(15)));
        let mut c = ModelConfig::tiny(1);
        c.vocab = 0;
        assert_eq!(c.validate(), Err(ConfigError::Zero { field: "vocab" }));
        let mut c = ModelConfig::tiny(1);
        c.rope_theta = f64::NAN;
        assert!(matches!(c.validate(), Err(ConfigError::RopeTheta(_))));
        let mut c = ModelConfig::tiny(1);
        c.hidden = usize::MAX / 2;
        assert!(matches!(c.validate(), Err(ConfigError::Overflow { .. })));
    }

    #[test]
    fn fingerprint_covers_seed_and_dtype() {
        let a = ModelConfig::tiny(1);
        assert_eq!(a.model_fingerprint(), ModelConfig::tiny(1).model_fingerprint());
        assert_ne!(a.model_fingerprint(), ModelConfig::tiny(2).model_fingerprint());
        let mut b = a.clone();
        b.kv_dtype = KvDtype::Bf16;
        assert_ne!(a.model_fingerprint(), b.model_fingerprint());
        let mut c = a.clone();
        c.rope_theta = 500_000.0;
        assert_ne!(a.model_fingerprint(), c.model_fingerprint());
    }
}
