"""cache.kv_cache_dtype "bfloat16": a float32 model keeps its K/V in bfloat16. The cache
holds exactly the float32 K/V rounded, a memory budget holds twice the blocks, outputs stay
close to float32's on every kernel backend, and the combinations the kernels lack are
refused by name."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.execution.model_rank import resolve_kv_cache_dtype
from baton.services.engine.step_metrics import StepCostModel
from pydantic import ValidationError
from testlib.agreement import teacher_forced
from testlib.models import tiny_model

NUM_BLOCKS = 64


def engine(model_dir, **kwargs) -> LLM:
    settings = {"num_kv_blocks": NUM_BLOCKS, "dtype": "float32", "block_size": 16, **kwargs}
    return LLM(model=str(model_dir), **settings)


def kv_caches(llm: LLM) -> list[torch.Tensor]:
    return llm.core.executor.rank.runner.kv_caches


@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])
def test_the_cache_holds_float32_k_v_rounded_to_bfloat16(llama_dir, kernel_backend):
    """Layer 0's K/V depend on the embeddings alone, so both engines compute the same float32
    values there; the bfloat16 cache must hold exactly their rounding, in the same slots."""
    prompt = list(range(30, 100))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    reference, bf16 = engine(llama_dir), engine(llama_dir, kv_cache_dtype="bfloat16", kernel_backend=kernel_backend)
    reference.generate([prompt], params), bf16.generate([prompt], params)
    assert all(cache.dtype == torch.bfloat16 for cache in kv_caches(bf16))
    expected = kv_caches(reference)[0].to(torch.bfloat16)
    assert expected.abs().sum() > 0
    assert torch.equal(kv_caches(bf16)[0], expected)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])
def test_outputs_stay_close_to_float32(arch, kernel_backend):
    """Measured on these tiny random models (6 prompts x 24 tokens, teacher-forced): argmax
    agreement 0.98-1.0, mean |logprob error| 0.0016. The bounds leave 6x; reading the
    bfloat16 bits as anything else puts the error at whole nats."""
    model_dir = tiny_model(arch)
    agreement, errors, _ = teacher_forced(
        engine(model_dir), engine(model_dir, kv_cache_dtype="bfloat16", kernel_backend=kernel_backend)
    )
    print(f"{arch}/{kernel_backend}: agreement {agreement:.3f}, mean |dlogprob| {sum(errors) / len(errors):.5f}")
    assert agreement >= 0.95
    assert sum(errors) / len(errors) < 0.01 and max(errors) < 0.1
    assert max(errors) > 0  # bfloat16 K/V are not float32's (else this measured nothing)


def test_a_memory_budget_holds_twice_the_blocks(llama_dir):
    budget = {"kv_cache_memory_bytes": 4 * 2**20, "num_kv_blocks": None}
    float32 = engine(llama_dir, **budget).core.num_kv_blocks
    assert engine(llama_dir, kv_cache_dtype="bfloat16", **budget).core.num_kv_blocks == 2 * float32


def test_a_prefix_cache_hit_generates_what_a_miss_does(llama_dir):
    llm = engine(llama_dir, kv_cache_dtype="bfloat16")
    prompt = list(range(20, 60))  # two full blocks and a partial one
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    miss, hit = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens == 32
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert hit.outputs[0].cumulative_logprob == pytest.approx(miss.outputs[0].cumulative_logprob, abs=1e-4)


def test_a_bfloat16_model_keeps_its_cache_and_float16_is_refused():
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float16) == torch.float16
    with pytest.raises(
        ValueError, match="kv_cache_dtype bfloat16 needs a float32 or bfloat16 model; the model runs in float16"
    ):
        resolve_kv_cache_dtype("bfloat16", torch.float16)  # dtype auto resolved to a float16 checkpoint's
    with pytest.raises(ValidationError, match="kv_cache_dtype bfloat16 needs a float32 or bfloat16 model"):
        EngineConfig.from_kwargs(model="m", dtype="float16", kv_cache_dtype="bfloat16")
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs(model="m", kv_cache_dtype="float8")


def test_utilization_counts_the_cache_at_its_own_width(llama_dir):
    arch = engine(llama_dir).core.arch
    float32, bf16 = StepCostModel(arch, 4, 1), StepCostModel(arch, 4, 1, "bfloat16")
    assert bf16.kv_bytes_per_token == float32.kv_bytes_per_token / 2
    assert bf16.weight_bytes == float32.weight_bytes
    assert engine(llama_dir, kv_cache_dtype="bfloat16").core.step_costs.kv_bytes_per_token == bf16.kv_bytes_per_token
