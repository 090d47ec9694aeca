//! Constructors for the layouts real engines use (vLLM FlashAttention NHD/HND, FlashInfer,
//! SGLang token-slot MHA and MLA, vLLM-style MLA). Each builds the plane table and region
//! lengths and then goes through the same validation as [`PoolLayout::custom`]; nothing here
//! is trusted.

use serde::{Deserialize, Serialize};

use crate::{AttnSpec, Dtype, LayoutError, LayoutKind, Plane, PlaneKind, PoolLayout, StrideOrder};

/// MLA geometry: one latent vector of `kv_lora_rank + rope_dim` elements per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MlaSpec {
    /// Transformer layers.
    pub layers: u32,
    /// Compressed KV width (e.g. 512 for DeepSeek-V3).
    pub kv_lora_rank: u32,
    /// Decoupled RoPE key width (e.g. 64).
    pub rope_dim: u32,
    /// Tokens per block (SGLang: page size).
    pub block_size: u32,
    /// Element type.
    pub dtype: Dtype,
}

impl MlaSpec {
    fn attn(&self) -> Result<AttnSpec, LayoutError> {
        let head_dim = self
            .kv_lora_rank
            .checked_add(self.rope_dim)
            .ok_or(LayoutError::Overflow { what: "latent width" })?;
        Ok(AttnSpec {
            layers: self.layers,
            kv_heads: 1,
            head_dim,
            block_size: self.block_size,
            dtype: self.dtype,
        })
    }
}

fn mul(a: u64, b: u64, what: &'static str) -> Result<u64, LayoutError> {
    a.checked_mul(b).ok_or(LayoutError::Overflow { what })
}

fn block_bytes(spec: &AttnSpec) -> Result<u64, LayoutError> {
    spec.block_bytes().ok_or(LayoutError::Overflow { what: "block bytes" })
}

/// Token slots of an SGLang pool of `size` tokens: `size + page_size` (slot page 0 is the
/// padding page SGLang reserves for dummy writes), as whole pages.
fn sglang_pages(size: u64, page_size: u32) -> Result<u32, LayoutError> {
    if page_size == 0 {
        return Err(LayoutError::Zero { what: "block_size" });
    }
    if size == 0 {
        return Err(LayoutError::Zero { what: "size" });
    }
    if !size.is_multiple_of(u64::from(page_size)) {
        return Err(LayoutError::PartialPage { size, page_size });
    }
    u32::try_from(size / u64::from(page_size) + 1).map_err(|_| LayoutError::Overflow { what: "page count" })
}

impl PoolLayout {
    /// vLLM FlashAttention: per layer one region shaped `(2, num_blocks, block_size, kv_heads,
    /// head_dim)`; K blocks first (`b * block_bytes`), then V (`(num_blocks + b) * block_bytes`).
    /// `order` says whether a block is stored NHD or HND inside (its extent is the same; the
    /// fingerprint differs, so NHD and HND pools never exchange blocks).
    pub fn vllm_flash_attn(spec: AttnSpec, num_blocks: u32, order: StrideOrder) -> Result<Self, LayoutError> {
        let bb = block_bytes(&spec)?;
        let plane_len = mul(u64::from(num_blocks), bb, "plane length")?;
        let region_len = mul(plane_len, 2, "region length")?;
        let layers = (0..spec.layers)
            .map(|l| {
                vec![
                    Plane { kind: PlaneKind::K, region: l, base: 0, stride: bb, block_bytes: bb },
                    Plane { kind: PlaneKind::V, region: l, base: plane_len, stride: bb, block_bytes: bb },
                ]
            })
            .collect();
        let regions = vec![region_len; spec.layers as usize];
        Self::custom(LayoutKind::VllmFlashAttn { order }, spec, num_blocks, regions, layers)
    }

