"""The CPU kernels' paths that the native build here does not take, in second builds.

Each kernel picks its vector width, register tiles and lanes at compile time from
-march=native, so the other tests check only the paths of the machine they run on. This
file builds the kernels again with parts of the instruction set switched off
(cpu_ops.build_variant) and checks their decode and prefill attention, blocked linear
(float32, and bfloat16 where the build has a kernel for it), int8 and w8a8 linears against
the same references:

avx2            -mno-avx512f: the AVX2 paths (8 lanes; bfloat16 widened to float32), on
                machines with AVX-512. Where the native build is already the AVX2 one it is
                skipped (the other tests cover it); BATON_TEST_AVX2_BUILD=1 runs it anyway.
avx512-no-bf16  -mno-avx512bf16: AVX-512 without its bfloat16 dot product (bfloat16 widened
                to float32 in 16 lanes), on machines with AVX512-BF16, whose native build
                multiplies bfloat16 with it.

Each build takes about a minute on 2 cores.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from baton.kernels import cpu_ops
from baton.kernels.reference import paged_decode_attention_ref, prefill_attention_ref
from baton.services.model.blocked_linear import pack_blocks
from baton.services.model.int8_linear import int8_linear_ref, pack_int8_blocks, quantize_int8
from baton.services.model.w8a8_linear import pack_w8a8_blocks, w8a8_linear_ref
from testlib.cpu import cpu_flags
from testlib.kernel_sweep import ATTENTION_DTYPE_IDS, ATTENTION_DTYPES

# AVX-512's subsets and AMX depend on avx512f
BUILD_FLAGS = {"avx2": ["-mno-avx512f", "-mno-amx-tile"], "avx512-no-bf16": ["-mno-avx512bf16", "-mno-amx-tile"]}


def _why_skip(build: str) -> str | None:
    flags = cpu_flags()
    if not cpu_ops.available():
        return "Baton's CPU kernels cannot be built here"
    if build == "avx2":
        if not {"avx2", "fma"} <= flags:
            return "this CPU has no AVX2 with FMA to run an AVX2 build on"
        if "avx512f" not in flags and os.environ.get("BATON_TEST_AVX2_BUILD") != "1":
            return "the native build is the AVX2 one here (BATON_TEST_AVX2_BUILD=1 builds it again)"
    elif "avx512_bf16" not in flags:
        return "this CPU has no AVX512-BF16: the native build is the one without it"
    return None


@pytest.fixture(scope="module", params=list(BUILD_FLAGS))
def variant(request):
    reason = _why_skip(request.param)
    if reason is not None:
        pytest.skip(reason)
    library = "baton_cpu_" + request.param.replace("-", "_")
    return request.param, cpu_ops.build_variant(library, BUILD_FLAGS[request.param])


def test_each_build_takes_its_paths(variant):
    build, ops = variant
    lanes = 8 if build == "avx2" else 16
    assert ops.prefill_attention_max_group() == lanes  # a vector's lanes
    assert ops.blocked_linear_supported(torch.float32)
    # AVX2 widens bfloat16 to float32; AVX-512 without its bfloat16 dot product leaves it to oneDNN
    assert ops.blocked_linear_supported(torch.bfloat16) == (build == "avx2")
    if build == "avx2":
        assert ops.int8_linear_layout() == 1


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("group", [1, 3, 4, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 48], ids=lambda d: f"d{d}")  # 48: the generic path
def test_decode_attention(variant, cpu_paged_context, cpu_heads_view, check, head_dim, group, dtype):
    ctx = cpu_paged_context([1, 7, 16, 19, 47, 100, 301], 2, head_dim, 16, dtype)
    query = cpu_heads_view(7, 2 * group, head_dim, dtype)
    scale = head_dim**-0.5
    out = variant[1].paged_decode_attention(
        query.contiguous(), ctx.key_cache, ctx.value_cache, ctx.block_tables, ctx.seq_lens, scale
    )
    check(out, paged_decode_attention_ref(query.float(), *ctx.reference_inputs(), scale))


@pytest.mark.parametrize("head_dim", [64, 128, 48], ids=lambda d: f"d{d}")
def test_decode_attention_over_a_bfloat16_cache(variant, cpu_paged_context, cpu_heads_view, check, head_dim):
    ctx = cpu_paged_context([1, 7, 16, 19, 47, 100, 301], 2, head_dim, 16, torch.bfloat16)
    query = cpu_heads_view(7, 8, head_dim, torch.float32)
    scale = head_dim**-0.5
    out = variant[1].paged_decode_attention(
        query.contiguous(), ctx.key_cache, ctx.value_cache, ctx.block_tables, ctx.seq_lens, scale
    )
    check(out, paged_decode_attention_ref(query, *ctx.reference_inputs(), scale))


# (cached, new) per request: full prefills, chunks after cached context, a request with no
# queries this step, a chunk spanning several tiles
REQUESTS = [(0, 1), (0, 17), (40, 23), (70, 2), (30, 0), (5, 45)]


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("group", [1, 3, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"d{d}")
def test_prefill_attention(variant, cpu_paged_context, cpu_heads_view, check, head_dim, group, dtype):
    new = torch.tensor([n for _, n in REQUESTS])
    query_start_loc = torch.zeros(len(REQUESTS) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(new, 0)
    ctx = cpu_paged_context([c + n for c, n in REQUESTS], 2, head_dim, 16, dtype)
    query = cpu_heads_view(int(new.sum()), 2 * group, head_dim, dtype)
    scale = head_dim**-0.5
    caches = ctx.key_cache, ctx.value_cache, ctx.block_tables
    out = variant[1].paged_prefill_attention(query, *caches, query_start_loc, ctx.seq_lens, scale)
    key_cache, value_cache, block_tables, seq_lens = ctx.reference_inputs()
    check(
        out,
        prefill_attention_ref(query.float(), key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale),
    )


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# every tile height of the AVX2 tiles (1 and 2 rows take their own), a panel boundary (120)
ROWS = [1, 2, 3, 5, 6, 7, 13, 25, 121]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("num_out", "num_in"), [(96, 40), (100, 48), (8, 7), (1024, 512)])
def test_blocked_linear(variant, rows, num_out, num_in):
    weight, bias, x = _randn(num_out, num_in, seed=0), _randn(num_out, seed=1), _randn(rows, num_in, seed=2)
    y = variant[1].blocked_linear(x, pack_blocks(weight), bias, num_out)
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


# bfloat16: the in-register tiles (1, 2, up to 4 rows) below 16 rows, a float32 copy of each block from 16
@pytest.mark.parametrize("variant", ["avx2"], indirect=True)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 15, 16, 25, 121])
@pytest.mark.parametrize(("num_out", "num_in"), [(96, 40), (100, 47), (8, 7), (1024, 512)])
def test_blocked_linear_bfloat16(variant, rows, num_out, num_in):
    weight, bias = _randn(num_out, num_in, seed=0).bfloat16(), _randn(num_out, seed=1).bfloat16()
    x = _randn(rows, num_in, seed=2).bfloat16()
    y = variant[1].blocked_linear(x, pack_blocks(weight), bias, num_out)
    assert y.dtype == torch.bfloat16
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(y.double(), expected, atol=2e-2, rtol=1.6e-2)  # one bfloat16 rounding


@pytest.mark.parametrize("rows", [*ROWS[:-1], 24, 30])  # from 24 rows a block is widened once per call
@pytest.mark.parametrize(("num_out", "num_in"), [(192, 64), (100, 48), (40, 70)])
def test_int8_linear(variant, rows, num_out, num_in):
    q, scale = quantize_int8(_randn(num_out, num_in, seed=0) * 0.1)
    bias, x = _randn(num_out, seed=1), _randn(rows, num_in, seed=2)
    y = variant[1].int8_linear(x, pack_int8_blocks(q, variant[1].int8_linear_layout()), scale, bias, num_out, 1 << 30)
    expected = int8_linear_ref(x.double(), q, scale.double(), bias.double())
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


# w8a8: the AVX2 build has no VNNI and multiplies int16 with vpmaddwd, which must give the same sums
@pytest.mark.parametrize("rows", [1, 2, 5, 13, 70])  # 70: tasks of two blocks
@pytest.mark.parametrize(("num_out", "num_in"), [(48, 64), (100, 47)])
def test_w8a8_linear(variant, rows, num_out, num_in):
    q, scale = quantize_int8(_randn(num_out, num_in, seed=0) * 0.1)
    x = _randn(rows, num_in, seed=2)
    packed, sums = pack_w8a8_blocks(q)
    y = variant[1].w8a8_linear(x, packed, sums, scale, None, num_out)
    assert torch.equal(y, w8a8_linear_ref(x, q, scale))
    assert variant[1].w8a8_linear_fast()  # VNNI, or AVX2's vpmaddwd where a build has no VNNI
