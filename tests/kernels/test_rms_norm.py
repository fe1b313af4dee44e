"""Fused RMSNorm (Triton) against `rms_norm_ref`, with and without the residual add."""

from __future__ import annotations

import pytest
import torch
from baton.kernels.reference import rms_norm_ref
from baton.kernels.rms_norm import rms_norm
from testlib.kernel_sweep import ALL_DTYPE_IDS, ALL_DTYPES

EPS = 1e-6


def randn(*shape: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("has_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("size", [64, 96, 128, 1000, 4096], ids=lambda n: f"n{n}")
def test_matches_reference(check, device, size, has_residual, dtype):
    x = randn(7, size, dtype=dtype, seed=0, device=device)
    weight = randn(size, dtype=dtype, seed=1, device=device)
    residual = randn(7, size, dtype=dtype, seed=2, device=device) if has_residual else None
    out, new_residual = rms_norm(x, weight, EPS, residual)
    expected, expected_residual = rms_norm_ref(x.cpu(), weight.cpu(), EPS, cpu(residual))
    check(out, expected)
    if has_residual:
        # x + residual is one rounding of an exact float32 sum, on every backend.
        assert torch.equal(new_residual.cpu(), expected_residual)
    else:
        assert new_residual is None


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_per_head_norm_on_strided_view(heads_view, check, device, head_dim, dtype):
    """Qwen3's q/k norm: [T, H, D] views into the merged qkv, normed over D."""
    x = heads_view(5, 4, head_dim, dtype)
    weight = randn(head_dim, dtype=dtype, seed=3, device=device)
    residual = heads_view(5, 4, head_dim, dtype, seed=4)
    out, _ = rms_norm(x, weight, EPS)
    check(out, rms_norm_ref(x.cpu(), weight.cpu(), EPS)[0])
    out, new_residual = rms_norm(x, weight, EPS, residual)
    expected, expected_residual = rms_norm_ref(x.cpu(), weight.cpu(), EPS, residual.cpu())
    check(out, expected)
    assert torch.equal(new_residual.cpu(), expected_residual)


def test_inputs_are_not_modified(device):
    x = randn(3, 64, dtype=torch.float32, seed=0, device=device)
    residual = randn(3, 64, dtype=torch.float32, seed=1, device=device)
    x_before, residual_before = x.clone(), residual.clone()
    rms_norm(x, torch.ones(64, device=device), EPS, residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_launcher_rejects_bad_inputs(device):
    x = randn(3, 64, dtype=torch.float32, seed=0, device=device)
    ones = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        rms_norm(x, ones[:32], EPS)
    with pytest.raises(TypeError, match="weight must have dtype"):
        rms_norm(x, ones.bfloat16(), EPS)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(x.t().contiguous().t(), ones, EPS)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm(x, ones, EPS, x[:2])
