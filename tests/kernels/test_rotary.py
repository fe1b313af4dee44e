"""Neox-style RoPE (Triton), in place on strided q/k views, against `rotary_embedding_ref`."""

from __future__ import annotations

import pytest
import torch
from baton.kernels.reference import rotary_embedding_ref
from baton.kernels.rotary import rotary_embedding
from baton.services.model.rotary import rope_inv_freq
from testlib.kernel_sweep import ALL_DTYPE_IDS, ALL_DTYPES

MAX_POSITION = 4096
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def cos_sin_cache(head_dim: int) -> torch.Tensor:
    """The model's cache: llama3 scaling folded into the frequencies."""
    inv_freq = rope_inv_freq(head_dim, 500000.0, LLAMA3_SCALING)
    freqs = torch.arange(MAX_POSITION).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def qkv_views(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
    """q and k as the model passes them: head-shaped views into one merged qkv row."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=torch.Generator().manual_seed(0))
    qkv = qkv.to(dtype).to(device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256], ids=lambda d: f"d{d}")
def test_matches_reference(check, device, head_dim, group, dtype):
    num_kv_heads, num_heads = 2, 2 * group
    positions = torch.tensor([0, 1, 17, 1023, 1024, 3000, MAX_POSITION - 1, 5, 5])
    qkv, q, k = qkv_views(len(positions), num_heads, num_kv_heads, head_dim, dtype, device)
    expected_qkv, expected_q, expected_k = qkv_views(len(positions), num_heads, num_kv_heads, head_dim, dtype, "cpu")
    cache = cos_sin_cache(head_dim)
    rotary_embedding(positions.to(device), q, k, cache.to(device))
    rotary_embedding_ref(positions, expected_q, expected_k, cache)
    check(q, expected_q)
    check(k, expected_k)
    # V, the rest of the row, is untouched.
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:].cpu(), expected_qkv[:, v_start:])


def test_launcher_rejects_bad_inputs(device):
    _, q, k = qkv_views(3, 4, 2, 64, torch.float32, device)
    positions = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache must be a contiguous float32"):
        rotary_embedding(positions, q, k, cos_sin_cache(64).double().to(device))
    with pytest.raises(ValueError, match="rotates 32 dims, but head_dim is 64"):
        rotary_embedding(positions, q, k, cos_sin_cache(32).to(device))
    with pytest.raises(TypeError, match="key must have dtype"):
        rotary_embedding(positions, q, k.bfloat16(), cos_sin_cache(64).to(device))
    with pytest.raises(TypeError, match="positions must be int32 or int64"):
        rotary_embedding(positions.float(), q, k, cos_sin_cache(64).to(device))
