//! KV-cache footprint: how many bytes one cached token occupies.
//!
//! Owns the bytes-per-token arithmetic for standard (MHA/GQA) caches and for MLA latent caches.
//! It knows nothing about block layout or memory addresses; that belongs to the pool crates.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, count, positive};

/// Element type of the cached K/V (or latent) values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 4 bytes per element.
    Fp32,
    /// 2 bytes per element (bf16 and fp16 cost the same).
    Bf16,
    /// 2 bytes per element.
    Fp16,
    /// 1 byte per element (e4m3/e5m2; per-tensor scales are negligible per token).
    Fp8,
}

impl KvDtype {
    /// Bytes per stored element.
    pub fn bytes(self) -> f64 {
        match self {
            KvDtype::Fp32 => 4.0,
            KvDtype::Bf16 | KvDtype::Fp16 => 2.0,
            KvDtype::Fp8 => 1.0,
        }
    }

    /// Parses `fp32`, `bf16`, `fp16`, `fp8` (also `f32`, `f16`, `float8`).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Some(KvDtype::Fp32),
            "bf16" | "bfloat16" => Some(KvDtype::Bf16),
            "fp16" | "f16" | "float16" | "half" => Some(KvDtype::Fp16),
            "fp8" | "float8" | "fp8_e4m3" | "fp8_e5m2" => Some(KvDtype::Fp8),
            _ => None,
        }
    }
}

/// What one layer caches per token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum KvShape {
    /// Multi-head or grouped-query attention: a K and a V vector per KV head per layer.
    /// bytes/token = 2 × layers × kv_heads × head_dim × element bytes
    /// (the seed's `bytes_per_kv_token`, after NVIDIA's NIXL KV-transfer sizing).
    Gqa { layers: u32, kv_heads: u32, head_dim: u32 },
    /// Multi-head latent attention (DeepSeek-V2/V3): one compressed latent of `latent_dim`
    /// (the `kv_lora_rank`) plus a decoupled RoPE key of `rope_dim` per layer, shared by all
    /// heads; there is no separate V. bytes/token = layers × (latent_dim + rope_dim) × element
    /// bytes (DeepSeek-V2 paper, arXiv 2405.04434, §2.1.3 and Table 1: (d_c + d_h^R)·l).
    Mla { layers: u32, latent_dim: u32, rope_dim: u32 },
}

impl KvShape {
    /// Number of transformer layers that cache KV.
    pub fn layers(&self) -> u32 {
        match *self {
            KvShape::Gqa { layers, .. } | KvShape::Mla { layers, .. } => layers,
        }
    }

    /// Elements cached per token across all layers.
    pub fn elements_per_token(&self) -> f64 {
        match *self {
            KvShape::Gqa { layers, kv_heads, head_dim } => {
                2.0 * f64::from(layers) * f64::from(kv_heads) * f64::from(head_dim)
            }
            KvShape::Mla { layers, latent_dim, rope_dim } => {
                f64::from(layers) * (f64::from(latent_dim) + f64::from(rope_dim))
            }
        }
    }

    fn validate(&self) -> Result<(), ModelError> {
        match *self {
            KvShape::Gqa { layers, kv_heads, head_dim } => {
                count("layers", layers.into())?;
                count("kv_heads", kv_heads.into())?;
                count("head_dim", head_dim.into())?;
            }
            KvShape::Mla { layers, latent_dim, rope_dim } => {
                count("layers", layers.into())?;
                count("latent_dim", latent_dim.into())?;
                // A latent cache without a decoupled rope key is legal (rope_dim may be 0).
                let _ = rope_dim;
            }
        }
        Ok(())
    }
}

/// The KV footprint of one model: its cache shape and the bytes per element.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KvFootprint {
    /// Per-layer cache shape.
    pub shape: KvShape,
    /// Bytes per stored element (2.0 for bf16). A float so that sub-byte formats fit.
    pub element_bytes: f64,
}

impl KvFootprint {
    /// Validated constructor.
    pub fn new(shape: KvShape, element_bytes: f64) -> Result<Self, ModelError> {
        shape.validate()?;
        positive("element_bytes", element_bytes)?;
        Ok(Self { shape, element_bytes })
    }

    /// Standard GQA cache with a named dtype.
    pub fn gqa(layers: u32, kv_heads: u32, head_dim: u32, dtype: KvDtype) -> Result<Self, ModelError> {
        Self::new(KvShape::Gqa { layers, kv_heads, head_dim }, dtype.bytes())
    }

    /// Bytes one cached token occupies in memory.
    pub fn bytes_per_token(&self) -> f64 {
        self.shape.elements_per_token() * self.element_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama70b_bf16_is_320_kib() {
        let kv = KvFootprint::gqa(80, 8, 128, KvDtype::Bf16).unwrap();
        assert_eq!(kv.bytes_per_token(), 327_680.0);
    }

    #[test]
    fn dtypes_scale_linearly() {
        let b = |d| KvFootprint::gqa(32, 8, 128, d).unwrap().bytes_per_token();
        assert_eq!(b(KvDtype::Fp32), 2.0 * b(KvDtype::Bf16));
        assert_eq!(b(KvDtype::Fp16), b(KvDtype::Bf16));
        assert_eq!(b(KvDtype::Bf16), 2.0 * b(KvDtype::Fp8));
    }

    #[test]
    fn deepseek_v3_mla_is_about_68_kib() {
        // 61 layers × (512 + 64) × 2 bytes = 70,272 bytes ≈ 68.6 KiB per token.
        let kv = KvFootprint::new(KvShape::Mla { layers: 61, latent_dim: 512, rope_dim: 64 }, 2.0).unwrap();
        assert_eq!(kv.bytes_per_token(), 70_272.0);
    }

    #[test]
    fn zero_shapes_are_refused_by_name() {
        let e = KvFootprint::gqa(0, 8, 128, KvDtype::Bf16).unwrap_err();
        assert_eq!(e, ModelError::ZeroCount { field: "layers", value: 0 });
        let e = KvFootprint::gqa(1, 0, 128, KvDtype::Bf16).unwrap_err();
        assert!(matches!(e, ModelError::ZeroCount { field: "kv_heads", .. }));
        let e = KvFootprint::new(KvShape::Gqa { layers: 1, kv_heads: 1, head_dim: 1 }, f64::NAN).unwrap_err();
        assert!(matches!(e, ModelError::NotFinite { field: "element_bytes", .. }));
    }

    #[test]
    fn dtype_names_parse() {
        assert_eq!(KvDtype::parse("BF16"), Some(KvDtype::Bf16));
        assert_eq!(KvDtype::parse("fp8_e4m3"), Some(KvDtype::Fp8));
        assert_eq!(KvDtype::parse("int3"), None);
    }
}
