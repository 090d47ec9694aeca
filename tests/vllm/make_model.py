#!/usr/bin/env python3
"""Creates a tiny seeded Llama locally (no downloads) for the vLLM tests:
    make_model.py OUT_DIR [--layers N --kv-heads H --heads Q --head-dim D --dtype float32|bfloat16 --seed S]
Random weights under a fixed seed, scaled up so greedy decoding has few near-ties; token-id
prompts only (vLLM runs with skip_tokenizer_init), so a minimal WordLevel tokenizer is saved
for completeness.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    done = a.out / "kvferry-model.json"
    spec = vars(a).copy()
    spec["out"] = str(a.out)
    if done.exists() and json.loads(done.read_text()) == spec:
        return
    torch.manual_seed(a.seed)
    hidden = a.heads * a.head_dim
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        vocab_size=a.vocab,
        max_position_embeddings=4096,
        torch_dtype=a.dtype,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model = model.to(getattr(torch, a.dtype))
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(a.vocab)}
    vocab["<unk>"] = 0
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    )
    tok.save_pretrained(a.out)
    done.write_text(json.dumps(spec))


if __name__ == "__main__":
    main()
