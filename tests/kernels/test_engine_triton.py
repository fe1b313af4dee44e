"""The engine with its Triton kernels forced on (interpreted on CPU) generates what the torch
reference backend generates: every kernel runs in every layer, for decodes mixed with
chunked prefills and prefix-cache hits."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams

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
        assert [o.token_ids for o in actual_round] == [o.token_ids for o in expected_round]
        for out, ref in zip(actual_round, expected_round):
            chosen = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
            ref_chosen = [entry[token].logprob for token, entry in zip(ref.token_ids, ref.logprobs)]
            assert chosen == pytest.approx(ref_chosen, abs=1e-4)
