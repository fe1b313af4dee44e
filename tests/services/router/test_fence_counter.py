"""A replica whose heartbeat lapsed is fenced off by the gateway's request router (`_fence`,
router/serve_request_router.py) and counted once in baton_replicas_fenced_total{role}; back
in the ranking it is placed again, and a second lapse counts again. A replica the router has
never seen registered is not fenced (it may be starting).

Real Redis and real worker agents (one stopped without deregistering: its heartbeat lapses
as a hung or crashed worker's does). The candidates are what the router reads of Serve's
RunningReplica, its replica id (a RunningReplica fetches its actor's handle when built, so it
needs a running Ray); the counter is Ray's metric object, its increments recorded."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from baton.services import metrics
from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.roles import Role
from baton.services.router import PrefixRouter
from baton.services.router.serve_request_router import BatonRequestRouter
from baton.services.worker_calls import GenerateCall
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest


@dataclass(frozen=True)
class Candidate:
    replica_id: ReplicaID


@pytest.fixture
def fenced_counts(monkeypatch) -> list[dict]:
    """The tags of every increment of baton_replicas_fenced_total."""
    counter, counts = metrics._metrics()["fenced"], []
    inc = counter.inc

    def recorded(value=1.0, tags=None):
        counts.append(dict(tags or {}))
        inc(value, tags)

    monkeypatch.setattr(counter, "inc", recorded)
    return counts


def _router(config) -> BatonRequestRouter:
    router = BatonRequestRouter(DeploymentID("decode", "baton"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(config.model_dump(mode="json"), "decode")
    return router


async def _choose(router: BatonRequestRouter, candidates: list[Candidate], n: int) -> list[list[str]]:
    call = GenerateCall(f"r{n}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    pending = PendingRequest([call], {}, RequestMetadata(f"r{n}", f"internal-{n}"))
    groups = await router.choose_replicas(candidates, pending)
    return [[c.replica_id.unique_id for c in group] for group in groups]


def _wait_ranked(config, count: int, timeout_s: float = 10.0) -> None:
    router = PrefixRouter.from_config(config)
    deadline = time.monotonic() + timeout_s
    while len(router.route_decode("probe", 8, record=False).ranked) != count:
        assert time.monotonic() < deadline, f"not {count} workers ranked"
        time.sleep(0.05)


async def test_a_lapsed_heartbeat_is_fenced_and_counted_once_per_lapse(config, fenced_counts, workers):
    replicas = {name: ReplicaID(name, DeploymentID("decode", "baton")) for name in ("a", "b", "new")}
    candidates = [Candidate(replica_id) for replica_id in replicas.values()]
    address = {name: replica_id.to_full_id_str() for name, replica_id in replicas.items()}
    workers.start(config, "a", Role.DECODE, address=address["a"])
    hung, _ = workers.start(config, "b", Role.DECODE, address=address["b"])
    _wait_ranked(config, 2)
    router = _router(config)

    groups = await _choose(router, candidates, 0)
    assert sorted(g[0] for g in groups[:2]) == ["a", "b"] and groups[2] == ["new"]  # never registered: last
    assert fenced_counts == []

    hung.close(deregister=False)  # it stops heartbeating, as a hung or crashed worker does
    _wait_ranked(config, 1)
    assert await _choose(router, candidates, 1) == [["a"], ["new"]]  # b fenced off
    assert await _choose(router, candidates, 2) == [["a"], ["new"]]
    assert fenced_counts == [{"role": "decode"}]  # counted once for the lapse, not per call

    workers.start(config, "b", Role.DECODE, address=address["b"])  # back (its replacement, same slot)
    _wait_ranked(config, 2)
    groups = await _choose(router, candidates, 3)
    assert sorted(g[0] for g in groups[:2]) == ["a", "b"]
    assert fenced_counts == [{"role": "decode"}]

    workers.running[-1][0].close(deregister=False)
    _wait_ranked(config, 1)
    assert await _choose(router, candidates, 4) == [["a"], ["new"]]
    assert fenced_counts == [{"role": "decode"}] * 2  # a second lapse is a second fencing


async def test_with_no_other_replica_nothing_is_fenced(config, fenced_counts, workers):
    replica_id = ReplicaID("only", DeploymentID("decode", "baton"))
    agent, _ = workers.start(config, "only", Role.DECODE, address=replica_id.to_full_id_str())
    _wait_ranked(config, 1)
    router = _router(config)
    assert await _choose(router, [Candidate(replica_id)], 0) == [["only"]]
    agent.close(deregister=False)
    _wait_ranked(config, 0)
    # Fencing the last replica would leave the call nowhere to go: it is tried, not counted.
    assert await _choose(router, [Candidate(replica_id)], 1) == [["only"]]
    assert fenced_counts == []
