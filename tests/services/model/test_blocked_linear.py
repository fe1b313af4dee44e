"""The blocked linear (services/model/blocked_linear.py, kernels/csrc/cpu_blocked_linear.cpp),
float32 and bfloat16: the kernel against F.linear in float64 over every tile height, panel
boundaries and ragged shapes (odd K for bfloat16's pairs); bfloat16's rounding of y; the
layouts' round trip; results that do not depend on the thread count; refused inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baton.kernels import cpu_ops
from baton.services.model.blocked_linear import BLOCK, BlockedWeight, pack_blocks, unpack_blocks, uses_blocked_kernel


def _kernel_runs(dtype: torch.dtype = torch.float32) -> bool:
    return cpu_ops.available() and bool(torch.ops.baton_cpu.blocked_linear_supported(dtype))


needs_kernel = pytest.mark.skipif(
    not _kernel_runs(), reason="no blocked linear kernel here (neither AVX-512 nor AVX2 with FMA)"
)
needs_bf16_kernel = pytest.mark.skipif(
    not _kernel_runs(torch.bfloat16),
    reason="no bfloat16 blocked linear here (neither AVX512-BF16 without AMX nor AVX2 without AVX-512)",
)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize(("num_out", "num_in"), [(96, 40), (100, 48), (8, 7), (17, 1), (3072, 512)])
def test_blocks_round_trip_and_pad_with_zeros(num_out, num_in):
    weight = _randn(num_out, num_in, seed=0)
    blocks = pack_blocks(weight)
    assert blocks.shape == (-(-num_out // BLOCK), num_in, BLOCK) and blocks.is_contiguous()
    assert torch.equal(blocks[0, :, 3], weight[3]) and torch.equal(unpack_blocks(blocks, weight.shape), weight)
    padding = blocks.transpose(1, 2).reshape(-1, num_in)[num_out:]
    assert not padding.any()


@pytest.mark.parametrize(("num_out", "num_in"), [(96, 40), (100, 47), (8, 7), (17, 1)])
def test_bfloat16_blocks_take_k_in_pairs(num_out, num_in):
    weight = _randn(num_out, num_in, seed=0).bfloat16()
    blocks = pack_blocks(weight)
    num_pairs = -(-num_in // 2)
    assert blocks.shape == (-(-num_out // BLOCK), num_pairs, BLOCK, 2) and blocks.is_contiguous()
    assert torch.equal(blocks[0, 0, 3], weight[3, :2]) if num_in > 1 else torch.equal(blocks[0, 0, 3, 0], weight[3, 0])
    assert torch.equal(unpack_blocks(blocks, weight.shape), weight)
    if num_in % 2:
        assert not blocks[:, -1, :, 1].any()  # the odd K's missing partner


# Row counts: every register tile height (1-12, and the 4-row x 4-block tile), tiles that
# leave a remainder, the 120-row panel's edges and several panels.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 25, 64, 119, 120, 121, 250, 300]
SHAPES = [(96, 40), (100, 48), (8, 7), (17, 1), (40, 70), (1024, 512), (512, 1536)]


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("num_out", "num_in"), SHAPES)
def test_the_kernel_equals_f_linear(rows, num_out, num_in):
    weight, bias, x = _randn(num_out, num_in, seed=0), _randn(num_out, seed=1), _randn(rows, num_in, seed=2)
    blocked = BlockedWeight.from_dense(weight)
    for b in (None, bias):
        torch.testing.assert_close(blocked(x, b).double(), _expected(x, weight, b), atol=1e-4, rtol=1e-4)


# bfloat16 rows: the AVX-512 tiles' heights as above; on AVX2 the in-register tiles (1, 2, up to
# 4 rows) below 16 rows and the float32 copy of each block from 16 on
BF16_ROWS = [1, 2, 3, 4, 5, 6, 7, 12, 13, 15, 16, 25, 121, 250]


@needs_bf16_kernel
@pytest.mark.parametrize("rows", BF16_ROWS)
@pytest.mark.parametrize(("num_out", "num_in"), [(96, 40), (100, 47), (8, 7), (17, 1), (1024, 512)])
def test_the_bfloat16_kernel_equals_f_linear(rows, num_out, num_in):
    """float32 sums of exact bfloat16 products, rounded to bfloat16 once: within one bf16 ulp
    of the float64 result."""
    weight, bias = _randn(num_out, num_in, seed=0).bfloat16(), _randn(num_out, seed=1).bfloat16()
    x = _randn(rows, num_in, seed=2).bfloat16()
    blocked = BlockedWeight.from_dense(weight)
    for b in (None, bias):
        y = blocked(x, b)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), _expected(x, weight, b), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_kernel)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize("rows", [481, 2100])
@needs_kernel
def test_many_panels_take_larger_chunks_of_blocks(rows, dtype):
    """From 4 panels of 120 rows the work items take larger chunks of blocks (up to 1 MB on
    AVX2), with a ragged last chunk and panel."""
    weight, bias = _randn(3000, 512, seed=0).to(dtype), _randn(3000, seed=1).to(dtype)
    x = _randn(rows, 512, seed=2).to(dtype)
    y = BlockedWeight.from_dense(weight)(x, bias)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(y.double(), _expected(x, weight, bias), **tol)


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 20])
@pytest.mark.parametrize("num_in", [24, 23])
def test_bfloat16_results_round_to_nearest_even_as_torch_does(rows, num_in):
    """y = x + bias through an identity weight: every product but one is zero, so the float32
    sum is exact and its rounding to bfloat16 (ties, infinities, NaN) must equal torch's."""
    num_out = num_in + 1  # one channel past the identity: a partial vector of 8
    weight = torch.zeros(num_out, num_in)
    weight[:num_in] = torch.eye(num_in)
    x = (_randn(rows, num_in, seed=3) * 4).bfloat16()
    x[0, :2] = 1.0
    bias = (_randn(num_out, seed=4) * 2.0 ** -torch.randint(0, 12, (num_out,))).bfloat16()
    bias[:5] = torch.tensor([2**-8, 3 * 2**-8, float("inf"), float("nan"), -float("inf")])
    y = BlockedWeight.from_dense(weight.bfloat16())(x, bias)
    expected = F.linear(x.float(), weight, bias.float()).bfloat16()
    torch.testing.assert_close(y, expected, atol=0, rtol=0, equal_nan=True)
    # ties: 1 + 2^-8 rounds down to the even 1, 1 + 3 * 2^-8 up to 1 + 2^-6
    assert y[0, 0] == 1.0 and y[0, 1] == 1.015625
    assert (y[:, 2] == float("inf")).all() and y[:, 3].isnan().all() and (y[:, 4] == -float("inf")).all()


