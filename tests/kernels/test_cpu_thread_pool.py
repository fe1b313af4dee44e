"""The CPU kernels on their own thread pool (kernels/csrc/thread_pool.h) against the same
kernels on OpenMP: the same bits, and from several callers at once."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from baton.kernels import cpu_ops
from baton.services.model import int8_linear
from baton.services.model.blocked_linear import BlockedWeight
from baton.services.model.w8a8_linear import W8A8Weight

pytestmark = pytest.mark.skipif(
    not (cpu_ops.available() and torch.ops.baton_cpu.blocked_linear_supported(torch.float32)),
    reason="no blocked linear kernel here (neither AVX-512 nor AVX2 with FMA)",
)


@contextlib.contextmanager
def thread_pool(on: bool, num_threads: int = 2):
    was_on, threads = cpu_ops.set_thread_pool(on), torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        cpu_ops.set_thread_pool(was_on)
        torch.set_num_threads(threads)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _kernel_calls(seed: int) -> dict[str, torch.Tensor]:
    """One call of each kernel that runs on the pool, with work enough to split: the blocked,
    int8 and w8a8 linears, decode attention (vector and scalar paths), the fused element-wise
    kernels, and prefill attention."""
    weight = BlockedWeight.from_dense(_randn(1536, 512, seed=seed))
    block_size, num_kv_heads, group, head_dim = 16, 4, 2, 64
    seq_lens = [1, 17, 60, 300, 45]
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * width + 4
    gen = torch.Generator().manual_seed(seed + 1)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = order[: len(seq_lens) * width].reshape(len(seq_lens), width).contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    decode_q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    out = {
        "linear, 16 rows": weight(_randn(16, 512, seed=seed + 2)),
        "linear, 700 rows": weight(_randn(700, 512, seed=seed + 3)),
        "decode attention": cpu_ops.paged_decode_attention(decode_q, key_cache, value_cache, block_tables, lens, scale),
    }
    # head size 48: the scalar decode path
    q48 = torch.randn(len(seq_lens), num_kv_heads * group, 48, generator=gen)
    k48 = torch.randn(num_blocks, block_size, num_kv_heads, 48, generator=gen)
    v48 = torch.randn(num_blocks, block_size, num_kv_heads, 48, generator=gen)
    out["decode attention, scalar"] = cpu_ops.paged_decode_attention(q48, k48, v48, block_tables, lens, 48**-0.5)
    x = torch.randn(600, 512, generator=gen)  # rows enough for the fused kernels to split
    residual = torch.randn(600, 512, generator=gen)
    out["rms norm"], out["rms norm's residual"] = cpu_ops.rms_norm(x, torch.randn(512, generator=gen), 1e-6, residual)
    out["silu and mul"] = cpu_ops.silu_and_mul(torch.randn(600, 2 * 1536, generator=gen))
    query, key = torch.randn(600, 8, 64, generator=gen), torch.randn(600, 4, 64, generator=gen)
    caches = torch.zeros(80, 16, 4, 64), torch.zeros(80, 16, 4, 64)
    cpu_ops.rotary_embedding_and_cache(
        torch.arange(600),
        query,
        key,
        torch.randn(600, 4, 64, generator=gen),
        torch.randn(2048, 64, generator=gen),
        *caches,
        torch.randperm(1280, generator=gen)[:600],
    )
    out["rotary query"], out["rotary key cache"], out["rotary value cache"] = query, *caches
    if int8_linear.uses_int8_kernel(torch.device("cpu"), "cpp"):
        int8 = int8_linear.Int8Weight.from_float(_randn(1536, 512, seed=seed + 4), "cpp")
        out["int8 linear, 8 rows"] = int8(_randn(8, 512, seed=seed + 5))
        out["int8 linear, 300 rows"] = int8(_randn(300, 512, seed=seed + 6))
        w8a8 = W8A8Weight.from_float(_randn(1536, 512, seed=seed + 4), "cpp")
        out["w8a8 linear, 8 rows"] = w8a8(_randn(8, 512, seed=seed + 5))
        out["w8a8 linear, 300 rows"] = w8a8(_randn(300, 512, seed=seed + 6))
    if cpu_ops.prefill_attention_supported(num_kv_heads * group, num_kv_heads, head_dim):
        new = torch.tensor([1, 17, 20, 300, 0], dtype=torch.int32)  # the last tokens of each context
        starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(new, 0)
        prefill_q = torch.randn(int(new.sum()), num_kv_heads * group, head_dim, generator=gen)
        out["prefill attention"] = cpu_ops.paged_prefill_attention(
            prefill_q, key_cache, value_cache, block_tables, starts, lens, scale
        )
    return out


@pytest.mark.parametrize("num_threads", [2, 3])
def test_the_pool_gives_openmps_bits(num_threads):
    """Every kernel splits its work into the same items either way, and each output is one
    item's: which thread runs an item must not change a bit."""
    with thread_pool(False, num_threads):
        expected = _kernel_calls(seed=0)
    joins = torch.ops.baton_cpu.thread_pool_joins()
    with thread_pool(True, num_threads):
        for pause in (0.0, 0.001, 0.05):  # the workers spin, yield, then sleep between calls
            time.sleep(pause)
            got = _kernel_calls(seed=0)
            assert got.keys() == expected.keys()
            for name in expected:
                assert torch.equal(got[name], expected[name]), name
    assert torch.ops.baton_cpu.thread_pool_joins() > joins, "no pool worker took part"


def test_callers_on_several_threads_share_the_pool():
    """Only one caller runs on the pool at a time; the others fall back to OpenMP, with the
    same results (two engines in one process, or a test beside a server)."""
    with thread_pool(False):
        expected = _kernel_calls(seed=5)
    errors: list[str] = []

    def call() -> None:
        for _ in range(6):
            got = _kernel_calls(seed=5)
            errors.extend(name for name in expected if not torch.equal(got[name], expected[name]))

    with thread_pool(True):
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    assert errors == []
