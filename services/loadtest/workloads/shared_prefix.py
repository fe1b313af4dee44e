"""Shared-prefix prompts: G groups, each a fixed prefix (a system prompt), plus a unique suffix.

    prompt = prefix[g] + random suffix,   g drawn by popularity:
        uniform   every group equally likely
        zipf:S    P(g) proportional to 1 / (g + 1)^S (S = 1 when omitted): a few hot prefixes

This is the workload a prefix-aware router is for: requests of one group share the prefix's
KV blocks, so sending them where the prefix is cached saves its prefill. The group name
("prefix-007") is the workload group. Each run of a sweep has its own prefixes (same lengths,
other tokens), so each run starts with prefixes the server has not seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import seeding
from ..errors import BenchInputError
from ..lengths import LengthDistribution
from .base import Session, Turn, Workload, random_token_ids


def popularity_weights(num_groups: int, popularity: str) -> list[float]:
    """Group probabilities for "uniform" or "zipf[:S]"."""
    if popularity == "uniform":
        return [1.0 / num_groups] * num_groups
    kind, _, exponent = popularity.partition(":")
    if kind != "zipf":
        raise BenchInputError(f"popularity {popularity!r}: expected uniform or zipf[:S]")
    try:
        s = float(exponent) if exponent else 1.0
    except ValueError as e:
        raise BenchInputError(f"popularity {popularity!r}: exponent {exponent!r} is not a number") from e
    if s < 0:
        raise BenchInputError(f"popularity {popularity!r}: exponent must be >= 0")
    raw = 1.0 / np.arange(1, num_groups + 1, dtype=np.float64) ** s
    return (raw / raw.sum()).tolist()


class SharedPrefixWorkload(Workload):
    name = "shared-prefix"

    def __init__(
        self,
        num_groups: int,
        prefix_len: LengthDistribution,
        suffix_len: LengthDistribution,
        output_len: LengthDistribution,
        popularity: str = "uniform",
    ) -> None:
        super().__init__()
        if num_groups < 1:
            raise BenchInputError(f"shared-prefix workload: num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups
        self.prefix_len = prefix_len
        self.suffix_len = suffix_len
        self.output_len = output_len
        self.popularity = popularity
        self._weights = popularity_weights(num_groups, popularity)
        self._prefixes: dict[tuple[int, int], list[list[int]]] = {}  # (seed, run) -> prefix per group

    def prefixes(self, seed: int, run: int) -> list[list[int]]:
        key = (seed, run)
        if key not in self._prefixes:
            shape, tokens = seeding.rng(seed, seeding.PREFIX_SHAPES), seeding.rng(seed, seeding.PREFIX_TOKENS, run)
            lengths = [self.prefix_len.sample(shape) for _ in range(self.num_groups)]
            self._prefixes[key] = [random_token_ids(tokens, n, self.vocab_size) for n in lengths]
        return self._prefixes[key]

    def session(self, seed: int, run: int, index: int) -> Session:
        shape, tokens = self._session_rngs(seed, run, index)
        group = int(shape.choice(self.num_groups, p=self._weights))
        suffix_len, output_len = self.suffix_len.sample(shape), self.output_len.sample(shape)
        suffix = random_token_ids(tokens, suffix_len, self.vocab_size)
        turn = Turn(output_len, new_token_ids=self.prefixes(seed, run)[group] + suffix)
        return Session(f"prefix-{group:03d}", [turn])

    def max_context_tokens(self) -> int:
        return self.prefix_len.high + self.suffix_len.high + self.output_len.high

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_groups": self.num_groups,
            "prefix_len": self.prefix_len.spec(),
            "suffix_len": self.suffix_len.spec(),
            "output_len": self.output_len.spec(),
            "popularity": self.popularity,
        }
