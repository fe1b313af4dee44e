"""Prompt logprobs equal Hugging Face transformers' (float32, CPU) over chunked prefill, n > 1
and prompts whose blocks are in the prefix cache; a disaggregated request gets them from its
prefill side only."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.handover import Handover
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore
from baton.services.engine.errors import InvalidRequestError
from testlib.hf import hf_model

TOP = 3


@pytest.fixture(scope="module")
def llm(model_dir):
    # 16-token steps: a prompt of 50 tokens is prefilled in 4 chunks.
    return LLM(
        model=str(model_dir), num_kv_blocks=256, block_size=16, max_num_batched_tokens=16, enable_chunked_prefill=True
    )


def hf_prompt_logprobs(model_dir, prompt_ids: list[int]) -> torch.Tensor:
    """[P - 1, V]: log-softmax of HF's logits at positions 0 .. P - 2."""
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check_against_hf(prompt_logprobs, prompt_ids, reference, num_top=TOP):
    assert len(prompt_logprobs) == len(prompt_ids)
    assert prompt_logprobs[0] is None
    for position, (entries, token_id) in enumerate(zip(prompt_logprobs[1:], prompt_ids[1:])):
        row = reference[position]
        assert entries[token_id].logprob == pytest.approx(row[token_id].item(), abs=1e-3)
        assert entries[token_id].rank == int((row > row[token_id]).sum()) + 1
        ranked = sorted(entries.items(), key=lambda item: item[1].rank)
        assert [t for t, e in ranked if e.rank <= num_top] == row.topk(num_top).indices.tolist()
        assert len(entries) in (num_top, num_top + 1)  # the prompt token, if not among the top


def prompt_of(llm, length: int) -> list[int]:
    ids = llm.tokenizer.encode("The with statement wraps a block with methods of a context manager. " * 8)
    return ids[:length]


def test_chunked_prefill_matches_hf(llm, model_dir):
    prompt_ids = prompt_of(llm, 50)
    (out,) = llm.generate([prompt_ids], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP))
    check_against_hf(out.prompt_logprobs, prompt_ids, hf_prompt_logprobs(model_dir, prompt_ids))
    assert out.prompt_logprobs[1][prompt_ids[1]].decoded_token == llm.tokenizer.decode([prompt_ids[1]])


def test_zero_gives_the_prompt_tokens_own_logprob_only(llm):
    prompt_ids = prompt_of(llm, 20)
    (out,) = llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert all(list(entries) == [t] for entries, t in zip(out.prompt_logprobs[1:], prompt_ids[1:]))


def test_a_cached_prompt_is_computed_again_for_its_logprobs(llm, model_dir):
    prompt_ids = prompt_of(llm, 40)
    llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0))  # caches its full blocks
    (warm,) = llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0))
    assert warm.num_cached_tokens == 32
    (out,) = llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP))
    assert out.num_cached_tokens == 0
    check_against_hf(out.prompt_logprobs, prompt_ids, hf_prompt_logprobs(model_dir, prompt_ids))


def test_batched_with_others_and_with_n(llm, model_dir):
    short, long = prompt_of(llm, 7), prompt_of(llm, 45)
    params = [
        SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=TOP),
        SamplingParams(max_tokens=4, temperature=0),
        SamplingParams(max_tokens=4, temperature=1.0, n=3, seed=1, prompt_logprobs=TOP),
    ]
    outs = llm.generate([short, long, long], params)
    check_against_hf(outs[0].prompt_logprobs, short, hf_prompt_logprobs(model_dir, short))
    assert outs[1].prompt_logprobs is None
    assert len(outs[2].outputs) == 3
    check_against_hf(outs[2].prompt_logprobs, long, hf_prompt_logprobs(model_dir, long))
    (alone,) = llm.generate([long], params[1])
    assert outs[1].token_ids == alone.token_ids  # a neighbour's prompt logprobs change nothing
    llm.core.check_integrity()


def test_a_one_token_prompt_has_only_the_null_entry(llm):
    (out,) = llm.generate([prompt_of(llm, 1)], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert out.prompt_logprobs == [None]


def test_validation(llm):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as error:
        llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=10_000))
    assert error.value.field == "prompt_logprobs"
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(InvalidRequestError, match="beam search"):
        SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4, prompt_logprobs=1)


def run(engine: EngineCore, request_id: str, prompt, params, handover):
    engine.submit(engine.prepare(request_id, prompt, params, handover=handover))
    outputs = []
    for _ in range(200):
        outputs.extend(o for o in engine.step() if o.request_id == request_id)
        if outputs and outputs[-1].finished:
            return outputs
    raise AssertionError(f"{request_id} did not finish")


def test_disaggregated_the_prefill_side_sends_them_the_decode_side_does_not(llama_dir):
    prompt_ids = list(range(100, 140))
    reference = hf_prompt_logprobs(llama_dir, prompt_ids)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    prefill = EngineCore(EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=32, role="prefill"))
    try:
        (first,) = run(prefill, "p", prompt_ids, params, Handover.prefill())
        check_against_hf(first.prompt_logprobs, prompt_ids, reference)
    finally:
        prefill.shutdown()
    # The decode side (here a resumed request, which recomputes the prompt) sends none again.
    decode = EngineCore(EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=32))
    try:
        outputs = run(decode, "d", prompt_ids, params, Handover.resume(first.token_ids))
        assert all(o.prompt_logprobs is None for o in outputs)
        assert len(outputs[-1].token_ids) == 3
    finally:
        decode.shutdown()
