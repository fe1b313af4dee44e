"""Weight-only int8: symmetric, one float32 scale per output channel.

    q = round(w / s).clamp(-128, 127),  s = max|w[n, :]| / 127     (quantize_int8)
    y = (x q^T) * s + b                                             (Int8Weight.__call__)

Only the weights are int8, a quarter of float32's bytes, which is what a decode step reads;
activations stay in the model's dtype. On the CPU the multiply is
kernels/csrc/cpu_int8_linear.cpp (`pack_int8_blocks` lays the weight out for it): for a few
rows, int8 widened to float32 in registers and float32 FMAs (AVX-512, or AVX2 on CPUs without
it); from `AMX_MIN_ROWS` rows, AMX on
a bfloat16 copy of each block, the activations rounded to bfloat16 (W8A16). Elsewhere, or with
kernel_backend "torch", `int8_linear_ref`, the reference the kernel is tested against.

Checkpoints of other tools carry their own scales (compressed_tensors.py): `quantize_int8`
then takes the given scale and integer-valued weights as they are, so the int8 values are
exactly the file's, -128 included (llm-compressor's min-max observer divides by 127.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from baton.kernels import cpu_ops

BLOCK = 32  # output channels per packed block (cpu_int8_linear.cpp)
PAD_K = 32  # the packed K is a multiple of this
# From this many rows up the kernel multiplies on AMX where the CPU has it. The bench model's
# linear layers per decode step (2 threads): AVX-512 0.9 / 1.5 / 2.1 / 2.9 / 3.9 ms at 1 / 4 /
# 8 / 12 / 16 rows, AMX 1.9-2.1 ms at 1-12 and 2.3 ms at 16 (float32 oneDNN 2.5-5.1 ms).
AMX_MIN_ROWS = 10


def quantize_int8(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale float32 [N]) of a [N, K] weight; with `scale` given the weight
    already holds the integer values (a pre-quantized checkpoint's) and is only cast."""
    w = weight.detach().float()
    if scale is None:
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
        w = w / scale[:, None]
    q = torch.round(w).clamp_(-128, 127).to(torch.int8)
    return q, scale.detach().float().reshape(-1).contiguous()


def int8_linear_ref(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: (x q^T) * scale + bias in x's dtype (int8 values are exact in bf16)."""
    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


def in_float32(x: torch.Tensor, bias: torch.Tensor | None, out_features: int, kernel) -> torch.Tensor:
    """`kernel(rows, bias)` on x's rows and the bias in float32, the kernels' dtype, and y in x's
    dtype. Converts only what is not float32 already: a decode step makes ~30 of these calls,
    and each no-op conversion costs a dispatch (with three of them, a w8a8 call on a 16 x 16
    weight took 13 us where the op takes 4; now 10)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32:
        rows = rows.float()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    y = kernel(rows, bias)
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], out_features)


def pack_channel_blocks(q: torch.Tensor, block: int, group: int, pad_k: int) -> torch.Tensor:
    """[N, K] as blocks of `block` channels with k in groups of `group`, [N/block, K/group,
    block, group], K padded to a multiple of `pad_k` and channels to whole blocks with zeros
    (the int8 kernels' layouts: this file's and w8a8_linear.py's)."""
    num_out, num_in = q.shape
    num_blocks = -(-num_out // block)
    padded_in = -(-num_in // pad_k) * pad_k
    padded = q.new_zeros(num_blocks * block, padded_in)
    padded[:num_out, :num_in] = q
    return padded.view(num_blocks, block, padded_in // group, group).transpose(1, 2).contiguous()


def unpack_channel_blocks(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[N, K] of `pack_channel_blocks`' layout (a 2-d tensor is already that)."""
    if packed.dim() == 2:
        return packed
    return packed.transpose(1, 2).reshape(packed.shape[0] * packed.shape[2], -1)[: shape[0], : shape[1]]


def pack_int8_blocks(q: torch.Tensor, layout: int) -> torch.Tensor:
    """[N, K] in the kernel's layout (cpu_int8_linear.cpp): 1, blocks of 32 channels in
    k-pairs [N/32, K/2, 32, 2] with K padded to 32, zero where padded; 0, as it is."""
    return q.contiguous() if layout == 0 else pack_channel_blocks(q, BLOCK, 2, PAD_K)


def kernel_layout() -> int:
    return torch.ops.baton_cpu.int8_linear_layout()


def uses_int8_kernel(device: torch.device, impl: str) -> bool:
    """The C++ kernel on the CPU for impl auto (where it builds) and cpp (required)."""
    if device.type != "cpu" or impl not in ("auto", "cpp"):
        return False
    if impl == "cpp":
        cpu_ops.require()
        return True
    return cpu_ops.available()


@dataclass(slots=True, eq=False)
class Int8Weight:
    """One layer's int8 weight; `values` is [N, K], or the kernel's blocks where `blocked`."""

    values: torch.Tensor
    scale: torch.Tensor  # float32 [N]
    shape: tuple[int, int]  # [N, K] of the float weight
    dtype: torch.dtype  # the float weight's, for dequantize and the output
    blocked: bool
    amx_min_rows: int = AMX_MIN_ROWS  # tests move it to reach either path

    @classmethod
    def from_float(cls, weight: torch.Tensor, impl: str, scale: torch.Tensor | None = None) -> Int8Weight:
        q, scale = quantize_int8(weight, scale)
        blocked = uses_int8_kernel(weight.device, impl)
        values = pack_int8_blocks(q, kernel_layout()) if blocked else q
        return cls(values, scale.to(weight.device), tuple(weight.shape), weight.dtype, blocked)

    @property
    def int8_values(self) -> torch.Tensor:
        """[N, K] int8."""
        return unpack_channel_blocks(self.values, self.shape) if self.blocked else self.values

    def dequantize(self) -> torch.Tensor:
        return (self.int8_values.float() * self.scale[:, None]).to(self.dtype)

    @property
    def num_bytes(self) -> int:
        return self.values.numel() + self.scale.numel() * 4

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.blocked:
            return int8_linear_ref(x, self.values, self.scale, bias)
        n = self.shape[0]
        op = torch.ops.baton_cpu.int8_linear
        return in_float32(x, bias, n, lambda rows, b: op(rows, self.values, self.scale, b, n, self.amx_min_rows))