    /// FlashInfer: per layer one region shaped `(num_blocks, 2, block_size, kv_heads, head_dim)`;
    /// block `b`'s K at `2b * block_bytes`, its V right after.
    pub fn flashinfer(spec: AttnSpec, num_blocks: u32, order: StrideOrder) -> Result<Self, LayoutError> {
        let bb = block_bytes(&spec)?;
        let stride = mul(bb, 2, "block stride")?;
        let region_len = mul(u64::from(num_blocks), stride, "region length")?;
        let layers = (0..spec.layers)
            .map(|l| {
                vec![
                    Plane { kind: PlaneKind::K, region: l, base: 0, stride, block_bytes: bb },
                    Plane { kind: PlaneKind::V, region: l, base: bb, stride, block_bytes: bb },
                ]
            })
            .collect();
        let regions = vec![region_len; spec.layers as usize];
        Self::custom(LayoutKind::FlashInfer { order }, spec, num_blocks, regions, layers)
    }

    /// SGLang MHA token-slot pool of `size` tokens with `page_size = spec.block_size`: per layer
    /// `k_buffer` (region `2l`) and `v_buffer` (region `2l + 1`), each shaped
    /// `(size + page_size, kv_heads, head_dim)`. Block id = SGLang page index; page 0 is the
    /// padding page SGLang reserves, so there are `size / page_size + 1` blocks.
    pub fn sglang_mha(spec: AttnSpec, size: u64) -> Result<Self, LayoutError> {
        let pages = sglang_pages(size, spec.block_size)?;
        let bb = block_bytes(&spec)?;
        let region_len = mul(u64::from(pages), bb, "buffer length")?;
        let layers = (0..spec.layers)
            .map(|l| {
                vec![
                    Plane { kind: PlaneKind::K, region: 2 * l, base: 0, stride: bb, block_bytes: bb },
                    Plane { kind: PlaneKind::V, region: 2 * l + 1, base: 0, stride: bb, block_bytes: bb },
                ]
            })
            .collect();
        let regions = vec![region_len; 2 * spec.layers as usize];
        Self::custom(LayoutKind::SglangMha, spec, pages, regions, layers)
    }

    /// vLLM's CPU backend ([`LayoutKind::VllmCpu`]): one region holding every layer, layer
    /// outermost, each layer `(num_blocks, kv_heads, block_size, 2 * head_dim)` contiguous; per
    /// layer one [`PlaneKind::KvRecord`] plane whose block `b` is the `2 * block_bytes` record at
    /// `layer * num_blocks * 2 * block_bytes + b * 2 * block_bytes`. Whole blocks only: the
    /// in-block order (K dimension-major, V token-major per head) is the kind's business, and
    /// the fingerprint keeps any other layout's bytes out.
    pub fn vllm_cpu(spec: AttnSpec, num_blocks: u32) -> Result<Self, LayoutError> {
        let record = mul(block_bytes(&spec)?, 2, "block record")?;
        let layer_len = mul(u64::from(num_blocks), record, "layer length")?;
        let region_len = mul(layer_len, u64::from(spec.layers), "region length")?;
        let layers = (0..spec.layers)
            .map(|l| {
                let base = mul(layer_len, u64::from(l), "layer base")?;
                Ok(vec![Plane {
                    kind: PlaneKind::KvRecord,
                    region: 0,
                    base,
                    stride: record,
                    block_bytes: record,
                }])
            })
            .collect::<Result<Vec<_>, LayoutError>>()?;
        Self::custom(LayoutKind::VllmCpu, spec, num_blocks, vec![region_len], layers)
    }

    /// MLA, vLLM style: per layer one latent region shaped `(num_blocks, block_size,
    /// kv_lora_rank + rope_dim)`.
    pub fn mla(mla: MlaSpec, num_blocks: u32) -> Result<Self, LayoutError> {
        let spec = mla.attn()?;
        let bb = block_bytes(&spec)?;
        let region_len = mul(u64::from(num_blocks), bb, "region length")?;
        let layers = (0..spec.layers)
            .map(|l| vec![Plane { kind: PlaneKind::Latent, region: l, base: 0, stride: bb, block_bytes: bb }])
            .collect();
        let kind = LayoutKind::Mla { kv_lora_rank: mla.kv_lora_rank, rope_dim: mla.rope_dim };
        Self::custom(kind, spec, num_blocks, vec![region_len; spec.layers as usize], layers)
    }

