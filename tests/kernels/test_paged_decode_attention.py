"""Paged decode attention (Triton) against `paged_decode_attention_ref`, unsplit and split-K,
and a bfloat16 cache under a float32 query (kv_cache_dtype)."""

from __future__ import annotations

import re

import pytest
import torch
from baton.kernels import paged_decode_attention as decode_module
from baton.kernels.paged_decode_attention import MIN_TOKENS_PER_SPLIT, choose_num_splits, paged_decode_attention
from baton.kernels.reference import paged_decode_attention_ref
from testlib.kernel_sweep import (
    ATTENTION_DTYPE_IDS,
    ATTENTION_DTYPES,
    OTHER_ATTENTION_SHAPE_IDS,
    OTHER_ATTENTION_SHAPES,
)


def ragged_lens(block_size: int) -> list[int]:
    """Lengths 1, under one block, exactly one block, and non-multiples of the block size."""
    return [1, 7, block_size, block_size + 3, 3 * block_size - 1, 100]


def run_and_check(
    paged_context, heads_view, check, seq_lens, num_kv_heads, group, head_dim, block_size, dtype, cache_dtype=None, **kw
):
    """The reference attends over the cache widened to float32: for a bfloat16 cache under a
    float32 query that is exact, the bfloat16-rounded K/V attended in float32."""
    ctx = paged_context(seq_lens, num_kv_heads, head_dim, block_size, cache_dtype or dtype)
    query = heads_view(len(seq_lens), num_kv_heads * group, head_dim, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(query, ctx.key_cache, ctx.value_cache, ctx.block_tables, ctx.seq_lens, scale, **kw)
    expected = paged_decode_attention_ref(query.cpu().float(), *ctx.reference_inputs(), scale)
    assert out.dtype == dtype and out.shape == query.shape
    check(out, expected)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_matches_reference(paged_context, heads_view, check, head_dim, group, block_size, dtype):
    run_and_check(
        paged_context, heads_view, check, ragged_lens(block_size), 2, group, head_dim, block_size, dtype, num_splits=1
    )


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("num_splits", [2, 3, 8], ids=lambda s: f"splits{s}")
def test_split_k_matches_reference(paged_context, heads_view, check, num_splits, dtype):
    # Longer contexts, and a short one that leaves most splits empty.
    seq_lens = [1, 130, 333, 600]
    run_and_check(paged_context, heads_view, check, seq_lens, 2, 4, 64, 16, dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [None, 5], ids=lambda s: f"splits{s}")
def test_max_seq_len_past_every_context(monkeypatch, paged_context, heads_view, check, num_splits):
    """A CUDA graph's launch: max_seq_len is max_model_len, far past these contexts (the
    heuristic then picks 27 splits on 132 SMs). Each request cuts its own context into the
    splits, the short ones included."""
    monkeypatch.setattr(decode_module, "_num_sms", lambda device: 132)
    seq_lens = [1, 64, 130, 333, 600]
    kw = dict(num_splits=num_splits, max_seq_len=8192)
    run_and_check(paged_context, heads_view, check, seq_lens, 2, 4, 64, 16, torch.float32, **kw)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize(
    "head_dim, group, num_kv_heads, block_size", OTHER_ATTENTION_SHAPES, ids=OTHER_ATTENTION_SHAPE_IDS
)
def test_other_shapes(paged_context, heads_view, check, head_dim, group, num_kv_heads, block_size, dtype):
    seq_lens = [1, 5, 70, 300]
    run_and_check(paged_context, heads_view, check, seq_lens, num_kv_heads, group, head_dim, block_size, dtype)


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
def test_float16(paged_context, heads_view, check, num_splits):
    run_and_check(paged_context, heads_view, check, [1, 40, 300], 2, 4, 64, 16, torch.float16, num_splits=num_splits)


def test_heuristic_splits_when_few_programs(monkeypatch, paged_context, heads_view, check):
    monkeypatch.setattr(decode_module, "_num_sms", lambda device: 132)
    assert choose_num_splits(1, 2, 600, 132) > 1
    run_and_check(paged_context, heads_view, check, [600], 2, 4, 64, 16, torch.float32)


def test_choose_num_splits():
    # Enough (request, KV head) programs already: no split.
    assert choose_num_splits(64, 8, 4096, 132) == 1
    # Short contexts are not worth a reduce pass.
    assert choose_num_splits(1, 8, 2 * MIN_TOKENS_PER_SPLIT - 1, 132) == 1
    # One long request: split, but every split keeps MIN_TOKENS_PER_SPLIT tokens.
    splits = choose_num_splits(1, 8, 32768, 132)
    assert 1 < splits <= 32768 // MIN_TOKENS_PER_SPLIT
    assert choose_num_splits(1, 1, 10**6, 132) <= 64
    assert choose_num_splits(1, 8, 1024, 132) == 1024 // MIN_TOKENS_PER_SPLIT


def test_max_seq_len_hint_is_an_upper_bound(paged_context, heads_view, check):
    # The backend passes the batch's longest context, which may exceed every decode's.
    run_and_check(paged_context, heads_view, check, [3, 40], 2, 4, 64, 16, torch.float32, max_seq_len=900)


def test_launcher_rejects_bad_inputs(paged_context, heads_view):
    ctx = paged_context([5], 2, 64, 16, torch.float32)
    query = heads_view(1, 4, 64, torch.float32)
    args = (ctx.key_cache, ctx.value_cache, ctx.block_tables, ctx.seq_lens, 0.125)
    with pytest.raises(TypeError, match="key_cache must have the query's dtype torch.bfloat16"):
        paged_decode_attention(query.bfloat16(), *args)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(heads_view(1, 3, 64, torch.float32), *args)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        paged_decode_attention(query.transpose(1, 2).contiguous().transpose(1, 2), *args)
    with pytest.raises(TypeError, match="block_tables must be int32 or int64"):
        paged_decode_attention(query, ctx.key_cache, ctx.value_cache, ctx.block_tables.float(), ctx.seq_lens, 0.1)
    ctx = paged_context([5], 2, 48, 16, torch.float32)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        paged_decode_attention(
            heads_view(1, 4, 48, torch.float32), ctx.key_cache, ctx.value_cache, ctx.block_tables, ctx.seq_lens, 0.1
        )


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
def test_float32_query_bfloat16_cache(paged_context, heads_view, check, num_splits):
    """Kernel and reference both attend over the bfloat16 K/V in float32, to float32's tolerance."""
    seq_lens = [1, 40, 300]
    kw = dict(cache_dtype=torch.bfloat16, num_splits=num_splits)
    run_and_check(paged_context, heads_view, check, seq_lens, 2, 4, 64, 16, torch.float32, **kw)
    ctx = paged_context(seq_lens, 2, 64, 16, torch.bfloat16)
    query = heads_view(len(seq_lens), 8, 64, torch.float32).cpu()
    key_cache, value_cache, block_tables, seq_lens_cpu = ctx.reference_inputs()
    out = paged_decode_attention_ref(
        query, key_cache.bfloat16(), value_cache.bfloat16(), block_tables, seq_lens_cpu, 0.1
    )
    assert out.dtype == torch.float32
    check(out, paged_decode_attention_ref(query, key_cache, value_cache, block_tables, seq_lens_cpu, 0.1))


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float16)],
    ids=["bf16-query-fp32-cache", "fp16-query-bf16-cache", "fp32-query-fp16-cache"],
)
def test_rejects_other_cache_dtypes(paged_context, heads_view, dtype, cache_dtype):
    ctx = paged_context([5], 2, 64, 16, cache_dtype)
    query = heads_view(1, 4, 64, dtype)
    args = (ctx.key_cache, ctx.value_cache, ctx.block_tables, ctx.seq_lens, 0.125)
    message = f"key_cache must have the query's dtype {dtype} or, for a float32 query, bfloat16; got {cache_dtype}"
    with pytest.raises(TypeError, match=re.escape(message)):
        paged_decode_attention(query, *args)
    with pytest.raises(TypeError, match=re.escape(message)):
        paged_decode_attention_ref(query.cpu(), *(t.cpu() for t in args[:4]), 0.125)
