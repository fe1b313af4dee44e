"""Greedy output and logprobs equal Hugging Face transformers (float32, CPU)."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams
from testlib.hf import PROMPTS, hf_greedy

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), num_kv_blocks=512, block_size=16, max_num_seqs=16)


@pytest.fixture(scope="module")
def references(llm, model_dir):
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return prompt_ids, [hf_greedy(model_dir, ids, MAX_TOKENS) for ids in prompt_ids]


def test_prompts_have_different_lengths(references):
    prompt_ids, _ = references
    assert len({len(ids) for ids in prompt_ids}) >= 6


def test_greedy_one_by_one_equals_hf(llm, references):
    prompt_ids, refs = references
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    for ids, (ref_tokens, _) in zip(prompt_ids, refs):
        (out,) = llm.generate([ids], params)
        assert out.token_ids == ref_tokens


def test_greedy_batched_equals_hf(llm, references):
    prompt_ids, refs = references
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in outs] == [tokens for tokens, _ in refs]
    llm.core.check_integrity()
    assert llm.core.scheduler.kv.num_free_blocks == llm.core.num_kv_blocks


def test_logprobs_match_hf(llm, references):
    prompt_ids, refs = references
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=3))
    for out, (ref_tokens, ref_logprobs) in zip(outs, refs):
        assert out.token_ids == ref_tokens
        assert len(out.logprobs) == len(ref_tokens)
        for token, entry, ref in zip(out.token_ids, out.logprobs, ref_logprobs):
            assert entry[token].logprob == pytest.approx(ref, abs=1e-3)
            assert entry[token].rank == 1  # greedy picks the most likely token
            assert len(entry) == 3  # the sampled token is one of the top 3
        assert out.outputs[0].cumulative_logprob == pytest.approx(sum(ref_logprobs), abs=1e-2)


def test_text_prompt_equals_token_prompt(llm):
    params = SamplingParams(max_tokens=8, temperature=0)
    by_text, by_ids = llm.generate(["def foo(x):", llm.tokenizer.encode("def foo(x):")], params)
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.prompt == "def foo(x):" and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
