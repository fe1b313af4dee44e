"""Writes each new token's K and V into its slot of the paged cache (reshape-and-cache).

One program per token copies all its KV heads: key[t] [H_kv, D] -> key_cache[s // B, s % B].
Slot -1 marks a padding token, which is skipped. A bfloat16 cache under float32 K/V
(kv_cache_dtype) stores each value rounded to nearest even, as torch's .to(bfloat16) does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import (
    check_devices,
    check_float,
    check_int,
    check_last_dim_contiguous,
    check_paged_cache,
    check_power_of_two,
)
from .interpreter import cast_to, is_interpreter


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = heads[:, None] < NUM_KV_HEADS

    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    # Decided at compile time: a same-dtype store stays a plain copy (cast_to rounds float32).
    if key.dtype != key_cache_ptr.dtype.element_ty:
        key = cast_to(key, key_cache_ptr.dtype.element_ty, INTERPRETED)
        value = cast_to(value, key_cache_ptr.dtype.element_ty, INTERPRETED)
    row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
    cache_offsets = row + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, H_kv, D] (rows may be strided), caches [N, B, H_kv, D] in key's dtype or,
    under float32 K/V, bfloat16; slot_mapping [T]."""
    check_float("key", key)
    check_float("value", value, key.dtype)
    check_paged_cache(key_cache, value_cache, key.dtype, source="key")
    check_int("slot_mapping", slot_mapping, dims=1)
    check_devices(key=key, value=value, key_cache=key_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    if tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key_cache heads/head_dim {tuple(key_cache.shape[2:])} != key's {(num_kv_heads, head_dim)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    check_power_of_two("head_dim", head_dim)
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=key_cache.shape[1],
        INTERPRETED=is_interpreter(),
    )
