"""Multi-turn conversations: each turn's prompt is the whole conversation so far.

A conversation arrives (by the arrival process), then its turns run one after another:
turn k is sent when the reply to turn k-1 has ended (plus an optional think time), with
the previous prompt, that reply's token ids and `turn_len` new tokens. Later turns find
the earlier ones in the prefix cache, so the cached-token ratio grows with the turn
number; the group is the turn number ("turn-1", "turn-2", ...).
"""

from __future__ import annotations

from typing import Any

from ..errors import BenchInputError
from ..lengths import LengthDistribution
from .base import Session, Turn, Workload, random_token_ids


class MultiTurnWorkload(Workload):
    name = "multi-turn"

    def __init__(
        self,
        num_turns: int,
        first_turn_len: LengthDistribution,
        turn_len: LengthDistribution,
        output_len: LengthDistribution,
        think_time_s: float = 0.0,
    ) -> None:
        super().__init__()
        if num_turns < 1:
            raise BenchInputError(f"multi-turn workload: turns must be >= 1, got {num_turns}")
        if think_time_s < 0:
            raise BenchInputError(f"multi-turn workload: think time must be >= 0, got {think_time_s}")
        self.num_turns = num_turns
        self.first_turn_len = first_turn_len
        self.turn_len = turn_len
        self.output_len = output_len
        self.think_time_s = think_time_s

    @property
    def needs_reply_token_ids(self) -> bool:
        return self.num_turns > 1

    def session(self, seed: int, run: int, index: int) -> Session:
        shape, tokens = self._session_rngs(seed, run, index)
        turns = []
        for k in range(self.num_turns):
            length = (self.first_turn_len if k == 0 else self.turn_len).sample(shape)
            new_ids = random_token_ids(tokens, length, self.vocab_size)
            turns.append(Turn(self.output_len.sample(shape), new_token_ids=new_ids, group=f"turn-{k + 1}"))
        return Session("conversation", turns, self.think_time_s)

    def max_context_tokens(self) -> int:
        return (
            self.first_turn_len.high + (self.num_turns - 1) * self.turn_len.high + self.num_turns * self.output_len.high
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_turns": self.num_turns,
            "first_turn_len": self.first_turn_len.spec(),
            "turn_len": self.turn_len.spec(),
            "output_len": self.output_len.spec(),
            "think_time_s": self.think_time_s,
        }
