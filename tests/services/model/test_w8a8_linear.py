"""int8 weights with per-token int8 activations (services/model/w8a8_linear.py,
kernels/csrc/cpu_w8a8_linear.cpp): the kernel against the exact reference over row counts,
shapes and padding, each row independent of the batch it is in, the block layout, and the
activations' own quantization."""

from __future__ import annotations

import pytest
import torch
from baton.kernels import cpu_ops
from baton.services.model.int8_linear import quantize_int8, unpack_channel_blocks
from baton.services.model.w8a8_linear import (
    BLOCK,
    W8A8Weight,
    pack_w8a8_blocks,
    quantize_rows,
    w8a8_linear_ref,
)

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="Baton's CPU kernels cannot be built here")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# 1-12 rows: one register tile; 13, 25, 300: several, the last partial
ROWS = [1, 2, 3, 5, 8, 12, 13, 25, 300]
SHAPES = [(1024, 512), (100, 47), (16, 4), (7, 3), (48, 1537)]  # channels past a block, K not a multiple of 4


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("num_out", "num_in"), SHAPES)
def test_the_kernel_gives_the_references_exact_sums(rows, num_out, num_in):
    weight, x = _randn(num_out, num_in, seed=0) * 0.1, _randn(rows, num_in, seed=1)
    x[rows // 2] = 0  # an all-zero row: scale 0, outputs 0
    q, scale = quantize_int8(weight)
    w8a8 = W8A8Weight.from_float(weight, "cpp")
    assert w8a8.blocked
    # Same integers, same float32 operations in the same order: equal, not close.
    assert torch.equal(w8a8(x), w8a8_linear_ref(x, q, scale))
    assert torch.equal(w8a8(x)[rows // 2], torch.zeros(num_out))
    bias = _randn(num_out, seed=2)
    # With a bias the compiler may fuse the last multiply and add (one rounding fewer).
    torch.testing.assert_close(w8a8(x, bias), w8a8_linear_ref(x, q, scale, bias), atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("at", [0, 37, 60])  # in the vector part, a later one, the tail
def test_a_nan_in_a_row_makes_that_row_nan_and_no_other(at):
    weight, x = _randn(40, 61, seed=0) * 0.1, _randn(3, 61, seed=1)
    x[1, at] = float("nan")
    w8a8 = W8A8Weight.from_float(weight, "cpp")
    y, expected = w8a8(x), w8a8_linear_ref(x, *quantize_int8(weight))
    assert y[1].isnan().all() and expected[1].isnan().all()
    assert torch.equal(y[[0, 2]], expected[[0, 2]])


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch():
    """Per-token scales: a request's outputs are the same whichever requests share its step
    (a per-tensor scale would change every row when one row's magnitude changes)."""
    w8a8 = W8A8Weight.from_float(_randn(256, 128, seed=0) * 0.1, "cpp")
    x = _randn(9, 128, seed=1)
    batch = torch.cat([x, 50 * _randn(4, 128, seed=2)])  # louder neighbours
    together = w8a8(batch)[:9]
    assert torch.equal(together, torch.cat([w8a8(x[i : i + 1]) for i in range(9)]))


@needs_kernel
def test_the_kernel_is_close_to_the_float_product():
    """Two int8 roundings (weights per channel, activations per token): ~1% of the output's
    scale on random data, where a wrong scale or channel order is off by whole units."""
    weight, x = _randn(512, 512, seed=0) * 0.05, _randn(8, 512, seed=1)
    y = W8A8Weight.from_float(weight, "cpp")(x)
    expected = x @ weight.T
    error = (y - expected).abs().max() / expected.abs().max()
    assert 0 < error < 0.03


def test_the_reference_runs_without_the_kernel_and_keeps_the_dtype():
    weight = _randn(40, 24, seed=0)
    w8a8 = W8A8Weight.from_float(weight.bfloat16(), "torch")
    assert not w8a8.blocked and w8a8.values.dtype == torch.int8
    x = _randn(2, 3, 24, seed=1).bfloat16()
    y = w8a8(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    q, scale = quantize_int8(weight.bfloat16())
    assert torch.equal(y, w8a8_linear_ref(x, q, scale))


def test_activations_quantize_per_row_to_plus_minus_127():
    x = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [3.0, 0.03, -1.5]])
    q, scale = quantize_rows(x)
    assert q.tolist() == [[32, -127, 64], [0, 0, 0], [127, 1, -64]]  # 63.5 -> 64, 1.27 -> 1, half to even
    torch.testing.assert_close(scale.view(-1), torch.tensor([2.0 / 127, 0.0, 3.0 / 127]))


@pytest.mark.parametrize(("num_out", "num_in"), SHAPES)
def test_blocks_round_trip_and_pad_with_zeros(num_out, num_in):
    q, _ = quantize_int8(_randn(num_out, num_in, seed=0))
    packed, sums = pack_w8a8_blocks(q)
    blocks = -(-num_out // BLOCK)
    assert packed.shape == (blocks, -(-num_in // 4), BLOCK, 4)
    assert torch.equal(unpack_channel_blocks(packed, (num_out, num_in)), q)
    assert sums.shape == (blocks * BLOCK,) and sums.dtype == torch.int32
    assert torch.equal(sums[:num_out], q.sum(dim=1, dtype=torch.int32)) and not sums[num_out:].any()
    assert int(packed.sum()) == int(q.sum())  # the padding holds zeros


@needs_kernel
def test_a_weight_that_does_not_fit_the_blocks_is_refused():
    w8a8 = W8A8Weight.from_float(_randn(32, 16, seed=0), "cpp")
    with pytest.raises(RuntimeError, match="does not fit the blocks"):
        torch.ops.baton_cpu.w8a8_linear(_randn(2, 16, seed=1), w8a8.values, w8a8.column_sums, w8a8.scale, None, 64)
    with pytest.raises(RuntimeError, match="padded to 4"):
        torch.ops.baton_cpu.w8a8_linear(_randn(2, 9, seed=1), w8a8.values, w8a8.column_sums, w8a8.scale, None, 32)
