"""int8 weights and int8 activations (quantization "w8a8"): the weights as weight-only int8
has them (int8_linear.py: symmetric, one float32 scale per output channel), and each row of
the activations quantized to int8 on every call with a scale of its own:

    s_x = max|x[m, :]| / 127,  q_x = round(x[m, :] * (127 / max|x[m, :]|))   (dynamic, per token)
    y = (q_x q_w^T) * s_x * s_w + b                                         (exact int32 sums)

Per token, so a request's outputs do not depend on which requests share its batch. On the CPU
the multiply is kernels/csrc/cpu_w8a8_linear.cpp (AVX512-VNNI's vpdpbusd, 64 multiply-adds
an instruction; on AVX2 CPUs int16 products with vpmaddwd, 16): where weight-only int8 widens
every weight to float32 and so costs as much as float32 from a few rows up on CPUs without
AMX, this stays ahead at decode batches of 4-16 rows. The price is the activations' rounding (`bench/int8.py` reports the agreement with
float32 of both). `w8a8_linear_ref` is the reference the kernel is tested against, and what
runs with kernel_backend "torch". There is no GPU kernel: a weight off the CPU is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .int8_linear import in_float32, pack_channel_blocks, quantize_int8, unpack_channel_blocks, uses_int8_kernel

logger = logging.getLogger(__name__)

BLOCK = 16  # output channels per packed block (cpu_w8a8_linear.cpp)
GROUP = 4  # k per VNNI lane; the packed K is a multiple of this


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_x int8 [M, K], s_x float32 [M, 1]) of float rows, as the kernel computes them: the same
    IEEE float32 operations, so the same integers."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    nonzero = amax > 0
    inv = torch.where(nonzero, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return q, torch.where(nonzero | amax.isnan(), amax / 127, torch.zeros_like(amax))  # a NaN's row stays NaN


def w8a8_linear_ref(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: per-token int8 activations times the int8 weight, summed exactly (float64
    holds every int32 sum), scaled in float32 as the kernel does; y in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    qx, sx = quantize_rows(rows)
    dot = F.linear(qx.double(), q.double()).float()
    y = dot * (sx * scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], q.shape[0])


def pack_w8a8_blocks(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [N/16, K/4, 16, 4] with K padded to 4 and zero where padded, column sums int32
    [N padded to 16]) of int8 [N, K], in the kernel's layout (cpu_w8a8_linear.cpp)."""
    packed = pack_channel_blocks(q, BLOCK, GROUP, GROUP)
    sums = torch.zeros(packed.shape[0] * BLOCK, dtype=torch.int32)
    sums[: q.shape[0]] = q.sum(dim=1, dtype=torch.int32)
    return packed, sums


_warned_slow = False


def _kernel_is_fast() -> bool:
    global _warned_slow
    fast = bool(torch.ops.baton_cpu.w8a8_linear_fast())
    if not fast and not _warned_slow:
        _warned_slow = True
        logger.warning(
            "quantization w8a8: this CPU (or this build) has neither AVX512-VNNI nor AVX2, so the "
            "int8 x int8 kernel runs scalar code, far slower than float32; quantization int8 "
            "(weight-only) is the one to use here"
        )
    return fast


@dataclass(slots=True, eq=False)
class W8A8Weight:
    """One layer's int8 weight for int8 activations; `values` is [N, K], or the kernel's
    blocks (with their column sums) where `blocked`."""

    values: torch.Tensor
    scale: torch.Tensor  # float32 [N]
    shape: tuple[int, int]  # [N, K] of the float weight
    dtype: torch.dtype  # the float weight's, for dequantize and the output
    blocked: bool
    column_sums: torch.Tensor | None = None  # int32, the kernel's compensation for q_x + 128

    @classmethod
    def from_float(cls, weight: torch.Tensor, impl: str, scale: torch.Tensor | None = None) -> W8A8Weight:
        if weight.device.type != "cpu":
            raise ValueError(
                f"quantization w8a8 runs on the CPU only (its kernel is an x86 one); this weight is on "
                f"{weight.device}: use quantization int8 (weight-only) there"
            )
        q, scale = quantize_int8(weight, scale)
        if uses_int8_kernel(weight.device, impl):
            _kernel_is_fast()
            packed, sums = pack_w8a8_blocks(q)
            return cls(packed, scale, tuple(weight.shape), weight.dtype, True, sums)
        return cls(q, scale.to(weight.device), tuple(weight.shape), weight.dtype, False)

    @property
    def int8_values(self) -> torch.Tensor:
        """[N, K] int8."""
        return unpack_channel_blocks(self.values, self.shape)

    def dequantize(self) -> torch.Tensor:
        return (self.int8_values.float() * self.scale[:, None]).to(self.dtype)

    @property
    def num_bytes(self) -> int:
        sums = 0 if self.column_sums is None else self.column_sums.numel() * 4
        return self.values.numel() + self.scale.numel() * 4 + sums

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.blocked:
            return w8a8_linear_ref(x, self.values, self.scale, bias)
        n = self.shape[0]
        op = torch.ops.baton_cpu.w8a8_linear
        return in_float32(x, bias, n, lambda rows, b: op(rows, self.values, self.column_sums, self.scale, b, n))