@needs_kernel
def test_the_kernel_takes_leading_dims_and_strided_rows():
    weight = _randn(96, 40, seed=0)
    blocked = BlockedWeight.from_dense(weight)
    x = _randn(3, 6, 80, seed=1)[..., ::2]  # [3, 6, 40], not contiguous
    y = blocked(x)
    assert y.shape == (3, 6, 96)
    torch.testing.assert_close(y.double(), _expected(x, weight, None), atol=1e-4, rtol=1e-4)
    assert blocked(torch.empty(0, 40)).shape == (0, 96)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_kernel)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize("rows", [3, 37])
@needs_kernel
def test_the_result_does_not_depend_on_the_thread_count(rows, dtype):
    """Each output is one thread's dot product in k order, whichever thread takes its item:
    a replica that runs with 1 thread or 2, or whose threads are preempted, gives the same bits."""
    weight, x = _randn(1024, 512, seed=0).to(dtype), _randn(rows, 512, seed=1).to(dtype)
    blocked = BlockedWeight.from_dense(weight)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(blocked(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


@needs_kernel
def test_the_kernel_refuses_what_does_not_fit():
    blocks = pack_blocks(_randn(40, 8, seed=0))  # 3 blocks
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.baton_cpu.blocked_linear(torch.ones(2, 9), blocks, None, 40)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.baton_cpu.blocked_linear(torch.ones(2, 8).bfloat16(), blocks, None, 40)
    with pytest.raises(RuntimeError, match="does not fit the blocks"):
        torch.ops.baton_cpu.blocked_linear(torch.ones(2, 8), blocks, None, 50)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.baton_cpu.blocked_linear(torch.ones(2, 8, dtype=torch.float64), blocks, None, 40)
    with pytest.raises(RuntimeError, match="no blocked linear kernel for Double"):
        torch.ops.baton_cpu.blocked_linear(torch.ones(2, 8, dtype=torch.float64), blocks.double(), None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.baton_cpu.blocked_linear(torch.ones(2, 8), blocks, torch.ones(41), 40)


def test_which_weights_are_blocked():
    assert not uses_blocked_kernel(torch.ones(4, 4, dtype=torch.float16), "auto")
    assert not uses_blocked_kernel(torch.ones(4, 4), "torch")
    assert uses_blocked_kernel(torch.ones(4, 4), "auto") == _kernel_runs()
    assert uses_blocked_kernel(torch.ones(4, 4, dtype=torch.bfloat16), "auto") == _kernel_runs(torch.bfloat16)
