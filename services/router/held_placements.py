"""Placements a router ranked and has not committed yet, counted in its next rankings.

Inside Serve a placement is committed (recorded in Redis) only once the replica accepted
the call (`BatonRequestRouter.on_request_routed`), a replica round trip after the ranking.
A burst of calls ranks in that gap: without these holds every one of them sees the same
loads and the same first worker, and the burst lands on one replica. A held placement
counts on its worker as a committed one does in Redis (one more request, its new tokens
queued and their KV blocks taken, and with `credit_prefix` the prompt's blocks as cached
there, as the index's speculative entries do) until it is committed or released, or
`ttl_s` at most (a call that Serve dropped before sending has no callback to release it).

Holds are this router's own: routers in other processes see a placement once it is
committed, as before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..engine.core.block_hash import BlockHash
from .policy import RankedWorker
from .prefix_index import WorkerView


@dataclass(frozen=True, slots=True)
class _Held:
    worker_id: str
    num_new_tokens: int
    block_hashes: tuple[BlockHash, ...]
    expires_at: float


class HeldPlacements:
    def __init__(self, ttl_s: float, credit_prefix: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.credit_prefix = credit_prefix
        self._clock = clock
        self._held: dict[str, _Held] = {}  # key (the caller's request id) -> its placement

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key: str, worker: RankedWorker, block_hashes: Sequence[BlockHash] = ()) -> None:
        """Holds `worker` for `key`, replacing what `key` held (a call ranked again)."""
        self._held[key] = _Held(
            worker.worker_id, worker.num_new_tokens, tuple(block_hashes), self._clock() + self.ttl_s
        )

    def release(self, key: str) -> None:
        self._held.pop(key, None)

    def apply(self, views: list[WorkerView], block_hashes: Sequence[BlockHash] = ()) -> list[WorkerView]:
        """`views` (one index query) with the held placements added to their workers."""
        self._expire()
        if not self._held:
            return views
        by_worker: dict[str, list[_Held]] = {}
        for held in self._held.values():
            by_worker.setdefault(held.worker_id, []).append(held)
        applied = []
        for view in views:
            held = by_worker.get(view.worker_id)
            if held is None:
                applied.append(view)
                continue
            cached = max(_common_prefix(h.block_hashes, block_hashes) for h in held) if self.credit_prefix else 0
            applied.append(
                dataclasses.replace(
                    view,
                    num_cached_blocks=max(view.num_cached_blocks, cached),
                    num_pending_requests=view.num_pending_requests + len(held),
                    num_pending_tokens=view.num_pending_tokens + sum(h.num_new_tokens for h in held),
                )
            )
        return applied

    def _expire(self) -> None:
        now = self._clock()
        for key in [key for key, held in self._held.items() if held.expires_at <= now]:
            del self._held[key]


def _common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """Leading blocks two prompts share (a block's hash chains its prefix's, so the first
    difference ends the shared prefix)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
