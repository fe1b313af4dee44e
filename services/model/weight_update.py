"""Weight updates on a loaded model: check everything, then write through the loader's path.

    check_update(layout, arch, shapes, complete)   raises before anything is written
    check_values(tensors)                          the same, for what a copy could not take
    writer = WeightWriter(model, names, impl)      unpacks the oneDNN-packed layers touched
    writer.write(tensors) ... writer.close()       the loader's per-tensor, per-shard path;
                                                   layers repacked once complete; tied heads
                                                   stay tied
    release_weights(model) / restore_weights(...)  frees the weights' memory (sleep level 2)

An update must match the checkpoint the model was loaded from (`CheckpointLayout`): same
tensor names and full shapes. Dtypes may differ (a bf16 trainer, an f32 engine): values are
cast as they are copied in, exactly as at start-up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .config import ModelArch
from .embedding import ParallelLMHead
from .errors import ModelLoadError
from .linear import CpuPackable, packable_modules, process_weights_after_loading
from .loader import CheckpointLayout, load_tensor
from .weights import LoadedWeight

# Fields that shape the model but are not weights: an update cannot change them.
_FIXED_ARCH_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LM_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def check_same_architecture(running: ModelArch, new: ModelArch, source: str) -> None:
    for name in _FIXED_ARCH_FIELDS:
        if getattr(running, name) != getattr(new, name):
            raise ModelLoadError(
                f"{source}: {name} is {getattr(new, name)!r}, the running model's is {getattr(running, name)!r} "
                "(a weight update keeps the architecture)"
            )


def check_update(
    layout: CheckpointLayout, arch: ModelArch, shapes: Mapping[str, tuple[int, ...]], complete: bool
) -> None:
    """Every tensor is one the model was loaded from, with the same full shape; with
    `complete` (a whole folder, or weights released by sleep), every such tensor is present."""
    for name, shape in shapes.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        expected = layout.shapes.get(name)
        if expected is None and name == _LM_HEAD and arch.tie_word_embeddings:
            expected = layout.shapes.get(_EMBEDDING)  # a tied head some trainers still send
        if expected is None:
            raise ModelLoadError(f"tensor {name!r} is not a tensor of the running model ({arch.architecture})")
        if tuple(shape) != tuple(expected):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(shape)}, the running model's is {tuple(expected)}")
    if complete:
        missing = sorted(set(layout.shapes) - set(shapes))
        if missing:
            raise ModelLoadError(
                "the update lacks tensors "
                + ", ".join(missing[:8])
                + (" ..." if len(missing) > 8 else "")
                + " (a checkpoint folder, or an update after sleep(level=2), carries every tensor)"
            )


def check_values(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """What a copy would fail on or cast into nonsense, refused before any write: weights
    are floating point (an integer tensor: a corrupt header, a wrong tensor) with data."""
    for name, tensor in tensors:
        if not tensor.dtype.is_floating_point:
            raise ModelLoadError(f"tensor {name!r} has dtype {tensor.dtype}, not a floating-point weight")
        if tensor.device.type == "meta":
            raise ModelLoadError(f"tensor {name!r} is on the meta device: it has no values to load")


class WeightWriter:
    """Writes an update's tensors in one batch or several (buckets, as they arrive).

    It unpacks every packed layer the update touches first (copying the old values out
    only where the update fills just part of a merged weight, e.g. q_proj of qkv), and
    repacks each layer as soon as its last tensor is in, so repacking overlaps whatever
    produces the next batch. `close` repacks the rest, also after an error.
    """

    def __init__(self, model: nn.Module, names: Iterable[str], impl: str) -> None:
        self.model = model
        self.impl = impl
        self._layer_of: dict[str, nn.Module] = {}
        self._remaining: dict[nn.Module, int] = {}
        for name in names:
            layer = _packable_layer(model, name)
            if layer is not None:
                self._layer_of[name] = layer
                self._remaining[layer] = self._remaining.get(layer, 0) + 1
        for layer, count in self._remaining.items():
            layer.unpack_for_loading(keep_values=count < layer.num_weight_shards)
        self.params = dict(model.named_parameters())  # after unpacking: new parameter objects

    def write(self, tensors: Iterable[tuple[str, LoadedWeight]]) -> None:
        done = []
        for name, tensor in tensors:
            load_tensor(self.model, self.params, name, tensor)
            layer = self._layer_of.get(name)
            if layer is not None:
                self._remaining[layer] -= 1
                if self._remaining[layer] == 0:
                    done.append(layer)
        self._repack(done)

    def close(self) -> None:
        self._repack([layer for layer, count in self._remaining.items() if count > 0])

    def _repack(self, layers: list[nn.Module]) -> None:
        for layer in layers:
            self._remaining[layer] = -1  # packed: not again
        process_weights_after_loading(self.model, self.impl, layers)


def release_weights(model: nn.Module) -> dict[str, torch.Size]:
    """Frees every parameter's memory (the parameters stay, empty); returns their shapes."""
    for module in packable_modules(model):
        module.unpack_for_loading(keep_values=False)
    shapes = {}
    for name, param in model.named_parameters():  # a tied parameter once
        shapes[name] = param.shape
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return shapes


def restore_weights(model: nn.Module, shapes: Mapping[str, torch.Size]) -> None:
    """Gives released parameters storage again (uninitialised: a complete update fills it)."""
    for name, param in model.named_parameters():
        param.data = torch.empty(shapes[name], dtype=param.dtype, device=param.device)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the parameters hold, with the LM head's packed copy."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and module.packed_weight is not None:
            total += module.packed_weight.numel() * module.packed_weight.element_size()
        if isinstance(module, ParallelLMHead) and module.blocked is not None:
            total += module.blocked.num_bytes
    return total


def _packable_layer(model: nn.Module, name: str) -> CpuPackable | None:
    """The packed layer a checkpoint tensor writes into, if any."""
    target, _ = model.checkpoint_target(name)
    path = target.rpartition(".")[0]
    if target == _EMBEDDING and model.arch.tie_word_embeddings:
        path = "lm_head"  # the head's packed copy is of the embedding it is tied to
    try:
        layer = model.get_submodule(path)
    except AttributeError:  # not a module path: check_update names it
        return None
    return layer if isinstance(layer, CpuPackable) and target.endswith(".weight") else None
