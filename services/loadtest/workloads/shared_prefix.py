"""Shared-prefix prompts: G groups, each a fixed prefix (a system prompt), plus a unique suffix.

    prompt = prefix[g] + random suffix,   g drawn by popularity:
        uniform   every group equally likely
        zipf:S    P(g) proportional to 1 / (g + 1)^S (S = 1 when omitted): a few hot prefixes

This is the workload a prefix-aware router is for: requests of one group share the prefix's
KV blocks, so sending them where the prefix is cached saves its prefill. The group name
("prefix-007") is the workload group. Prefixes are drawn per run of a sweep, so each run
starts with prefixes the server has not seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import seeding
from ..errors import BenchInputError
from ..lengths import LengthDistribution
from .base import Session, Turn, Workload, WorkloadContext, random_token_ids


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
        if num_groups < 1:
            raise BenchInputError(f"shared-prefix workload: num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups
        self.prefix_len = prefix_len
        self.suffix_len = suffix_len
        self.output_len = output_len
        self.popularity = popularity
        self._weights = popularity_weights(num_groups, popularity)
        self._prefixes: dict[tuple[int, int], list[list[int]]] = {}  # (seed, run) -> prefix per group
        self._vocab_size = 0

    async def prepare(self, context: WorkloadContext, num_sessions: int) -> None:
        self._check_fits(context)
        self._vocab_size = context.vocab_size

    def prefixes(self, seed: int, run: int) -> list[list[int]]:
        key = (seed, run)
        if key not in self._prefixes:
            rng = seeding.rng(seed, seeding.PREFIXES, run)
            self._prefixes[key] = [
                random_token_ids(rng, self.prefix_len.sample(rng), self._vocab_size) for _ in range(self.num_groups)
            ]
        return self._prefixes[key]

    def session(self, seed: int, run: int, index: int) -> Session:
        assert self._vocab_size > 0, "prepare() first"
        rng = seeding.rng(seed, seeding.WORKLOAD, run, index)
        group = int(rng.choice(self.num_groups, p=self._weights))
        suffix = random_token_ids(rng, self.suffix_len.sample(rng), self._vocab_size)
        turn = Turn(self.output_len.sample(rng), new_token_ids=self.prefixes(seed, run)[group] + suffix)
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
