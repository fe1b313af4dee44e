"""Argument checks every Triton launcher runs before it launches.

A kernel given a wrong stride or dtype reads garbage instead of failing, so launchers check
their inputs on the host, with messages that name the argument.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}")
    if dtype is not None and tensor.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (as the query/input), got {tensor.dtype}")


def check_int(name: str, tensor: torch.Tensor, dims: int) -> None:
    if tensor.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(tensor.shape)}")
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tensor.stride()}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Rows may be strided (views of a merged qkv), but each row is read as one vector."""
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tensor.stride()}")


def check_devices(**tensors: torch.Tensor) -> None:
    """One device for all; CUDA unless Triton is interpreting on the CPU."""
    # Imported here: the torch references use this module's dtype checks without Triton.
    from .interpreter import is_interpreter

    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")
    device = next(iter(devices.values()))
    if device.type != "cuda" and not is_interpreter():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {device}")


def check_power_of_two(name: str, value: int, low: int = 1, high: int | None = None, why: str = "") -> None:
    """Tile and vector sizes: Triton's tl.arange spans a power of two, tl.dot at least 16."""
    if value >= low and (high is None or value <= high) and value & (value - 1) == 0:
        return
    bounds = f" in [{low}, {high}]" if high is not None else (f" >= {low}" if low > 1 else "")
    raise ValueError(f"{name} must be a power of two{bounds}{why}, got {value}")


def check_head_dim(head_dim: int) -> None:
    """tl.dot needs at least 16 along each dim; tiles are powers of two."""
    check_power_of_two("head_dim", head_dim, 16, 256)


def check_cache_dtype(name: str, cache: torch.Tensor, dtype: torch.dtype, source: str = "query") -> None:
    """A KV cache holds its activations' dtype, or bfloat16 under float32 activations
    (kv_cache_dtype: bfloat16 halves a float32 model's cache); `source` names the activation."""
    check_float(name, cache)
    if cache.dtype == dtype or (dtype == torch.float32 and cache.dtype == torch.bfloat16):
        return
    raise TypeError(
        f"{name} must have the {source}'s dtype {dtype} or, for a float32 {source}, bfloat16; got {cache.dtype}"
    )


def check_paged_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype, source: str = "query"
) -> None:
    """Key and value caches [N, B, H_kv, D] share one layout and dtype, so kernels get one set
    of strides; the dtype is `source`'s (`dtype`) or bfloat16 under float32 (check_cache_dtype)."""
    check_cache_dtype("key_cache", key_cache, dtype, source)
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache must have key_cache's dtype {key_cache.dtype}, got {value_cache.dtype}")
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {key_cache.shape}")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"key_cache and value_cache must share shape and strides, got {tuple(key_cache.shape)}/"
            f"{key_cache.stride()} and {tuple(value_cache.shape)}/{value_cache.stride()}"
        )
    check_last_dim_contiguous("key_cache", key_cache)
    check_power_of_two("block_size", key_cache.shape[1], 1, 256)


def check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """What decode and prefill attention both need: query [*, H, D] with H a multiple of the
    cache's H_kv, and one block-table row and one context length per request."""
    check_float("query", query)
    check_last_dim_contiguous("query", query)
    check_paged_cache(key_cache, value_cache, query.dtype)
    check_int("block_tables", block_tables, dims=2)
    check_int("seq_lens", seq_lens, dims=1)
    check_devices(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens
    )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    check_head_dim(head_dim)
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} needs a row per seq_lens entry ({seq_lens.shape[0]})"
        )
