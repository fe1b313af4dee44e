"""Reshape-and-cache (Triton) against `reshape_and_cache_ref`: bit-exact copies."""

from __future__ import annotations

import pytest
import torch
from baton.kernels.reference import reshape_and_cache_ref
from baton.kernels.reshape_and_cache import reshape_and_cache
from testlib.kernel_sweep import ALL_DTYPE_IDS, ALL_DTYPES


def random_slots(num_tokens: int, num_slots: int, num_padding: int, seed: int = 0) -> torch.Tensor:
    """Distinct slots in random order, with `num_padding` tokens marked -1."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    return slots


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("block_size", [1, 16, 32, 128], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8], ids=lambda h: f"kv{h}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_matches_reference(heads_view, device, head_dim, num_kv_heads, block_size, dtype):
    num_tokens, num_blocks = 21, max(4, 64 // block_size)
    key = heads_view(num_tokens, num_kv_heads, head_dim, dtype, seed=1)
    value = heads_view(num_tokens, num_kv_heads, head_dim, dtype, seed=2)
    slot_mapping = random_slots(num_tokens, num_blocks * block_size, num_padding=3)
    expected = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    kv_cache = expected.to(device)
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping.to(device))
    reshape_and_cache_ref(key.cpu(), value.cpu(), expected[0], expected[1], slot_mapping)
    assert torch.equal(kv_cache.cpu(), expected)


def test_int32_slots_and_empty_batch(heads_view, device):
    kv_cache = torch.zeros(2, 4, 16, 2, 64, device=device)
    key = heads_view(3, 2, 64, torch.float32)
    reshape_and_cache(key, key, kv_cache[0], kv_cache[1], torch.tensor([5, -1, 63], dtype=torch.int32, device=device))
    assert torch.equal(kv_cache[0, 0, 5], key[0]) and torch.equal(kv_cache[1, 3, 15], key[2])
    assert int((kv_cache != 0).any(dim=(-1, -2)).sum()) == 4  # two slots, in both caches
    reshape_and_cache(key[:0], key[:0], kv_cache[0], kv_cache[1], torch.zeros(0, dtype=torch.int64, device=device))


def test_launcher_rejects_bad_inputs(heads_view, device):
    kv_cache = torch.zeros(2, 4, 16, 2, 64, device=device)
    key = heads_view(3, 2, 64, torch.float32)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="key_cache heads/head_dim"):
        reshape_and_cache(key, key, kv_cache[0, :, :, :1], kv_cache[1, :, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 3 tokens"):
        reshape_and_cache(key, key, kv_cache[0], kv_cache[1], slots[:2])
    with pytest.raises(TypeError, match="key_cache must have dtype"):
        reshape_and_cache(key, key, kv_cache[0].bfloat16(), kv_cache[1].bfloat16(), slots)
    with pytest.raises(ValueError, match="share shape and strides"):
        reshape_and_cache(key, key, kv_cache[0], kv_cache[1].contiguous().transpose(0, 1), slots)
