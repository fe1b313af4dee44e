"""A tensor-parallel rank group: one Ray actor per rank, gang-scheduled.

The driver (the engine core's process) owns the scheduler and sends every step's typed
`SchedulerOutput` to all ranks at once; the ranks run the forward pass in lockstep,
communicating through torch.distributed (gloo on CPU, NCCL on CUDA), and only rank 0
samples (it returns the tokens; the scheduler sends them back to every rank with the
next step, so all ranks hold the same token history).

Ranks are placed with a placement group (STRICT_PACK on one node by default); inside a
Ray Serve replica that already reserved bundles, the group uses the replica's own.
A rank that dies or a step that outlasts `rank_timeout_s` ends the group: the caller
gets `RankGroupError`, the actors and the placement group are released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ...kv_transfer.config import FaultInjection
from ...kv_transfer.types import KVTransferStatus
from ...model.config import ModelArch
from ...ray_env import ensure_ray
from ..config import EngineConfig
from ..core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ..errors import EngineDeadError
from .executor import Executor, raise_rank_failures
from .model_rank import ModelRank

T = TypeVar("T")

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0


class RankGroupError(EngineDeadError):
    """A tensor-parallel rank died or stopped answering; the group has been torn down."""


class RayTPExecutor(Executor):
    def __init__(self, config: EngineConfig, arch: ModelArch) -> None:
        self.ray = ray = ensure_ray()
        from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        self.config = config
        self.world_size = size = config.parallel.tensor_parallel_size
        self._transfers = TransferStatusMerger(size)
        self.timeout_s = config.parallel.rank_timeout_s
        use_gpu = _wants_gpu(config, ray)
        resource = "GPU" if use_gpu else "CPU"
        available = ray.cluster_resources().get(resource, 0)
        if available < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} {resource}s in the Ray cluster, which has {available:g}"
            )
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= size:
            self.placement_group, self._owns_placement_group = current, False
        else:
            self.placement_group = placement_group([bundle] * size, strategy=config.parallel.placement_strategy)
            self._owns_placement_group = True
            try:
                ray.get(self.placement_group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError as e:
                self._release()
                raise ValueError(
                    f"could not place {size} workers ({bundle} each, {config.parallel.placement_strategy}) "
                    f"within {_PLACEMENT_TIMEOUT_S:.0f}s"
                ) from e

        actor_class = ray.remote(ModelRank)
        self.ranks = [
            actor_class.options(
                num_cpus=1,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(config, arch, rank, size, 1)
            for rank in range(size)
        ]
        try:
            ((host, port),) = self._wait_all([self.ranks[0].node_address.remote()])
            self._wait_all([r.init_distributed.remote(f"tcp://{host}:{port}") for r in self.ranks])
            self.num_kv_blocks = min(self._wait_all([r.load_model.remote() for r in self.ranks]))
            self._wait_all([r.initialize_kv_cache.remote(self.num_kv_blocks) for r in self.ranks])
            endpoints = self._wait_all([r.kv_endpoint.remote() for r in self.ranks])
            self.kv_endpoints = tuple(endpoints) if all(endpoints) else ()
            first = self.ranks[0]
            self.device_name, self.dtype_bytes, self.kv_cache_dtype = self._wait_all(
                [first.device_name.remote(), first.dtype_bytes.remote(), first.kv_cache_dtype.remote()]
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor-parallel group of %d ranks ready (%s), %d KV blocks per rank", size, resource, self.num_kv_blocks
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ref = self.ray.put(scheduler_output)  # serialised once for every rank
        outputs = self._wait_all([r.execute_model.remote(ref) for r in self.ranks])
        result = outputs[0]
        if any(o.kv_transfer for o in outputs):
            result.kv_transfer = self._transfers.merge([o.kv_transfer for o in outputs])
        return result

    def set_kv_faults(self, faults: FaultInjection) -> None:
        self._wait_all([r.set_kv_faults.remote(faults) for r in self.ranks])

    def run_on_ranks(self, fn: Callable[[ModelRank], T]) -> list[T]:
        return raise_rank_failures(self._wait_all([r.call.remote(fn) for r in self.ranks]))

    def named_parameters(self) -> list[dict]:
        """Every rank's parameters (for inspection and tests)."""
        return self._wait_all([r.named_parameters.remote() for r in self.ranks])

    def shutdown(self) -> None:
        for rank in getattr(self, "ranks", []):
            self.ray.kill(rank, no_restart=True)
        self.ranks = []
        self._release()

    # -- internals --------------------------------------------------------------------

    def _wait_all(self, refs: list) -> list:
        """All results, failing fast: the first rank error (or the timeout) tears the group down."""
        ray = self.ray
        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(remaining, 0))
            if not ready:
                self.shutdown()
                raise RankGroupError(f"a tensor-parallel step took longer than {self.timeout_s:g}s; group stopped")
            try:
                ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                rank = refs.index(ready[0])
                self.shutdown()
                raise RankGroupError(f"tensor-parallel rank {rank} failed: {e}") from e
        return ray.get(refs)

    def _release(self) -> None:
        if getattr(self, "_owns_placement_group", False) and self.placement_group is not None:
            self._remove_placement_group(self.placement_group)
            self.placement_group = None


def _wants_gpu(config: EngineConfig, ray) -> bool:
    if config.runner.device == "cuda":
        return True
    if config.runner.device == "cpu":
        return False
    return ray.cluster_resources().get("GPU", 0) >= config.parallel.tensor_parallel_size


class TransferStatusMerger:
    """Every rank moves its own heads' share of a transfer. A transfer is over once every
    rank has reported it (in any step); it succeeded only if every rank succeeded."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._recv: dict[str, dict[int, str | None]] = {}  # request id -> rank -> failure (None: ok)
        self._send: dict[str, dict[int, bool]] = {}  # transfer id -> rank -> ok

    def merge(self, statuses: list[KVTransferStatus | None]) -> KVTransferStatus:
        merged = KVTransferStatus()
        for rank, status in enumerate(statuses):
            if status is None:
                continue
            for request_id in status.finished_recving:
                self._recv.setdefault(request_id, {})[rank] = None
            for request_id, reason in status.failed_recving.items():
                self._recv.setdefault(request_id, {})[rank] = reason
            for transfer_id in status.finished_sending:
                self._send.setdefault(transfer_id, {})[rank] = True
            for transfer_id in status.failed_sending:
                self._send.setdefault(transfer_id, {})[rank] = False
            merged.bytes_received += status.bytes_received
            merged.recv_seconds = max(merged.recv_seconds, status.recv_seconds)
        for request_id, ranks in list(self._recv.items()):
            if len(ranks) == self.world_size:
                failures = [reason for reason in ranks.values() if reason is not None]
                if failures:
                    merged.failed_recving[request_id] = failures[0]
                else:
                    merged.finished_recving.add(request_id)
                del self._recv[request_id]
        for transfer_id, ranks in list(self._send.items()):
            if len(ranks) == self.world_size:
                (merged.finished_sending if all(ranks.values()) else merged.failed_sending).add(transfer_id)
                del self._send[transfer_id]
        return merged
