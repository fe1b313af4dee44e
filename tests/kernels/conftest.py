"""Inputs and tolerances shared by the kernel tests.

Kernels run on CUDA when there is a GPU (`make gpu-check`) and under TRITON_INTERPRET=1 on
the CPU otherwise. Each is compared with its torch reference from `baton.kernels.reference`,
computed on the CPU in float32 from the same (possibly bfloat16) inputs. Tolerances, per
output dtype:

    float32   atol 1e-5, rtol 1e-5    sums in another order, exp2 for exp
    float16   atol 1e-3, rtol 2e-3    about two fp16 ulps, for the same reasons as bf16
    bfloat16  atol 1e-2, rtol 1.6e-2  about two bf16 ulps: the output is rounded to bf16,
                                      and attention rounds P to bf16 before P @ V, as
                                      FlashAttention does on tensor cores

Paged caches are poisoned: every slot no request owns, and the block that padding table
entries point at, hold NaN. A kernel that reads past a context or through a padding entry
without masking the load turns its output NaN, which no tolerance accepts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A kernel's output against the CPU float32 reference, at the output dtype's tolerance."""
    actual = actual.cpu()
    assert not actual.isnan().any(), "kernel output has NaN (a read of a poisoned slot?)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[actual.dtype])


@dataclass
class PagedContext:
    """The paged K/V of a batch, as the engine lays it out, on the test device."""

    key_cache: torch.Tensor  # [N, B, H_kv, D], views of one kv tensor [2, N, B, H_kv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [R, max_blocks] int32; padding entries name the poison block
    seq_lens: torch.Tensor  # [R] int32

    def reference_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CPU float32 caches with the poison zeroed (the reference's masks multiply it), and
        CPU block tables and seq_lens."""
        return (
            self.key_cache.cpu().float().nan_to_num(0.0),
            self.value_cache.cpu().float().nan_to_num(0.0),
            self.block_tables.cpu(),
            self.seq_lens.cpu(),
        )


def make_paged_context(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> PagedContext:
    """Random K/V for each request's context, in shuffled, non-contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # one padding entry at least, in every row
    num_blocks = sum(blocks_per_req) + 3
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    poison_block = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    block_tables = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
    for r, (seq_len, num_req_blocks) in enumerate(zip(seq_lens, blocks_per_req)):
        blocks = torch.tensor([order.pop() for _ in range(num_req_blocks)], dtype=torch.int32)
        block_tables[r, :num_req_blocks] = blocks
        positions = torch.arange(seq_len)
        slots = (blocks[positions // block_size].long(), positions % block_size)
        kv[:, slots[0], slots[1]] = torch.randn((2, seq_len, num_kv_heads, head_dim), generator=gen).to(dtype)
    kv = kv.to(device)
    seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return PagedContext(kv[0], kv[1], block_tables.to(device), seq_lens_tensor)


def strided_heads(
    num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1, device: torch.device = DEVICE
) -> torch.Tensor:
    """Random [T, H, D] as a view into a wider, NaN-filled row (as q is a slice of qkv)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.full((num_tokens, (num_heads + 3) * head_dim), float("nan"), dtype=dtype)
    view = wide[:, head_dim : (num_heads + 1) * head_dim].view(num_tokens, num_heads, head_dim)
    view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
    return wide.to(device)[:, head_dim : (num_heads + 1) * head_dim].view(num_tokens, num_heads, head_dim)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def paged_context():
    return make_paged_context


@pytest.fixture
def heads_view():
    return strided_heads


# The C++ CPU kernels' tests: the same inputs on the CPU, also where a GPU is the test device
# (a strided CUDA view copied to the CPU would arrive contiguous).
@pytest.fixture
def cpu_paged_context():
    return functools.partial(make_paged_context, device=torch.device("cpu"))


@pytest.fixture
def cpu_heads_view():
    return functools.partial(strided_heads, device=torch.device("cpu"))


@pytest.fixture
def check():
    return assert_matches
