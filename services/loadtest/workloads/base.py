"""The workload seam: a workload turns (seed, run, index) into a session of turns.

A session is one conversation: single-turn workloads make one turn per session; a
multi-turn session's prompts grow, each being the previous prompt, the model's reply to it
(the token ids the server streamed back) and the new turn's tokens:

    turn 0 prompt:  [new_0]
    turn 1 prompt:  [new_0][reply_0][new_1]
    turn 2 prompt:  [new_0][reply_0][new_1][reply_1][new_2]

`session()` is a pure function of its arguments, so a run is reproducible and request i is
the same whether the run is bounded by count or by duration. `prepare()` runs once, before
any load, with what the server told the harness (vocabulary, context length, a token
counter); it raises `BenchInputError` when the workload cannot fit the server.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import seeding
from ..errors import BenchInputError

# (texts, add_special_tokens) -> token counts; the server's tokenizer or a local one
TokenCounter = Callable[[list[str], bool], Awaitable[list[int]]]


@dataclass(slots=True)
class Turn:
    max_tokens: int  # output tokens asked for (exact when the server ignores EOS)
    new_token_ids: list[int] | None = None  # appended to the conversation (token-id prompts)
    text: str | None = None  # a text prompt (single-turn sessions only)
    num_text_tokens: int | None = None  # the text prompt's length, when counted
    group: str = ""  # overrides the session's group for this turn (e.g. "turn-2")


@dataclass(slots=True)
class Session:
    group: str  # reported per group: request class, prefix group, turn number ...
    turns: list[Turn]
    think_time_s: float = 0.0  # pause between a reply and the next turn

    def __post_init__(self) -> None:
        if len(self.turns) > 1 and any(t.text is not None for t in self.turns):
            raise ValueError("text prompts are single-turn; multi-turn sessions use token ids")


@dataclass(slots=True)
class WorkloadContext:
    """What the server told the harness before the load."""

    vocab_size: int  # token ids are drawn from [0, vocab_size)
    max_context_length: int | None  # prompt + output limit; None: unknown
    count_tokens: TokenCounter | None  # None: no tokenizer available
    seed: int = 0  # the benchmark's seed
    num_runs: int = 1  # runs in the sweep (each wants its own sessions)


class Workload(ABC):
    name: str = ""

    def __init__(self) -> None:
        self.vocab_size = 0  # set by prepare(): token ids are drawn below it

    @property
    def uses_token_ids(self) -> bool:
        """Whether prompts are token ids (else text)."""
        return True

    @property
    def needs_reply_token_ids(self) -> bool:
        """Whether later turns need the token ids of earlier replies."""
        return False

    async def prepare(self, context: WorkloadContext, num_sessions: int) -> None:
        """Checks the workload against the server and loads what it needs, expecting about
        `num_sessions` sessions per run. Raises BenchInputError."""
        self._check_fits(context)
        self.vocab_size = context.vocab_size

    @abstractmethod
    def session(self, seed: int, run: int, index: int) -> Session:
        """Session `index` of run `run`; the same arguments give the same session."""

    @abstractmethod
    def max_context_tokens(self) -> int:
        """The longest prompt + output any session can reach (for the context check)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The workload's parameters, recorded in the result file."""

    def _session_rngs(self, seed: int, run: int, index: int) -> tuple[np.random.Generator, np.random.Generator]:
        """Session `index`'s generators: for its shape (the same in every run of a sweep) and
        for its token ids (the run's own; see seeding.py)."""
        assert self.vocab_size > 0, "prepare() first"
        return seeding.rng(seed, seeding.SHAPES, index), seeding.rng(seed, seeding.TOKENS, run, index)

    def _check_fits(self, context: WorkloadContext) -> None:
        limit = context.max_context_length
        if limit is not None and self.max_context_tokens() > limit:
            raise BenchInputError(
                f"{self.name} workload: a request can reach {self.max_context_tokens()} tokens (prompt + output), "
                f"over the server's context length {limit}; shorten the lengths"
            )


def random_token_ids(rng, num: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=num).tolist()
