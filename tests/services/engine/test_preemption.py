"""A KV budget too small for the batch: requests are preempted, recomputed, and still
produce exactly the unconstrained outputs; afterwards every block is free."""

from __future__ import annotations

from baton.services.engine import LLM, SamplingParams
from testlib.hf import PROMPTS


def test_preemption_keeps_outputs_and_frees_every_block(llama_dir):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 24, 32, 48, 16, 40, 28, 36)]
    roomy = LLM(model=str(llama_dir), num_kv_blocks=512, block_size=16)
    expected = roomy.generate(PROMPTS, params)

    tight = LLM(model=str(llama_dir), num_kv_blocks=10, block_size=16, max_model_len=160)
    outs = tight.generate(PROMPTS, params)

    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the budget was meant to force preemption"
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "length" for o in outs)
    tight.core.check_integrity()
    assert tight.core.scheduler.kv.num_free_blocks == 10
    assert not tight.core.scheduler.kv.req_to_blocks


def test_seeded_sampling_survives_preemption(llama_dir):
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i) for i in range(8)]
    roomy = LLM(model=str(llama_dir), num_kv_blocks=512, enable_prefix_caching=False)
    tight = LLM(model=str(llama_dir), num_kv_blocks=10, max_model_len=160, enable_prefix_caching=False)
    expected = roomy.generate(PROMPTS, params)
    outs = tight.generate(PROMPTS, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
