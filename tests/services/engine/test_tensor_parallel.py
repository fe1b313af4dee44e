"""Tensor parallelism over Ray actors and gloo: TP=2 equals TP=1, shards load exactly,
bad sizes fail at start-up, and a dead rank becomes an error, not a hang."""

from __future__ import annotations

import time

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.execution.tp_executor import RankGroupError
from safetensors.torch import load_file
from testlib.models import tiny_model
from testlib.ray_cluster import local_ray

pytestmark = pytest.mark.ray

PROMPTS = ["def foo(x):", "The quick brown fox jumps over", "import os\nimport sys\n" * 3, "A"]
MODELS = {
    "llama-2kv": ("llama", {}),
    "qwen3-2kv": ("qwen3", {}),
    "llama-1kv": ("llama", {"num_key_value_heads": 1}),  # TP 2 > 1 KV head: replicated
}


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(num_cpus=3) as ray:
        yield ray


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_equals_tp1(ray_cluster, name):
    arch, overrides = MODELS[name]
    model = str(tiny_model(arch, **overrides))
    vocab = 1024
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=vocab)
    single = LLM(model=model, num_kv_blocks=64, max_logprobs=vocab).generate(PROMPTS, params)
    tp = LLM(model=model, num_kv_blocks=64, max_logprobs=vocab, tensor_parallel_size=2)
    try:
        double = tp.generate(PROMPTS, params)
    finally:
        tp.shutdown()
    for a, b in zip(single, double):
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            # Full log-softmax over the vocabulary: the logits agree up to a constant shift.
            ids = sorted(step_a)
            la = torch.tensor([step_a[i].logprob for i in ids])
            lb = torch.tensor([step_b[i].logprob for i in ids])
            assert torch.allclose(la, lb, atol=1e-4), (la - lb).abs().max()


def test_each_rank_holds_its_slice_of_the_checkpoint(ray_cluster):
    model = tiny_model("llama", num_key_value_heads=1)
    llm = LLM(model=str(model), num_kv_blocks=16, tensor_parallel_size=2)
    try:
        ranks = llm.core.executor.named_parameters()
    finally:
        llm.shutdown()
    full = load_file(model / "model.safetensors")
    head_dim = 16
    for rank, params in enumerate(ranks):
        prefix = "model.layers.0."
        q = full[prefix + "self_attn.q_proj.weight"].chunk(2, 0)[rank]
        k = full[prefix + "self_attn.k_proj.weight"]  # one KV head: replicated on both ranks
        v = full[prefix + "self_attn.v_proj.weight"]
        assert torch.equal(params[prefix + "self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
        assert k.shape[0] == head_dim
        gate = full[prefix + "mlp.gate_proj.weight"].chunk(2, 0)[rank]
        up = full[prefix + "mlp.up_proj.weight"].chunk(2, 0)[rank]
        assert torch.equal(params[prefix + "mlp.gate_up_proj.weight"], torch.cat([gate, up]))
        assert torch.equal(
            params[prefix + "mlp.down_proj.weight"], full[prefix + "mlp.down_proj.weight"].chunk(2, 1)[rank]
        )
        assert torch.equal(
            params[prefix + "self_attn.o_proj.weight"], full[prefix + "self_attn.o_proj.weight"].chunk(2, 1)[rank]
        )
        assert torch.equal(params["model.embed_tokens.weight"], full["model.embed_tokens.weight"].chunk(2, 0)[rank])
        assert torch.equal(params["lm_head.weight"], full["lm_head.weight"].chunk(2, 0)[rank])
        assert torch.equal(params[prefix + "input_layernorm.weight"], full[prefix + "input_layernorm.weight"])


def test_invalid_sizes_fail_at_start_up(ray_cluster, llama_dir):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(model=str(llama_dir), num_kv_blocks=16, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs 4 CPUs in the Ray cluster, which has 3"):
        LLM(model=str(llama_dir), num_kv_blocks=16, tensor_parallel_size=4)


def test_a_killed_rank_is_an_error_not_a_hang(ray_cluster, llama_dir):
    llm = LLM(model=str(llama_dir), num_kv_blocks=64, tensor_parallel_size=2, rank_timeout_s=30)
    executor = llm.core.executor
    llm.generate(["warm up"], SamplingParams(max_tokens=2))
    ray_cluster.kill(executor.ranks[1])
    start = time.monotonic()
    with pytest.raises(RankGroupError, match="rank 1"):
        llm.generate(["after the kill"], SamplingParams(max_tokens=4))
    assert time.monotonic() - start < 30
    assert executor.ranks == [] and executor.placement_group is None  # resources released


def test_speculative_decoding_over_tp2_equals_plain_tp1(ray_cluster, llama_dir):
    """The drafts go to every rank in the step's SchedulerOutput; rank 0 verifies them."""
    prompts = ["a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2", "hello hello hello"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    single = LLM(model=str(llama_dir), num_kv_blocks=64).generate(prompts, params)
    tp = LLM(
        model=str(llama_dir),
        num_kv_blocks=64,
        tensor_parallel_size=2,
        speculative_method="ngram",
        num_speculative_tokens=4,
    )
    try:
        outputs = tp.generate(prompts, params)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in single]
        assert tp.core.speculator.stats.num_accepted_tokens > 0
        tp.core.check_integrity()
    finally:
        tp.shutdown()
