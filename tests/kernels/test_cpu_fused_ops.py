"""The fused C++ CPU kernels (kernels/csrc/cpu_fused_ops.cpp) against their torch references,
over dtypes and shapes, and how `ops` picks them: RMSNorm with the residual add and rotary
embedding fused with the KV-cache write, SiLU-and-multiply."""

from __future__ import annotations

import pytest
import torch
from baton.kernels import cpu_ops, ops
from baton.kernels.reference import reshape_and_cache_ref, rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref
from baton.services.model.rotary import RotaryEmbedding
from testlib.kernel_sweep import ALL_DTYPE_IDS, ALL_DTYPES

from .conftest import TOLERANCES, strided_heads

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler for the CPU kernels")

ROWS = [1, 3, 8, 200]  # 200 rows of 512: more than one parallel task
IDS = [f"rows{r}" for r in ROWS]


def randn(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[actual.dtype])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("rows", ROWS, ids=IDS)
@pytest.mark.parametrize("hidden", [512, 64, 100], ids=lambda h: f"h{h}")
def test_rms_norm_matches_the_reference_with_and_without_a_residual(dtype, rows, hidden):
    x, residual = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype, seed=1)
    weight = randn(hidden, dtype=dtype, seed=2)
    out, none = cpu_ops.rms_norm(x, weight, 1e-6)
    expected, _ = rms_norm_ref(x, weight, 1e-6)
    assert none is None
    close(out, expected)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = cpu_ops.rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = rms_norm_ref(x, weight, 1e-6, residual)
    close(out, expected)
    assert torch.equal(new_residual, expected_residual)  # one rounded add: exact
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched


def test_rms_norm_keeps_leading_dimensions_and_ops_falls_back_for_strided_input():
    x = randn(4, 3, 64, dtype=torch.float32)
    weight = randn(64, dtype=torch.float32, seed=2)
    out, _ = cpu_ops.rms_norm(x, weight, 1e-5)
    close(out, rms_norm_ref(x, weight, 1e-5)[0])
    strided = strided_heads(5, 4, 64, torch.float32, device=torch.device("cpu"))  # q heads: a view into qkv rows
    out, _ = ops.rms_norm(strided, weight, 1e-5)
    close(out, rms_norm_ref(strided, weight, 1e-5)[0])
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.baton_cpu.rms_norm(strided, weight, 1e-5, None)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.rms_norm(x, randn(32, dtype=torch.float32), 1e-5)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("rows", ROWS, ids=IDS)
@pytest.mark.parametrize("intermediate", [1536, 40, 7], ids=lambda i: f"i{i}")
def test_silu_and_mul_matches_the_reference(dtype, rows, intermediate):
    x = randn(rows, 2 * intermediate, dtype=dtype) * 4
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # the exp's clamped tails, and silu(0) = 0
    out = cpu_ops.silu_and_mul(x)
    close(out, silu_and_mul_ref(x))
    assert out[0, 0] == 0 and out[0, 2] == 0
    assert (out[0, 1] / x[0, intermediate + 1]).item() == pytest.approx(100.0, rel=1e-2)


def test_silu_and_mul_keeps_leading_dimensions_ops_falls_back_for_strided_input_and_odd_widths_are_named():
    x = randn(2, 3, 80, dtype=torch.float32)
    close(cpu_ops.silu_and_mul(x), silu_and_mul_ref(x))
    strided = randn(5, 160, dtype=torch.float32)[:, ::2]
    close(ops.silu_and_mul(strided), silu_and_mul_ref(strided))
    assert torch.equal(ops.silu_and_mul(strided, impl="torch"), silu_and_mul_ref(strided))
    with pytest.raises(RuntimeError, match="last dimension \\(7\\) must hold gate and up halves"):
        cpu_ops.silu_and_mul(randn(2, 7, dtype=torch.float32))


def rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, num_slots=64):
    """q, k, v as views of one qkv row (as the model splits them), positions, distinct slots
    (one -1: padding), and NaN-poisoned caches [N, B, H_kv, D]."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    views = [t.view(num_tokens, -1, head_dim) for t in (q, k, v)]
    positions = torch.randint(0, 2048, (num_tokens,), generator=torch.Generator().manual_seed(3))
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(4))[:num_tokens]
    slots[num_tokens // 2] = -1
    caches = torch.full((2, num_slots // 16, 16, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    return views, positions, slots, caches


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 5, 48], ids=lambda t: f"t{t}")
@pytest.mark.parametrize("heads", [(8, 4, 64), (4, 1, 128), (2, 2, 16)], ids=["gqa2-d64", "mqa-d128", "mha-d16"])
def test_rotary_embedding_and_cache_matches_rope_then_the_cache_write(dtype, tokens, heads):
    num_heads, num_kv_heads, head_dim = heads
    rotary = RotaryEmbedding(head_dim, 2048, 10000.0, None, torch.device("cpu"))
    (q, k, v), positions, slots, caches = rope_inputs(tokens, num_heads, num_kv_heads, head_dim, dtype)
    q_ref, k_ref, v_ref, caches_ref = q.clone(), k.clone(), v.clone(), caches.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, rotary.cos_sin_cache)
    reshape_and_cache_ref(k_ref, v_ref, caches_ref[0], caches_ref[1], slots)
    cpu_ops.rotary_embedding_and_cache(positions, q, k, v, rotary.cos_sin_cache, caches[0], caches[1], slots)
    close(q, q_ref)
    close(k, k_ref)
    written = caches_ref.isnan().logical_not()
    assert torch.equal(caches.isnan().logical_not(), written)  # the same slots, no others
    close(caches[written], caches_ref[written])
    assert written.sum() == 2 * (tokens - 1) * num_kv_heads * head_dim  # every token but the padding one


@pytest.mark.parametrize("heads", [(8, 4, 64), (2, 2, 16)], ids=["gqa2-d64", "mha-d16"])
def test_rotary_embedding_and_cache_rounds_into_a_bfloat16_cache(heads):
    """kv_cache_dtype bfloat16: q and k stay float32; the cache gets their bfloat16 rounding."""
    num_heads, num_kv_heads, head_dim = heads
    rotary = RotaryEmbedding(head_dim, 2048, 10000.0, None, torch.device("cpu"))
    (q, k, v), positions, slots, caches_ref = rope_inputs(17, num_heads, num_kv_heads, head_dim, torch.float32)
    caches = caches_ref.to(torch.bfloat16)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, rotary.cos_sin_cache)
    reshape_and_cache_ref(k_ref, v, caches_ref[0], caches_ref[1], slots)
    cpu_ops.rotary_embedding_and_cache(positions, q, k, v, rotary.cos_sin_cache, caches[0], caches[1], slots)
    close(q, q_ref)
    close(k, k_ref)
    written = caches_ref.isnan().logical_not()
    assert torch.equal(caches.isnan().logical_not(), written)
    assert torch.equal(caches[written], caches_ref[written].to(torch.bfloat16))


def test_the_rotary_module_fuses_on_the_cpu_and_keeps_two_ops_for_the_reference_impl(monkeypatch):
    calls = []
    real = cpu_ops.rotary_embedding_and_cache
    monkeypatch.setattr(cpu_ops, "rotary_embedding_and_cache", lambda *a: calls.append(1) or real(*a))
    results = {}
    for impl in ("auto", "torch"):
        rotary = RotaryEmbedding(64, 2048, 10000.0, None, torch.device("cpu"), impl=impl)
        (q, k, v), positions, slots, caches = rope_inputs(6, 8, 4, 64, torch.float32)
        rotary.forward_and_cache(positions, q, k, v, caches[0], caches[1], slots)
        results[impl] = q, caches
    assert calls == [1]
    close(results["auto"][0], results["torch"][0])
    written = results["torch"][1].isnan().logical_not()
    close(results["auto"][1][written], results["torch"][1][written])


def test_rotary_embedding_and_cache_names_what_does_not_fit():
    (q, k, v), positions, slots, caches = rope_inputs(4, 8, 4, 64, torch.float32)
    cos_sin = RotaryEmbedding(64, 2048, 10000.0, None, torch.device("cpu")).cos_sin_cache
    with pytest.raises(RuntimeError, match="caches"):
        cpu_ops.rotary_embedding_and_cache(positions, q, k, v, cos_sin, caches[0][:, :, :2], caches[1], slots)
    with pytest.raises(RuntimeError, match="one entry per token"):
        cpu_ops.rotary_embedding_and_cache(positions[:3], q, k, v, cos_sin, caches[0], caches[1], slots)
    with pytest.raises(RuntimeError, match="query, key and value must share a dtype"):
        cpu_ops.rotary_embedding_and_cache(positions, q, k, v.double(), cos_sin, caches[0], caches[1], slots)
    half = caches.half()
    with pytest.raises(RuntimeError, match=r"the query's dtype \(Float\) or, for a float32 query, bfloat16; got Half"):
        cpu_ops.rotary_embedding_and_cache(positions, q, k, v, cos_sin, half[0], half[1], slots)
