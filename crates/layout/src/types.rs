//! The vocabulary of a layout: element dtype, stride order, layout kind, attention spec, and a
//! plane (one K, V or latent array of blocks inside a region).

use std::fmt;

use serde::{Deserialize, Serialize};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single.
    F32,
    /// FP8 E4M3 (vLLM `fp8` / `fp8_e4m3`).
    Fp8E4m3,
    /// FP8 E5M2.
    Fp8E5m2,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
        }
    }
    /// Stable name (used in the fingerprint digest).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Order of (tokens, heads) inside one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StrideOrder {
    /// (block_size, kv_heads, head_dim): vLLM's default stride order (0,1,2,3,4).
    Nhd,
    /// (kv_heads, block_size, head_dim): stride order (0,1,3,2,4), what NixlConnector asks for.
    Hnd,
}

impl StrideOrder {
    fn name(self) -> &'static str {
        match self {
            StrideOrder::Nhd => "nhd",
            StrideOrder::Hnd => "hnd",
        }
    }
}

/// How an engine lays KV out. Two pools can exchange blocks only when their kinds are equal
/// (a block's bytes are ordered differently otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutKind {
    /// vLLM FlashAttention: per layer `(2, num_blocks, block_size, kv_heads, head_dim)`.
    VllmFlashAttn {
        /// Stride order inside a block.
        order: StrideOrder,
    },
    /// FlashInfer: per layer `(num_blocks, 2, block_size, kv_heads, head_dim)`.
    FlashInfer {
        /// Stride order inside a block.
        order: StrideOrder,
    },
    /// SGLang MHA token-slot pool: per layer `k_buffer`/`v_buffer` `(size + page_size, heads, head_dim)`.
    SglangMha,
    /// MLA, one latent buffer per layer `(num_blocks, block_size, kv_lora_rank + rope_dim)`.
    Mla {
        /// Compressed KV width.
        kv_lora_rank: u32,
        /// Decoupled RoPE key width.
        rope_dim: u32,
    },
    /// SGLang MLA token-slot pool: per layer `(size + page_size, 1, kv_lora_rank + rope_dim)`.
    SglangMla {
        /// Compressed KV width.
        kv_lora_rank: u32,
        /// Decoupled RoPE key width.
        rope_dim: u32,
    },
    /// vLLM's CPU backend: all layers in one buffer, layer outermost; per layer
    /// `(num_blocks, kv_heads, block_size, 2 * head_dim)`; inside a (block, head) K is stored
    /// dimension-major (`d * block_size + t`) and then V token-major (`t * head_dim + d`).
    /// A block's bytes (all heads, K and V) are one contiguous record per layer.
    VllmCpu,
    /// Anything else, named by the engine.
    Custom {
        /// Engine-chosen name; equal names promise equal in-block byte order.
        name: String,
    },
}

impl fmt::Display for LayoutKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutKind::VllmFlashAttn { order } => write!(f, "vllm_flash_attn/{}", order.name()),
            LayoutKind::FlashInfer { order } => write!(f, "flashinfer/{}", order.name()),
            LayoutKind::SglangMha => f.write_str("sglang_mha"),
            LayoutKind::VllmCpu => f.write_str("vllm_cpu"),
            LayoutKind::Mla { kv_lora_rank, rope_dim } => write!(f, "mla/{kv_lora_rank}+{rope_dim}"),
            LayoutKind::SglangMla { kv_lora_rank, rope_dim } => {
                write!(f, "sglang_mla/{kv_lora_rank}+{rope_dim}")
            }
            LayoutKind::Custom { name } => write!(f, "custom/{name}"),
        }
    }
}

/// The attention geometry of a pool (for MLA: `kv_heads = 1`, `head_dim = latent width`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AttnSpec {
    /// Transformer layers in the pool.
    pub layers: u32,
    /// KV heads (per rank).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per block (SGLang: page size).
    pub block_size: u32,
    /// Element type.
    pub dtype: Dtype,
}

impl AttnSpec {
    /// Bytes of one plane's block: block_size × kv_heads × head_dim × dtype size.
    pub fn block_bytes(&self) -> Option<u64> {
        u64::from(self.block_size)
            .checked_mul(u64::from(self.kv_heads))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(self.dtype.size())
    }
}

/// What a plane holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlaneKind {
    /// Keys.
    K,
    /// Values.
    V,
    /// MLA latent (compressed KV + RoPE key).
    Latent,
    /// Keys and values of every head of a block in one record (vLLM CPU): twice
    /// [`AttnSpec::block_bytes`].
    KvRecord,
}

impl PlaneKind {
    /// How many [`AttnSpec::block_bytes`] one block of this plane holds.
    pub fn block_multiple(self) -> u64 {
        match self {
            PlaneKind::K | PlaneKind::V | PlaneKind::Latent => 1,
            PlaneKind::KvRecord => 2,
        }
    }
}

/// One array of blocks: block `b` occupies `region[base + b*stride .. + block_bytes]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Plane {
    /// K, V or latent.
    pub kind: PlaneKind,
    /// Region index in the pool's region table.
    pub region: u32,
    /// Offset of block 0 in the region.
    pub base: u64,
    /// Distance between consecutive blocks.
    pub stride: u64,
    /// Bytes of one block.
    pub block_bytes: u64,
}
