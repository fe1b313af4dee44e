"""The C++ CPU prefill attention (kernels/csrc/cpu_paged_prefill_attention.cpp) against
`prefill_attention_ref` on poisoned paged caches, and how `ops` picks it.

A request is (cached, new): `cached` tokens of context already in the cache (an earlier
chunk or a prefix-cache hit), then `new` query tokens whose K/V were just written."""

from __future__ import annotations

import pytest
import torch
from baton.kernels import cpu_ops, ops
from baton.kernels.reference import prefill_attention_ref
from testlib.kernel_sweep import ATTENTION_DTYPE_IDS, ATTENTION_DTYPES

needs_kernel = pytest.mark.skipif(
    not cpu_ops.prefill_attention_supported(2, 1, 64),
    reason="no prefill attention kernel here (neither AVX-512 nor AVX2 with FMA)",
)

# Full prefills of 1 and 17 tokens, a chunk after 40 cached tokens, a 2-token prefix-cache
# tail, a request with no queries this step, and a chunk spanning several tiles. With 16
# lanes, tasks of four tiles, two and one, and four with the last empty (45 tokens at gqa1).
REQUESTS = [(0, 1), (0, 17), (40, 23), (70, 2), (30, 0), (5, 45)]


def run_and_check(
    cpu_paged_context,
    cpu_heads_view,
    check,
    requests,
    num_kv_heads,
    group,
    head_dim,
    block_size,
    dtype,
    cache_dtype=None,
):
    seq_lens = [cached + new for cached, new in requests]
    num_queries = torch.tensor([new for _, new in requests])
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(num_queries, 0)
    ctx = cpu_paged_context(seq_lens, num_kv_heads, head_dim, block_size, cache_dtype or dtype)
    query = cpu_heads_view(int(num_queries.sum()), num_kv_heads * group, head_dim, dtype)  # a strided view
    scale = head_dim**-0.5
    caches = ctx.key_cache, ctx.value_cache, ctx.block_tables
    out = cpu_ops.paged_prefill_attention(query, *caches, query_start_loc, ctx.seq_lens, scale)
    key_cache, value_cache, block_tables, seq_lens_cpu = ctx.reference_inputs()
    expected = prefill_attention_ref(
        query.float(), key_cache, value_cache, block_tables, query_start_loc, seq_lens_cpu, scale
    )
    assert out.dtype == dtype and out.shape == query.shape
    check(out, expected)


@needs_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32, 8], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"d{d}")
def test_matches_reference(cpu_paged_context, cpu_heads_view, check, head_dim, group, block_size, dtype):
    if group > cpu_ops.prefill_attention_max_group():
        pytest.skip(f"{group} query heads per KV head are more than this CPU's vector lanes (the reference runs)")
    run_and_check(cpu_paged_context, cpu_heads_view, check, REQUESTS, 2, group, head_dim, block_size, dtype)


@needs_kernel
def test_a_long_chunk_after_a_long_prefix(cpu_paged_context, cpu_heads_view, check):
    """Tiles whose keys span many chunks of 16, heaviest tasks first, several requests."""
    requests = [(922, 102), (0, 300), (17, 1)]
    run_and_check(cpu_paged_context, cpu_heads_view, check, requests, 4, 2, 64, 16, torch.float32)


@needs_kernel
@pytest.mark.parametrize("group", [1, 3, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"d{d}")
def test_a_bfloat16_cache_under_float32_queries(cpu_paged_context, cpu_heads_view, check, head_dim, group):
    """kv_cache_dtype bfloat16: chunks after cached context read the cache's bfloat16 values,
    at float32's tolerance against the reference on those values widened."""
    requests = [*REQUESTS, (922, 102)]
    run_and_check(
        cpu_paged_context, cpu_heads_view, check, requests, 2, group, head_dim, 16, torch.float32, torch.bfloat16
    )


@needs_kernel
def test_float16(cpu_paged_context, cpu_heads_view, check):
    run_and_check(cpu_paged_context, cpu_heads_view, check, REQUESTS, 2, 4, 64, 16, torch.float16)


@needs_kernel
def test_the_result_does_not_depend_on_the_thread_count(cpu_paged_context, cpu_heads_view):
    ctx = cpu_paged_context([300, 41], 2, 64, 16, torch.float32)
    query = cpu_heads_view(341, 4, 64, torch.float32)
    args = (ctx.key_cache, ctx.value_cache, ctx.block_tables, torch.tensor([0, 300, 341], dtype=torch.int32))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_ops.paged_prefill_attention(query, *args, ctx.seq_lens, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_ops_picks_the_kernel_where_it_has_one(monkeypatch, cpu_paged_context, cpu_heads_view):
    calls = []
    real = cpu_ops.paged_prefill_attention
    monkeypatch.setattr(cpu_ops, "paged_prefill_attention", lambda *a: calls.append(1) or real(*a))
    for head_dim, expected in ((64, cpu_ops.prefill_attention_supported(2, 1, 64)), (48, False)):
        calls.clear()
        ctx = cpu_paged_context([5], 1, head_dim, 16, torch.float32)
        query = cpu_heads_view(5, 2, head_dim, torch.float32)
        args = (ctx.key_cache, ctx.value_cache, ctx.block_tables, torch.tensor([0, 5], dtype=torch.int32))
        out = ops.prefill_attention(query, *args, ctx.seq_lens, 0.125, 5)
        assert calls == ([1] if expected else []), head_dim  # 48: no kernel, the reference
        assert not out.isnan().any()
        ops.prefill_attention(query, *args, ctx.seq_lens, 0.125, 5, impl="torch")
        assert calls == ([1] if expected else [])


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_run():
    q = torch.zeros(3, 4, 48)
    cache = torch.zeros(4, 16, 2, 48)
    table, seq_lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    args = (table, torch.tensor([0, 3], dtype=torch.int32), seq_lens)
    with pytest.raises(RuntimeError, match="head size 48"):
        torch.ops.baton_cpu.paged_prefill_attention(q, cache, cache, *args, 0.1)
    half = torch.zeros(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match=r"the query's dtype \(BFloat16\) or, for a float32 query, bfloat16"):
        torch.ops.baton_cpu.paged_prefill_attention(torch.zeros(3, 4, 64).bfloat16(), half, half, *args, 0.1)
    with pytest.raises(RuntimeError, match="the key and value caches differ in dtype"):
        torch.ops.baton_cpu.paged_prefill_attention(torch.zeros(3, 4, 64), half, half.bfloat16(), *args, 0.1)
    with pytest.raises(RuntimeError, match="one longer"):
        torch.ops.baton_cpu.paged_prefill_attention(q, cache, cache, args[0], args[2], args[2], 0.1)
    lanes = cpu_ops.prefill_attention_max_group()  # 16 on AVX-512, 8 on AVX2
    wide = torch.zeros(3, 2 * (lanes + 1), 64)  # one query head per KV head more than a tile's lanes
    with pytest.raises(RuntimeError, match=f"{lanes + 1} query heads per KV head have no kernel"):
        torch.ops.baton_cpu.paged_prefill_attention(wide, half, half, *args, 0.1)
    assert cpu_ops.prefill_attention_supported(2 * lanes, 2, 64)
    assert not cpu_ops.prefill_attention_supported(2 * (lanes + 1), 2, 64)
