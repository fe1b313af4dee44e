"""The RL-rollout admin calls, applied to every engine replica of every role.

    update_weights_from_disk(path, version, pause_mode)
        all or nothing:
          1. prepare on every replica at once: each reads and checks the whole folder into
             a staged copy, its live weights untouched (generation goes on meanwhile)
          2. any replica failed: discard on every replica; the answer names each failed
             replica and why, and every replica still serves the old version (a folder
             refused as such, e.g. another shape: the client's error, 400). Nothing was
             paused, so a refused update disturbs no request.
          3. pause every replica (`pause_mode`, default "keep"; a replica the caller had
             paused already stays as the caller paused it, and paused afterwards)
          4. commit on one replica, then on the others with the version it took
          5. continue the replicas step 3 paused; once every replica committed, each
             records the update, which a replica that starts later (a replacement,
             autoscaling) loads before it takes requests (workers/last_update.py)
    pause_generation(mode) / continue_generation() / reset_prefix_cache() / sleep(level) /
    wake_up()                                 every replica, at once
    update_weights_from_distributed(...)      every replica checks the names, dtypes and
                                              shapes first (a preflight); only if all agree
                                              does any join the trainer's collective
    weight_versions()                         what each replica serves

With the fleet paused from before any replica commits until after every one has, no
request sees two versions under "abort" or "wait"; under "keep" a request in flight
continues on the new weights (its earlier tokens came from the old ones). A commit that
fails after another replica's succeeded (the replica's process died, say) is named in
the answer, beside the replicas that moved: `WeightUpdateResult.failed`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..engine.errors import InvalidRequestError
from ..model.errors import ModelLoadError

DEFAULT_GROUP = "weight_update"  # a trainer group's name when the caller gives none
PAUSE_MODES = ("abort", "wait", "keep")
# An update leaves requests in flight as updates did before the gateway paused around them:
# they continue on the new weights.
DEFAULT_UPDATE_PAUSE = "keep"
# What a replica raises for an update that is wrong as asked (not the replica's fault).
_REFUSALS = (ModelLoadError, InvalidRequestError, FileNotFoundError, ValueError)


@dataclass(slots=True)
class WeightUpdateResult:
    weight_version: str  # what the updated replicas serve now (none updated: what all still serve)
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


def failures(outcomes: dict[str, Any]) -> dict[str, BaseException]:
    return {worker_id: o for worker_id, o in outcomes.items() if isinstance(o, BaseException)}


def described(failed: dict[str, BaseException]) -> str:
    """Each failed replica and why, one after the other."""
    return "; ".join(f"{worker_id}: {reason(error)}" for worker_id, error in sorted(failed.items()))


def is_refusal(error: BaseException) -> bool:
    return isinstance(getattr(error, "cause", None) or error, _REFUSALS)


def one_version(versions: dict[str, str]) -> str:
    distinct = sorted(set(versions.values()))
    return distinct[0] if len(distinct) == 1 else str(distinct)


class WeightAdmin:
    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles  # role -> the deployment's handle

    async def update_weights_from_disk(
        self, path: str, weight_version: str | None = None, pause_mode: str = DEFAULT_UPDATE_PAUSE
    ) -> WeightUpdateResult:
        check_pause_mode(pause_mode)
        prepared = await self._at_once("prepare_weights_from_disk", path)
        if failed := failures(prepared):
            await self._at_once("discard_prepared_weights")
            if all(is_refusal(error) for error in failed.values()):
                raise InvalidRequestError("model_path", f"refused by {described(failed)}; no replica changed")
            return await self._not_updated(failed, "prepared")
        paused = await self._at_once("pause_for_update", pause_mode)
        try:
            if failed := failures(paused):
                await self._at_once("discard_prepared_weights")
                return await self._not_updated(failed, "paused")
            # The prepared replicas: one that came up since has nothing staged (_catch_up).
            return await self._commit(sorted(prepared), path, weight_version)
        finally:
            await self._at_once("continue_generation", [w for w, was_paused in paused.items() if was_paused is True])

    async def _commit(self, worker_ids: list[str], path: str, weight_version: str | None) -> WeightUpdateResult:
        """One replica first (without a caller's version it counts one), then the others with
        the version it took: every replica ends on the same name."""
        first = worker_ids[0]
        outcomes = await self._at_once("commit_prepared_weights", weight_version, [first])
        if failed := failures(outcomes):
            await self._at_once("discard_prepared_weights")
            return await self._not_updated(failed, "committed")
        version = outcomes[first]
        result = WeightUpdateResult(version, [first])
        result.add(await self._at_once("commit_prepared_weights", version, worker_ids[1:]))
        if result.failed:  # their staged copies go too
            await self._at_once("discard_prepared_weights")
        else:
            await self._at_once("record_update", path, version)  # for replicas that start later
            result.add(await self._catch_up(path, version))
        return result

    async def _catch_up(self, path: str, version: str) -> dict[str, Any]:
        """Replicas that came up while the update ran (after its prepare step, before they
        could read the record) serve their startup weights: they take the update now,
        unpaused (as "keep": what runs there continues on the new weights)."""
        versions = await self._at_once("weight_version")
        late = sorted(w for w, v in versions.items() if isinstance(v, str) and v != version)
        if not late:
            return {}
        prepared = await self._at_once("prepare_weights_from_disk", path, late)
        ready = [w for w in late if not isinstance(prepared.get(w), BaseException)]
        committed = await self._at_once("commit_prepared_weights", version, ready) if ready else {}
        return {**failures(prepared), **committed}

    async def _not_updated(self, failed: dict[str, BaseException], step: str) -> WeightUpdateResult:
        """No replica committed: every one still on the version it had."""
        answered = {w: v for w, v in (await self._at_once("weight_version")).items() if isinstance(v, str)}
        why = {worker_id: f"not {step}: {reason(error)}" for worker_id, error in failed.items()}
        return WeightUpdateResult(one_version(answered), [], why)

    # -- from a trainer's torch.distributed group -------------------------------------

    async def weight_update_ranks(self) -> dict[str, int]:
        """worker id -> the group ranks it takes (its TP ranks): the trainer's group has
        1 + their sum ranks, the trainer being rank 0."""
        outcomes = await self._at_once("weight_update_ranks")
        if failed := failures(outcomes):
            raise RuntimeError(f"replicas did not answer: {described(failed)}")
        return outcomes

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
        if failed := failures(await self._at_once("init_weights_update_group", *args)):
            raise RuntimeError(f"init_weights_update_group failed on {described(failed)}")
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
        take part). A preflight on every replica first: a replica that would refuse the
        names, dtypes or shapes would leave the others waiting in the collective (until its
        timeout, their weights released), so then none joins."""
        if failed := failures(await self._at_once("check_weights_update", names, dtypes, shapes, group_name)):
            if all(is_refusal(error) for error in failed.values()):
                raise InvalidRequestError("names", f"refused by {described(failed)}; no replica joined the transfer")
            raise RuntimeError(f"the preflight failed on {described(failed)}; no replica joined the transfer")
        outcomes = await self._at_once(
            "update_weights_from_distributed", names, dtypes, shapes, weight_version, group_name
        )
        result = WeightUpdateResult(one_version({w: v for w, v in outcomes.items() if isinstance(v, str)}))
        result.add(outcomes)
        if result.ok:  # a later replica cannot replay it, and says so (workers/last_update.py)
            await self._at_once("record_update", None, result.weight_version)
        return result

    async def destroy_weights_update_group(self, group_name: str) -> list[str]:
        return await self._on_every_replica("destroy_weights_update_group", group_name)

    # -- generation ---------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> list[str]:
        check_pause_mode(mode)
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
        outcomes = await self._at_once("weight_version")
        return {w: o if isinstance(o, str) else f"unknown ({reason(o)})" for w, o in outcomes.items()}

    async def _on_every_replica(self, method: str, *args: Any) -> list[str]:
        """The worker ids that did it; raises naming each replica that failed."""
        outcomes = await self._at_once(method, *args)
        if failed := failures(outcomes):
            done = [w for w in outcomes if w not in failed]
            raise RuntimeError(f"{method} failed on {described(failed)}; done on {done}")
        return list(outcomes)

    async def _at_once(self, method: str, *args: Any) -> dict[str, Any]:
        """worker id -> its result (or the exception it raised), from every replica of every
        role at once (a collective call needs them together)."""
        per_role = await asyncio.gather(*(self._broadcast(role, method, *args) for role in self.handles))
        return {worker_id: outcome for role_outcomes in per_role for worker_id, outcome in role_outcomes.items()}

    async def _broadcast(self, role: str, method: str, *args: Any) -> dict[str, Any]:
        """worker id -> its result (or the exception it raised), from every replica of `role`.
        Each replica's method returns (worker id, result), or None where a call names the
        replicas it is for and this is not one. A role with no running replica (Serve raises
        while one that died is being replaced) is one failure named after the role, so the
        other roles still answer and an update names why it did not run."""
        try:
            results = await self.handles[role].broadcast(method, *args).results_async(return_exceptions=True)
        except Exception as error:
            return {f"{role} (not reached)": error}
        outcomes: dict[str, Any] = {}
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                outcomes[f"{role}-replica-{i}"] = result
            elif result is not None:
                worker_id, value = result
                outcomes[worker_id] = value
        return outcomes


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidRequestError("mode", f"{mode!r} is not one of {', '.join(PAUSE_MODES)}")
