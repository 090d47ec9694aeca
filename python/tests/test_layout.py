"""The connector's layout derivation from vLLM's KV tensors, on real torch tensors.

The CPU path (`vllm_cpu`, one buffer) runs end to end in tests/vllm with real vLLM. The GPU
path (FlashAttention NHD/HND, one VRAM region per layer) is exercised here up to the device
boundary: `_cuda` reads only shapes, strides, dtypes and data pointers, so host tensors with the
GPU layouts' strides drive it; no CUDA device is needed or touched.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvferry.vllm import layout  # noqa: E402


def test_cpu_caches_in_one_buffer_are_one_dram_region() -> None:
    nb, h, bs, hd = 6, 2, 16, 8
    buf = torch.zeros(3, nb, h, bs, 2 * hd, dtype=torch.bfloat16)
    caches = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(3)}
    g = layout.geometry_of(caches, bs)
    assert g.mem_type == "DRAM"
    assert (g.spec.kind, g.spec.layers, g.spec.kv_heads, g.spec.head_dim, g.spec.num_blocks) == (
        "vllm_cpu",
        3,
        h,
        hd,
        nb,
    )
    assert g.spec.dtype == "bf16"
    assert [(r.addr, r.length) for r in g.regions] == [(buf.data_ptr(), buf.numel() * 2)]


def test_cpu_caches_not_in_one_buffer_are_refused() -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 2, 16, 16) for i in range(2)}
    with pytest.raises(layout.UnsupportedConfig, match="one buffer"):
        layout.geometry_of(caches, 16)


def test_flash_attention_nhd_and_hnd_strides_give_their_kinds() -> None:
    nb, bs, h, hd = 5, 16, 4, 32
    nhd = [torch.zeros(2, nb, bs, h, hd, dtype=torch.float16) for _ in range(2)]
    g = layout._cuda(["l.0", "l.1"], nhd, bs, 2)
    assert (g.spec.kind, g.mem_type, g.spec.fingerprint_kind) == (
        "vllm_flash_attn_nhd",
        "VRAM",
        "vllm_flash_attn/nhd",
    )
    assert [r.length for r in g.regions] == [2 * nb * bs * h * hd * 2] * 2
    assert [r.addr for r in g.regions] == [t.data_ptr() for t in nhd]
    # NixlConnector's HND: the same logical shape over [2, nb, h, bs, hd] storage.
    hnd = [torch.zeros(2, nb, h, bs, hd, dtype=torch.float16).permute(0, 1, 3, 2, 4) for _ in range(2)]
    g = layout._cuda(["l.0", "l.1"], hnd, bs, 2)
    assert (g.spec.kind, g.spec.kv_heads, g.spec.head_dim, g.spec.block_size) == (
        "vllm_flash_attn_hnd",
        h,
        hd,
        bs,
    )


def test_gpu_layouts_kvferry_does_not_know_are_refused() -> None:
    bs = 16
    odd = [torch.zeros(2, 4, bs, 2, 8).permute(0, 1, 2, 4, 3).contiguous().permute(0, 1, 2, 4, 3)]
    with pytest.raises(layout.UnsupportedConfig, match="neither NHD nor HND"):
        layout._cuda(["l.0"], odd, bs, 4)
    with pytest.raises(layout.UnsupportedConfig, match="not \\[2, nb, bs, h, hd\\]"):
        layout._cuda(["l.0"], [torch.zeros(2, 4, 8, 2, 8)], bs, 4)
    meta = {"l.0": torch.empty(2, 4, bs, 2, 8, device="meta")}
    with pytest.raises(layout.UnsupportedConfig, match="meta"):
        layout.geometry_of(meta, bs)
