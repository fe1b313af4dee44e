"""Rejection sampling: greedy exactness, seeds, batch layout, and input validation.
(Distributions: test_rejection_sampler_distribution.py.)"""

from __future__ import annotations

import random

import pytest
import torch
from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.engine.execution.sampler import Sampler, SamplingRow
from baton.services.engine.spec_decode.rejection_sampler import DraftBatch, RejectionSampler, RequestDrafts

VOCAB = 8


def random_probs(rows: int, gen: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, VOCAB, generator=gen) * 2, dim=-1)


def random_request(k: int, gen: torch.Generator, seed: int | None = None, with_q: bool = True) -> RequestDrafts:
    q = random_probs(k, gen) if with_q else None
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0].tolist() if with_q and k else [0] * k
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return RequestDrafts(drafts, random_probs(k + 1, gen), q, generator=generator)


def reference_greedy(drafts: list[int], target_probs: torch.Tensor) -> list[int]:
    out = []
    for j, token in enumerate(drafts):
        best = int(target_probs[j].argmax())
        out.append(best)
        if token != best:
            return out
    return out + [int(target_probs[len(drafts)].argmax())]


def test_greedy_is_exact_argmax_matching():
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    requests, expected = [], []
    for _ in range(200):
        k = rng.randint(0, 4)
        p = random_probs(k + 1, gen)
        drafts = p[:k].argmax(dim=-1).tolist()
        if k and rng.random() < 0.7:  # a mismatch somewhere, else all k match
            j = rng.randrange(k)
            drafts[j] = (drafts[j] + rng.randint(1, VOCAB - 1)) % VOCAB
        q = random_probs(k, gen) if rng.random() < 0.5 else None  # greedy ignores q
        requests.append(RequestDrafts(drafts, p, q, is_greedy=True, generator=torch.Generator().manual_seed(1)))
        expected.append(reference_greedy(drafts, p))
    out = RejectionSampler()(DraftBatch.from_requests(requests))
    assert out.token_ids == expected
    assert out.num_accepted == [len(t) - 1 for t in expected]
    assert any(n == len(r.draft_token_ids) > 0 for n, r in zip(out.num_accepted, requests))  # bonus reached


def test_greedy_draws_no_random_numbers():
    gen = torch.Generator().manual_seed(0)
    generator = torch.Generator().manual_seed(7)
    before, global_before = generator.get_state(), torch.get_rng_state()
    requests = [RequestDrafts([1, 2, 3], random_probs(4, gen), is_greedy=True, generator=generator)]
    requests.append(RequestDrafts([4], random_probs(2, gen), is_greedy=True))
    RejectionSampler()(DraftBatch.from_requests(requests))
    assert torch.equal(generator.get_state(), before)
    assert torch.equal(torch.get_rng_state(), global_before)


def test_greedy_requests_are_unaffected_by_random_neighbours():
    gen = torch.Generator().manual_seed(3)
    greedy = [
        RequestDrafts([2, 5], random_probs(3, gen), is_greedy=True),
        RequestDrafts([], random_probs(1, gen), is_greedy=True),
    ]
    alone = RejectionSampler()(DraftBatch.from_requests(greedy)).token_ids
    mixed = [random_request(3, gen, seed=1), greedy[0], random_request(0, gen, seed=2), greedy[1]]
    out = RejectionSampler()(DraftBatch.from_requests(mixed)).token_ids
    assert [out[1], out[3]] == alone


def run_seeded(seeds: list[int], k: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(42)  # the same inputs every time; only the seeds vary
    requests = [random_request(k, gen, seed=seed) for seed in seeds]
    return RejectionSampler()(DraftBatch.from_requests(requests)).token_ids


def test_same_seeds_same_outputs_other_seeds_other_outputs():
    seeds = list(range(64))
    assert run_seeded(seeds) == run_seeded(seeds)
    assert run_seeded(seeds) != run_seeded([s + 1000 for s in seeds])


def test_a_requests_output_depends_only_on_its_own_generator():
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    target = random_request(3, gen, seed=99)
    alone = RejectionSampler()(DraftBatch.from_requests([target])).token_ids[0]
    for _ in range(5):
        target.generator = torch.Generator().manual_seed(99)
        others = [random_request(rng.randint(0, 4), gen, seed=rng.randint(0, 10**6)) for _ in range(6)]
        others.insert(3, target)
        assert RejectionSampler()(DraftBatch.from_requests(others)).token_ids[3] == alone


def test_global_rng_is_reproducible_under_a_global_seed():
    gen = torch.Generator().manual_seed(8)
    requests = [random_request(2, gen) for _ in range(32)]
    batch = DraftBatch.from_requests(requests)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        first = RejectionSampler()(batch).token_ids
        torch.manual_seed(0)
        again = RejectionSampler()(batch).token_ids
        torch.manual_seed(1)
        other = RejectionSampler()(batch).token_ids
    assert first == again != other


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_without_drafts_a_request_samples_as_the_sampler_does(params):
    # The same generator seed gives the same token as non-speculative sampling.
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    probs = Sampler.probabilities(logits, [params])
    for seed in range(100):
        expected = Sampler(eos_token_ids=())(
            logits.clone(), [SamplingRow(params, torch.Generator().manual_seed(seed), [], [])]
        )
        request = RequestDrafts([], probs, generator=torch.Generator().manual_seed(seed))
        assert RejectionSampler()(DraftBatch.from_requests([request])).token_ids == [[expected[0].token_id]]


def test_missing_q_equals_explicit_one_hot_q():
    gen = torch.Generator().manual_seed(11)
    ks = [0, 1, 2, 3, 4] * 10
    drafts = [torch.randint(0, VOCAB, (k,), generator=gen).tolist() for k in ks]
    probs = [random_probs(k + 1, gen) for k in ks]

    def batch(first_q: torch.Tensor | None) -> DraftBatch:
        requests = [
            RequestDrafts(d, p, generator=torch.Generator().manual_seed(i))
            for i, (d, p) in enumerate(zip(drafts, probs))
        ]
        requests[0].draft_probs = first_q  # one request with q: the others get one-hot rows
        return DraftBatch.from_requests(requests)

    implicit, explicit = batch(None), batch(torch.zeros(0, VOCAB))
    assert implicit.draft_probs is None
    assert torch.equal(explicit.draft_probs, torch.nn.functional.one_hot(implicit.draft_token_ids, VOCAB).float())
    out = RejectionSampler()(implicit)
    assert 0 < sum(out.num_accepted) < sum(ks)
    assert RejectionSampler()(explicit) == out


def test_a_draft_p_forbids_is_rejected_and_one_q_forbids_is_accepted():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.5, 0.0, 0.0, 0.5]])
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        rejected = RejectionSampler()(DraftBatch.from_requests([RequestDrafts([0], p, q, generator=g)]))
        assert rejected.num_accepted == [0] and rejected.token_ids[0][0] in (1, 2)
        accepted = RejectionSampler()(DraftBatch.from_requests([RequestDrafts([1], p, q, generator=g)]))
        assert accepted.num_accepted == [1] and accepted.token_ids[0][0] == 1


