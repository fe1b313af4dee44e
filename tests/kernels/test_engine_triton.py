"""The engine with its Triton kernels forced on (interpreted on CPU) generates what the torch
reference backend generates: every kernel runs in every layer, for decodes mixed with
chunked prefills and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from testlib.greedy_outputs import SHRINKING_PROMPTS, assert_same_greedy, shrinking_params

PROMPTS = [
    "def foo(x):",
    "Hello",
    # Longer than two 8-token blocks, and prefilled in 16-token chunks beside the decodes.
    "The with statement is used to wrap the execution of a block with methods defined by a context manager.",
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


def generate(model_dir, kernel_backend: str):
    llm = LLM(
        model=str(model_dir),
        kernel_backend=kernel_backend,
        dtype="float32",  # so the two backends may differ only in summation order
        num_kv_blocks=64,
        block_size=8,
        long_prefill_token_threshold=16,
    )
    # The second round hits the prefix cache: its prefills attend to cached blocks.
    return [llm.generate(PROMPTS, GREEDY) for _ in range(2)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_triton_equals_torch(arch, request):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    expected = generate(model_dir, "torch")
    actual = generate(model_dir, "triton")
    assert actual[1][2].num_cached_tokens > 0, "the second round should hit the prefix cache"
    for expected_round, actual_round in zip(expected, actual):
        assert_same_greedy(actual_round, expected_round, 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_generate_what_eager_generates(llama_dir):
    """engine.runner.cuda_graphs on the GPU: the captured decode steps generate the eager
    engine's tokens (tests/services/engine/test_decode_graphs.py checks the runner's side on
    the CPU). The graph's attention splits the context for max_model_len, so the sums may
    differ in order: logprobs agree to 1e-3."""
    outputs = []
    for cuda_graphs in (False, True):
        llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=256, block_size=8, cuda_graphs=cuda_graphs)
        outputs.append(llm.generate(SHRINKING_PROMPTS, shrinking_params()))
        graphs = llm.core.executor.rank.runner.graphs
        if cuda_graphs:
            assert graphs.num_replays >= 8, "the decode steps should have replayed graphs"
        else:
            assert graphs is None
        llm.shutdown()
    expected, actual = outputs
    assert_same_greedy(actual, expected, 1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_let_sleep_free_the_kv_cache(llama_dir):
    """sleep(1) gives the KV cache's memory back to the device although graphs were captured
    over it, and after wake_up the graphs are captured again over the new cache."""
    llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=8192, block_size=8, cuda_graphs=True)
    try:
        expected = llm.generate(SHRINKING_PROMPTS, shrinking_params())
        runner = llm.core.executor.rank.runner
        kv_bytes, reserved = runner.kv_cache_bytes, torch.cuda.memory_reserved()
        captures = runner.graphs.num_captures
        llm.sleep(1)
        assert torch.cuda.memory_reserved() <= reserved - 0.9 * kv_bytes
        llm.wake_up()
        actual = llm.generate(SHRINKING_PROMPTS, shrinking_params())
        assert [o.token_ids for o in actual] == [o.token_ids for o in expected]
        assert runner.graphs.num_captures > captures
    finally:
        llm.shutdown()
