"""Incremental detokenization: deltas never split a character and add up to the text."""

from __future__ import annotations

import pytest
from baton.services.engine.api.detokenizer import IncrementalDetokenizer
from baton.services.engine.api.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return load_tokenizer(llama_dir)


@pytest.mark.parametrize("text", ["héllo wörld — ☃ ✓ 🎉 done", "日本語のテキスト", "plain ascii, with spaces"])
def test_deltas_are_whole_characters_and_concatenate(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    deltas = []
    for token in ids:
        detok.append(token)
        deltas.append(detok.take_delta(finished=False))
    detok.flush()
    deltas.append(detok.take_delta(finished=True))
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    # Byte-level BPE with a small vocabulary spells rare characters as several byte tokens.
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in ids[:-1]:
        detok.append(token)
        assert detok.take_delta(finished=False) == ""
    detok.append(ids[-1])
    assert detok.take_delta(finished=False) == "🎉"


def test_stop_string_across_tokens_is_never_streamed(tokenizer):
    text = "alpha beta gamma delta"
    detok = IncrementalDetokenizer(tokenizer, [], stop=["gamma"])
    streamed, stop = "", None
    for token in tokenizer.encode(text):
        stop = detok.append(token) or stop
        streamed += detok.take_delta(finished=False)
        if stop:
            break
    streamed += detok.take_delta(finished=True)
    assert stop == "gamma"
    assert streamed == "alpha beta "
