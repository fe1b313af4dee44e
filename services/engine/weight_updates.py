"""Weight updates without a restart, for RL rollouts: versions, pausing, sleep and wake.

The engine core owns one `WeightUpdates`; `LLM` and `AsyncLLM` call it on the engine
thread, between steps, so an update never lands in the middle of a step (with TP, every
rank's update runs after its previous step and before its next one).

Updates (names as SGLang's): `update_weights_from_disk(path)`, `..._from_tensors(named)`,
`..._from_distributed(names, dtypes, shapes)` over a group made by
`init_weights_update_group` (execution/weight_sync.py). Each rank checks every name and
shape (and, from a trainer, its bucket plan) before writing any: a refused update changes
nothing, version included. A trainer lost part-way through its buckets (they are written
as they arrive) leaves the weights released, as after `sleep(2)`: requests are refused
until a complete update.

Disk and tensor updates are also two calls, for callers that update many replicas at once
(all-or-nothing: prepare on every replica, then commit on every one):
`prepare_weights_from_disk(path)` (or `_from_tensors`) reads and checks everything on every
rank into a staged copy, the live weights and version untouched (a folder's tensors sit in
host memory until then); `commit_prepared_weights(version)` writes it, with nothing left to
refuse; `discard_prepared_weights()` drops it. `update_weights_from_disk` is both in one.
A write that fails anyway releases the weights, as a lost trainer does (rank_weights.py).
A successful update then:

  - running requests are preempted: they recompute their K/V on the new weights when next
    scheduled, so K/V of old weights is never read after an update;
  - the prefix cache is reset (a `cleared` KV event for the router), unless the caller
    says the cached K/V is still valid (`reset_prefix_cache=False`);
  - the version becomes the caller's string, or else counts updates: "0" as loaded at
    start, then "1", "2", ... (a caller's string does not reset the count). Every
    `RequestOutput` carries the version in effect when it was produced.

Pausing (`pause_generation(mode)`; `continue_generation()` ends it). In every mode, requests
that arrive while paused are held, unstarted, and start on `continue_generation`; the
offline `LLM.generate` refuses to run while paused (nothing would finish).

  abort   every request in flight ends now with finish_reason "abort"
  wait    requests in flight run to the end (AsyncLLM.pause_generation returns then)
  keep    requests in flight stop where they are; after the update they recompute their
          K/V and continue on the new weights. Their output then mixes versions: tokens
          before the pause came from the old weights, later ones from the new, and their
          outputs report the version in effect when each output was produced

Sleep: `sleep(1)` frees the KV-cache tensors (and drops the prefix cache); `sleep(2)` also
frees the weights. `wake_up()` brings the KV cache back, zeroed. After level 2 the weights
come back only with an update carrying every tensor (before or after `wake_up`); until
then requests are refused with `EngineSleepingError`, as they are while asleep. Sleep
needs an idle engine: pause with "abort" or "wait" first.

A draft model (speculative.method draft_model) is not the target, and updates never touch it:
  - sleep (either level) frees the draft's KV-cache tensors with the target's and drops
    every request's draft state (requests aborted by a pause leave theirs until a step;
    their K/V is about to go), so its blocks are all free; wake_up brings them back, zeroed.
    The draft's weights stay at level 2: an update carries the target's tensors only, so
    nothing would bring them back (a draft is small beside its target);
  - an update keeps the draft state of running requests: their draft K/V depends on the
    draft's weights and the tokens it holds, both unchanged, so it stays valid (only
    acceptance changes with the target). It is never hashed into the prefix cache nor
    announced (spec_decode/draft_blocks.py), so there is nothing to reset;
  - `memory_bytes` counts the draft's KV cache in the KV figure, the weights figure is the
    target's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from .api.input_processor import PreparedRequest
from .api.outputs import RequestOutput
from .errors import EngineSleepingError
from .execution.weight_sync import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from .execution.model_rank import ModelRank


class EngineCoreParts(Protocol):
    """What weight updates use of the engine core (engine_core.py owns a WeightUpdates, so
    this module names the parts it needs rather than importing the core)."""

    executor: Any  # run_on_ranks
    scheduler: Any  # preempt_running, kv.reset_prefix_cache, handover.weight_version
    speculator: Any  # None, or a Speculator whose drafter (None: n-gram) has a draft KV cache
    outputs: Any  # take_outputs

    def abort_all(self) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def publish_kv_events(self) -> None: ...
    def submit(self, prepared: PreparedRequest) -> None: ...


PauseMode = Literal["abort", "wait", "keep"]
_PAUSE_MODES = ("abort", "wait", "keep")


class WeightUpdates:
    def __init__(self, core: EngineCoreParts, initial_version: str = "0") -> None:
        self.core = core
        self.weight_version = initial_version
        self._counter = int(initial_version) if initial_version.isdigit() else 0
        self.pause_mode: PauseMode | None = None
        self.held: list[PreparedRequest] = []  # arrived while paused, in order
        self.sleep_level = 0  # 0: awake
        self.weights_released = False  # by sleep(2), until an update loads them
        self.stashed: list[RequestOutput] = []  # outputs taken early, for the next step to return
        self.has_prepared = False  # every rank holds a staged update (prepare_weights_from_*)

    # -- updates ----------------------------------------------------------------------

    def update_weights_from_disk(
        self, path: str | Path, weight_version: str | None = None, reset_prefix_cache: bool = True
    ) -> str:
        """Loads a Hugging Face folder of the same architecture and shapes; returns the new
        version. Prepare, then commit: every rank has read and checked it before any writes."""
        self.prepare_weights_from_disk(path)
        return self.commit_prepared_weights(weight_version, reset_prefix_cache)

    def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        reset_prefix_cache: bool = True,
    ) -> str:
        """Checkpoint-named full tensors (any subset); each rank keeps its shard."""
        self.prepare_weights_from_tensors(named_tensors)
        return self.commit_prepared_weights(weight_version, reset_prefix_cache)

    def prepare_weights_from_disk(self, path: str | Path) -> None:
        """Reads and checks a Hugging Face folder on every rank into a staged copy (replacing
        any staged before); the live weights are untouched. `commit_prepared_weights` applies it."""
        self._prepare(functools.partial(_stage_from_disk, str(path)))

    def prepare_weights_from_tensors(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """As `prepare_weights_from_disk`, for in-process tensors (staged as given, not
        copied: leave them unchanged until the commit)."""
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        self._prepare(functools.partial(_stage_from_tensors, named))

    def commit_prepared_weights(self, weight_version: str | None = None, reset_prefix_cache: bool = True) -> str:
        """Writes the prepared update on every rank; returns the new version."""
        if not self.has_prepared:
            raise RuntimeError("no update is prepared: call prepare_weights_from_disk first")
        self.has_prepared = False  # the ranks drop their staged copy, written or not
        return self._apply(_commit_prepared, weight_version, reset_prefix_cache)

    def discard_prepared_weights(self) -> None:
        """Drops a prepared update (none: nothing to do)."""
        self.core.executor.run_on_ranks(_discard_prepared)
        self.has_prepared = False

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> None:
        """Every rank joins the trainer's group as rank_offset + tp_rank (the trainer is rank 0
        and must join at the same time: this returns once everyone has). backend "gloo"
        receives into host memory, "nccl" onto the weights' CUDA device (refused without one)."""
        fn = functools.partial(_init_group, master_address, master_port, rank_offset, world_size, group_name, backend)
        self.core.executor.run_on_ranks(fn)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        weight_version: str | None = None,
        group_name: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reset_prefix_cache: bool = True,
    ) -> str:
        """Receives what the trainer sends with `weight_sync.broadcast_weights` (same names,
        dtypes, shapes and bucket_bytes); `group_name` may be left out when there is one group."""
        shapes = [list(shape) for shape in shapes]
        fn = functools.partial(_from_distributed, list(names), list(dtypes), shapes, group_name, bucket_bytes)
        return self._apply(fn, weight_version, reset_prefix_cache)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.core.executor.run_on_ranks(functools.partial(_destroy_group, group_name))

    def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix (emits `cleared`); blocks in use stay with their requests."""
        self.core.scheduler.kv.reset_prefix_cache()
        self.core.publish_kv_events()
        return True

    # -- pausing ----------------------------------------------------------------------

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(_PAUSE_MODES)}, got {mode!r}")
        self.pause_mode = mode
        if mode == "abort":
            self.core.abort_all()
            self.stash_outputs()  # the aborts go out now, with the version that produced them
        elif mode == "keep":
            self.stash_outputs()
            self.core.scheduler.preempt_running()

    def continue_generation(self) -> None:
        self.pause_mode = None
        held, self.held = self.held, []
        for prepared in held:
            self.core.submit(prepared)

    @property
    def is_paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def halts_steps(self) -> bool:
        """Nothing is scheduled: paused with "keep", or asleep."""
        return self.pause_mode == "keep" or self.sleep_level > 0

    def hold(self, prepared: PreparedRequest) -> bool:
        """Keeps a request that arrives while paused; False when not paused."""
        if self.pause_mode is None:
            return False
        self.held.append(prepared)
        return True

    def take_held(self, request_id: str) -> PreparedRequest | None:
        for i, prepared in enumerate(self.held):
            if prepared.request_id == request_id:
                return self.held.pop(i)
        return None

    # -- sleep ------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level}")
        if self.core.has_unfinished_requests():
            raise RuntimeError("sleep needs an idle engine: pause_generation('abort' or 'wait') first")
        self.reset_prefix_cache()  # the blocks' K/V is about to go
        self.core.executor.run_on_ranks(_release_kv_cache)
        drafter = self._drafter()
        if drafter is not None:
            drafter.retain(set())  # no request keeps draft state that points at freed K/V
            drafter.runner.release_kv_cache()
        if level == 2:
            self.core.executor.run_on_ranks(_release_weights)
            self.weights_released = True
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        if self.sleep_level:
            self.core.executor.run_on_ranks(_restore_kv_cache)
            drafter = self._drafter()
            if drafter is not None:
                drafter.runner.restore_kv_cache()
        self.sleep_level = 0

    def memory_bytes(self) -> tuple[int, int]:
        """(KV cache, weights) bytes summed over the ranks; the draft's KV cache is in the first."""
        per_rank = self.core.executor.run_on_ranks(_memory_bytes)
        drafter = self._drafter()
        draft_kv = 0 if drafter is None else drafter.runner.kv_cache_bytes
        return draft_kv + sum(kv for kv, _ in per_rank), sum(w for _, w in per_rank)

    def _drafter(self) -> Any:
        """The draft model's proposer, or None (no speculation, or n-gram)."""
        speculator = self.core.speculator
        return None if speculator is None else speculator.drafter

    def check_accepting(self) -> None:
        """Raises EngineSleepingError where a request could not run."""
        if self.sleep_level:
            raise EngineSleepingError(
                f"the engine is asleep (sleep level {self.sleep_level}) and refuses requests; call wake_up() first"
            )
        if self.weights_released:
            raise EngineSleepingError(
                "the weights are released (by sleep(level=2), or by an update that failed part-way); "
                "an update_weights_from_* call carrying every tensor loads them"
            )

    # -- outputs ----------------------------------------------------------------------

    def stamp(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """This step's outputs, after those taken early, each with the version in effect."""
        outputs = self._stamped(outputs)
        if self.stashed:
            outputs, self.stashed = self.stashed + outputs, []
        return outputs

    def stash_outputs(self) -> None:
        """Takes the pending outputs now, stamped with the current version."""
        self.stashed.extend(self._stamped(self.core.outputs.take_outputs()))

    def _stamped(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for output in outputs:
            output.weight_version = self.weight_version
        return outputs

    # -- internals --------------------------------------------------------------------

    def _prepare(self, stage: Callable[[ModelRank], None]) -> None:
        self.has_prepared = False
        try:
            self.core.executor.run_on_ranks(stage)
        except Exception:
            self.core.executor.run_on_ranks(_discard_prepared)  # ranks that staged before one refused
            raise
        self.has_prepared = True

    def _apply(self, fn: Callable[[ModelRank], None], weight_version: str | None, reset: bool) -> str:
        self.stash_outputs()  # tokens produced so far report the version that produced them
        try:
            self.core.executor.run_on_ranks(fn)  # a refused update raises before any rank writes
        except Exception:
            # A trainer lost part-way leaves the ranks' weights released (rank_weights.py).
            self.weights_released = any(self.core.executor.run_on_ranks(_is_released))
            raise
        self.weights_released = False
        self.core.scheduler.preempt_running()
        if reset:
            self.reset_prefix_cache()
        self._counter += 1
        self.weight_version = str(self._counter) if weight_version is None else str(weight_version)
        self.core.scheduler.handover.weight_version = self.weight_version  # handed-over K/V must match it
        return self.weight_version


# What each rank runs (module-level functions: they travel to Ray actors by reference).


def _stage_from_disk(path: str, rank: ModelRank) -> None:
    rank.weights.prepare(rank.weights.stage_from_disk(path))


def _stage_from_tensors(named: list[tuple[str, torch.Tensor]], rank: ModelRank) -> None:
    rank.weights.prepare(rank.weights.stage_from_tensors(named))


def _commit_prepared(rank: ModelRank) -> None:
    rank.weights.commit_prepared()


def _discard_prepared(rank: ModelRank) -> None:
    rank.weights.discard_prepared()


def _init_group(address: str, port: int, offset: int, world_size: int, name: str, backend: str, rank: ModelRank):
    rank.weights.init_group(address, port, offset, world_size, name, backend)


def _from_distributed(names, dtypes, shapes, group_name, bucket_bytes, rank: ModelRank) -> None:
    rank.weights.update_from_distributed(names, dtypes, shapes, group_name, bucket_bytes)


def _destroy_group(group_name: str, rank: ModelRank) -> None:
    rank.weights.destroy_group(group_name)


def _release_kv_cache(rank: ModelRank) -> None:
    rank.release_kv_cache()


def _restore_kv_cache(rank: ModelRank) -> None:
    rank.restore_kv_cache()


def _release_weights(rank: ModelRank) -> None:
    rank.weights.release()


def _is_released(rank: ModelRank) -> bool:
    return rank.weights.is_released


def _memory_bytes(rank: ModelRank) -> tuple[int, int]:
    return rank.memory_bytes()
