"""Builders of speculative heads in their public checkpoint layouts, random or made to agree
with a cycle target, written to tmp folders (nothing is downloaded):

    Medusa (FasterDecoding): config.json + medusa_lm_head.safetensors, {i}.{j}.linear.* and {i}.{L}.weight
    Medusa (vLLM):           blocks.{i}.layers.{j}.* and lm_heads.{i}.weight
    EAGLE-1 (yuhuili):       a one-layer LlamaConfig + fc.weight, layers.0.*, optional embed_tokens.weight
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

CYCLE = 32


def cycle_successor(vocab_size: int, seed: int = 0) -> torch.Tensor:
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    successor = torch.empty(vocab_size, dtype=torch.long)
    for start in range(0, vocab_size, CYCLE):
        cycle = order[start : start + CYCLE]
        successor[cycle] = torch.roll(cycle, -1)
    return successor


def make_cycle_target(src: Path, dst: Path) -> Path:
    """The tiny model whose layers add nothing, its LM head mapping each token's embedding
    to its successor on fixed 32-token cycles (bench/speculative.py's cycle model): greedy
    output walks a cycle."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    embed = weights["model.embed_tokens.weight"]
    successor = cycle_successor(embed.shape[0])
    lm_head = torch.empty_like(weights["lm_head.weight"])
    lm_head[successor] = embed
    weights["lm_head.weight"] = lm_head
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def write_medusa(
    path: Path,
    target_dir: Path,
    num_heads: int = 4,
    num_layers: int = 1,
    layout: str = "faster",
    agree_on_cycle: bool = False,
    seed: int = 0,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    noise: float = 0.0,
) -> Path:
    """Medusa heads for the target (random ones of another hidden or vocabulary size where
    asked); `agree_on_cycle`: head i maps a cycle target's hidden state at x to
    succ^(i+2)(x), what the target would emit i + 1 tokens later (`noise` on the LM heads
    makes them miss now and then)."""
    path.mkdir(parents=True, exist_ok=True)
    target = json.loads((target_dir / "config.json").read_text())
    hidden, vocab = hidden_size or target["hidden_size"], vocab_size or target["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    lm_head = load_file(target_dir / "model.safetensors")["lm_head.weight"] if agree_on_cycle else None
    successor = cycle_successor(vocab)
    for i in range(num_heads):
        if agree_on_cycle:
            # lm_head[succ(x)] peaks at x; head i must peak at succ^(i+2)(x): W_i[succ^(i+1)(y)] = lm_head[y].
            shift = torch.arange(vocab)
            for _ in range(i + 1):
                shift = successor[shift]
            head = torch.empty_like(lm_head)
            head[shift] = lm_head
            head += noise * torch.randn(head.shape, generator=generator)
        else:
            head = 0.1 * torch.randn(vocab, hidden, generator=generator)
        for j in range(num_layers):
            scale = 0.0 if agree_on_cycle else 0.05
            w, b = (
                scale * torch.randn(hidden, hidden, generator=generator),
                scale * torch.randn(hidden, generator=generator),
            )
            if layout == "faster":
                tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"] = w, b
            else:
                tensors[f"blocks.{i}.layers.{j}.weight"], tensors[f"blocks.{i}.layers.{j}.bias"] = w, b
        tensors[f"{i}.{num_layers}.weight" if layout == "faster" else f"lm_heads.{i}.weight"] = head
    config = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "base_model_name_or_path": str(target_dir),
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "medusa_lm_head.safetensors")
    return path


def write_eagle(
    path: Path,
    target_dir: Path,
    agree_on_cycle: bool = False,
    own_embed: bool = False,
    fc_bias: bool = False,
    seed: int = 0,
    config_overrides: dict | None = None,
    noise: float = 0.0,
) -> Path:
    """An EAGLE-1 drafter for the target; `agree_on_cycle`: fc passes the token's embedding
    through and the layer adds nothing, so the target's LM head maps it to its successor
    (`noise` on fc makes it miss now and then)."""
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target_dir / "config.json").read_text())
    config.update({"num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], **(config_overrides or {})})
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return 0.1 * torch.randn(*shape, generator=generator)

    if agree_on_cycle:
        fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        fc += noise * torch.randn(fc.shape, generator=generator)
    else:
        fc = rand(hidden, 2 * hidden)
    zero_out = agree_on_cycle
    tensors = {
        "fc.weight": fc,
        "layers.0.self_attn.q_proj.weight": rand(q, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.o_proj.weight": torch.zeros(hidden, q) if zero_out else rand(hidden, q),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
        "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": torch.zeros(hidden, inter) if zero_out else rand(hidden, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
    }
    if fc_bias:
        tensors["fc.bias"] = torch.zeros(hidden) if agree_on_cycle else rand(hidden)
    if own_embed:
        tensors["embed_tokens.weight"] = load_file(target_dir / "model.safetensors")["model.embed_tokens.weight"]
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def cycle_dir(llama_dir, tmp_path_factory):
    return make_cycle_target(llama_dir, tmp_path_factory.mktemp("cycle") / "model")


@pytest.fixture(scope="session")
def heads():
    """The builders above, for test modules (a conftest is not importable by name)."""
    return SimpleNamespace(write_medusa=write_medusa, write_eagle=write_eagle, cycle_successor=cycle_successor)
