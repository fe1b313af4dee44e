"""Work-arounds for Triton's CPU interpreter (TRITON_INTERPRET=1), on which the tests run.

The interpreter keeps bfloat16 as raw uint16 bits: its tl.dot multiplies those bits as
integers, and its float32 -> bfloat16 cast truncates instead of rounding to nearest even.
Kernels take an `INTERPRETED` constexpr and route dots and downcasts through these helpers,
which compile to the plain operations on a GPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def dot_operand(x, INTERPRETED: tl.constexpr):
    """A tl.dot operand; upcast under the interpreter. bf16 x bf16 products are exact in
    float32, which is what the tensor cores compute, so only the summation order differs."""
    if INTERPRETED:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def cast_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 x -> dtype, rounding to nearest even (the interpreter's own cast truncates)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
