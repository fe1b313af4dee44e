"""Per-request seeds: reproducible inside any batch; different seeds differ."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=512)


def test_same_seed_same_output_alone_and_in_a_batch(llm):
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    (alone,) = llm.generate(["def foo(x):"], seeded)
    others = [SamplingParams(max_tokens=n, temperature=1.0) for n in (5, 30, 12)]
    batch = llm.generate(["A", "def foo(x):", "Hello there", "import sys"], [others[0], seeded, others[1], others[2]])
    assert batch[1].token_ids == alone.token_ids
    (again,) = llm.generate(["def foo(x):"], seeded)
    assert again.token_ids == alone.token_ids


def test_different_seeds_differ(llm):
    outs = llm.generate(["def foo(x):"] * 4, [SamplingParams(max_tokens=24, temperature=1.0, seed=s) for s in range(4)])
    assert len({tuple(o.token_ids) for o in outs}) == 4


def test_unseeded_requests_vary(llm):
    outs = llm.generate(["def foo(x):"] * 3, SamplingParams(max_tokens=24, temperature=1.0))
    assert len({tuple(o.token_ids) for o in outs}) == 3
