"""A replica whose heartbeat lapsed is fenced off by the gateway's request router (`_fence`,
router/serve_request_router.py) and counted once in baton_replicas_fenced_total{role}; back
in the ranking it is placed again, and a second lapse counts again. A replica the router has
never seen registered is not fenced (it may be starting).

Real Redis and real worker agents (one stopped without deregistering: its heartbeat lapses
as a hung or crashed worker's does), the router driven as Serve's handle does
(testlib/serve_router.py); the counter is Ray's metric object, its increments recorded."""

from __future__ import annotations

import pytest
from baton.services import metrics
from baton.services.roles import Role
from ray.serve._private.common import DeploymentID, ReplicaID
from testlib.serve_router import Candidate, choose, pending, serve_router, wait_ranked


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


async def _choose(router, candidates: list[Candidate], n: int) -> list[list[str]]:
    return await choose(router, candidates, pending(n))


async def test_a_lapsed_heartbeat_is_fenced_and_counted_once_per_lapse(config, fenced_counts, workers):
    replicas = {name: ReplicaID(name, DeploymentID("decode", "baton")) for name in ("a", "b", "new")}
    candidates = [Candidate(replica_id) for replica_id in replicas.values()]
    address = {name: replica_id.to_full_id_str() for name, replica_id in replicas.items()}
    workers.start(config, "a", Role.DECODE, address=address["a"])
    hung, _ = workers.start(config, "b", Role.DECODE, address=address["b"])
    wait_ranked(config, 2)
    router = serve_router(config)

    groups = await _choose(router, candidates, 0)
    assert sorted(g[0] for g in groups[:2]) == ["a", "b"] and groups[2] == ["new"]  # never registered: last
    assert fenced_counts == []

    hung.close(deregister=False)  # it stops heartbeating, as a hung or crashed worker does
    wait_ranked(config, 1)
    assert await _choose(router, candidates, 1) == [["a"], ["new"]]  # b fenced off
    assert await _choose(router, candidates, 2) == [["a"], ["new"]]
    assert fenced_counts == [{"role": "decode"}]  # counted once for the lapse, not per call

    workers.start(config, "b", Role.DECODE, address=address["b"])  # back (its replacement, same slot)
    wait_ranked(config, 2)
    groups = await _choose(router, candidates, 3)
    assert sorted(g[0] for g in groups[:2]) == ["a", "b"]
    assert fenced_counts == [{"role": "decode"}]

    workers.running[-1][0].close(deregister=False)
    wait_ranked(config, 1)
    assert await _choose(router, candidates, 4) == [["a"], ["new"]]
    assert fenced_counts == [{"role": "decode"}] * 2  # a second lapse is a second fencing


async def test_with_no_other_replica_nothing_is_fenced(config, fenced_counts, workers):
    replica_id = ReplicaID("only", DeploymentID("decode", "baton"))
    agent, _ = workers.start(config, "only", Role.DECODE, address=replica_id.to_full_id_str())
    wait_ranked(config, 1)
    router = serve_router(config)
    assert await _choose(router, [Candidate(replica_id)], 0) == [["only"]]
    agent.close(deregister=False)
    wait_ranked(config, 0)
    # Fencing the last replica would leave the call nowhere to go: it is tried, not counted.
    assert await _choose(router, [Candidate(replica_id)], 1) == [["only"]]
    assert fenced_counts == []
