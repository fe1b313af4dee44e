"""A tensor-parallel worker group: one Ray actor per rank, gang-scheduled.

The driver (the engine core's process) owns the scheduler and sends every step's typed
`SchedulerOutput` to all ranks at once; the ranks run the forward pass in lockstep,
communicating through torch.distributed (gloo on CPU, NCCL on CUDA), and only rank 0
samples (it returns the tokens; the scheduler sends them back to every rank with the
next step, so all ranks hold the same token history).

Ranks are placed with a placement group (STRICT_PACK on one node by default); inside a
Ray Serve replica that already reserved bundles, the group uses the replica's own.
A rank that dies or a step that outlasts `worker_timeout_s` ends the group: the caller
gets `WorkerGroupError`, the actors and the placement group are released.
"""

from __future__ import annotations

import logging
import time

from ..model.config import ModelArch
from ..ray_env import ensure_ray
from .config import EngineConfig
from .errors import EngineDeadError
from .executor import Executor
from .scheduler_output import ModelRunnerOutput, SchedulerOutput
from .worker import Worker

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0


class WorkerGroupError(EngineDeadError):
    """A tensor-parallel rank died or stopped answering; the group has been torn down."""


class RayTPExecutor(Executor):
    def __init__(self, config: EngineConfig, arch: ModelArch) -> None:
        self.ray = ray = ensure_ray()
        from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        self.config = config
        self.world_size = size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.worker_timeout_s
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

        actor_class = ray.remote(Worker)
        self.workers = [
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
            ((host, port),) = self._wait_all([self.workers[0].node_address.remote()])
            self._wait_all([w.init_distributed.remote(f"tcp://{host}:{port}") for w in self.workers])
            self.num_kv_blocks = min(self._wait_all([w.load_model.remote() for w in self.workers]))
            self._wait_all([w.initialize_kv_cache.remote(self.num_kv_blocks) for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor-parallel group of %d ranks ready (%s), %d KV blocks per rank", size, resource, self.num_kv_blocks
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ref = self.ray.put(scheduler_output)  # serialised once for every rank
        return self._wait_all([w.execute_model.remote(ref) for w in self.workers])[0]

    def named_parameters(self) -> list[dict]:
        """Every rank's parameters (for inspection and tests)."""
        return self._wait_all([w.named_parameters.remote() for w in self.workers])

    def shutdown(self) -> None:
        for worker in getattr(self, "workers", []):
            self.ray.kill(worker, no_restart=True)
        self.workers = []
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
                raise WorkerGroupError(f"a tensor-parallel step took longer than {self.timeout_s:g}s; group stopped")
            try:
                ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                rank = refs.index(ready[0])
                self.shutdown()
                raise WorkerGroupError(f"tensor-parallel rank {rank} failed: {e}") from e
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
