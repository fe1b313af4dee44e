"""Medusa heads and an EAGLE drafter beside a tensor-parallel target: rank 0 hands its
hidden states back with its sampled tokens, the heads draft in the engine's process, and
greedy output equals plain TP 1 token for token."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams
from testlib.ray_cluster import local_ray

pytestmark = pytest.mark.ray


def test_medusa_and_eagle_over_tp2_equal_plain_tp1(cycle_dir, tmp_path, heads):
    prompts = ["a b c a b c a b c", "hello hello hello", "def foo(x):"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)]
    single = LLM(model=str(cycle_dir), num_kv_blocks=64).generate(prompts, greedy)
    folders = {
        "medusa": heads.write_medusa(tmp_path / "medusa", cycle_dir, num_heads=3, agree_on_cycle=True),
        "eagle": heads.write_eagle(tmp_path / "eagle", cycle_dir, agree_on_cycle=True),
    }
    with local_ray(num_cpus=3):
        for method, folder in folders.items():
            tp = LLM(
                model=str(cycle_dir),
                num_kv_blocks=64,
                tensor_parallel_size=2,
                speculative_method=method,
                heads=str(folder),
                num_speculative_tokens=3,
            )
            try:
                assert [o.token_ids for o in tp.generate(prompts, greedy)] == [o.token_ids for o in single], method
                stats = tp.core.speculator.stats
                assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens > 0, (method, stats)
                first = tp.generate(prompts, sampled)
                assert [o.token_ids for o in tp.generate(prompts, sampled)] == [o.token_ids for o in first]
                tp.core.check_integrity()
            finally:
                tp.shutdown()
