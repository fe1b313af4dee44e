"""Rejection sampling keeps the target's distribution: statistical tests over many draws.

Each test runs N requests in one batch, every request with the same p (target) and q (draft)
rows and its own drafts drawn from q, and compares what was emitted against what exact
speculative decoding must give:

  first token                  ~ p_0, whatever q is
  drafts accepted              P(r >= j + 1) = a_0 ... a_j, a_j = sum(min(p_j, q_j))
  (t_0, t_1) given r >= 1      ~ min(p_0, q_0) / a_0  x  p_1    (t_1 from p_1 whatever t_0 was)
  t_2 given r = 2 (bonus)      ~ p_2

Goodness of fit is Pearson's chi-square with its exact survival function (integer degrees of
freedom, closed form; scipy is not installed), and a test fails when the p-value is at or
below SIGNIFICANCE. Tokens outside the expected support must never appear (an exact check).
Seeds are fixed, so each test passes or fails deterministically; the power tests at the end
show that the same N detects plausible bugs.
"""

from __future__ import annotations

import math

import pytest
import torch
from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.engine.execution.sampler import Sampler
from baton.services.engine.spec_decode.rejection_sampler import DraftBatch, RejectionSampler
from testlib.chi_square import chi_square_sf

SIGNIFICANCE = 1e-4
NUM_TRIALS = 40_000
VOCAB = 6


