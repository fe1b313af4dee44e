"""The one dispatch module the engine calls: Triton kernels on CUDA, references on CPU.

Every op takes `impl`: "auto" picks Triton for CUDA tensors; on the CPU, the C++ kernel
where one exists and builds (cpu_ops.py), else the torch reference. "triton" forces the
Triton kernel (on CPU only under TRITON_INTERPRET=1, which the tests use); "cpp" forces the
C++ kernel of an op that has one (decode and prefill attention, RMSNorm, rotary embedding
fused with the cache write), raising if it cannot be built; "torch" forces the reference.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import cpu_ops, reference

KernelImpl = Literal["auto", "torch", "triton", "cpp"]


def use_triton(impl: KernelImpl, tensor: torch.Tensor) -> bool:
    if impl == "torch":
        return False
    if impl == "triton":
        return True
    return tensor.is_cuda


def use_cpp(impl: KernelImpl, tensor: torch.Tensor) -> bool:
    if impl == "cpp":
        return True
    return impl == "auto" and tensor.device.type == "cpu" and cpu_ops.available()


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, impl: KernelImpl = "auto"):
    if use_triton(impl, key):
        from .reshape_and_cache import reshape_and_cache

        return reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return reference.reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)


def paged_decode_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    scale,
    max_seq_len: int | None = None,
    impl: KernelImpl = "auto",
):
    """`max_seq_len` (an upper bound of seq_lens) lets the Triton path skip a device sync."""
    if use_triton(impl, query):
        from .paged_decode_attention import paged_decode_attention

        return paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len)
    if use_cpp(impl, query):
        return cpu_ops.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return reference.paged_decode_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale)


def prefill_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    max_query_len: int,
    impl: KernelImpl = "auto",
):
    if use_triton(impl, query):
        from .prefill_attention import prefill_attention

        return prefill_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len
        )
    # head sizes and GQA groups without a C++ kernel keep the reference, under "cpp" too
    if use_cpp(impl, query) and cpu_ops.prefill_attention_supported(query.shape[1], key_cache.shape[2], query.shape[2]):
        return cpu_ops.paged_prefill_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale
        )
    return reference.prefill_attention_ref(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale
    )


def rms_norm(x, weight, eps: float, residual=None, impl: KernelImpl = "auto"):
    if use_triton(impl, x):
        from .rms_norm import rms_norm

        return rms_norm(x, weight, eps, residual)
    contiguous = x.is_contiguous() and (residual is None or residual.is_contiguous())
    if use_cpp(impl, x) and (contiguous or impl == "cpp"):
        if not contiguous:
            x, residual = x.contiguous(), None if residual is None else residual.contiguous()
        return cpu_ops.rms_norm(x, weight, eps, residual)
    return reference.rms_norm_ref(x, weight, eps, residual)


def silu_and_mul(x, impl: KernelImpl = "auto"):
    """[..., 2I] (gate, then up) -> silu(gate) * up: one fused pass on the CPU, torch's ops
    elsewhere."""
    if use_cpp(impl, x) and (x.is_contiguous() or impl == "cpp"):
        return cpu_ops.silu_and_mul(x.contiguous())
    return reference.silu_and_mul_ref(x)


def rotary_embedding(positions, query, key, cos_sin_cache, impl: KernelImpl = "auto"):
    if use_triton(impl, query):
        from .rotary import rotary_embedding

        return rotary_embedding(positions, query, key, cos_sin_cache)
    return reference.rotary_embedding_ref(positions, query, key, cos_sin_cache)


def rotary_embedding_and_cache(
    positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping, impl: KernelImpl = "auto"
):
    """Rotates query and key in place, then writes the rotated keys and the values into the
    caches: one pass on the CPU (the C++ kernel), the two ops elsewhere."""
    heads_contiguous = query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    if not use_triton(impl, query) and use_cpp(impl, query) and heads_contiguous:
        return cpu_ops.rotary_embedding_and_cache(
            positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping
        )
    rotary_embedding(positions, query, key, cos_sin_cache, impl=impl)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, impl=impl)
