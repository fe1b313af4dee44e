"""Architecture name -> model class."""

from __future__ import annotations

import torch
from baton.kernels.ops import KernelImpl
from torch import nn

from .attention import AttentionBackend
from .config import ModelArch
from .llama import LlamaForCausalLM
from .parallel import TPGroup

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def create_model(
    arch: ModelArch, backend: AttentionBackend, tp: TPGroup, dtype: torch.dtype, device: torch.device, impl: KernelImpl
) -> nn.Module:
    return _MODEL_CLASSES[arch.architecture](arch, backend, tp, dtype, device, impl)
