"""The C++ CPU decode attention (kernels/csrc) against `paged_decode_attention_ref`, and how
`ops` picks it or falls back to the reference."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from baton.kernels import cpu_ops, ops
from baton.kernels.reference import paged_decode_attention_ref
from testlib.kernel_sweep import (
    ATTENTION_DTYPE_IDS,
    ATTENTION_DTYPES,
    OTHER_ATTENTION_SHAPE_IDS,
    OTHER_ATTENTION_SHAPES,
)


def run_and_check(
    cpu_paged_context,
    cpu_heads_view,
    check,
    seq_lens,
    num_kv_heads,
    group,
    head_dim,
    block_size,
    dtype,
    cache_dtype=None,
):
    ctx = cpu_paged_context(seq_lens, num_kv_heads, head_dim, block_size, cache_dtype or dtype)
    query = cpu_heads_view(len(seq_lens), num_kv_heads * group, head_dim, dtype)  # a strided view
    scale = head_dim**-0.5
    caches = ctx.key_cache, ctx.value_cache, ctx.block_tables, ctx.seq_lens
    out = cpu_ops.paged_decode_attention(query, *caches, scale)
    expected = paged_decode_attention_ref(query.float(), *ctx.reference_inputs(), scale)
    assert out.dtype == dtype and out.shape == query.shape
    check(out, expected)


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_kernels_build_on_this_machine():
    """CI machines have a compiler: the fallback must not hide a broken build there."""
    assert cpu_ops.available(), cpu_ops._state.get("error")


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 48], ids=lambda d: f"d{d}")  # 48: the generic path
def test_matches_reference(cpu_paged_context, cpu_heads_view, check, head_dim, group, block_size, dtype):
    seq_lens = [1, 7, block_size, block_size + 3, 3 * block_size - 1, 100, 301]
    run_and_check(cpu_paged_context, cpu_heads_view, check, seq_lens, 2, group, head_dim, block_size, dtype)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize(
    ("head_dim", "group", "num_kv_heads", "block_size"), OTHER_ATTENTION_SHAPES, ids=OTHER_ATTENTION_SHAPE_IDS
)
def test_other_shapes_match_reference(
    cpu_paged_context, cpu_heads_view, check, head_dim, group, num_kv_heads, block_size, dtype
):
    seq_lens = [1, block_size + 1, 2 * block_size, 257]
    run_and_check(cpu_paged_context, cpu_heads_view, check, seq_lens, num_kv_heads, group, head_dim, block_size, dtype)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize(
    ("head_dim", "group"), [(64, 3), (64, 6), (64, 12), (128, 3), (128, 9), (256, 3)], ids=lambda v: str(v)
)
def test_groups_that_split_into_uneven_passes(cpu_paged_context, cpu_heads_view, check, head_dim, group, dtype):
    """The vector path's register tiles take a KV head's query heads two at a time (an odd one
    alone), and a block takes at most eight of them at once: groups of 9 and 12 take a second
    pass over each block, shorter than the first."""
    run_and_check(cpu_paged_context, cpu_heads_view, check, [1, 33, 300], 2, group, head_dim, 16, dtype)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize(
    "seq_lens", [[300], [5, 300, 70], [40] * 3 + [1, 2, 17], [33] * 16], ids=lambda lens: f"{len(lens)}reqs"
)
@pytest.mark.parametrize("head_dim", [64, 48], ids=lambda d: f"d{d}")
def test_small_batches_split_requests_into_head_ranges(
    cpu_paged_context, cpu_heads_view, check, seq_lens, head_dim, dtype
):
    """A task is a range of one request's KV heads, as many ranges as give each thread about
    four tasks: one request of 8 KV heads splits into eight, three into ranges of two and
    three heads, 16 requests stay whole. Each range prefetches its own slices of the next
    block."""
    for threads in (1, 2):
        with torch_threads(threads):
            run_and_check(cpu_paged_context, cpu_heads_view, check, seq_lens, 8, 2, head_dim, 16, dtype)


@pytest.mark.parametrize("group", [1, 3, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 48], ids=lambda d: f"d{d}")  # 48: the generic path
def test_a_bfloat16_cache_under_float32_queries(cpu_paged_context, cpu_heads_view, check, head_dim, group):
    """kv_cache_dtype bfloat16: float32 attention over the cache's bfloat16 values, at
    float32's tolerance against the reference on those values widened."""
    seq_lens = [1, 7, 16, 19, 47, 100, 301]
    run_and_check(
        cpu_paged_context, cpu_heads_view, check, seq_lens, 2, group, head_dim, 16, torch.float32, torch.bfloat16
    )


