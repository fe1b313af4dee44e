"""Fused RMSNorm with an optional residual add, matching `rms_norm_ref` step for step.

One program normalises one row of the last dim. Rows may be strided: x is [T, N] or
[T, H, N] (Qwen3's q/k norm runs on views of the merged qkv), seen as [A, B, N] with
row i at (i // B, i % B).

    with residual:  s = round(x + residual)        (in x's dtype, as torch adds)
                    out = weight * round(s * rsqrt(mean(s^2) + eps))   (math in float32)
                    returns (out, s)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_devices, check_float, check_last_dim_contiguous
from .interpreter import cast_to, is_interpreter

# One row lives in registers; Llama-405B's hidden size (16384) fits.
MAX_ROW = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    rows_per_outer,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_per_outer
    inner = row % rows_per_outer
    cols = tl.arange(0, BLOCK)
    is_col = cols < N
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=is_col, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=is_col, other=0.0
        )
        # Rounded to x's dtype before the norm, as the reference's `x + residual` is.
        x = cast_to(x.to(tl.float32) + residual.to(tl.float32), x.dtype, INTERPRETED)
        tl.store(residual_out_ptr + row * N + cols, x, mask=is_col)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / N
    normed = cast_to(xf * tl.rsqrt(variance + eps), x.dtype, INTERPRETED)
    weight = tl.load(weight_ptr + cols, mask=is_col, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * N + cols, cast_to(out, out_ptr.dtype.element_ty, INTERPRETED), mask=is_col)


def _as_3d(name: str, t: torch.Tensor) -> tuple[int, int, int, int]:
    """(outer, inner, stride_outer, stride_inner) of a [T, N] or [T, H, N] tensor."""
    check_last_dim_contiguous(name, t)
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[0], t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(f"{name} must be [T, N] or [T, H, N], got shape {tuple(t.shape)}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed x, the new residual x + residual or None); outputs are new contiguous tensors."""
    check_float("x", x)
    check_float("weight", weight, x.dtype)
    size = x.shape[-1]
    if weight.shape != (size,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{size}], got shape {tuple(weight.shape)}")
    if size > MAX_ROW:
        raise ValueError(f"rows longer than {MAX_ROW} are not supported, got {size}")
    outer, inner, stride_x_outer, stride_x_inner = _as_3d("x", x)
    stride_r_outer = stride_r_inner = 0
    if residual is not None:
        check_float("residual", residual, x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        check_devices(x=x, residual=residual, weight=weight)
        _, _, stride_r_outer, stride_r_inner = _as_3d("residual", residual)
    else:
        check_devices(x=x, weight=weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    num_rows = outer * inner
    if num_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(size)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual_out is not None else out,
        eps,
        inner,
        stride_x_outer,
        stride_x_inner,
        stride_r_outer,
        stride_r_inner,
        N=size,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        INTERPRETED=is_interpreter(),
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, residual_out
