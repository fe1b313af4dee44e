"""n > 1: the samples share the prompt's blocks (copy on write at the partial block),
each with its own output; seeded samples are reproducible."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16, then a partial one


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_samples_share_prompt_blocks_and_copy_the_partial_one(llama_dir, prefix_caching):
    config = EngineConfig.from_kwargs(
        model=str(llama_dir), num_kv_blocks=64, block_size=16, enable_prefix_caching=prefix_caching
    )
    engine = EngineCore(config)
    engine.add_request("r", PROMPT, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3))
    engine.step()  # computes the 39-token shared prefix, then forks 4 samples from it
    tables = [engine.scheduler.kv.get_block_ids(f"r/{i}") for i in range(4)]
    assert len({tuple(t[:2]) for t in tables}) == 1, "full prompt blocks are shared"
    assert all(engine.scheduler.kv.pool.blocks[b].ref_cnt == 4 for b in tables[0][:2])
    engine.step()  # each sample writes the last prompt token into the partial block
    tables = [engine.scheduler.kv.get_block_ids(f"r/{i}") for i in range(4)]
    assert len({t[2] for t in tables}) == 4, "the partial block is copied on write"
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv.num_free_blocks == 64
    engine.check_integrity()


def test_seeded_samples_are_reproducible_and_distinct(llama_dir):
    llm = LLM(model=str(llama_dir), num_kv_blocks=64)
    params = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=11)
    (first,) = llm.generate([PROMPT], params)
    (second,) = llm.generate([PROMPT], params)
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 4
    # Sample i is the same draw as a single request seeded with seed + i.
    singles = llm.generate(
        [PROMPT] * 4, [SamplingParams(max_tokens=16, temperature=1.0, seed=11 + i) for i in range(4)]
    )
    assert [c.token_ids for c in first.outputs] == [s.token_ids for s in singles]


def test_greedy_samples_agree_and_report_each_finish(llama_dir):
    llm = LLM(model=str(llama_dir), num_kv_blocks=64)
    (out,) = llm.generate(["Hello"], SamplingParams(n=3, max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert all(c.finish_reason == "length" for c in out.outputs)
