"""A draft model beside a tensor-parallel target: the draft runs at TP 1 in the engine's
process, its q travels to every rank in the step's SchedulerOutput, and rank 0 verifies."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams
from testlib.ray_cluster import local_ray

pytestmark = pytest.mark.ray


def test_a_draft_model_over_tp2_equals_plain_tp1(llama_dir):
    prompts = ["a b c a b c a b c", "hello hello hello", "def foo(x):"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)]
    single = LLM(model=str(llama_dir), num_kv_blocks=64).generate(prompts, greedy)
    with local_ray(num_cpus=3):
        tp = LLM(
            model=str(llama_dir),
            num_kv_blocks=64,
            tensor_parallel_size=2,
            speculative_method="draft_model",
            draft_model=str(llama_dir),
            num_speculative_tokens=3,
        )
        try:
            assert [o.token_ids for o in tp.generate(prompts, greedy)] == [o.token_ids for o in single]
            stats = tp.core.speculator.stats
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0, stats
            greedy_drafts = stats.num_draft_tokens
            first = tp.generate(prompts, sampled)  # random requests: q goes to the ranks
            assert [o.token_ids for o in tp.generate(prompts, sampled)] == [o.token_ids for o in first]
            assert stats.num_draft_tokens > greedy_drafts
            tp.core.check_integrity()
            pool = tp.core.speculator.drafter.pool
            assert pool.num_free_blocks == pool.num_blocks
        finally:
            tp.shutdown()
