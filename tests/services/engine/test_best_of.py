"""best_of > n: best_of samples are generated, the n with the highest cumulative logprob are
returned best first, and nothing streams before they are all done."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.handover import can_disaggregate
from baton.services.engine.api.sampling_params import RequestOutputKind
from baton.services.engine.errors import InvalidRequestError

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=256)


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True, **kwargs)


def test_the_n_best_of_the_samples_are_returned_best_first(llm):
    # Sample i of a seeded request draws with seed + i either way, so n=5 shows every candidate.
    (everyone,) = llm.generate([PROMPT], sampled(n=5, logprobs=0))
    ranked = sorted(everyone.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    (best,) = llm.generate([PROMPT], sampled(n=2, best_of=5))
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.cumulative_logprob for c in best.outputs] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    assert best.outputs[0].text == llm.tokenizer.decode(best.outputs[0].token_ids, skip_special_tokens=True)
    assert best.outputs[0].logprobs is None  # not asked for, though computed to rank them
    llm.core.check_integrity()


def test_with_logprobs_and_a_one_token_prompt(llm):
    (best,) = llm.generate([[5]], sampled(n=1, best_of=3, logprobs=2))
    (output,) = best.outputs
    assert len(output.logprobs) == len(output.token_ids) == 10
    assert output.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(output.token_ids, output.logprobs))
    )


def test_deltas_come_once_at_the_end(llm):
    params = sampled(n=2, best_of=4, output_kind=RequestOutputKind.DELTA)
    llm.core.add_request("delta", PROMPT, params)
    outputs = []
    while llm.core.has_unfinished_requests():
        outputs.extend(o for o in llm.core.step() if o.request_id == "delta")
    assert len(outputs) == 1 and outputs[0].finished
    assert [len(c.token_ids) for c in outputs[0].outputs] == [10, 10]


def test_best_of_equal_to_n_returns_every_sample(llm):
    (plain,) = llm.generate([PROMPT], sampled(n=2))
    (same,) = llm.generate([PROMPT], sampled(n=2, best_of=2))
    assert [c.token_ids for c in same.outputs] == [c.token_ids for c in plain.outputs]


def test_validation_and_placement():
    with pytest.raises(InvalidRequestError, match="must be >= n") as error:
        SamplingParams(n=3, best_of=2)
    assert error.value.field == "best_of"
    assert not can_disaggregate(SamplingParams(best_of=2))  # its samples share one worker's blocks
    assert can_disaggregate(SamplingParams(best_of=1, prompt_logprobs=1))
