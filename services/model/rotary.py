"""Rotary position embedding (neox style), with Llama 3 and linear frequency scaling.

The frequencies follow Hugging Face's formulas exactly (same float32 operations), so
positions rotate identically and greedy outputs can be compared token for token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from baton.kernels import ops
from baton.kernels.ops import KernelImpl
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: low frequencies slowed by `factor`, high ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
        impl: KernelImpl = "auto",
    ) -> None:
        super().__init__()
        self.impl = impl
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_dim], float32
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q [T, H, D] and k [T, H_kv, D] in place."""
        ops.rotary_embedding(positions, q, k, self.cos_sin_cache, impl=self.impl)

    def forward_and_cache(self, positions, q, k, v, key_cache, value_cache, slot_mapping) -> None:
        """Rotates q and k in place and writes the rotated k and v into the caches at their
        slots: one pass on the CPU (kernels/ops.py)."""
        ops.rotary_embedding_and_cache(
            positions, q, k, v, self.cos_sin_cache, key_cache, value_cache, slot_mapping, impl=self.impl
        )
