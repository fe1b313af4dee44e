"""MigratingClient's rules, against a scripted EngineClient whose workers die on cue (the real
deaths, on a Ray cluster, are in tests/services/disaggregation/test_migration.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.outputs import CompletionOutput, RequestOutput
from baton.services.gateway.engine_client import EngineClient, PlacementTrace
from baton.services.gateway.migration import MigratingClient
from baton.services.serving_errors import is_worker_lost
from baton.services.worker_calls import GenerateCall
from ray.exceptions import ActorDiedError, RayTaskError

TOKENS = list(range(10, 20))


def output(token_ids: list[int], finished: bool, num_cached: int = 0) -> RequestOutput:
    completion = CompletionOutput(0, "", token_ids, None, "length" if finished else None)
    return RequestOutput("r", None, [1, 2, 3], [completion], finished, num_cached)


class DyingWorkers(EngineClient):
    """Streams TOKENS one per output; the k-th worker dies after `deaths[k]` tokens (None: it lives)."""

    def __init__(self, deaths: list[int | None]) -> None:
        self.deaths = deaths
        self.calls: list[tuple[str, list[int]]] = []  # ("stream" | "resume", the tokens it was given)

    def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        self.calls.append(("stream", []))
        return self._run(0)

    def resume(self, call: GenerateCall, token_ids: list[int], trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        self.calls.append(("resume", list(token_ids)))
        return self._run(len(token_ids))

    async def _run(self, start: int) -> AsyncIterator[RequestOutput]:
        dies_after = self.deaths[len(self.calls) - 1]
        for i in range(start, len(TOKENS)):
            if dies_after is not None and i - start == dies_after:
                raise ActorDiedError()
            yield output([TOKENS[i]], i == len(TOKENS) - 1, num_cached=100 + len(self.calls))

    async def model_info(self):
        raise NotImplementedError

    async def is_healthy(self) -> bool:
        return True

    @property
    def roles(self) -> list[str]:
        return ["prefill", "decode"]


def run(client: MigratingClient, params: SamplingParams | None = None) -> list[RequestOutput]:
    async def collect():
        call = GenerateCall("r", [1, 2, 3], params or SamplingParams(max_tokens=10))
        return [o async for o in client.stream(call, PlacementTrace())]

    return asyncio.run(collect())


def test_a_stream_continues_from_the_tokens_streamed():
    workers, recorded = DyingWorkers([3, 4, None]), []
    outputs = run(MigratingClient(workers, on_migration=lambda *a: recorded.append(a)))
    assert [t for o in outputs for t in o.token_ids] == TOKENS
    assert workers.calls == [("stream", []), ("resume", TOKENS[:3]), ("resume", TOKENS[:7])]
    assert {o.num_cached_tokens for o in outputs} == {101}  # the first prefill's hit is what counted
    assert recorded == [("decode", "migrated"), ("decode", "migrated")]


def test_a_call_lost_before_its_first_token_is_sent_again():
    workers, recorded = DyingWorkers([0, None]), []
    outputs = run(MigratingClient(workers, on_migration=lambda *a: recorded.append(a)))
    assert [t for o in outputs for t in o.token_ids] == TOKENS
    assert workers.calls == [("stream", []), ("stream", [])]
    assert recorded == [("prefill", "retried")]


def test_the_limit_ends_it():
    workers, recorded = DyingWorkers([2, 2, 2]), []
    with pytest.raises(ActorDiedError):
        run(MigratingClient(workers, max_migrations=2, on_migration=lambda *a: recorded.append(a)))
    assert len(workers.calls) == 3 and recorded[-1] == ("decode", "failed")


def test_several_samples_are_not_migrated_once_streamed():
    workers, recorded = DyingWorkers([2, None]), []
    with pytest.raises(ActorDiedError):
        run(MigratingClient(workers, on_migration=lambda *a: recorded.append(a)), SamplingParams(n=2, max_tokens=10))
    assert recorded == [("decode", "refused")]


def test_other_errors_are_not_migrations():
    class Refusing(DyingWorkers):
        async def _run(self, start):
            raise ValueError("bad")
            yield

    with pytest.raises(ValueError):
        run(MigratingClient(Refusing([None])))


def test_what_counts_as_a_lost_worker():
    assert is_worker_lost(ActorDiedError())
    assert is_worker_lost(RayTaskError("f", "tb", ActorDiedError()))
    assert not is_worker_lost(ValueError("no"))
