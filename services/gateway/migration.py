"""Request migration: a stream whose worker is lost goes on, from another worker.

    inner.stream(call) ---- outputs ----> client
           | the worker's process dies (RayActorError & co) with k tokens streamed
           v
    k == 0                       the same call again: another replica prefills it (a prefill
                                 replica lost before the first token, or a colocated one)
    k > 0, one sample            inner.resume(call, those k tokens): a live decode (or
                                 colocated) replica recomputes prompt + k tokens and continues
                                 (engine/api/handover.py `Handover.resume`); max_tokens,
                                 min_tokens, penalties, stop strings and the grammar count the
                                 k tokens, so the client sees one unbroken stream
    k > 0, n > 1 or beam search  fails (UNAVAILABLE, "retrying may succeed"): the samples'
                                 states (beams, per-sample seeds) are not rebuilt elsewhere

A greedy request's migrated output equals the undisturbed one token for token. A seeded
sampling request continues from a fresh generator seeded with the same seed, so it stays
reproducible for a given migration point but differs from the undisturbed run after it.
Each request migrates at most `max_migrations` times; then the loss reaches the client.
Usage keeps the first worker's prompt-cache hit: that is the prefill that counted.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from ..engine.api.handover import can_disaggregate
from ..engine.api.outputs import RequestOutput
from ..serving_errors import is_worker_lost
from ..worker_calls import GenerateCall, WorkerModelInfo
from .engine_client import EngineClient, PlacementTrace

logger = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 3


class MigratingClient(EngineClient):
    """Wraps the deployment's client (colocated or disaggregated) with migration."""

    def __init__(
        self,
        inner: EngineClient,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        on_migration: Callable[[str, str], None] | None = None,
    ) -> None:
        self.inner = inner
        self.max_migrations = max_migrations
        # Metrics: (the lost worker's role, "migrated" (resumed with its tokens) | "retried" (lost
        # before any token: sent again) | "refused" (n > 1, beam search) | "failed" (over the
        # limit)). Lost before any token, the role is the first (prefill, or colocated); after
        # them, the last (decode).
        self.on_migration = on_migration

    async def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        streamed: list[int] = []  # every token the client has been sent (one sample: in order)
        num_cached: int | None = None
        num_migrations = 0
        outputs = self.inner.stream(call, trace)
        while True:
            try:
                async with aclosing(outputs):
                    async for output in outputs:
                        if num_cached is None and output.outputs:
                            num_cached = output.num_cached_tokens
                        elif num_cached is not None:
                            output.num_cached_tokens = num_cached
                        for completion in output.outputs:
                            streamed.extend(completion.token_ids)
                        yield output
                return
            except Exception as error:
                if not is_worker_lost(error):
                    raise
                lost_role = self.inner.roles[-1] if streamed else self.inner.roles[0]
                if streamed and not can_disaggregate(call.params):
                    self._record(lost_role, "refused")
                    raise
                if num_migrations >= self.max_migrations:
                    self._record(lost_role, "failed")
                    raise
                num_migrations += 1
                how = "resumed" if streamed else "retried"
                self._record(lost_role, "migrated" if streamed else "retried")
                logger.warning(
                    "request %s lost its %s worker after %d tokens; %s elsewhere (migration %d of at most %d)",
                    call.request_id,
                    lost_role,
                    len(streamed),
                    how,
                    num_migrations,
                    self.max_migrations,
                )
                if streamed:
                    outputs = self.inner.resume(call, list(streamed), trace)
                else:
                    outputs = self.inner.stream(call, trace)

    def resume(self, call: GenerateCall, token_ids: list[int], trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        return self.inner.resume(call, token_ids, trace)

    async def model_info(self) -> WorkerModelInfo:
        return await self.inner.model_info()

    async def is_healthy(self) -> bool:
        return await self.inner.is_healthy()

    @property
    def roles(self) -> list[str]:
        return self.inner.roles

    def _record(self, role: str, outcome: str) -> None:
        if self.on_migration is not None:
            self.on_migration(role, outcome)
