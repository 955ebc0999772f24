"""A tiny random-weight Llama, made at test time (no hub here), and the prompts the engine tests
send: token ids that share long prefixes, so that the second request of a prefix reuses the
first one's KV from wherever the engine kept it.

``python model.py DIR [--layers N --hidden N]`` writes the model; the engine tests call
:func:`build` once per session. The weights are scaled ×5 because at the default init
(std 0.02) the logits are nearly flat and greedy decoding repeats one token: with visible
structure, a wrong KV page changes the generated tokens, which is what the negative controls
rely on."""

from __future__ import annotations

import argparse
import json
import os

VOCAB = 1024


def build(path: str, *, layers: int = 2, hidden: int = 256, intermediate: int = 512, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> str:
    """Writes config.json and model.safetensors into ``path`` (once: an existing model with the
    same shape is kept); returns ``path``."""
    marker = os.path.join(path, "hicache-io-model.json")
    shape = {"layers": layers, "hidden": hidden, "intermediate": intermediate, "heads": heads, "kv_heads": kv_heads, "seed": seed}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == shape:
                return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(5.0)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    with open(marker, "w") as f:
        json.dump(shape, f)
    return path


def prompts(prefix_len: int, suffixes: int, suffix_len: int = 24, seed: int = 1) -> "tuple[list[int], list[list[int]]]":
    """One shared prefix of ``prefix_len`` tokens and ``suffixes`` prompts that extend it with
    distinct tails (token ids 3..VOCAB-1: no bos/eos inside)."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(prefix_len)]
    return prefix, [prefix + [rng.randrange(3, VOCAB) for _ in range(suffix_len)] for _ in range(suffixes)]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    a = ap.parse_args()
    print(build(a.dir, layers=a.layers, hidden=a.hidden, intermediate=a.intermediate))
