"""Loads a Hugging Face folder's safetensors into a model, one tensor (or one shard of a
tensor) at a time. Every failure names the file and tensor involved."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .errors import ModelLoadError

# Tensors some checkpoints carry that have no parameter here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights (model.safetensors is missing)")
    for path in files:
        if not path.exists():
            raise ModelLoadError(f"{path} is listed in the safetensors index but missing")
    return files


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    target, shard_id = model.checkpoint_target(name)
                    param = params.get(target)
                    if param is None:
                        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
                            continue
                        raise ModelLoadError(f"{path}: tensor {name!r} matches no model parameter")
                    loader = param.weight_loader
                    try:
                        tensor = f.get_slice(name)
                        with torch.no_grad():
                            loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
                    except ValueError as e:
                        raise ModelLoadError(f"{path}: tensor {name!r}: {e}") from e
                    loaded.add(target if shard_id is None else f"{target}:{shard_id}")
        except SafetensorError as e:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {e}") from e
    missing = [_checkpoint_name(model, n) for n in _expected_names(model, params) if n not in loaded]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: the checkpoint lacks tensors {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
        )


def _expected_names(model: nn.Module, params: dict[str, nn.Parameter]) -> list[str]:
    """Every (parameter, shard) the checkpoint must fill, as `name` or `name:shard`."""
    shards: dict[str, list[object]] = {}
    for target, shard_id in model.stacked_params.values():
        shards.setdefault(target, []).append(shard_id)
    names = []
    for name in params:
        stacked = next((t for t in shards if f".{t}." in name), None)
        if stacked is None:
            names.append(name)
        else:
            names.extend(f"{name}:{shard}" for shard in shards[stacked])
    return names


def _checkpoint_name(model: nn.Module, expected: str) -> str:
    """`...gate_up_proj.weight:1` -> `...up_proj.weight`: the tensor name users look for."""
    name, _, shard = expected.partition(":")
    for source, (target, shard_id) in model.stacked_params.items():
        if shard and f".{target}." in name and str(shard_id) == shard:
            return name.replace(f".{target}.", f".{source}.")
    return name
