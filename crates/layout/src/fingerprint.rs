//! `LayoutFingerprint`: what two pools must agree on before a block may be copied between
//! them (model, dtype, layers, heads, head dim, block size, layout kind incl. stride order),
//! the field-naming compatibility check, and a stable SHA-256 digest.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Dtype, FingerprintMismatch, LayoutKind, PoolLayout};

/// What makes a block's bytes meaningful to another pool. `num_blocks` is deliberately not
/// part of it: pools of different sizes exchange blocks freely.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutFingerprint {
    /// Model identity (name and revision, as the operator configures it).
    pub model_id: String,
    /// Element type.
    pub dtype: Dtype,
    /// Layers.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Layout kind, including stride order.
    pub kind: LayoutKind,
}

impl PoolLayout {
    /// This layout's fingerprint for model `model_id`.
    pub fn fingerprint(&self, model_id: &str) -> LayoutFingerprint {
        LayoutFingerprint {
            model_id: model_id.to_owned(),
            dtype: self.spec.dtype,
            layers: self.spec.layers,
            kv_heads: self.spec.kv_heads,
            head_dim: self.spec.head_dim,
            block_size: self.spec.block_size,
            kind: self.kind.clone(),
        }
    }
}

impl LayoutFingerprint {
    /// `Ok` when a block may be copied between the two pools; otherwise the first differing
    /// field (in declaration order) with both values.
    pub fn check_compatible(&self, other: &LayoutFingerprint) -> Result<(), FingerprintMismatch> {
        let fields: [(&'static str, String, String); 7] = [
            ("model_id", self.model_id.clone(), other.model_id.clone()),
            ("dtype", self.dtype.to_string(), other.dtype.to_string()),
            ("layers", self.layers.to_string(), other.layers.to_string()),
            ("kv_heads", self.kv_heads.to_string(), other.kv_heads.to_string()),
            ("head_dim", self.head_dim.to_string(), other.head_dim.to_string()),
            ("block_size", self.block_size.to_string(), other.block_size.to_string()),
            ("kind", self.kind.to_string(), other.kind.to_string()),
        ];
        match fields.into_iter().find(|(_, a, b)| a != b) {
            Some((field, ours, theirs)) => Err(FingerprintMismatch { field, ours, theirs }),
            None => Ok(()),
        }
    }

    /// Stable lowercase-hex SHA-256 of a versioned, length-prefixed encoding of every field
    /// ([`Self::digest_bytes`] as text, for logs and messages).
    pub fn digest(&self) -> String {
        crate::hash::hex(&self.digest_bytes())
    }

    /// The SHA-256 of a versioned, length-prefixed encoding of every field: the 32 bytes that
    /// cross the wire (peer frames, the Engine and Migration APIs). Equal fingerprints have
    /// equal digests in every process and on every platform.
    pub fn digest_bytes(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(b"kvferry-layout-fingerprint-v1");
        field(self.model_id.as_bytes());
        field(self.dtype.name().as_bytes());
        field(&self.layers.to_le_bytes());
        field(&self.kv_heads.to_le_bytes());
        field(&self.head_dim.to_le_bytes());
        field(&self.block_size.to_le_bytes());
        field(self.kind.to_string().as_bytes());
        h.finalize().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttnSpec, StrideOrder};

    fn spec() -> AttnSpec {
        AttnSpec { layers: 32, kv_heads: 8, head_dim: 128, block_size: 16, dtype: Dtype::Bf16 }
    }

    #[test]
    fn equal_layouts_are_compatible_regardless_of_pool_size() {
        let a = PoolLayout::vllm_flash_attn(spec(), 100, StrideOrder::Hnd).unwrap().fingerprint("llama-3-8b");
        let b =
            PoolLayout::vllm_flash_attn(spec(), 5000, StrideOrder::Hnd).unwrap().fingerprint("llama-3-8b");
        assert_eq!(a.check_compatible(&b), Ok(()));
        assert_eq!(a.digest(), b.digest());
        assert_eq!(a.digest().len(), 64);
        assert_eq!(a.digest(), crate::hash::hex(&a.digest_bytes()));
    }

    #[test]
    fn mismatch_names_the_field() {
        let base = PoolLayout::vllm_flash_attn(spec(), 100, StrideOrder::Nhd).unwrap().fingerprint("m");
        let hnd = PoolLayout::vllm_flash_attn(spec(), 100, StrideOrder::Hnd).unwrap().fingerprint("m");
        let e = base.check_compatible(&hnd).unwrap_err();
        assert_eq!(
            (e.field, e.ours.as_str(), e.theirs.as_str()),
            ("kind", "vllm_flash_attn/nhd", "vllm_flash_attn/hnd")
        );
        assert!(e.to_string().contains("kind"));
        type Change = Box<dyn Fn(&mut LayoutFingerprint)>;
        let cases: [(&str, Change); 7] = [
            ("model_id", Box::new(|f| f.model_id.push('x'))),
            ("dtype", Box::new(|f| f.dtype = Dtype::F16)),
            ("layers", Box::new(|f| f.layers += 1)),
            ("kv_heads", Box::new(|f| f.kv_heads += 1)),
            ("head_dim", Box::new(|f| f.head_dim += 1)),
            ("block_size", Box::new(|f| f.block_size += 1)),
            ("kind", Box::new(|f| f.kind = LayoutKind::FlashInfer { order: StrideOrder::Nhd })),
        ];
        for (field, change) in cases {
            let mut other = base.clone();
            change(&mut other);
            let e = base.check_compatible(&other).unwrap_err();
            assert_eq!(e.field, field);
            assert_ne!(base.digest(), other.digest(), "digest ignores {field}");
        }
    }

    #[test]
    fn digest_is_pinned() {
        let f = PoolLayout::vllm_flash_attn(spec(), 100, StrideOrder::Hnd).unwrap().fingerprint("llama-3-8b");
        // Computed independently (Python hashlib over the documented encoding); a change here breaks cross-version handshakes.
        assert_eq!(f.digest(), PINNED_DIGEST);
    }

    const PINNED_DIGEST: &str = "487daf20bdf7358b753d150b9f125ab52342acb4bcfcd8581f066ea803764037";
}
