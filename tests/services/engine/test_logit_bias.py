"""logit_bias: added to the logits before every other transform, per request inside a batch,
for greedy, random and speculative (n-gram) decoding; bad values and ids are refused by name."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.errors import InvalidRequestError
from baton.services.engine.execution.sampler import LogitBias, Sampler, SamplingRow

PROMPT = "a b c a b c a b c"


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=256)


@pytest.fixture(scope="module")
def speculative(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=256, speculative_method="ngram", num_speculative_tokens=4)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kwargs)


def row(params: SamplingParams, bias: dict[int, float] | None = None) -> SamplingRow:
    return SamplingRow(params, torch.Generator(), [1, 2], [], logit_bias=LogitBias.build(bias, torch.device("cpu")))


def test_the_sampler_adds_each_rows_bias_to_its_logits_only():
    logits = torch.randn(3, 50)
    rows = [row(greedy(), {3: 5.0, 7: -2.5}), row(greedy()), row(greedy(), {49: 100.0})]
    _, processed = Sampler(eos_token_ids=(0,)).process(logits.clone(), rows)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 7] -= 2.5
    expected[2, 49] += 100.0
    torch.testing.assert_close(processed, expected)


def test_the_bias_comes_before_the_repetition_penalty():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 1.0
    (biased,) = [row(SamplingParams(repetition_penalty=2.0, temperature=0), {2: -3.0})]  # prompt holds token 2
    _, processed = Sampler(eos_token_ids=(0,)).process(logits, [biased])
    assert processed[0, 2].item() == pytest.approx((1.0 - 3.0) * 2.0)  # biased to -2, then penalised


def test_greedy_follows_the_biased_argmax(plain):
    (reference,) = plain.generate([PROMPT], greedy())
    first = reference.token_ids[0]
    (banned,) = plain.generate([PROMPT], greedy(logit_bias={first: -100}))
    assert banned.token_ids[0] != first
    forced_token = plain.tokenizer.encode(" z", add_special_tokens=False)[0]
    (forced,) = plain.generate([PROMPT], greedy(logit_bias={forced_token: 100}))
    assert set(forced.token_ids) == {forced_token}


def test_random_sampling_draws_only_the_forced_token_and_neighbours_are_untouched(plain):
    token = plain.tokenizer.encode(" z", add_special_tokens=False)[0]
    params = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True, logit_bias={token: 100}),
        SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True),
    ]
    biased, unbiased = plain.generate([PROMPT, PROMPT], params)
    assert set(biased.token_ids) == {token}
    (alone,) = plain.generate([PROMPT], params[1])
    assert unbiased.token_ids == alone.token_ids


def test_speculative_verification_uses_the_biased_target(plain, speculative):
    """The n-gram drafts repeat the prompt; with its tokens banned, verification must refuse
    them (an unbiased argmax would accept them)."""
    (reference,) = plain.generate([PROMPT], greedy())
    banned = {t: -100.0 for t in set(reference.token_ids[:6])}
    (expected,) = plain.generate([PROMPT], greedy(logit_bias=banned))
    assert not set(expected.token_ids) & set(banned)
    before = speculative.core.speculator.stats.num_drafts
    (got,) = speculative.generate([PROMPT], greedy(logit_bias=banned))
    assert got.token_ids == expected.token_ids
    assert speculative.core.speculator.stats.num_drafts > before, "drafts were meant to be verified"
    # A bias the drafts agree with: speculation still equals the plain engine.
    favoured = {reference.token_ids[1]: 4.0}
    (expected,) = plain.generate([PROMPT], greedy(logit_bias=favoured))
    (got,) = speculative.generate([PROMPT], greedy(logit_bias=favoured))
    assert got.token_ids == expected.token_ids


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({1: 100.5}, "in [-100, 100], got 100.5"),
        ({1: float("nan")}, "finite"),
        ({-1: 1.0}, "token ids"),
        ({"7": 1.0}, "token ids"),
    ],
)
def test_bad_values_are_refused_by_name(bias, words):
    with pytest.raises(InvalidRequestError, match="logit_bias") as error:
        SamplingParams(logit_bias=bias)
    assert error.value.field == "logit_bias" and words in error.value.message


def test_ids_outside_the_vocabulary_are_refused(plain):
    vocab = plain.core.arch.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"\[{vocab}\] are outside the vocabulary") as error:
        plain.generate([PROMPT], greedy(logit_bias={vocab: 1.0, 3: 1.0}))
    assert error.value.field == "logit_bias"


def test_beam_search_with_a_bias_is_refused():
    with pytest.raises(InvalidRequestError, match="beam search") as error:
        SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4, logit_bias={1: 1.0})
    assert error.value.field == "logit_bias"
