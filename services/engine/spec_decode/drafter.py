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
    # What sleep, wake-up and the engine's stats read: the drafter's own KV blocks (None: it
    # has none) and what holds its KV cache (release_kv_cache, restore_kv_cache, kv_cache_bytes).
    pool: DraftBlockPool | None
    runner: Any

    @abstractmethod
    def propose(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Drafts for each request, at most its room ([]: none this step)."""

    @abstractmethod
    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """[num_drafts, V] q of the request's last drafts (None: greedy, one-hot q)."""

    @abstractmethod
    def retain(self, request_ids: set[str]) -> None:
        """Forgets every request not in `request_ids` (and frees what it held)."""

    def take_hidden_states(self, hidden_states: dict[str, HiddenRows]) -> None:  # noqa: B027 - optional
        """The target's hidden states from the step just run (heads draft from them)."""

    def check_integrity(self) -> None:  # noqa: B027 - optional
        """Asserts the drafter's own block accounting adds up."""
