"""What vLLM hands the connector, checked and turned into a kvferry pool: the KV tensors'
geometry (derived from the tensors, never from constants), the memory regions to register,
and the configurations kvferry refuses at start-up (with the reason).

CPU (``vllm_cpu``): every layer is a view ``[num_blocks, kv_heads, block_size, 2*head_size]``
into one buffer, layer outermost; registered as one DRAM region. GPU FlashAttention
(``vllm_flash_attn_nhd`` / ``_hnd``): per layer ``[2, num_blocks, block_size, kv_heads,
head_size]`` (NHD) or the HND permutation, one VRAM region per layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from kvferry.nixl_pool import Region
from kvferry.sdk import LayoutSpec

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class UnsupportedConfig(ValueError):
    """A vLLM configuration kvferry does not support (refused at start-up)."""


@dataclass(frozen=True)
class PoolGeometry:
    spec: LayoutSpec
    regions: list[Region]
    mem_type: str
    layer_names: list[str]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        es = {"f32": 4, "bf16": 2, "f16": 2, "fp8_e4m3": 1}[self.spec.dtype]
        return 2 * self.spec.layers * self.spec.kv_heads * self.spec.block_size * self.spec.head_dim * es


def check_config(vllm_config: Any) -> None:
    """Refuses what kvferry does not support, with a message naming the setting."""
    par = vllm_config.parallel_config
    if getattr(par, "tensor_parallel_size", 1) != 1 or getattr(par, "pipeline_parallel_size", 1) != 1:
        raise UnsupportedConfig(
            "kvferry: tensor/pipeline parallelism is not supported (one pool per engine, one rank); "
            f"got tensor_parallel_size={par.tensor_parallel_size}, "
            f"pipeline_parallel_size={par.pipeline_parallel_size}"
        )
    mc = vllm_config.model_config
    if getattr(mc, "use_mla", False):
        raise UnsupportedConfig("kvferry: MLA models are not supported by KvferryConnector yet")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        raise UnsupportedConfig(
            f"kvferry: kv_cache_dtype={cache_dtype!r} (fp8 KV) is not supported; use 'auto'"
        )
    ktc = vllm_config.kv_transfer_config
    policy = getattr(ktc, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise UnsupportedConfig(
            'kvferry: set "kv_load_failure_policy": "recompute" in --kv-transfer-config: a failed or '
            f"late load must be recomputed, not fail the request (got {policy!r})"
        )


def check_groups(kv_cache_config: Any) -> None:
    """Hybrid (HMA) models have several KV cache groups; kvferry handles exactly one."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        raise UnsupportedConfig(
            f"kvferry: models with {len(groups)} KV cache groups (hybrid / sliding-window mixes) are not "
            "supported; KvferryConnector handles one full-attention group"
        )


def _layer_index(name: str) -> int:
    nums = re.findall(r"\.(\d+)\.", name + ".")
    if not nums:
        raise UnsupportedConfig(f"kvferry: cannot tell the layer index of KV cache {name!r}")
    return int(nums[0])


def geometry_of(kv_caches: dict[str, torch.Tensor], block_size: int) -> PoolGeometry:
    """The pool layout of vLLM's KV tensors, verified against their real addresses and strides."""
    if not kv_caches:
        raise UnsupportedConfig("kvferry: vLLM handed over no KV caches")
    names = sorted(kv_caches, key=_layer_index)
    ts = [kv_caches[n] for n in names]
    t0 = ts[0]
    if t0.dtype not in DTYPES:
        raise UnsupportedConfig(f"kvferry: KV dtype {t0.dtype} is not supported")
    if any(t.dtype != t0.dtype or t.shape != t0.shape or t.device != t0.device for t in ts):
        raise UnsupportedConfig("kvferry: the KV caches of all layers must share dtype, shape and device")
    es = t0.element_size()
    if t0.device.type == "cpu":
        return _cpu(names, ts, block_size, es)
    if t0.device.type == "cuda":
        return _cuda(names, ts, block_size, es)
    raise UnsupportedConfig(f"kvferry: KV caches on {t0.device.type} are not supported")


def _contiguous(t: torch.Tensor) -> bool:
    return t.is_contiguous()


def _cpu(names: list[str], ts: list[torch.Tensor], block_size: int, es: int) -> PoolGeometry:
    t0 = ts[0]
    if t0.dim() != 4:
        raise UnsupportedConfig(f"kvferry: CPU KV cache of shape {tuple(t0.shape)} is not [nb, h, bs, 2*hd]")
    nb, heads, bs, two_hd = t0.shape
    if bs != block_size or two_hd % 2:
        raise UnsupportedConfig(
            f"kvferry: CPU KV cache {tuple(t0.shape)} does not match block_size {block_size} with K and V"
        )
    if not all(_contiguous(t) for t in ts):
        raise UnsupportedConfig("kvferry: CPU KV caches must be contiguous per layer")
    layer_bytes = nb * heads * bs * two_hd * es
    base = ts[0].data_ptr()
    for i, t in enumerate(ts):
        if t.data_ptr() != base + i * layer_bytes:
            raise UnsupportedConfig(
                f"kvferry: layer {names[i]} is not at layer offset {i} of one buffer (LBHNC expected)"
            )
    spec = LayoutSpec(
        kind="vllm_cpu",
        layers=len(ts),
        kv_heads=heads,
        head_dim=two_hd // 2,
        block_size=bs,
        num_blocks=nb,
        dtype=DTYPES[t0.dtype],
    )
    return PoolGeometry(spec, [Region(base, layer_bytes * len(ts))], "DRAM", names)


def _cuda(names: list[str], ts: list[torch.Tensor], block_size: int, es: int) -> PoolGeometry:
    """FlashAttention: each layer `[2, nb, bs, h, hd]` (NHD, contiguous) or that shape with HND
    strides (NixlConnector's layout); one VRAM region per layer."""
    t0 = ts[0]
    if t0.dim() != 5 or t0.shape[0] != 2 or t0.shape[2] != block_size:
        raise UnsupportedConfig(f"kvferry: GPU KV cache of shape {tuple(t0.shape)} is not [2, nb, bs, h, hd]")
    _, nb, bs, heads, hd = t0.shape
    st = t0.stride()
    nhd = (2 * 0 + nb * bs * heads * hd, bs * heads * hd, heads * hd, hd, 1)
    hnd = (nb * bs * heads * hd, bs * heads * hd, hd, bs * hd, 1)
    if st == nhd:
        kind = "vllm_flash_attn_nhd"
    elif st == hnd:
        kind = "vllm_flash_attn_hnd"
    else:
        raise UnsupportedConfig(f"kvferry: GPU KV cache strides {st} are neither NHD nor HND")
    dev = t0.device.index or 0
    regions = [Region(t.data_ptr(), 2 * nb * bs * heads * hd * es, dev) for t in ts]
    spec = LayoutSpec(
        kind=kind,
        layers=len(ts),
        kv_heads=heads,
        head_dim=hd,
        block_size=bs,
        num_blocks=nb,
        dtype=DTYPES[t0.dtype],
    )
    return PoolGeometry(spec, regions, "VRAM", names)
