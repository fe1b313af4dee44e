"""Baton's Serve request router driven directly, on a real Redis, without Serve's handle.

The candidates are what the router reads of Serve's RunningReplica, its replica id (a
RunningReplica fetches its actor's handle when built, so it needs a running Ray)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.router import PrefixRouter, RouterConfig
from baton.services.router.serve_request_router import BatonRequestRouter
from baton.services.worker_calls import GenerateCall
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest


@dataclass(frozen=True)
class Candidate:
    replica_id: ReplicaID


def candidates(role: str, *names: str) -> list[Candidate]:
    return [Candidate(ReplicaID(name, DeploymentID(role, "baton"))) for name in names]


def serve_router(config: RouterConfig, role: str = "decode") -> BatonRequestRouter:
    router = BatonRequestRouter(DeploymentID(role, "baton"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(config.model_dump(mode="json"), role)
    return router


def pending(n: int, prompt: Sequence[int] = (1, 2, 3, 4, 5)) -> PendingRequest:
    call = GenerateCall(f"r{n}", list(prompt), SamplingParams(max_tokens=4))
    return PendingRequest([call], {}, RequestMetadata(f"r{n}", f"internal-{n}"))


async def choose(router: BatonRequestRouter, replicas: list[Candidate], request: PendingRequest) -> list[list[str]]:
    """The ranked groups, as replica names."""
    groups = await router.choose_replicas(replicas, request)
    return [[c.replica_id.unique_id for c in group] for group in groups]


def wait_ranked(config: RouterConfig, count: int, role: str = "decode", timeout_s: float = 10.0) -> None:
    router = PrefixRouter.from_config(config)
    deadline = time.monotonic() + timeout_s
    while len(rank(router, role).ranked) != count:
        assert time.monotonic() < deadline, f"not {count} {role} workers ranked"
        time.sleep(0.05)


def rank(router: PrefixRouter, role: str, prompt: Sequence[int] = tuple(range(8))):
    """A probe: the ranking as it stands, recording nothing."""
    if role == "decode":
        return router.route_decode("probe", len(prompt), record=False)
    hashes = router.hasher.block_hashes(prompt)
    return router.route_prefill_hashes("probe", len(prompt), hashes, record=False)
