"""Medusa heads (Cai et al. 2024, github.com/FasterDecoding/Medusa): k small heads on the
target's final hidden state h_t, head i guessing the token i + 1 places after the one the
target's own LM head gives:

    head i:  logits = W_i · R_i,L(... R_i,1(h_t))      R(x) = x + SiLU(A x + b)   (L ResBlocks)

The folder holds `config.json` (`medusa_num_heads`, `medusa_num_layers`; `hidden_size` and
`vocab_size` where given, else read off the tensors) and the heads in `*.safetensors`,
named as either public layout names them (a `medusa_head.` or `medusa_heads.` prefix is
dropped; a Medusa-2 file's base-model tensors, `model.*` and `lm_head.weight`, are skipped):

    FasterDecoding (medusa_lm_head.safetensors)   vLLM's Medusa loader
    {i}.{j}.linear.weight / .bias                 blocks.{i}.layers.{j}.weight / .bias
    {i}.{L}.weight                                lm_heads.{i}.weight
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...model.linear import ColumnParallelLinear, process_weights_after_loading
from ...model.loader import checkpoint_files, iter_checkpoint
from ...model.parallel import TPGroup
from ...model.weights import read_all

_PREFIXES = ("medusa_heads.", "medusa_head.")
_FASTER_DECODING = re.compile(r"(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)")
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_HEAD = re.compile(r"lm_heads\.(\d+)\.weight")


class MedusaHeads(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_layers: int,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        tp = TPGroup()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size, self.dtype = hidden_size, vocab_size, dtype
        self.blocks = nn.ModuleList(
            nn.ModuleList(
                ColumnParallelLinear(hidden_size, [hidden_size], True, tp, dtype, device) for _ in range(num_layers)
            )
            for _ in range(num_heads)
        )
        self.lm_heads = nn.ModuleList(
            ColumnParallelLinear(hidden_size, [vocab_size], False, tp, dtype, device) for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[num_heads, B, V] logits of the first `num_heads` heads on hidden [B, H]."""
        out = []
        for blocks, lm_head in zip(self.blocks[:num_heads], self.lm_heads[:num_heads]):
            x = hidden
            for block in blocks:
                x = x + F.silu(block(x))
            out.append(lm_head(x).float())
        return torch.stack(out)


def load_medusa_heads(folder: str, dtype: torch.dtype, device: torch.device, kernel_impl: str) -> MedusaHeads:
    """The heads of `folder`; a ValueError naming speculative.heads where the folder does not
    hold them in a layout above."""
    path = Path(folder)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"speculative.heads {folder}: config.json is missing (Medusa heads need one)")
    config = json.loads(config_path.read_text())
    try:
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except KeyError as e:
        raise ValueError(f"speculative.heads {folder}: config.json lacks {e.args[0]} (not a Medusa folder)") from e
    try:
        checkpoint_files(path)
    except Exception as e:  # the loader's own error says which file
        raise ValueError(f"speculative.heads {folder}: {e}") from e
    tensors = {}
    for name, tensor in iter_checkpoint(path):
        for prefix in _PREFIXES:
            name = name.removeprefix(prefix)
        key = _parameter_name(name, num_layers)
        if key is None:
            if name.startswith("model.") or name == "lm_head.weight":
                continue  # a Medusa-2 checkpoint carries the base model too
            raise ValueError(f"speculative.heads {folder}: tensor {name!r} is not part of a Medusa head")
        tensors[key] = read_all(tensor)
    first = tensors.get("lm_heads.0.weight")
    if first is None:
        raise ValueError(f"speculative.heads {folder}: no Medusa head tensors (see the accepted layouts)")
    hidden = int(config.get("hidden_size") or first.shape[1])
    vocab = int(config.get("vocab_size") or first.shape[0])
    heads = MedusaHeads(num_heads, num_layers, hidden, vocab, dtype, device)
    params = dict(heads.named_parameters())
    missing = [name for name in params if name not in tensors]
    if missing:
        raise ValueError(f"speculative.heads {folder}: the heads lack tensors {', '.join(missing[:6])}")
    for name, value in tensors.items():
        if name not in params:
            continue  # heads past medusa_num_heads
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(
                f"speculative.heads {folder}: {name} has shape {tuple(value.shape)}, config.json says "
                f"{tuple(params[name].shape)}"
            )
        with torch.no_grad():
            params[name].copy_(value.to(dtype))
    process_weights_after_loading(heads, kernel_impl)
    return heads.eval()


def _parameter_name(name: str, num_layers: int) -> str | None:
    """Our parameter name of a checkpoint tensor (either layout), None if neither names it."""
    if m := _VLLM_BLOCK.fullmatch(name):
        return f"blocks.{m[1]}.{m[2]}.{m[3]}"
    if m := _VLLM_HEAD.fullmatch(name):
        return f"lm_heads.{m[1]}.weight"
    if m := _FASTER_DECODING.fullmatch(name):
        head, layer, kind = m[1], int(m[2]), m[3]
        if layer == num_layers and kind == "weight":
            return f"lm_heads.{head}.weight"
        if layer < num_layers:
            return f"blocks.{head}.{layer}.{kind}"
    return None
