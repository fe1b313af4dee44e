"""The RL-rollout admin calls, applied to every engine replica of every role.

    update_weights_from_disk(path, version)   one replica first (the canary): a folder it
                                              refuses (another architecture, a wrong shape,
                                              a missing tensor) changes nothing anywhere,
                                              and the error is the client's (400). Then
                                              every other replica of every role, at once.
    pause_generation(mode) / continue_generation() / reset_prefix_cache() / sleep(level) /
    wake_up()                                 every replica, at once
    weight_versions()                         what each replica serves

An engine refuses a bad update before it writes anything (engine/weight_updates.py), so
the canary's refusal is the all-or-nothing case. A replica that fails after the canary
succeeded (its disk, its process) is named in the answer with its reason, beside the
version every other replica moved to: `WeightUpdateResult.failed`.

Each replica's engine applies an update between two steps. While replicas move one after
another, a prefill on one version can hand over to a decode on another; pause generation
around the update (as RL loops do) for outputs of one version only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..engine.errors import InvalidRequestError
from ..model.errors import ModelLoadError

DEFAULT_GROUP = "weight_update"  # a trainer group's name when the caller gives none


@dataclass(slots=True)
class WeightUpdateResult:
    weight_version: str  # what the updated replicas serve now
    updated: list[str] = field(default_factory=list)  # worker ids
    failed: dict[str, str] = field(default_factory=dict)  # worker id -> why

    @property
    def ok(self) -> bool:
        return not self.failed

    def add(self, outcomes: dict[str, Any]) -> None:
        """Replicas' outcomes (a version, or the exception a replica raised), by worker id."""
        for worker_id, outcome in outcomes.items():
            if isinstance(outcome, BaseException):
                self.failed[worker_id] = reason(outcome)
            else:
                self.updated.append(worker_id)


def reason(error: BaseException) -> str:
    """Why a replica failed, as its own exception says (Ray wraps it in RayTaskError)."""
    return str(getattr(error, "cause", None) or error)


