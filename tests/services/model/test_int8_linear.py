"""Weight-only int8 linear (services/model/int8_linear.py, kernels/csrc/cpu_int8_linear.cpp):
the kernel against the dequantized reference over row counts and shapes, quantization's own
error, the block layout and the compressed-tensors int32 packing."""

from __future__ import annotations

import pytest
import torch
from baton.kernels import cpu_ops
from baton.services.model.compressed_tensors import pack_int32, unpack_int32
from baton.services.model.int8_linear import (
    BLOCK,
    Int8Weight,
    int8_linear_ref,
    pack_int8_blocks,
    quantize_int8,
    unpack_channel_blocks,
)
from testlib.cpu import cpu_flags

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="Baton's CPU kernels cannot be built here")


def _weight(num_out: int, num_in: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_out, num_in, generator=torch.Generator().manual_seed(seed)) * 0.1


AVX512, AMX = 10**9, 1  # amx_min_rows that take each path


def _paths() -> list[int]:
    """The vector path (AVX-512, or AVX2 without it) wherever the kernels build; AMX where this
    CPU and OS have it (the kernel falls back to the vector path elsewhere, so the AMX case
    then checks that)."""
    return [AVX512, AMX]


def _kernel(weight: torch.Tensor, path: int) -> Int8Weight:
    int8 = Int8Weight.from_float(weight, "cpp")
    int8.amx_min_rows = path
    return int8


def _amx_runs() -> bool:
    return {"amx_bf16", "avx512_bf16"} <= cpu_flags()


def _activations_as_the_kernel_rounds_them(x: torch.Tensor, path: int) -> torch.Tensor:
    """The AMX path rounds activations to bfloat16 (cpu_int8_linear.cpp)."""
    return x.bfloat16().float() if path == AMX and _amx_runs() else x


@needs_kernel
@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 12, 13, 16, 17, 23, 24, 64, 300])
@pytest.mark.parametrize(("num_out", "num_in"), [(192, 64), (100, 48), (3072, 512), (8, 7), (40, 70)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_equals_the_dequantized_reference(path, rows, num_out, num_in, with_bias):
    weight = _weight(num_out, num_in)
    bias = torch.randn(num_out) if with_bias else None
    int8 = _kernel(weight, path)
    assert int8.blocked and int8.values.shape == (-(-num_out // BLOCK), -(-num_in // 32) * 16, BLOCK, 2)
    x = torch.randn(rows, num_in, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_int8(weight)
    assert torch.equal(int8.int8_values, q)
    x_ref = _activations_as_the_kernel_rounds_them(x, path)
    expected = int8_linear_ref(x_ref.double(), q, scale.double(), None if bias is None else bias.double())
    torch.testing.assert_close(int8(x, bias).double(), expected, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_the_kernel_takes_leading_dims_strided_rows_and_half_precision():
    weight = _weight(96, 40)
    ref = Int8Weight.from_float(weight, "torch")
    x = torch.randn(3, 6, 80)[..., ::2]  # [3, 6, 40], not contiguous; 18 rows
    for path in _paths():
        kernel = _kernel(weight, path)
        torch.testing.assert_close(
            kernel(x), ref(_activations_as_the_kernel_rounds_them(x, path)), atol=1e-4, rtol=1e-4
        )
        assert kernel(x).shape == (3, 6, 96)
    half = Int8Weight.from_float(weight.bfloat16(), "cpp")
    y = half(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref(x), atol=0.05, rtol=0.02)


def test_quantization_error_is_half_a_step_per_weight():
    weight = _weight(64, 256)
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    assert torch.equal(q.abs().amax(dim=1), torch.full((64,), 127, dtype=torch.int8))  # the range is used
    error = (q.float() * scale[:, None] - weight).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert error.max() > scale.min() / 4  # it does round (a test that could not fail would not)


def test_an_all_zero_row_quantizes_to_zeros():
    weight = _weight(4, 16)
    weight[2] = 0
    q, scale = quantize_int8(weight)
    assert torch.equal(q[2], torch.zeros(16, dtype=torch.int8)) and torch.isfinite(scale).all()


def test_given_scales_keep_the_checkpoint_integers_exactly():
    q = torch.randint(-128, 128, (8, 16), dtype=torch.int8)
    scale = torch.rand(8) + 0.01
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got_q, got_scale = quantize_int8(q.to(dtype), scale)
        assert torch.equal(got_q, q) and torch.equal(got_scale, scale)


def test_blocks_round_trip_and_pad_with_zeros():
    q = torch.randint(-128, 128, (BLOCK + 6, 9), dtype=torch.int8)
    pairs = pack_int8_blocks(q, 1)  # K padded to 32, in k-pairs
    assert pairs.shape == (2, 16, BLOCK, 2)
    assert torch.equal(pairs[0, 2, 5, 1], q[5, 5]) and torch.equal(pairs[1, 4, 1, 0], q[BLOCK + 1, 8])
    assert torch.equal(pairs[:, 5:], torch.zeros_like(pairs[:, 5:]))  # k >= 10
    assert torch.equal(pairs[0, 4, :, 1], torch.zeros(BLOCK, dtype=torch.int8))  # k = 9
    assert torch.equal(pairs[1, :, 6:], torch.zeros(16, BLOCK - 6, 2, dtype=torch.int8))
    assert torch.equal(unpack_channel_blocks(pairs, q.shape), q)
    assert pack_int8_blocks(q, 0) is q or torch.equal(pack_int8_blocks(q, 0), q)


def test_dequantize_is_what_the_layer_multiplies_by():
    weight = _weight(70, 33)
    for impl in ("torch", "auto"):
        int8 = Int8Weight.from_float(weight, impl)
        x = torch.randn(4, 33)
        torch.testing.assert_close(int8(x), x @ int8.dequantize().T, atol=1e-4, rtol=1e-4)
        assert (int8.dequantize() - weight).abs().max() <= int8.scale.max() / 2 * (1 + 1e-5)


def test_compressed_tensors_int32_packing():
    q = torch.tensor([[1, 2, -128, 127, 0, -1]], dtype=torch.int8)
    packed = pack_int32(q)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    # compressed-tensors' own pseudocode: [1, 2] -> bytes 129, 130 -> 33409 (then -128 -> 0, 127 -> 255)
    assert packed[0, 0].item() == (129 | 130 << 8 | 0 << 16 | 255 << 24) - (1 << 32)
    assert packed[0, 1].item() == (128 | 127 << 8)  # padding bytes are 0
    assert torch.equal(unpack_int32(packed, (1, 6)), q)
    big = torch.randint(-128, 128, (33, 70), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_int32(big), (33, 70)), big)