    /// MLA, SGLang style: per layer one token-slot buffer `(size + page_size, 1, kv_lora_rank +
    /// rope_dim)`; block id = page index, page 0 being SGLang's padding page.
    pub fn sglang_mla(mla: MlaSpec, size: u64) -> Result<Self, LayoutError> {
        let spec = mla.attn()?;
        let pages = sglang_pages(size, spec.block_size)?;
        let bb = block_bytes(&spec)?;
        let region_len = mul(u64::from(pages), bb, "buffer length")?;
        let layers = (0..spec.layers)
            .map(|l| vec![Plane { kind: PlaneKind::Latent, region: l, base: 0, stride: bb, block_bytes: bb }])
            .collect();
        let kind = LayoutKind::SglangMla { kv_lora_rank: mla.kv_lora_rank, rope_dim: mla.rope_dim };
        Self::custom(kind, spec, pages, vec![region_len; spec.layers as usize], layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-3-8B-like: 32 layers, 8 KV heads, head dim 128, bf16, block 16 -> 32 KiB per plane block.
    fn llama() -> AttnSpec {
        AttnSpec { layers: 32, kv_heads: 8, head_dim: 128, block_size: 16, dtype: Dtype::Bf16 }
    }

    #[test]
    fn vllm_offsets_match_tensor_shape() {
        for order in [StrideOrder::Nhd, StrideOrder::Hnd] {
            let l = PoolLayout::vllm_flash_attn(llama(), 1000, order).unwrap();
            let bb = 16 * 8 * 128 * 2;
            assert_eq!(l.region_lens(), &vec![2 * 1000 * bb; 32][..]);
            let ext = l.extents(&[7], 3..4).unwrap();
            // element offset of [kv, b, 0, 0, 0] in a contiguous (2, nb, bs, h, d) tensor
            assert_eq!(ext[0], crate::Extent { region: 3, offset: 7 * bb, len: bb });
            assert_eq!(ext[1], crate::Extent { region: 3, offset: (1000 + 7) * bb, len: bb });
        }
    }

    #[test]
    fn flashinfer_interleaves_k_and_v() {
        let l = PoolLayout::flashinfer(llama(), 10, StrideOrder::Nhd).unwrap();
        let bb = 16 * 8 * 128 * 2;
        let ext = l.extents(&[2], 0..1).unwrap();
        // (nb, 2, ...): block 2's K at (2*2+0)*bb, V at (2*2+1)*bb; staging order K then V, and
        // contiguous, so they coalesce into one extent.
        assert_eq!(ext, vec![crate::Extent { region: 0, offset: 4 * bb, len: 2 * bb }]);
        let ext = l.extents(&[2, 3], 0..1).unwrap();
        assert_eq!(ext.len(), 4, "K2 K3 V2 V3 are not contiguous in staging order");
    }

    #[test]
    fn sglang_reserves_a_padding_page() {
        let spec = AttnSpec { layers: 2, kv_heads: 4, head_dim: 64, block_size: 64, dtype: Dtype::F16 };
        let l = PoolLayout::sglang_mha(spec, 64 * 100).unwrap();
        assert_eq!(l.num_blocks(), 101);
        let slot_bytes = 4 * 64 * 2;
        assert_eq!(l.region_lens(), &vec![(6400 + 64) * slot_bytes; 4][..]);
        let ext = l.extents(&[100], 1..2).unwrap();
        assert_eq!(ext[0], crate::Extent { region: 2, offset: 100 * 64 * slot_bytes, len: 64 * slot_bytes });
        assert_eq!(ext[1].region, 3);
        assert!(matches!(PoolLayout::sglang_mha(spec, 100), Err(LayoutError::PartialPage { size: 100, .. })));
    }

    #[test]
    fn mla_has_one_latent_region_per_layer() {
        let m = MlaSpec { layers: 61, kv_lora_rank: 512, rope_dim: 64, block_size: 64, dtype: Dtype::Bf16 };
        let l = PoolLayout::mla(m, 50).unwrap();
        assert_eq!(l.region_lens().len(), 61);
        assert_eq!(l.spec().head_dim, 576);
        assert_eq!(l.bytes_per_block(0..61).unwrap(), 61 * 64 * 576 * 2);
        let s = PoolLayout::sglang_mla(m, 64 * 10).unwrap();
        assert_eq!(s.num_blocks(), 11);
        assert_eq!(s.region_lens()[0], (640 + 64) * 576 * 2);
    }

    #[test]
    fn vllm_cpu_is_one_buffer_of_whole_block_records() {
        // 4 layers, 2 KV heads, head 64, block 128, f32: a record is 2 * 128*2*64*4 = 128 KiB.
        let spec = AttnSpec { layers: 4, kv_heads: 2, head_dim: 64, block_size: 128, dtype: Dtype::F32 };
        let l = PoolLayout::vllm_cpu(spec, 10).unwrap();
        let rec = 2 * 128 * 2 * 64 * 4;
        assert_eq!(l.region_lens(), &[4 * 10 * rec][..]);
        // element offset of [layer, b, 0, 0, 0] in a contiguous (L, nb, H, bs, 2*hd) tensor
        let ext = l.extents(&[7], 2..3).unwrap();
        assert_eq!(ext, vec![crate::Extent { region: 0, offset: (2 * 10 + 7) * rec, len: rec }]);
        // consecutive blocks of a layer coalesce; layers do not (other blocks lie between)
        let ext = l.extents(&[3, 4, 5], 0..2).unwrap();
        assert_eq!(ext.len(), 2);
        assert_eq!(ext[0], crate::Extent { region: 0, offset: 3 * rec, len: 3 * rec });
        assert_eq!(l.bytes_per_block(0..4).unwrap(), 4 * rec);
        // the last block of the last layer ends at the region's end
        let last = l.extents(&[9], 3..4).unwrap()[0];
        assert_eq!(last.offset + last.len, l.region_lens()[0]);
        // a KvRecord plane of K-plane size is refused
        let bad = PoolLayout::custom(
            LayoutKind::VllmCpu,
            spec,
            10,
            vec![4 * 10 * rec],
            (0..4)
                .map(|i| {
                    vec![Plane {
                        kind: PlaneKind::KvRecord,
                        region: 0,
                        base: i * 10 * rec,
                        stride: rec,
                        block_bytes: rec / 2,
                    }]
                })
                .collect(),
        );
        assert!(matches!(bad, Err(LayoutError::BlockBytes { .. })), "{bad:?}");
    }

    #[test]
    fn vllm_cpu_fingerprint_differs_from_every_gpu_layout() {
        let spec = llama();
        let cpu = PoolLayout::vllm_cpu(spec, 100).unwrap().fingerprint("m");
        assert_eq!(cpu.kind.to_string(), "vllm_cpu");
        for other in [
            PoolLayout::vllm_flash_attn(spec, 100, StrideOrder::Nhd).unwrap(),
            PoolLayout::vllm_flash_attn(spec, 100, StrideOrder::Hnd).unwrap(),
            PoolLayout::flashinfer(spec, 100, StrideOrder::Nhd).unwrap(),
            PoolLayout::flashinfer(spec, 100, StrideOrder::Hnd).unwrap(),
        ] {
            let f = other.fingerprint("m");
            let e = cpu.check_compatible(&f).unwrap_err();
            assert_eq!(e.field, "kind");
            assert_ne!(cpu.digest(), f.digest());
            // same per-block byte count: only the fingerprint keeps them apart
            assert_eq!(
                other.bytes_per_block(0..32).unwrap(),
                PoolLayout::vllm_cpu(spec, 100).unwrap().bytes_per_block(0..32).unwrap()
            );
        }
    }

    #[test]
    fn zero_dims_are_refused() {
        let mut s = llama();
        s.kv_heads = 0;
        assert!(matches!(
            PoolLayout::vllm_flash_attn(s, 10, StrideOrder::Nhd),
            Err(LayoutError::Zero { what: "kv_heads" })
        ));
        assert!(matches!(
            PoolLayout::vllm_flash_attn(llama(), u32::MAX, StrideOrder::Nhd).map(|l| l.total_bytes()),
            Ok(_) | Err(LayoutError::Overflow { .. })
        ));
    }
}
