"""Weights in blocks of 16 output channels, for the CPU's blocked linear kernel.

    float32:   blocks[nb][k][c]    = W[nb * 16 + c][k]         [N/16, K, 16]
    bfloat16:  blocks[nb][p][c][j] = W[nb * 16 + c][2 p + j]   [N/16, K/2, 16, 2]

(channels past N and a k past an odd K are zero). kernels/csrc/cpu_blocked_linear.cpp
multiplies by this layout (bfloat16 in k-pairs, as AVX512-BF16 multiplies): each block is one
contiguous run of 64-byte lines, so a decode step reads the weights as a few long streams (the layout's
reason: oneDNN's packed weights read at ~18 GB/s in a small decode batch, these at ~30 on the
same 2 cores), and the kernel's threads share the work from a counter, so a thread that
another process preempts does not hold the others up. The blocks replace the dense weight;
`dense` turns them back for whoever reads weights (weight updates, inspection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from baton.kernels import cpu_ops

BLOCK = 16  # output channels per block (cpu_blocked_linear.cpp)


def _pairs(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the module docstring's layout for its dtype, zero where padded."""
    num_out, num_in = weight.shape
    num_blocks = -(-num_out // BLOCK)
    if not _pairs(weight.dtype):
        padded = weight.new_zeros(num_blocks * BLOCK, num_in)
        padded[:num_out] = weight
        return padded.view(num_blocks, BLOCK, num_in).transpose(1, 2).contiguous()
    num_pairs = -(-num_in // 2)
    padded = weight.new_zeros(num_blocks * BLOCK, 2 * num_pairs)
    padded[:num_out, :num_in] = weight
    return padded.view(num_blocks, BLOCK, num_pairs, 2).transpose(1, 2).contiguous()


def unpack_blocks(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The dense [N, K] weight `shape` of `pack_blocks`' result."""
    num_out, num_in = shape
    dense = blocks.transpose(1, 2).reshape(blocks.shape[0] * BLOCK, -1)  # pairs: (p, j) -> k = 2 p + j
    return dense[:num_out, :num_in].contiguous()


def uses_blocked_kernel(weight: torch.Tensor, impl: str) -> bool:
    """The blocked kernel for a CPU weight whose dtype this build has it for (float32 on an
    AVX-512 or AVX2 CPU; bfloat16 where it has AVX512-BF16 but no AMX, whose oneDNN GEMMs are
    faster, or AVX2 but no AVX-512), with impl "auto" (where the kernels build) or "cpp";
    oneDNN elsewhere (linear.py)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if impl not in ("auto", "cpp"):
        return False
    if impl == "cpp":
        cpu_ops.require()
    elif not cpu_ops.available():
        return False
    return bool(torch.ops.baton_cpu.blocked_linear_supported(weight.dtype))


@dataclass(slots=True, eq=False)
class BlockedWeight:
    """One layer's weight as blocks; `shape` is the dense [N, K]."""

    values: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> BlockedWeight:
        return cls(pack_blocks(weight.detach()), tuple(weight.shape))

    def dense(self) -> torch.Tensor:
        return unpack_blocks(self.values, self.shape)

    @property
    def num_bytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.baton_cpu.blocked_linear(rows, self.values, bias, self.shape[0])
        return y.view(*x.shape[:-1], self.shape[0])