def test_float16(cpu_paged_context, cpu_heads_view, check):
    run_and_check(cpu_paged_context, cpu_heads_view, check, [1, 40, 300], 2, 4, 64, 16, torch.float16)


def test_auto_picks_the_kernel_on_cpu(monkeypatch, cpu_paged_context, cpu_heads_view):
    ctx = cpu_paged_context([5, 40], 2, 64, 16, torch.float32)
    query = cpu_heads_view(2, 4, 64, torch.float32)
    calls = []
    real = cpu_ops.paged_decode_attention
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", lambda *a: calls.append(1) or real(*a))
    caches = ctx.key_cache, ctx.value_cache, ctx.block_tables, ctx.seq_lens
    ops.paged_decode_attention(query, *caches, 0.125)
    assert calls == [1]
    ops.paged_decode_attention(query, *caches, 0.125, impl="torch")
    assert calls == [1]


def test_a_failed_build_falls_back_to_the_reference(monkeypatch, caplog, cpu_paged_context, cpu_heads_view, check):
    def broken_load(**kwargs):
        raise RuntimeError("Error building extension 'baton_cpu_kernels'\nc++: not found")

    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setattr("torch.utils.cpp_extension.load", broken_load)
    with caplog.at_level(logging.WARNING, logger=cpu_ops.__name__):
        assert not cpu_ops.available()
    assert "could not be built (RuntimeError: c++: not found)" in caplog.text
    ctx = cpu_paged_context([5, 40], 2, 64, 16, torch.float32)
    query = cpu_heads_view(2, 4, 64, torch.float32)
    caches = ctx.reference_inputs()  # the reference needs finite values past each context
    check(ops.paged_decode_attention(query, *caches, 0.125), paged_decode_attention_ref(query, *caches, 0.125))
    with pytest.raises(cpu_ops.CpuKernelsUnavailable, match="c\\+\\+: not found"):
        ops.paged_decode_attention(query, *caches, 0.125, impl="cpp")


def test_the_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    assert not cpu_ops.available()
    with pytest.raises(cpu_ops.CpuKernelsUnavailable, match="BATON_CPU_KERNELS=0"):
        cpu_ops.require()


def test_bad_inputs_are_named(cpu_paged_context, cpu_heads_view):
    ctx = cpu_paged_context([5], 2, 64, 16, torch.float32)
    query = cpu_heads_view(1, 4, 64, torch.float32)
    caches = ctx.key_cache, ctx.value_cache
    tables = ctx.block_tables, ctx.seq_lens
    with pytest.raises(
        RuntimeError, match=r"the query's dtype \(BFloat16\) or, for a float32 query, bfloat16; got Float"
    ):
        cpu_ops.paged_decode_attention(query.bfloat16(), *caches, *tables, 0.1)
    with pytest.raises(RuntimeError, match="the key and value caches differ in dtype"):
        cpu_ops.paged_decode_attention(query, caches[0], caches[1].bfloat16(), *tables, 0.1)
    with pytest.raises(RuntimeError, match="3 query heads do not divide into 2 KV heads"):
        cpu_ops.paged_decode_attention(cpu_heads_view(1, 3, 64, torch.float32), *caches, *tables, 0.1)
    with pytest.raises(RuntimeError, match="query head size 32 != cache head size 64"):
        cpu_ops.paged_decode_attention(cpu_heads_view(1, 4, 32, torch.float32), *caches, *tables, 0.1)
    with pytest.raises(RuntimeError, match="one row per request"):
        cpu_ops.paged_decode_attention(cpu_heads_view(2, 4, 64, torch.float32), *caches, *tables, 0.1)


def test_the_cpp_backend_is_checked_when_the_engine_starts(monkeypatch, llama_dir):
    from baton.services.engine import LLM
    from baton.services.engine.execution.model_runner import _prepare_cpu_kernels

    with pytest.raises(ValueError, match="kernel_backend 'cpp' runs on the CPU"):
        _prepare_cpu_kernels("cpp", torch.device("cuda"))
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    with pytest.raises(cpu_ops.CpuKernelsUnavailable, match="BATON_CPU_KERNELS=0"):
        LLM(model=str(llama_dir), kernel_backend="cpp", device="cpu", num_kv_blocks=16)
    llm = LLM(model=str(llama_dir), device="cpu", num_kv_blocks=16)  # auto: the reference, and it still generates
    assert len(llm.generate(["Hello"])[0].token_ids) > 0
