"""Varlen prefill attention (Triton) against `prefill_attention_ref`.

A request is (cached, new): `cached` tokens of context already in the paged cache (an
earlier chunk or a prefix-cache hit), then `new` query tokens whose K/V were just written.
A bfloat16 cache may serve a float32 query (kv_cache_dtype).
"""

from __future__ import annotations

import re

import pytest
import torch
from baton.kernels.prefill_attention import PrefillTiles, prefill_attention
from baton.kernels.reference import prefill_attention_ref
from testlib.kernel_sweep import (
    ATTENTION_DTYPE_IDS,
    ATTENTION_DTYPES,
    OTHER_ATTENTION_SHAPE_IDS,
    OTHER_ATTENTION_SHAPES,
)

# Full prefills of 1 and 17 tokens, a chunk after 40 cached tokens, a 2-token prefix-cache
# tail, a request with no queries this step, and a chunk spanning two 32-query tiles.
REQUESTS = [(0, 1), (0, 17), (40, 23), (70, 2), (30, 0), (5, 45)]


def run_and_check(
    paged_context, heads_view, check, requests, num_kv_heads, group, head_dim, block_size, dtype, cache_dtype=None, **kw
):
    """The reference attends over the cache widened to float32: for a bfloat16 cache under a
    float32 query that is exact, the bfloat16-rounded K/V attended in float32."""
    seq_lens = [cached + new for cached, new in requests]
    num_queries = torch.tensor([new for _, new in requests])
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(num_queries, 0)
    ctx = paged_context(seq_lens, num_kv_heads, head_dim, block_size, cache_dtype or dtype)
    query = heads_view(int(num_queries.sum()), num_kv_heads * group, head_dim, dtype)
    scale = head_dim**-0.5
    out = prefill_attention(
        query,
        ctx.key_cache,
        ctx.value_cache,
        ctx.block_tables,
        query_start_loc.to(query.device),
        ctx.seq_lens,
        scale,
        int(num_queries.max()),
        **kw,
    )
    key_cache, value_cache, block_tables, seq_lens_cpu = ctx.reference_inputs()
    expected = prefill_attention_ref(
        query.cpu().float(), key_cache, value_cache, block_tables, query_start_loc, seq_lens_cpu, scale
    )
    assert out.dtype == dtype and out.shape == query.shape
    check(out, expected)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_matches_reference(paged_context, heads_view, check, head_dim, group, block_size, dtype):
    # 32x32 tiles keep the interpreter fast and give several query and key tiles per request;
    # with 16-token blocks a key tile spans two blocks, with 32 it sits in one.
    run_and_check(
        paged_context, heads_view, check, REQUESTS, 2, group, head_dim, block_size, dtype, tiles=PrefillTiles(32, 32)
    )


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("sm", [80, 90], ids=lambda sm: f"sm{sm}")
def test_default_tiles(paged_context, heads_view, check, head_dim, dtype, sm):
    """The tiles an Ampere or Hopper GPU runs with, over a chunk longer than one query tile."""
    requests = [(0, 150), (100, 30), (3, 1)]
    tiles = PrefillTiles.default(head_dim, dtype.itemsize, sm)
    run_and_check(paged_context, heads_view, check, requests, 2, 4, head_dim, 16, dtype, tiles=tiles)


def test_hopper_takes_wider_key_tiles_for_16_bit_head_size_128():
    assert PrefillTiles.default(128, 2, sm=90) == PrefillTiles(128, 128, num_warps=8, num_stages=2)
    narrow = PrefillTiles(128, 64, num_warps=8, num_stages=3)
    assert PrefillTiles.default(128, 4, sm=90) == narrow  # float32 tiles would not fit twice
    assert PrefillTiles.default(128, 2, sm=80) == narrow
    assert PrefillTiles.default(128, 2) == narrow


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize(
    "head_dim, group, num_kv_heads, block_size", OTHER_ATTENTION_SHAPES, ids=OTHER_ATTENTION_SHAPE_IDS
)
def test_other_shapes(paged_context, heads_view, check, head_dim, group, num_kv_heads, block_size, dtype):
    requests = [(0, 1), (0, 20), (50, 14)]
    run_and_check(
        paged_context,
        heads_view,
        check,
        requests,
        num_kv_heads,
        group,
        head_dim,
        block_size,
        dtype,
        tiles=PrefillTiles(16, 32),
    )


def test_float16(paged_context, heads_view, check):
    run_and_check(paged_context, heads_view, check, REQUESTS, 2, 4, 64, 16, torch.float16, tiles=PrefillTiles(32, 32))


def test_launcher_rejects_bad_inputs(paged_context, heads_view, device):
    ctx = paged_context([5], 2, 64, 16, torch.float32)
    query = heads_view(5, 4, 64, torch.float32)
    query_start_loc = torch.tensor([0, 5], dtype=torch.int32, device=device)
    args = (ctx.key_cache, ctx.value_cache, ctx.block_tables, query_start_loc, ctx.seq_lens, 0.125, 5)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        PrefillTiles(block_m=8)
    with pytest.raises(ValueError, match="different devices"):
        prefill_attention(query, *args[:3], query_start_loc.cpu().to("meta"), *args[4:])
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention(query, *args[:3], query_start_loc[:1], *args[4:])
    with pytest.raises(TypeError, match="value_cache must have key_cache's dtype torch.float32"):
        prefill_attention(query, ctx.key_cache, ctx.value_cache.bfloat16(), *args[2:])


def test_float32_query_bfloat16_cache(paged_context, heads_view, check):
    """Kernel and reference both attend over the bfloat16 K/V in float32, to float32's
    tolerance: a full prefill, and chunks whose context is partly earlier cache."""
    requests = [(0, 17), (40, 23), (5, 45)]
    kw = dict(cache_dtype=torch.bfloat16, tiles=PrefillTiles(16, 16))
    run_and_check(paged_context, heads_view, check, requests, 2, 4, 64, 16, torch.float32, **kw)
    seq_lens = [cached + new for cached, new in requests]
    query_start_loc = torch.tensor([0, 17, 40, 85], dtype=torch.int32)
    ctx = paged_context(seq_lens, 2, 64, 16, torch.bfloat16)
    query = heads_view(85, 8, 64, torch.float32).cpu()
    key_cache, value_cache, block_tables, seq_lens_cpu = ctx.reference_inputs()
    tables = (block_tables, query_start_loc, seq_lens_cpu, 0.1)
    out = prefill_attention_ref(query, key_cache.bfloat16(), value_cache.bfloat16(), *tables)
    assert out.dtype == torch.float32
    check(out, prefill_attention_ref(query, key_cache, value_cache, *tables))


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float16)],
    ids=["bf16-query-fp32-cache", "fp16-query-bf16-cache", "fp32-query-fp16-cache"],
)
def test_rejects_other_cache_dtypes(paged_context, heads_view, device, dtype, cache_dtype):
    ctx = paged_context([5], 2, 64, 16, cache_dtype)
    query = heads_view(5, 4, 64, dtype)
    query_start_loc = torch.tensor([0, 5], dtype=torch.int32, device=device)
    args = (ctx.key_cache, ctx.value_cache, ctx.block_tables, query_start_loc, ctx.seq_lens, 0.125)
    message = f"key_cache must have the query's dtype {dtype} or, for a float32 query, bfloat16; got {cache_dtype}"
    with pytest.raises(TypeError, match=re.escape(message)):
        prefill_attention(query, *args, 5)
    with pytest.raises(TypeError, match=re.escape(message)):
        prefill_attention_ref(query.cpu(), *(t.cpu() for t in args[:5]), 0.125)