class WeightAdmin:
    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles  # role -> the deployment's handle

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> WeightUpdateResult:
        roles = list(self.handles)
        canary_role = roles[-1]  # decode (or colocated): where a version mismatch would matter last
        try:
            canary_id, version = await self.handles[canary_role].update_weights_from_disk.remote(path, weight_version)
        except Exception as error:
            cause = getattr(error, "cause", None) or error
            if isinstance(cause, ModelLoadError | InvalidRequestError | FileNotFoundError | ValueError):
                raise InvalidRequestError("model_path", f"{cause}; no replica changed") from error
            raise
        result = WeightUpdateResult(version, [canary_id])
        for role in roles:
            outcomes = await self._broadcast(
                role, "update_weights_from_disk", path, version, skip_worker=canary_id if role == canary_role else None
            )
            result.add(outcomes)
        return result

    # -- from a trainer's torch.distributed group -------------------------------------

    async def weight_update_ranks(self) -> dict[str, int]:
        """worker id -> the group ranks it takes (its TP ranks): the trainer's group has
        1 + their sum ranks, the trainer being rank 0."""
        ranks: dict[str, int] = {}
        for role in self.handles:
            for worker_id, outcome in (await self._broadcast(role, "weight_update_ranks")).items():
                if isinstance(outcome, BaseException):
                    raise RuntimeError(f"replica {worker_id} did not answer: {outcome}")
                ranks[worker_id] = outcome
        return ranks

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        rank_offset: int = 1,
    ) -> dict[str, int]:
        """Every replica joins the trainer's group, replica after replica from `rank_offset`
        (in worker-id order); returns each one's offset. The trainer joins meanwhile."""
        ranks = await self.weight_update_ranks()
        offsets, next_rank = {}, rank_offset
        for worker_id in sorted(ranks):
            offsets[worker_id] = next_rank
            next_rank += ranks[worker_id]
        if next_rank != world_size:
            raise InvalidRequestError(
                "world_size",
                f"is {world_size}, but the engine ranks from rank_offset {rank_offset} end at {next_rank} "
                f"({len(ranks)} replicas, {sum(ranks.values())} ranks)",
            )
        args = (master_address, master_port, offsets, world_size, group_name, backend)
        await self._on_every_replica_at_once("init_weights_update_group", *args)
        return offsets

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | None,
        group_name: str,
    ) -> WeightUpdateResult:
        """Every replica receives the trainer's broadcast at once (a collective: all or none
        take part); each checks the bucket plan before it reads a byte."""
        outcomes = await self._on_every_replica_at_once(
            "update_weights_from_distributed", names, dtypes, shapes, weight_version, group_name, check=False
        )
        versions = {v for v in outcomes.values() if isinstance(v, str)}
        result = WeightUpdateResult(versions.pop() if len(versions) == 1 else str(sorted(versions)))
        result.add(outcomes)
        return result

    async def destroy_weights_update_group(self, group_name: str) -> list[str]:
        return await self._on_every_replica("destroy_weights_update_group", group_name)

    # -- generation ---------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> list[str]:
        if mode not in ("abort", "wait", "keep"):
            raise InvalidRequestError("mode", f"{mode!r} is not one of abort, wait, keep")
        return await self._on_every_replica("pause_generation", mode)

    async def continue_generation(self) -> list[str]:
        return await self._on_every_replica("continue_generation")

    async def reset_prefix_cache(self) -> list[str]:
        return await self._on_every_replica("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> list[str]:
        if level not in (1, 2):
            raise InvalidRequestError("level", f"{level} is not 1 (free the KV cache) or 2 (also the weights)")
        return await self._on_every_replica("sleep", level)

    async def wake_up(self) -> list[str]:
        return await self._on_every_replica("wake_up")

    async def weight_versions(self) -> dict[str, str]:
        versions: dict[str, str] = {}
        for role in self.handles:
            for worker_id, outcome in (await self._broadcast(role, "weight_version")).items():
                versions[worker_id] = outcome if isinstance(outcome, str) else f"unknown ({outcome})"
        return versions

    async def _on_every_replica(self, method: str, *args: Any) -> list[str]:
        """The worker ids that did it; raises naming each replica that failed."""
        done, failed = [], {}
        for role in self.handles:
            for worker_id, outcome in (await self._broadcast(role, method, *args)).items():
                if isinstance(outcome, BaseException):
                    failed[worker_id] = reason(outcome)
                else:
                    done.append(worker_id)
        if failed:
            raise RuntimeError(f"{method} failed on {failed}; done on {done}")
        return done

    async def _on_every_replica_at_once(self, method: str, *args: Any, check: bool = True) -> dict[str, Any]:
        """Like `_on_every_replica`, but every role's replicas together (a collective call)."""
        per_role = await asyncio.gather(*(self._broadcast(role, method, *args) for role in self.handles))
        outcomes = {worker_id: outcome for role_outcomes in per_role for worker_id, outcome in role_outcomes.items()}
        failed = {w: reason(o) for w, o in outcomes.items() if isinstance(o, BaseException)}
        if check and failed:
            raise RuntimeError(f"{method} failed on {failed}")
        return outcomes

    async def _broadcast(self, role: str, method: str, *args: Any, skip_worker: str | None = None) -> dict[str, Any]:
        """worker id -> its result (or the exception it raised), from every replica of `role`.
        Each replica's method returns (worker id, result)."""
        kwargs = {} if skip_worker is None else {"skip_worker": skip_worker}
        response = self.handles[role].broadcast(method, *args, **kwargs)
        results = await response.results_async(return_exceptions=True)
        outcomes: dict[str, Any] = {}
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                outcomes[f"{role}-replica-{i}"] = result
            elif result is not None:
                worker_id, value = result
                outcomes[worker_id] = value
        return outcomes