def goodness_of_fit(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """The chi-square p-value of integer samples against a distribution over range(len(expected))."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    assert counts.numel() == expected.numel()
    outside = expected == 0
    assert counts[outside].sum() == 0, f"tokens with probability 0 were emitted: counts {counts.tolist()}"
    observed, exp = pool_small_cells(counts[~outside], expected[~outside].double() * counts.sum())
    if exp.numel() == 1:
        return 1.0
    stat = ((observed - exp) ** 2 / exp).sum().item()
    return chi_square_sf(stat, exp.numel() - 1)


def pool_small_cells(observed: torch.Tensor, exp: torch.Tensor, min_expected: float = 5.0):
    """Cells expecting fewer than 5 counts (where the chi-square approximation fails) share one."""
    small = exp < min_expected
    if not small.any():
        return observed, exp
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    if exp[-1] < min_expected and exp.numel() > 1:  # still too small: fold it into the smallest cell
        smallest = int(exp[:-1].argmin())
        observed[smallest] += observed[-1]
        exp[smallest] += exp[-1]
        observed, exp = observed[:-1], exp[:-1]
    return observed, exp


def assert_fits(samples: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    p_value = goodness_of_fit(samples, expected)
    counts = torch.bincount(samples, minlength=expected.numel())
    assert p_value > SIGNIFICANCE, (
        f"{what}: chi-square p-value {p_value:.2e}; counts {counts.tolist()}, expected "
        f"{(expected * samples.numel()).round().tolist()}"
    )


@pytest.fixture(autouse=True)
def seeded():
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        yield


def dist(*weights: float) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float64)
    return t / t.sum()


def truncated(logits: list[float], **params) -> torch.Tensor:
    """p after temperature and top-k/top-p/min-p, as the engine's sampler computes it."""
    probs = Sampler.probabilities(torch.tensor([logits]), [SamplingParams(**params)])[0]
    return probs.double() / probs.double().sum()


def repeated_batch(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, generators=None) -> DraftBatch:
    """One request per row of drafts [N, k], all with the same p [k + 1, V] and q [k, V] rows."""
    num, k = drafts.shape
    return DraftBatch(
        num_draft_tokens=[k] * num,
        draft_token_ids=drafts.reshape(-1),
        target_probs=p.repeat(num, 1),
        draft_probs=None if q is None else q.repeat(num, 1),
        is_greedy=[False] * num,
        generators=generators or [None] * num,
    )


def run(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor | None = None, sampler=None):
    """NUM_TRIALS requests with k = len(p) - 1 drafts, drawn from q (or the fixed `drafts`
    when q is None: one-hot). Returns emitted tokens [N, k + 1] (-1 padded) and r [N]."""
    k = p.shape[0] - 1
    if q is not None:
        drafts = torch.multinomial(q, NUM_TRIALS, replacement=True).T  # [N, k]
    else:
        drafts = drafts.repeat(NUM_TRIALS, 1)
    out = (sampler or RejectionSampler())(repeated_batch(p, q, drafts))
    tokens = torch.tensor([t + [-1] * (k + 1 - len(t)) for t in out.token_ids])
    return tokens, torch.tensor(out.num_accepted)


def check_speculative_distribution(p: torch.Tensor, q: torch.Tensor) -> None:
    tokens, num_accepted = run(p, q)
    assert_fits(tokens[:, 0], p[0], "first token vs p_0")
    overlap = torch.minimum(p[:-1], q).sum(dim=-1)  # a_j per draft position
    check_acceptance_rate(num_accepted >= 1, overlap[0].item())
    k = q.shape[0]
    expected_r = torch.tensor(
        [math.prod(overlap[:j].tolist()) * (1 - (overlap[j].item() if j < k else 0)) for j in range(k + 1)]
    )
    assert_fits(num_accepted, expected_r, "drafts accepted per request")
    after_accept = num_accepted >= 1
    if after_accept.sum() >= 2_000:
        accepted_first = torch.minimum(p[0], q[0]) / overlap[0]
        joint = (accepted_first[:, None] * p[1][None, :]).reshape(-1)
        pairs = tokens[after_accept, 0] * VOCAB + tokens[after_accept, 1]
        assert_fits(pairs, joint, "(t0, t1) given t0 was an accepted draft")
    all_accepted = num_accepted == k
    if all_accepted.sum() >= 1_000:
        assert_fits(tokens[all_accepted, k], p[k], "the bonus token vs p_k")


def check_acceptance_rate(accepted: torch.Tensor, rate: float) -> None:
    """The first draft's acceptance against sum(min(p_0, q_0)): exact at 0 and 1, else a
    two-sided z-test at SIGNIFICANCE (|z| < 3.89)."""
    observed = accepted.double().mean().item()
    if rate in (0.0, 1.0):
        assert observed == rate
        return
    z = (observed - rate) / math.sqrt(rate * (1 - rate) / accepted.numel())
    assert math.erfc(abs(z) / math.sqrt(2)) > SIGNIFICANCE, f"acceptance {observed:.4f}, expected {rate:.4f}"


P = torch.stack([dist(5, 3, 1, 1, 4, 2), dist(1, 1, 6, 2, 1, 1), dist(2, 5, 1, 1, 1, 3)])
CASES = {
    "p equals q": (P, P[:2].clone()),
    "disjoint supports": (
        torch.stack([dist(3, 2, 1, 0, 0, 0), dist(1, 1, 1, 0, 0, 0), dist(1, 2, 3, 0, 0, 0)]),
        torch.stack([dist(0, 0, 0, 1, 2, 3), dist(0, 0, 0, 3, 2, 1)]),
    ),
    "q is zero where p is not": (P, torch.stack([dist(3, 1, 0, 0, 0, 0), dist(0, 0, 5, 1, 0, 0)])),
    "q nearly one-hot on a token p dislikes": (P, torch.stack([dist(1, 1, 1e3, 1, 1, 1), dist(1e3, 1, 1, 1, 1, 1)])),
    "p truncated by top-k and top-p, q full": (
        torch.stack(
            [
                truncated([2.0, 1.0, 0.5, 0.3, -1.0, 1.5], temperature=0.8, top_k=3),
                truncated([0.1, 2.0, 1.9, 1.0, 0.0, -2.0], temperature=1.2, top_p=0.8),
                truncated([1.0, 1.0, 0.2, 0.9, 0.5, 0.4], min_p=0.5),
            ]
        ),
        torch.stack([dist(1, 1, 1, 1, 1, 1), dist(2, 1, 1, 3, 1, 1)]),
    ),
    "p and q both truncated, supports overlapping": (
        torch.stack([dist(0, 4, 3, 2, 0, 0), dist(5, 0, 0, 1, 1, 0), dist(1, 1, 1, 0, 0, 1)]),
        torch.stack([dist(0, 0, 3, 2, 4, 0), dist(1, 0, 0, 0, 1, 1)]),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_emitted_tokens_follow_p(case):
    p, q = CASES[case]
    check_speculative_distribution(p, q)


def test_random_pairs_follow_p():
    for _ in range(3):
        p = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((3,)).double()
        q = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((2,)).double()
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        check_speculative_distribution(p, q)


@pytest.mark.parametrize(
    "drafts",
    [[0, 2], [3, 1], [5, 5]],  # p likes them; p likes neither much; the first one p_0 dislikes
)
def test_one_hot_drafts_follow_p(drafts):
    drafts = torch.tensor(drafts)
    tokens, num_accepted = run(P, None, drafts)
    assert_fits(tokens[:, 0], P[0], "first token vs p_0")
    check_acceptance_rate(num_accepted >= 1, P[0, drafts[0]].item())
    after_accept = num_accepted >= 1
    assert torch.equal(tokens[after_accept, 0], drafts[0].expand(int(after_accept.sum())))
    assert_fits(tokens[after_accept, 1], P[1], "second token given the first draft was accepted")


def test_a_one_hot_draft_outside_p_is_always_rejected():
    p = torch.stack([truncated([2.0, 1.0, 0.5, 0.3, -1.0, 1.5], top_k=2), P[1]])
    tokens, num_accepted = run(p, None, torch.tensor([3]))  # top-k 2 keeps 0 and 5
    assert (num_accepted == 0).all()
    assert_fits(tokens[:, 0], p[0], "first token vs p_0")


def test_p_equals_q_and_a_draft_neither_allows_recovers_from_p():
    # max(p - q, 0) is all zero here, so the recovered token comes from p itself.
    p = torch.stack([dist(0, 1, 2, 3, 0, 4), dist(1, 1, 1, 1, 1, 1)])
    batch = repeated_batch(p, p[:1], torch.zeros(NUM_TRIALS, 1, dtype=torch.long))
    out = RejectionSampler()(batch)
    assert set(out.num_accepted) == {0}
    assert_fits(torch.tensor([t[0] for t in out.token_ids]), p[0], "recovered token vs p_0")


def test_mixed_draft_counts_in_one_batch():
    ks = [0, 1, 2, 3] * (NUM_TRIALS // 4)
    p, q = torch.cat([P, dist(1, 2, 3, 4, 5, 6)[None]]), torch.cat([CASES["q is zero where p is not"][1], P[2:]])
    is_draft = torch.arange(3)[None, :] < torch.tensor(ks)[:, None]  # [N, 3]: request-major once flattened
    drafts = torch.multinomial(q, len(ks), replacement=True).T[is_draft]
    target_rows = [j for k in ks for j in range(k + 1)]
    draft_rows = [j for k in ks for j in range(k)]
    batch = DraftBatch(ks, drafts, p[target_rows], q[draft_rows], [False] * len(ks), [None] * len(ks))
    out = RejectionSampler()(batch)
    for k in range(4):
        firsts = torch.tensor([t[0] for t, kk in zip(out.token_ids, ks) if kk == k])
        assert_fits(firsts, p[0], f"first token of requests with k = {k}")
        accepted = [n for n, kk in zip(out.num_accepted, ks) if kk == k]
        assert max(accepted) <= k
    bonus = torch.tensor([t[3] for t, n in zip(out.token_ids, out.num_accepted) if n == 3])
    assert_fits(bonus, p[3], "the bonus token after 3 accepted drafts")


def test_per_request_generators_follow_p():
    p, q = CASES["q nearly one-hot on a token p dislikes"]
    num = 8_000
    drafts = torch.multinomial(q, num, replacement=True).T
    batch = repeated_batch(p, q, drafts, [torch.Generator().manual_seed(seed) for seed in range(num)])
    out = RejectionSampler()(batch)
    assert_fits(torch.tensor([t[0] for t in out.token_ids]), p[0], "first token vs p_0 (own generators)")


def test_float32_inputs_follow_p():
    p, q = CASES["p truncated by top-k and top-p, q full"]
    tokens, _ = run(p.float(), q.float())
    assert_fits(tokens[:, 0], p[0], "first token vs p_0 (float32)")


# -- the tests themselves: correct chi-square values, and enough power to catch bugs --------


@pytest.mark.parametrize(
    "stat,dof", [(3.841, 1), (5.991, 2), (7.815, 3), (9.488, 4), (11.070, 5), (12.592, 6), (14.067, 7)]
)
def test_chi_square_sf_at_tabulated_5_percent_points(stat, dof):
    assert chi_square_sf(stat, dof) == pytest.approx(0.05, abs=2e-4)


def test_chi_square_sf_at_tabulated_1e4_points():
    assert chi_square_sf(15.137, 1) == pytest.approx(1e-4, rel=2e-3)
    assert chi_square_sf(25.745, 5) == pytest.approx(1e-4, rel=2e-3)
    assert chi_square_sf(27.856, 6) == pytest.approx(1e-4, rel=2e-3)


class RecoversFromP(RejectionSampler):
    """A plausible bug: after a rejection, sample from p instead of max(p - q, 0)."""

    @staticmethod
    def _recover_or_bonus(batch, rows, rejected_drafts, is_rejected, noise):
        return (batch.target_probs[rows] / noise).argmax(dim=-1)


def test_recovering_from_p_is_caught():
    p, q = CASES["q is zero where p is not"]
    tokens, _ = run(p, q, sampler=RecoversFromP())
    assert goodness_of_fit(tokens[:, 0], p[0]) < SIGNIFICANCE


def test_drafts_not_drawn_from_the_stated_q_are_caught():
    p, q = CASES["q is zero where p is not"]
    drafts = torch.multinomial(q, NUM_TRIALS, replacement=True).T
    stated_q = torch.full_like(q, 1 / VOCAB)
    batch = repeated_batch(p, stated_q, drafts)
    first = torch.tensor([t[0] for t in RejectionSampler()(batch).token_ids])
    assert goodness_of_fit(first, p[0]) < SIGNIFICANCE
