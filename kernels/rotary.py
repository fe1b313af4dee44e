"""Neox-style rotary position embedding, applied in place to q and k.

One program rotates every head of one token. The cache row of the token's position holds
cos in its first D/2 columns and sin in the rest (llama3 or linear scaling is folded into
the cache by the model), so the kernel only reads it:

    x = [ x1 | x2 ]  (halves of D)   ->   [ x1*cos - x2*sin | x2*cos + x1*sin ]   (float32)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_devices, check_float, check_int, check_last_dim_contiguous, check_power_of_two
from .interpreter import cast_to, is_interpreter


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)
    is_head = heads[:, None] < NUM_HEADS
    x1_ptrs = x_ptr + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(x1_ptrs, mask=is_head, other=0.0)
    x2 = tl.load(x1_ptrs + HALF, mask=is_head, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(x1_ptrs, cast_to(x1f * cos - x2f * sin, x1.dtype, INTERPRETED), mask=is_head)
    tl.store(x1_ptrs + HALF, cast_to(x2f * cos + x1f * sin, x1.dtype, INTERPRETED), mask=is_head)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_sin_cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF)
    cos = tl.load(cos_sin_cache_ptr + position * stride_cache + cols)[None, :]
    sin = tl.load(cos_sin_cache_ptr + position * stride_cache + HALF + cols)[None, :]
    _rotate_heads(query_ptr + token * stride_qt, stride_qh, cos, sin, NUM_HEADS, BLOCK_H, HALF, INTERPRETED)
    _rotate_heads(key_ptr + token * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, BLOCK_KV_H, HALF, INTERPRETED)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotates query [T, H, D] and key [T, H_kv, D] (rows may be strided) in place.

    positions [T] index cos_sin_cache [max_position, D] (float32); positions past the cache
    are not checked on the device (that would need a sync), as with the reference's indexing.
    """
    check_float("query", query)
    check_float("key", key, query.dtype)
    check_int("positions", positions, dims=1)
    check_devices(query=query, key=key, positions=positions, cos_sin_cache=cos_sin_cache)
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or not cos_sin_cache.is_contiguous():
        raise ValueError(
            f"cos_sin_cache must be a contiguous float32 [max_position, D], got {cos_sin_cache.dtype} "
            f"{tuple(cos_sin_cache.shape)} strides {cos_sin_cache.stride()}"
        )
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(f"query and key must be [T, heads, D], got {tuple(query.shape)} and {tuple(key.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and positions {tuple(positions.shape)} disagree"
        )
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache rotates {cos_sin_cache.shape[1]} dims, but head_dim is {head_dim}")
    check_power_of_two("head_dim", head_dim, 2)
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("key", key)
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        INTERPRETED=is_interpreter(),
    )
