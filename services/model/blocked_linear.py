"""Float32 weights in blocks of 16 output channels, for the CPU's blocked linear kernel.

    blocks[nb][k][c] = W[nb * 16 + c][k]        [N/16, K, 16], channels past N zero

kernels/csrc/cpu_blocked_linear.cpp multiplies by this layout: each block is one contiguous
run of 64-byte lines, so a decode step reads the weights as a few long streams (the layout's
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


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16], zero past N."""
    num_out, num_in = weight.shape
    num_blocks = -(-num_out // BLOCK)
    padded = weight.new_zeros(num_blocks * BLOCK, num_in)
    padded[:num_out] = weight
    return padded.view(num_blocks, BLOCK, num_in).transpose(1, 2).contiguous()


def unpack_blocks(blocks: torch.Tensor, num_out: int) -> torch.Tensor:
    return blocks.transpose(1, 2).reshape(-1, blocks.shape[1])[:num_out].contiguous()


def uses_blocked_kernel(weight: torch.Tensor, impl: str) -> bool:
    """The blocked kernel for a float32 CPU weight, with impl "auto" (where the kernels build
    for an AVX-512 CPU) or "cpp"; oneDNN elsewhere (linear.py)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or impl not in ("auto", "cpp"):
        return False
    if impl == "cpp":
        cpu_ops.require()
    elif not cpu_ops.available():
        return False
    return bool(torch.ops.baton_cpu.blocked_linear_supported())


@dataclass(slots=True, eq=False)
class BlockedWeight:
    """One layer's float32 weight as blocks; `shape` is the dense [N, K]."""

    values: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> BlockedWeight:
        return cls(pack_blocks(weight.detach()), tuple(weight.shape))

    def dense(self) -> torch.Tensor:
        return unpack_blocks(self.values, self.shape[0])

    @property
    def num_bytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.baton_cpu.blocked_linear(rows, self.values, bias, self.shape[0])
        return y.view(*x.shape[:-1], self.shape[0])
