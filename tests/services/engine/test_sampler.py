"""Sampling: distributions (chi-square), truncation, seeds, penalties, masks."""

from __future__ import annotations

import pytest
import torch
from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.engine.execution.sampler import Sampler, SamplingRow
from testlib.chi_square import chi_square_sf

VOCAB = 12
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.2, -2.0])


def draw(params: SamplingParams, num_draws: int, seed: int = 0) -> torch.Tensor:
    """Token frequencies over many draws (one batch row per draw, its own generator)."""
    sampler = Sampler(eos_token_ids=())
    counts = torch.zeros(VOCAB)
    batch = 500
    for start in range(0, num_draws, batch):
        rows = []
        for i in range(batch):
            g = torch.Generator().manual_seed(seed * 1_000_003 + start + i)
            rows.append(SamplingRow(params, g, [], []))
        tokens = sampler(LOGITS.repeat(batch, 1), rows)
        for t in tokens:
            counts[t.token_id] += 1
    return counts


def expected_distribution(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Written out independently: temperature, then top-k, then top-p, renormalised."""
    probs = torch.softmax(LOGITS.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    kept = probs[keep] / probs[keep].sum()
    mass, nucleus = 0.0, []
    for token, p in zip(keep, kept.tolist()):
        nucleus.append(token)
        mass += p
        if mass >= top_p - 1e-12:
            break
    out = torch.zeros(VOCAB, dtype=torch.float64)
    out[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return out


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    support = expected > 0
    n = counts.sum().item()
    observed, exp = counts[support].double(), expected[support] * n
    stat = ((observed - exp) ** 2 / exp).sum().item()
    return chi_square_sf(stat, int(support.sum()) - 1)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 5, 1.0), (1.0, -1, 0.8), (0.9, 6, 0.7)],
)
def test_sampled_frequencies_match_renormalised_distribution(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    counts = draw(params, 20_000)
    expected = expected_distribution(temperature, top_k, top_p)
    assert counts[expected == 0].sum() == 0, "a token outside top-k/top-p was sampled"
    assert chi_square_p_value(counts, expected) > 1e-4


def test_expected_distribution_is_not_trivial():
    assert (expected_distribution(1.0, 5, 1.0) > 0).sum() == 5
    assert 1 < (expected_distribution(1.0, -1, 0.8) > 0).sum() < VOCAB


def test_min_p_drops_unlikely_tokens():
    counts = draw(SamplingParams(temperature=1.0, min_p=0.3), 3000)
    probs = torch.softmax(LOGITS, -1)
    assert counts[probs < 0.3 * probs.max()].sum() == 0
    assert (counts > 0).sum() >= 3


def test_greedy_is_argmax_and_ignores_generators():
    sampler = Sampler(eos_token_ids=())
    rows = [SamplingRow(SamplingParams(temperature=0), torch.Generator().manual_seed(i), [], []) for i in range(4)]
    tokens = sampler(LOGITS.repeat(4, 1), rows)
    assert [t.token_id for t in tokens] == [0, 0, 0, 0]


def test_same_generator_seed_same_draws():
    params = SamplingParams(temperature=1.0)
    assert torch.equal(draw(params, 1000, seed=3), draw(params, 1000, seed=3))
    assert not torch.equal(draw(params, 1000, seed=3), draw(params, 1000, seed=4))


def test_penalties():
    sampler = Sampler(eos_token_ids=())
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    # Repetition penalty divides a positive logit of a seen token (prompt or output).
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), torch.Generator(), [0], [])
    assert sampler(logits.clone(), [row])[0].token_id == 1
    # Frequency penalty counts occurrences in the output only.
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.1), torch.Generator(), [], [0, 0])
    assert sampler(logits.clone(), [row])[0].token_id == 1
    row = SamplingRow(SamplingParams(temperature=0, presence_penalty=0.05), torch.Generator(), [], [0, 0])
    assert sampler(logits.clone(), [row])[0].token_id == 0  # 3.0 - 0.05 still wins
    row = SamplingRow(SamplingParams(temperature=0, presence_penalty=0.2), torch.Generator(), [1], [0])
    assert sampler(logits.clone(), [row])[0].token_id == 1  # prompt tokens are not penalised


def test_min_tokens_and_allowed_tokens_masks():
    sampler = Sampler(eos_token_ids=(0,))
    logits = torch.tensor([[5.0, 1.0, 2.0, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]), torch.Generator(), [], [7])
    assert sampler(logits.clone(), [row])[0].token_id == 1  # EOS and the stop token are masked
    row = SamplingRow(SamplingParams(temperature=0, min_tokens=1), torch.Generator(), [], [7])
    assert sampler(logits.clone(), [row])[0].token_id == 0
    row = SamplingRow(SamplingParams(temperature=0, allowed_token_ids=[1, 3]), torch.Generator(), [], [])
    assert sampler(logits.clone(), [row])[0].token_id == 1


def test_logprobs_include_sampled_token_with_rank():
    sampler = Sampler(eos_token_ids=())
    row = SamplingRow(SamplingParams(temperature=0, logprobs=2, allowed_token_ids=[5]), torch.Generator(), [], [])
    (token,) = sampler(LOGITS[None].clone(), [row])
    assert token.token_id == 5 and token.rank == 6  # raw logprobs: five tokens are likelier
    assert token.logprob == pytest.approx(torch.log_softmax(LOGITS, -1)[5].item())
    assert [t for t, _ in token.top_logprobs] == [0, 1]
