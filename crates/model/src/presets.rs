//! Real model shapes and accelerator peaks, each with its source.
//!
//! Model shapes come from each model's published `config.json` (Hugging Face model cards) or
//! technical report; parameter counts from the model cards. Accelerator figures are **dense**
//! BF16 tensor-core peaks: NVIDIA's datasheets print the 2:4-sparse figure first, which is twice
//! the dense one.

use crate::compute::AttentionShape;
use crate::error::ModelError;
use crate::kv::KvShape;

/// A model's KV shape, attention shape and parameter counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelPreset {
    /// Lower-case name used on the command line.
    pub name: &'static str,
    /// Per-layer KV cache shape.
    pub kv: KvShape,
    /// Attention dimensions (the quadratic prefill term).
    pub attention: AttentionShape,
    /// Total parameters.
    pub params: f64,
    /// Parameters each token passes through (= total for dense models).
    pub active_params: f64,
}

const fn gqa(layers: u32, q_heads: u32, kv_heads: u32, head_dim: u32) -> (KvShape, AttentionShape) {
    (
        KvShape::Gqa { layers, kv_heads, head_dim },
        AttentionShape { layers, q_heads, qk_head_dim: head_dim, v_head_dim: head_dim },
    )
}

const fn dense(name: &'static str, shape: (KvShape, AttentionShape), params: f64) -> ModelPreset {
    ModelPreset { name, kv: shape.0, attention: shape.1, params, active_params: params }
}

/// The model table.
pub const MODELS: &[ModelPreset] = &[
    // meta-llama/Llama-3.1-8B config.json: 32 layers, 32 heads, 8 KV heads, hidden 4096 (head 128); 8.03B.
    dense("llama-3.1-8b", gqa(32, 32, 8, 128), 8.03e9),
    // meta-llama/Llama-3.1-70B config.json: 80 layers, 64 heads, 8 KV heads, hidden 8192; 70.6B.
    dense("llama-3.1-70b", gqa(80, 64, 8, 128), 70.6e9),
    // meta-llama/Llama-3.1-405B config.json: 126 layers, 128 heads, 8 KV heads, hidden 16384; 405.9B.
    dense("llama-3.1-405b", gqa(126, 128, 8, 128), 405.9e9),
    // Qwen/Qwen2.5-72B config.json: 80 layers, 64 heads, 8 KV heads, hidden 8192; 72.7B.
    dense("qwen2.5-72b", gqa(80, 64, 8, 128), 72.7e9),
    // mistralai/Mixtral-8x7B-v0.1 config.json: 32 layers, 32 heads, 8 KV heads, hidden 4096;
    // 46.7B total, 12.9B active with 2 of 8 experts per token (arXiv 2401.04088).
    ModelPreset {
        name: "mixtral-8x7b",
        kv: KvShape::Gqa { layers: 32, kv_heads: 8, head_dim: 128 },
        attention: AttentionShape { layers: 32, q_heads: 32, qk_head_dim: 128, v_head_dim: 128 },
        params: 46.7e9,
        active_params: 12.9e9,
    },
    // deepseek-ai/DeepSeek-V3 config.json: 61 layers, MLA with kv_lora_rank 512 and
    // qk_rope_head_dim 64 cached per token; 128 heads, qk_nope_head_dim 128 (+64 rope = 192),
    // v_head_dim 128; 671B total, 37B active (arXiv 2412.19437).
    ModelPreset {
        name: "deepseek-v3",
        kv: KvShape::Mla { layers: 61, latent_dim: 512, rope_dim: 64 },
        attention: AttentionShape { layers: 61, q_heads: 128, qk_head_dim: 192, v_head_dim: 128 },
        params: 671e9,
        active_params: 37e9,
    },
];

/// An accelerator's dense BF16 peak.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuPreset {
    /// Lower-case name used on the command line.
    pub name: &'static str,
    /// Dense BF16 tensor-core peak, TFLOP/s.
    pub tflops: f64,
}

/// The accelerator table.
pub const GPUS: &[GpuPreset] = &[
    // NVIDIA H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense (the seed's figure).
    GpuPreset { name: "h100-sxm", tflops: 989.0 },
    // NVIDIA H200 datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense (same die as H100 SXM).
    GpuPreset { name: "h200", tflops: 989.0 },
    // NVIDIA A100 datasheet: BF16 312 TFLOPS dense (624 with sparsity).
    GpuPreset { name: "a100", tflops: 312.0 },
    // NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity).
    GpuPreset { name: "l40s", tflops: 362.05 },
    // NVIDIA HGX B200 datasheet: BF16 4.5 PFLOPS with sparsity per GPU -> 2,250 dense.
    GpuPreset { name: "b200", tflops: 2250.0 },
];

/// Looks up a model preset by name (case-insensitive).
pub fn model(name: &str) -> Result<&'static ModelPreset, ModelError> {
    MODELS.iter().find(|m| m.name.eq_ignore_ascii_case(name)).ok_or_else(|| ModelError::UnknownPreset {
        kind: "model",
        name: name.to_owned(),
        known: MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", "),
    })
}

/// Looks up an accelerator preset by name (case-insensitive).
pub fn gpu(name: &str) -> Result<&'static GpuPreset, ModelError> {
    GPUS.iter().find(|g| g.name.eq_ignore_ascii_case(name)).ok_or_else(|| ModelError::UnknownPreset {
        kind: "gpu",
        name: name.to_owned(),
        known: GPUS.iter().map(|g| g.name).collect::<Vec<_>>().join(", "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvFootprint;

    #[test]
    fn known_footprints() {
        let bpt = |n: &str| KvFootprint::new(model(n).unwrap().kv, 2.0).unwrap().bytes_per_token();
        assert_eq!(bpt("llama-3.1-8b"), 131_072.0); // 128 KiB
        assert_eq!(bpt("llama-3.1-70b"), 327_680.0); // 320 KiB, the seed's model
        assert_eq!(bpt("llama-3.1-405b"), 516_096.0); // 504 KiB
        assert_eq!(bpt("qwen2.5-72b"), 327_680.0);
        assert_eq!(bpt("mixtral-8x7b"), 131_072.0);
        assert_eq!(bpt("DeepSeek-V3"), 70_272.0);
    }

    #[test]
    fn moe_active_is_below_total() {
        for m in MODELS {
            assert!(m.active_params <= m.params, "{}", m.name);
            assert_eq!(m.kv.layers(), m.attention.layers, "{}", m.name);
        }
        assert!(model("mixtral-8x7b").unwrap().active_params < 13e9);
    }

    #[test]
    fn unknown_presets_list_the_known_ones() {
        let e = model("gpt-5").unwrap_err().to_string();
        assert!(e.contains("llama-3.1-70b") && e.contains("gpt-5"), "{e}");
        assert_eq!(gpu("H100-SXM").unwrap().tflops, 989.0);
        assert!(gpu("tpu").is_err());
    }
}