def test_output_layout_in_a_ragged_batch():
    gen = torch.Generator().manual_seed(2)
    ks = [0, 3, 1, 0, 4, 2]
    requests = [random_request(k, gen, seed=i) for i, k in enumerate(ks)]
    out = RejectionSampler()(DraftBatch.from_requests(requests))
    assert len(out.token_ids) == len(out.num_accepted) == len(ks)
    for tokens, n, k, r in zip(out.token_ids, out.num_accepted, ks, requests):
        assert 0 <= n <= k and len(tokens) == n + 1
        assert tokens[:n] == r.draft_token_ids[:n]
        assert all(0 <= t < VOCAB for t in tokens)


def test_all_requests_without_drafts():
    gen = torch.Generator().manual_seed(4)
    out = RejectionSampler()(DraftBatch.from_requests([random_request(0, gen, seed=i) for i in range(4)]))
    assert out.num_accepted == [0] * 4 and all(len(t) == 1 for t in out.token_ids)


def flat(**overrides) -> dict:
    fields = dict(
        num_draft_tokens=[2, 0],
        draft_token_ids=torch.tensor([1, 2]),
        target_probs=torch.full((4, VOCAB), 1 / VOCAB),
        draft_probs=torch.full((2, VOCAB), 1 / VOCAB),
        is_greedy=[False, True],
        generators=[None, None],
    )
    return fields | overrides


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(num_draft_tokens=[]), "a batch needs at least one request"),
        (dict(num_draft_tokens=[3, -1]), r"num_draft_tokens must be non-negative ints, got \[3, -1\]"),
        (
            dict(draft_token_ids=torch.tensor([1, 2, 3])),
            r"draft_token_ids must be int64 of shape \[sum\(num_draft_tokens\) = 2\]",
        ),
        (dict(draft_token_ids=torch.tensor([1.0, 2.0])), "draft_token_ids must be int64"),
        (
            dict(target_probs=torch.full((3, VOCAB), 0.1)),
            r"target_probs must be float of shape \[.* = 4, V\], got .* \(3, 8\)",
        ),
        (dict(target_probs=torch.ones(4, VOCAB, dtype=torch.long)), "target_probs must be float"),
        (
            dict(draft_probs=torch.full((2, VOCAB + 1), 0.1)),
            r"draft_probs must be None or float of shape \[2, V = 8\], got \(2, 9\)",
        ),
        (dict(draft_token_ids=torch.tensor([1, VOCAB])), r"draft_token_ids must lie in \[0, V = 8\), got \[1, 8\]"),
        (dict(is_greedy=[False]), "is_greedy has 1 entries for 2 requests"),
        (dict(generators=[None] * 3), "generators has 3 entries for 2 requests"),
    ],
)
def test_bad_batches_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        DraftBatch(**flat(**overrides))


@pytest.mark.parametrize(
    "request_,message",
    [
        (
            RequestDrafts([1, 2], torch.full((2, VOCAB), 0.1)),
            r"requests\[1\].target_probs has shape \(2, 8\), expected \[k \+ 1 = 3, V\]",
        ),
        (
            RequestDrafts([1], torch.full((2, VOCAB), 0.1), torch.full((2, VOCAB), 0.1)),
            r"requests\[1\].draft_probs has shape \(2, 8\), expected \[k = 1, V\]",
        ),
        (
            RequestDrafts([1], torch.full((2, VOCAB + 2), 0.1)),
            r"requests\[1\].target_probs has V = 10, requests\[0\]'s 8",
        ),
        (
            RequestDrafts([VOCAB], torch.full((2, VOCAB), 0.1)),
            r"requests\[1\].draft_token_ids must lie in \[0, V = 8\), got \[8\]",
        ),
    ],
)
def test_bad_requests_are_named(request_, message):
    good = RequestDrafts([0], torch.full((2, VOCAB), 1 / VOCAB))
    with pytest.raises(ValueError, match=message):
        DraftBatch.from_requests([good, request_])


def test_an_empty_request_list_is_refused():
    with pytest.raises(ValueError, match="requests: a batch needs at least one request"):
        DraftBatch.from_requests([])
