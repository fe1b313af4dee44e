"""Reshape-and-cache (Triton) against `reshape_and_cache_ref`: bit-exact copies, and float32
K/V stored in a bfloat16 cache (kv_cache_dtype) rounded as torch's .to(bfloat16) rounds."""

from __future__ import annotations

import re

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
    with pytest.raises(TypeError, match="key_cache must have the key's dtype torch.float32"):
        reshape_and_cache(key, key, kv_cache[0].half(), kv_cache[1].half(), slots)
    with pytest.raises(TypeError, match="value_cache must have key_cache's dtype"):
        reshape_and_cache(key, key, kv_cache[0].bfloat16(), kv_cache[1], slots)
    with pytest.raises(ValueError, match="share shape and strides"):
        reshape_and_cache(key, key, kv_cache[0], kv_cache[1].contiguous().transpose(0, 1), slots)


@pytest.mark.parametrize("block_size", [1, 16], ids=lambda b: f"block{b}")
def test_float32_into_bfloat16_cache(heads_view, device, block_size):
    num_tokens, num_kv_heads, head_dim, num_blocks = 9, 2, 64, max(4, 64 // block_size)
    key = heads_view(num_tokens, num_kv_heads, head_dim, torch.float32, seed=1)
    value = heads_view(num_tokens, num_kv_heads, head_dim, torch.float32, seed=2)
    # Rounding to nearest even, not truncation: a tie that rounds up, one that rounds down,
    # and a value just past a tie.
    key[:, 0, :3] = torch.tensor([1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-12])
    slot_mapping = random_slots(num_tokens, num_blocks * block_size, num_padding=2)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    expected = kv_cache.cpu()
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping.to(device))
    reshape_and_cache_ref(key.cpu(), value.cpu(), expected[0], expected[1], slot_mapping)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    stored = expected.flatten(1, 2)[:, slots]  # [2, T_valid, H_kv, D]
    assert torch.equal(stored[0], key.cpu()[valid].to(torch.bfloat16))
    assert torch.equal(stored[1], value.cpu()[valid].to(torch.bfloat16))
    assert torch.equal(kv_cache.cpu(), expected)


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float16)],
    ids=["bf16-into-fp32", "fp16-into-bf16", "fp32-into-fp16"],
)
def test_rejects_other_cache_dtypes(heads_view, device, dtype, cache_dtype):
    kv_cache = torch.zeros(2, 4, 16, 2, 64, dtype=cache_dtype, device=device)
    key = heads_view(3, 2, 64, dtype)
    slots = torch.arange(3, device=device)
    message = f"key_cache must have the key's dtype {dtype} or, for a float32 key, bfloat16; got {cache_dtype}"
    with pytest.raises(TypeError, match=re.escape(message)):
        reshape_and_cache(key, key, kv_cache[0], kv_cache[1], slots)
    with pytest.raises(TypeError, match=re.escape(message)):
        reshape_and_cache_ref(key.cpu(), key.cpu(), kv_cache[0].cpu(), kv_cache[1].cpu(), slots.cpu())
