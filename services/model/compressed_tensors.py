"""Loads int8 checkpoints in the layouts llm-compressor writes for its W8A16 and W8A8 schemes
and vLLM serves: compressed-tensors, 8-bit symmetric per-output-channel int weights, format
"pack-quantized" (W8A16) or "int-quantized" (W8A8). A W8A16 config.json carries

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
        "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel",
                    "group_size": null, "dynamic": false, "actorder": null}}},
      "ignore": ["lm_head"], "quantization_status": "compressed"}

and each quantized linear `X` stores, in place of `X.weight`:

    X.weight_packed  int32 [N, K/4]  four int8 values per word, value k of a word in byte k
                                     (little-endian), each stored as q + 128 (unsigned)
    X.weight_scale   [N, 1]          one scale per output channel (the model's dtype)
    X.weight_shape   int [2]         (N, K)

W8A8 ("int-quantized") stores `X.weight` as int8 [N, K] beside `X.weight_scale`, and its
groups quantize the activations dynamically per token:

    "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token",
                          "dynamic": true, "group_size": null, "actorder": null}

so its layers multiply with int8 activations (w8a8_linear.py), as quantization "w8a8" does
(quantization "int8" runs them weight-only); an LM head quantized there keeps float
activations (the logits), as under "w8a8".

Layers named in "ignore" (and the embedding) keep a float `X.weight`. Anything else (other
bit widths, groups, asymmetric weights, static or per-tensor activation scales, output
activations, sparsity, another quant_method or format) is refused by name.

Loading goes through the float loaders, so every TP rank reads just its shard as before:
`X.weight` arrives holding the integer values q (exact in float32, bfloat16 and float16),
and `X.weight_scale` loads into a float32 [N/tp, 1] parameter this module adds to the layer,
sharded as the weight's rows (whole, for a row-parallel layer). Quantizing the layer
(linear.py) then takes both as they are; an update later writes float weights, re-quantized.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ModelLoadError
from .linear import CpuPackable, RowParallelLinear
from .loader import CheckpointLayout, iter_checkpoint, load_weights
from .weights import LoadedWeight, copy_into, read_all

_SUPPORTED_WEIGHTS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "channel",
    "group_size": None,
    "dynamic": False,
    "actorder": None,
}
_SUPPORTED_ACTIVATIONS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
    "group_size": None,
    "actorder": None,
}
_FORMATS = ("pack-quantized", "int-quantized")
_PACKED, _SCALE, _SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"


def read_quantization_config(model_dir: str | Path) -> dict[str, Any] | None:
    """config.json's quantization_config, checked; None for a float checkpoint."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()).get("quantization_config")
    if config is None:
        return None
    where = f"{path}: quantization_config"
    _expect(config.get("quant_method"), "compressed-tensors", f"{where}.quant_method")
    if config.get("format") not in _FORMATS:
        raise ModelLoadError(f"{where}.format is {config.get('format')!r}: only {' or '.join(_FORMATS)} is supported")
    _expect(config.get("quantization_status", "compressed"), "compressed", f"{where}.quantization_status")
    if config.get("sparsity_config"):
        raise ModelLoadError(f"{where}.sparsity_config: sparse checkpoints are not supported")
    if config.get("kv_cache_scheme"):
        raise ModelLoadError(f"{where}.kv_cache_scheme: KV-cache quantization is not supported")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ModelLoadError(f"{where}.config_groups is empty")
    activations = set()
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        if group.get("format", config["format"]) != config["format"]:
            raise ModelLoadError(f"{at}.format {group['format']!r} differs from {config['format']!r}")
        if group.get("output_activations"):
            raise ModelLoadError(f"{at}.output_activations: output quantization is not supported")
        weights = group.get("weights") or {}
        for field, supported in _SUPPORTED_WEIGHTS.items():
            _expect(weights.get(field, supported), supported, f"{at}.weights.{field}")
        inputs = group.get("input_activations") or {}
        for field, supported in _SUPPORTED_ACTIVATIONS.items():
            _expect(inputs.get(field, supported), supported, f"{at}.input_activations.{field}")
        activations.add(bool(inputs))
    if len(activations) > 1:
        raise ModelLoadError(f"{where}.config_groups: weight-only and W8A8 groups in one checkpoint are not supported")
    return config


