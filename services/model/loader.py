"""Loads a Hugging Face folder's safetensors into a model, one tensor (or one shard of a
tensor) at a time. Every failure names the file and tensor involved.

`load_tensor` is the one path from a checkpoint tensor to a parameter shard: start-up
(`load_weights`) and weight updates (weight_update.py) both go through it, so an update
reshards exactly as loading did.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .errors import ModelLoadError
from .weights import LoadedWeight, shape_of

# Tensors some checkpoints carry that have no parameter here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """Every tensor the model was loaded from, by checkpoint name, with its full (unsharded)
    shape: what a weight update must match."""

    shapes: dict[str, tuple[int, ...]]


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


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, LoadedWeight]]:
    """(name, lazy slice) of every tensor in the folder; a slice reads only what is indexed."""
    for path in checkpoint_files(Path(model_dir)):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not name.endswith(_IGNORED_SUFFIXES):
                        yield name, f.get_slice(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {e}") from e


def load_weights(
    model: nn.Module, model_dir: str | Path, tensors: Iterable[tuple[str, LoadedWeight]] | None = None
) -> CheckpointLayout:
    """The folder's tensors, or `tensors` read from it (compressed_tensors.py converts them)."""
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in iter_checkpoint(model_dir) if tensors is None else tensors:
        try:
            filled = load_tensor(model, params, name, tensor)
        except ModelLoadError as e:
            raise ModelLoadError(f"{model_dir}: {e}") from e
        shapes[name] = shape_of(tensor)
        if filled is not None:
            loaded.add(filled)
    missing = missing_tensors(model, params, loaded)
    if missing:
        raise ModelLoadError(
            f"{model_dir}: the checkpoint lacks tensors {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
        )
    return CheckpointLayout(shapes)


def load_tensor(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: LoadedWeight) -> str | None:
    """Loads one checkpoint tensor into this rank's shard of its parameter. Returns what it
    filled (`param` or `param:shard`), or None for a tensor with nothing to fill (a tied LM head)."""
    target, shard_id = model.checkpoint_target(name)
    param = params.get(target)
    if param is None:
        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
            return None  # the embedding is the head; loading it once keeps them tied
        raise ModelLoadError(f"tensor {name!r} matches no model parameter")
    loader = param.weight_loader
    try:
        with torch.no_grad():
            loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
    except ValueError as e:
        raise ModelLoadError(f"tensor {name!r}: {e}") from e
    return target if shard_id is None else f"{target}:{shard_id}"


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, LoadedWeight]]) -> None:
    """load_tensor for each (name, tensor), in order."""
    params = dict(model.named_parameters())
    for name, tensor in tensors:
        load_tensor(model, params, name, tensor)


def missing_tensors(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str]) -> list[str]:
    """Checkpoint names of every (parameter, shard) not in `loaded`."""
    return [_checkpoint_name(model, n) for n in _expected_names(model, params) if n not in loaded]


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
