"""Chunked prefill: any chunk size gives one-shot outputs; decodes keep flowing."""

from __future__ import annotations

import random

import pytest
from baton.services.engine import LLM, RequestOutputKind, SamplingParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 37, 70, 101)]


@pytest.fixture(scope="module")
def one_shot(llama_dir, prompts):
    llm = LLM(model=str(llama_dir), num_kv_blocks=128, max_num_batched_tokens=4096, enable_chunked_prefill=False)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("budget", [1, 7, 16, 33])
def test_any_chunk_size_equals_one_shot_prefill(llama_dir, prompts, one_shot, budget):
    llm = LLM(model=str(llama_dir), num_kv_blocks=128, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == one_shot


def test_long_prefill_threshold_splits_one_request(llama_dir, prompts, one_shot):
    llm = LLM(model=str(llama_dir), num_kv_blocks=128, max_num_batched_tokens=512, long_prefill_token_threshold=13)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == one_shot


def test_decodes_keep_producing_while_a_long_prompt_prefills(llama_dir):
    config = EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=256, max_num_batched_tokens=64)
    engine = EngineCore(config)
    decode = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in range(4):
        engine.add_request(f"d{i}", [10 + i, 20, 30], decode)
    engine.step()  # the short prompts are prefilled together
    engine.add_request("long", list(range(3, 1003)), SamplingParams(max_tokens=1, temperature=0))
    steps_while_prefilling = 0
    while "long" in engine.scheduler.requests:
        outputs = {o.request_id: o for o in engine.step()}
        steps_while_prefilling += 1
        assert all(len(outputs[f"d{i}"].token_ids) == 1 for i in range(4)), "a decode was starved"
    assert steps_while_prefilling >= 1000 // 60  # the prompt really was split (4 budget tokens go to decodes)
    engine.check_integrity()