def int8_activations(config: dict[str, Any]) -> bool:
    """Whether a checked quantization_config quantizes its layers' activations (W8A8)."""
    return any(group.get("input_activations") for group in config["config_groups"].values())


def load_quantized_weights(model: nn.Module, model_dir: str | Path) -> CheckpointLayout:
    """`load_weights` for a checkpoint of either kind (module docstring). The layout it
    returns names the float tensors an update writes (`X.weight`), not the scales."""
    config = read_quantization_config(model_dir)
    if config is None:
        return load_weights(model, model_dir)
    marker = _PACKED if config["format"] == "pack-quantized" else _SCALE  # int-quantized: X.weight is int8
    activations = int8_activations(config)
    for name, _ in iter_checkpoint(model_dir):
        if name.endswith(marker):
            _stage_scale(model, name[: -len(marker)] + ".weight", activations)
    layout = load_weights(model, model_dir, _float_tensors(model_dir))
    return CheckpointLayout({name: shape for name, shape in layout.shapes.items() if not name.endswith(_SCALE)})


def unpack_int32(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """weight_packed [N, K/4] int32 -> the int8 values [N, K] (module docstring)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed has dtype {packed.dtype}, not int32")
    unsigned = packed.contiguous().view(torch.uint8).view(packed.shape[0], -1)[:, : shape[1]]
    return (unsigned.to(torch.int16) - 128).to(torch.int8)


def pack_int32(q: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_int32` (writes checkpoints in this layout: tests, tools)."""
    num_out, num_in = q.shape
    padded = torch.zeros(num_out, -(-num_in // 4) * 4, dtype=torch.uint8)  # padding: 0, as compressed-tensors pads
    padded[:, :num_in] = (q.to(torch.int16) + 128).to(torch.uint8)
    return padded.view(torch.int32)


def _expect(value: Any, supported: Any, what: str) -> None:
    if value != supported:
        raise ModelLoadError(
            f"{what} is {value!r}: only {supported!r} is supported "
            "(int8 weights per channel; activations float, or int8 dynamic per token)"
        )


def _float_tensors(model_dir: str | Path) -> Iterator[tuple[str, LoadedWeight]]:
    """The checkpoint as the float loaders read it: `X.weight` holding each packed
    weight's integers, `X.weight_scale` as is, float tensors untouched."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, tensor in iter_checkpoint(model_dir):
        if name.endswith(_SHAPE):
            shapes[name[: -len(_SHAPE)]] = tuple(int(v) for v in read_all(tensor).tolist())
    for name, tensor in iter_checkpoint(model_dir):
        if name.endswith(_SHAPE):
            continue
        if name.endswith(_PACKED):
            prefix = name[: -len(_PACKED)]
            if prefix not in shapes:
                raise ModelLoadError(f"tensor {name!r} has no {prefix + _SHAPE!r}")
            try:
                q = unpack_int32(read_all(tensor), shapes[prefix])
            except ValueError as e:
                raise ModelLoadError(f"tensor {name!r}: {e}") from e
            yield prefix + ".weight", q.float()
        else:
            yield name, tensor


def _stage_scale(model: nn.Module, weight_name: str, activations: bool) -> None:
    """Adds `weight_scale` [rows, 1] to the layer `weight_name` loads into (once for merged
    layers), loaded as the weight's rows are; `activations`: the layer multiplies with int8
    activations (W8A8)."""
    target, _ = model.checkpoint_target(weight_name)
    layer = model.get_submodule(target.rpartition(".")[0])
    if not isinstance(layer, CpuPackable):
        raise ModelLoadError(f"{weight_name!r} is quantized in the checkpoint, but is not a linear layer here")
    layer.int8_activations = layer.int8_activations or activations
    if "weight_scale" in layer._parameters:
        return
    rows = layer.weight.shape[0]
    scale = nn.Parameter(torch.ones(rows, 1, device=layer.weight.device), requires_grad=False)
    scale.weight_loader = _whole_scale_loader if isinstance(layer, RowParallelLinear) else layer.weight_loader
    layer.weight_scale = scale


def _whole_scale_loader(param: nn.Parameter, loaded: LoadedWeight) -> None:
    copy_into(param, read_all(loaded), "row-parallel weight_scale")
