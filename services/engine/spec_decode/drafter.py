"""The seam between the Speculator and a drafter with a model: a draft model
(draft_proposer.py), Medusa heads (medusa_proposer.py) or an EAGLE drafter (eagle_proposer.py).
The n-gram lookup needs none of this and stays inside the Speculator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from ..core.request import Request
from ..core.scheduler_output import HiddenRows
from .draft_blocks import DraftBlockPool


class NoKVCache:
    """The `runner` of a drafter without a KV cache (Medusa heads): sleep has nothing to free."""

    kv_cache_bytes = 0

    def release_kv_cache(self) -> None:
        pass

    def restore_kv_cache(self) -> None:
        pass


class Drafter(ABC):
    """Holds, per request, what the drafter keeps between steps (`_states`), its own KV blocks
    (`pool`, None: it has none) and what holds its KV cache (`runner`: release_kv_cache,
    restore_kv_cache, kv_cache_bytes), which sleep, wake-up and the engine's stats read."""

    def __init__(self, pool: DraftBlockPool | None, runner: Any) -> None:
        self.pool = pool
        self.runner = runner
        self._states: dict[str, Any] = {}
        self._probs: dict[str, torch.Tensor] = {}  # [k, V] q of the last drafts, random requests only

    @abstractmethod
    def propose(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Drafts for each request, at most its room ([]: none this step); sets `_probs`."""

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """[num_drafts, V] q of the request's first drafts (None: greedy, one-hot q)."""
        probs = self._probs.get(request_id)
        return None if probs is None else probs[:num_drafts]

    def retain(self, request_ids: set[str]) -> None:
        """Forgets every request not in `request_ids`, and frees its blocks."""
        for request_id in [r for r in self._states if r not in request_ids]:
            del self._states[request_id]
            if self.pool is not None:
                self.pool.free(request_id)

    def take_hidden_states(self, hidden_states: dict[str, HiddenRows]) -> None:  # noqa: B027 - optional
        """The target's hidden states from the step just run (heads draft from them)."""

    def check_integrity(self) -> None:
        """The drafter's own blocks add up, and only requests it knows hold any."""
        if self.pool is not None:
            self.pool.check_integrity()
            assert set(self.pool.request_ids()) <= set(self._states), "drafter blocks held by a request without state"
