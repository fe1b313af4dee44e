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

    # -- speculative decoding: look ahead through drafts, then roll back ------------------

    def valid_drafts(self, draft_token_ids: Sequence[int]) -> list[int]:
        """The longest prefix of the drafts the grammar allows in order, up to and including
        a token that completes it; the matcher is left as it was."""
        valid: list[int] = []
        for token_id in draft_token_ids:
            if not self._matcher.accept_token(token_id):
                break
            valid.append(token_id)
            if self._matcher.is_terminated():
                break
        if valid:
            self._matcher.rollback(len(valid))
        return valid

    def fill_bitmasks(self, draft_token_ids: Sequence[int]) -> torch.Tensor:
        """[k + 1, words] allowed tokens at the next position and after each of the k drafts
        (which `valid_drafts` has checked); the matcher is left as it was. The row after a
        draft that completes the grammar allows everything: the request ends at that draft
        if it is accepted, so nothing sampled there is kept."""
        masks = torch.zeros((len(draft_token_ids) + 1, self.bitmask.shape[1]), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(masks, 0)
        accepted = 0
        for j, token_id in enumerate(draft_token_ids, start=1):
            if not self._matcher.accept_token(token_id):
                raise ValueError(f"draft token {token_id} at position {j - 1} is not allowed by the grammar")
            accepted += 1
            if self._matcher.is_terminated():
                masks[j] = -1  # every bit set
            else:
                self._matcher.fill_next_token_bitmask(masks, j)
        self._matcher.rollback(accepted)
        return masks
