"""One engine request's grammar state: the matcher that has accepted its output so far.

It is rebuilt from tokens, never shipped: a decode worker replays the tokens the prefill
worker handed over; a preempted request keeps its matcher (recomputing the prompt samples
nothing new); each of n samples has its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .bitmask import bitmask_width


class RequestGrammar:
    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.bitmask = torch.zeros((1, bitmask_width(vocab_size)), dtype=torch.int32)

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def accept_all(self, token_ids: Sequence[int]) -> bool:
        return all(self.accept(t) for t in token_ids)

    @property
    def is_terminated(self) -> bool:
        """The output is complete: the grammar has accepted its end (a stop token)."""
        return self._matcher.is_terminated()

    def fill_bitmask(self) -> torch.Tensor:
        """This request's row of allowed next tokens (reused: the step reads it at once)."""
        self._matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask
