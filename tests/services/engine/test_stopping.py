"""How generation ends: EOS, stop token ids, stop strings, max_tokens, context limit."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=256)


@pytest.fixture(scope="module")
def free_run(llm):
    """A greedy continuation long enough to pick stop conditions from."""
    (out,) = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    return out


def test_max_tokens_gives_length(llm):
    (out,) = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_id(llm, free_run):
    stop_token = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_token)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_token])
    (out,) = llm.generate(["The quick brown fox"], params)
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_token


def test_eos_stops_unless_ignored(llm, free_run):
    # Declare the token greedy decoding emits at step 4 to be EOS for new requests.
    eos = free_run.token_ids[4]
    first = free_run.token_ids.index(eos)
    llm.core.groups.eos_token_ids = frozenset({eos})
    try:
        (out,) = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=40, temperature=0))
        assert out.token_ids == free_run.token_ids[: first + 1]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason is None
        (ignored,) = llm.generate(
            ["The quick brown fox"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        )
        assert ignored.token_ids == free_run.token_ids
    finally:
        llm.core.groups.eos_token_ids = frozenset(llm.core.arch.eos_token_ids)


def test_stop_string_truncates_text(llm, free_run):
    text = free_run.text
    stop = text[10:14]
    assert stop.strip(), "pick a visible stop string"
    cut = text.index(stop)
    (out,) = llm.generate(
        ["The quick brown fox"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    )
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[:cut]
    (kept,) = llm.generate(
        ["The quick brown fox"],
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )
    assert kept.text == text[: cut + len(stop)]


def test_context_limit_gives_length(llama_dir):
    # max_tokens=None runs to the end of the context; a max_tokens past it is refused
    # (test_validation.py), where it used to be capped silently.
    llm = LLM(model=str(llama_dir), num_kv_blocks=64, max_model_len=20)
    prompt = llm.tokenizer.encode("The quick brown fox jumps")
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(prompt) + len(out.token_ids) == 20 and out.finish_reason == "length"
