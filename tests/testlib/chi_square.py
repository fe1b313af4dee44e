"""Pearson's chi-square tests for the sampling tests (scipy is not a dependency)."""

from __future__ import annotations

import math

import torch


def chi_square_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the closed forms for even and odd dof."""
    half = stat / 2
    if dof % 2 == 0:
        term = total = math.exp(-half)
        for i in range(1, dof // 2):
            term *= half / i
            total += term
        return total
    total = math.erfc(math.sqrt(half))
    term = math.exp(-half) * math.sqrt(half) * 2 / math.sqrt(math.pi)  # e^-h h^(1/2) / Gamma(3/2)
    for i in range(1, (dof + 1) // 2):
        total += term
        term *= half / (i + 0.5)
    return total


def homogeneity_p_value(counts_a: torch.Tensor, counts_b: torch.Tensor, min_expected: float = 5.0) -> float:
    """The p-value that two samples' category counts come from one distribution (the 2 x C
    contingency table's chi-square). Categories expecting fewer than `min_expected` in
    either sample are pooled into one."""
    a, b = counts_a.double(), counts_b.double()
    n_a, n_b = a.sum(), b.sum()
    total = a + b
    exp_a, exp_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
    small = (exp_a < min_expected) | (exp_b < min_expected)
    if small.any():
        a = torch.cat([a[~small], a[small].sum()[None]])
        b = torch.cat([b[~small], b[small].sum()[None]])
        exp_a = torch.cat([exp_a[~small], exp_a[small].sum()[None]])
        exp_b = torch.cat([exp_b[~small], exp_b[small].sum()[None]])
    keep = (exp_a > 0) & (exp_b > 0)
    a, b, exp_a, exp_b = a[keep], b[keep], exp_a[keep], exp_b[keep]
    if a.numel() < 2:
        return 1.0
    stat = (((a - exp_a) ** 2 / exp_a) + ((b - exp_b) ** 2 / exp_b)).sum().item()
    return chi_square_sf(stat, a.numel() - 1)


def assert_same_token_frequencies(want, got, vocab_size: int, num_positions: int, alpha: float = 1e-4) -> None:
    """Per output position, the tokens of two runs' outputs (RequestOutputs of the same
    seeded requests) pass a 2 x C homogeneity test at p > alpha."""
    for position in range(num_positions):
        counts_want = torch.bincount(torch.tensor([o.token_ids[position] for o in want]), minlength=vocab_size)
        counts_got = torch.bincount(torch.tensor([o.token_ids[position] for o in got]), minlength=vocab_size)
        assert homogeneity_p_value(counts_want, counts_got) > alpha, f"position {position}"
