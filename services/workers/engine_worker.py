"""A Ray Serve replica that holds one engine (`AsyncLLM`) in a colocated, prefill or
decode role, registers itself with the router's Redis registry, publishes its KV events
and load, and streams outputs back to the gateway.

A plain class: the constructor is synchronous and takes its dependencies, so unit tests
build it without Ray; `services/serve_app/builder.py` turns it into a Serve deployment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from ..autoscaling.signals import ReplicaSignals
from ..engine.api.async_llm import AsyncLLM
from ..engine.api.handover import Handover
from ..engine.api.outputs import RequestOutput
from ..engine.api.sampling_params import RequestOutputKind
from ..engine.config import EngineConfig
from ..engine.stats import EngineStats
from ..kv_transfer.config import FaultInjection
from ..local_channel import ray_node_id
from ..metrics import EngineMetrics
from ..replica_ports import bind_to_node_ip
from ..roles import Role
from ..router.config import RouterConfig
from ..router.worker_agent import WorkerAgent
from ..router.worker_info import WorkerInfo, new_epoch
from ..serving_errors import quiet_rejections
from ..worker_calls import ChannelOffer, DecodeCall, GenerateCall, MovedToChannel, OpenChannel, WorkerModelInfo
from . import last_update
from .admission import Admission, AdmissionLimits
from .output_channels import OutputChannels

logger = logging.getLogger(__name__)

METRICS_INTERVAL_S = 1.0


class EngineWorker:
    def __init__(
        self,
        role: str,
        engine_config: EngineConfig,
        served_model_name: str,
        router_config: RouterConfig | None = None,
        admission: AdmissionLimits | None = None,
        replica_id: str | None = None,
    ) -> None:
        quiet_rejections()  # a request the engine refuses is one log line here, not Serve's traceback
        bind_to_node_ip()
        self.role = role
        self.served_model_name = served_model_name
        # A prefill replica hands each request on at its first token: it holds no batch slot after.
        slots = None if role == "prefill" else engine_config.scheduler.max_num_seqs
        self.admission = Admission(admission or AdmissionLimits(), max_running=slots)
        self.signals = ReplicaSignals()  # what record_autoscaling_stats reports (autoscaling/signals.py)
        self.agent: WorkerAgent | None = None
        serve_name, serve_address = _serve_identity()
        address = replica_id or serve_address or f"local-{uuid.uuid4().hex[:8]}"
        self.info = WorkerInfo(
            # A replica's rank is its stable slot: its replacement's new epoch wipes its entries at once.
            name=f"{role}-{serve_name}" if serve_name else f"{role}-{address.rsplit('#', 1)[-1]}",
            epoch=new_epoch(),
            role=Role(role),
            model=served_model_name,
            block_size=engine_config.cache.block_size,
            tp_size=engine_config.parallel.tensor_parallel_size,
            address=address,
        )
        if router_config is not None:
            self.agent = WorkerAgent.from_config(router_config, self.info)
        self.channels = OutputChannels(address, ray_node_id())
        self.llm = AsyncLLM(
            _with_core_process(engine_config),
            kv_event_publisher=self.agent.publisher if self.agent else None,
            worker_id=self.info.worker_id,
        )
        last_update.replay(self.llm, engine_config.model.model)  # the fleet's weights, before any request
        if self.agent is not None:
            self.agent.start(self.llm.stats)
        self._metrics_stop = threading.Event()
        if _in_ray():
            threading.Thread(target=self._export_metrics, name="baton-metrics", daemon=True).start()
        logger.info("engine worker %s (%s) ready", self.info.worker_id, role)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    async def generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput | ChannelOffer | MovedToChannel]:
        """Streams the request's outputs (or moves them onto the caller's output channel,
        workers/output_channels.py); if the caller goes away, the request is aborted."""
        async with aclosing(self.channels.deliver(call, self._generated(call))) as items:
            async for item in items:
                yield item

    async def open_channel(self, open_channel: OpenChannel) -> AsyncIterator[list[RequestOutput]]:
        """A gateway's output channel on this replica (workers/output_channels.py)."""
        async with aclosing(self.channels.serve(open_channel.channel, open_channel.node)) as batches:
            async for batch in batches:
                yield batch

    async def channel_counts(self) -> tuple[int, int, int]:
        """(messages, outputs, messages on a local socket) sent on output channels since start:
        how much they coalesce, and how many bypassed Ray."""
        channels = self.channels
        return channels.num_messages, channels.num_outputs, channels.num_socket_messages

    async def _generated(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        self._admit(call)
        self.signals.prefill_started()
        prefilling = True
        try:
            stream = self.llm.add_request(call.request_id, call.prompt_token_ids, call.params, call.cache_salt)
            try:
                async for output in stream.merged(call.params.output_kind):
                    self.admission.started(call.request_id)
                    if prefilling:
                        prefilling = False
                        self.signals.prefill_finished(len(call.prompt_token_ids) - output.num_cached_tokens)
                    self.signals.output(output, call.params.output_kind is RequestOutputKind.CUMULATIVE)
                    yield output
            finally:
                await stream.aclose()
        finally:
            if prefilling:
                self.signals.prefill_finished(0)
            self.signals.request_ended(call.request_id)
            self.admission.left(call.request_id)

    async def prefill(self, call: GenerateCall) -> RequestOutput:
        """Prefill role: runs the prompt and samples the first token. When the request goes
        on, the prompt's blocks stay leased and the output's `kv_transfer_params` say where."""
        self._admit(call)
        params = dataclasses.replace(call.params, output_kind=RequestOutputKind.FINAL_ONLY)
        num_computed_tokens = 0
        self.signals.prefill_started()
        try:
            stream = self.llm.add_request(
                call.request_id, call.prompt_token_ids, params, call.cache_salt, handover=Handover.prefill()
            )
            try:
                async for output in stream:
                    if output.finished:
                        self.admission.started(call.request_id)
                        num_computed_tokens = len(call.prompt_token_ids) - output.num_cached_tokens
                        return output
            finally:
                await stream.aclose()
        finally:
            self.signals.prefill_finished(num_computed_tokens)
            self.admission.left(call.request_id)
        raise RuntimeError(f"prefill of {call.request_id} ended without output")

    async def decode(self, decode: DecodeCall) -> AsyncIterator[RequestOutput | ChannelOffer | MovedToChannel]:
        """Decode role: receives the prompt's K/V from the prefill worker (or recomputes it if
        the transfer fails) and streams the tokens after the first (as `generate` does)."""
        async with aclosing(self.channels.deliver(decode.call, self._decoded(decode))) as items:
            async for item in items:
                yield item

    async def _decoded(self, decode: DecodeCall) -> AsyncIterator[RequestOutput]:
        call = decode.call
        self._admit(call)
        try:
            stream = self.llm.add_request(
                call.request_id, call.prompt_token_ids, call.params, call.cache_salt, handover=decode.handover
            )
            try:
                async for output in stream.merged(call.params.output_kind):
                    self.admission.started(call.request_id)
                    self.signals.output(output, call.params.output_kind is RequestOutputKind.CUMULATIVE)
                    yield output
            finally:
                await stream.aclose()
        finally:
            self.signals.request_ended(call.request_id)
            self.admission.left(call.request_id)

    async def set_kv_faults(self, faults: FaultInjection) -> None:
        """Fault injection on this worker's KV sends (see Executor.set_kv_faults)."""
        await self.llm.run_in_engine(lambda core: core.executor.set_kv_faults(faults))

    async def abort(self, request_id: str) -> bool:
        found = self.llm.has_request(request_id)
        self.llm.abort(request_id)
        return found

    async def model_info(self) -> WorkerModelInfo:
        llm = self.llm
        return WorkerModelInfo(
            model=self.served_model_name,
            max_model_len=llm.max_model_len,
            block_size=llm.config.cache.block_size,
            tensor_parallel_size=llm.config.parallel.tensor_parallel_size,
            vocab_size=llm.vocab_size,
            role=self.role,
            worker_id=self.worker_id,
            address=self.info.address,
        )

    async def stats(self) -> EngineStats:
        return self.llm.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-autoscaling hook: called on the replica every `metrics_interval_s`
        while the deployment autoscales; policies read it (autoscaling/policy.py)."""
        llm = self.llm
        if llm is None:
            return {}
        return self.signals.report(llm.stats(), self.admission.num_queued)

    async def check_integrity(self) -> EngineStats:
        """Checks block accounting on the engine thread; returns the stats it saw (tests)."""
        return await self.llm.run_in_engine(lambda core: (core.check_integrity(), core.stats())[1])

    # -- RL rollouts: the admin calls, through gateway/weight_admin.py -------------------
    # Each answers (worker id, result), or None on a replica the call does not name (`only`).
    # The all-or-nothing steps answer a failure as (worker id, the exception), so the gateway
    # names the replica that failed.

    async def pause_for_update(self, mode: str) -> tuple[str, bool | BaseException]:
        """Pauses unless already paused (a caller's own pause stays as it is); True when
        this call paused, so only then does the update's end continue generation."""

        async def pause() -> bool:
            if await self.llm.run_in_engine(lambda core: core.weights.is_paused):
                return False
            await self.llm.pause_generation(mode)
            return True

        return await self._answer(pause)

    async def prepare_weights_from_disk(
        self, path: str, only: list[str] | None = None
    ) -> tuple[str, None | BaseException] | None:
        if only is not None and self.worker_id not in only:
            return None
        return await self._answer(lambda: self.llm.prepare_weights_from_disk(path))

    async def commit_prepared_weights(
        self, weight_version: str | None, only: list[str]
    ) -> tuple[str, str | BaseException] | None:
        if self.worker_id not in only:
            return None
        return await self._answer(lambda: self.llm.commit_prepared_weights(weight_version))

    async def discard_prepared_weights(self) -> tuple[str, None | BaseException]:
        return await self._answer(lambda: self.llm.discard_prepared_weights())

    async def check_weights_update(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> tuple[str, None | BaseException]:
        """The preflight of a trainer's update: would every rank take these tensors?"""

        def check(rank) -> None:
            rank.weights.check_distributed_update(names, dtypes, shapes, group_name)

        return await self._answer(lambda: self.llm.run_in_engine(lambda core: core.executor.run_on_ranks(check)))

    async def record_update(self, path: str | None, weight_version: str) -> tuple[str, bool]:
        """Where a replica that starts later finds the fleet's update (workers/last_update.py)."""
        return self.worker_id, last_update.record(self.llm.config.model.model, path, weight_version)

    async def pause_generation(self, mode: str = "abort") -> tuple[str, None]:
        await self.llm.pause_generation(mode)
        return self.worker_id, None

    async def continue_generation(self, only: list[str] | None = None) -> tuple[str, None] | None:
        if only is not None and self.worker_id not in only:
            return None
        await self.llm.continue_generation()
        return self.worker_id, None

    async def reset_prefix_cache(self) -> tuple[str, bool]:
        return self.worker_id, await self.llm.reset_prefix_cache()

    async def sleep(self, level: int = 1) -> tuple[str, None]:
        await self.llm.sleep(level)
        return self.worker_id, None

    async def wake_up(self) -> tuple[str, None]:
        await self.llm.wake_up()
        return self.worker_id, None

    async def weight_version(self) -> tuple[str, str]:
        return self.worker_id, self.llm.weight_version

    async def weight_update_ranks(self) -> tuple[str, int]:
        """How many ranks of a trainer's group this replica takes (its TP ranks)."""
        return self.worker_id, self.info.tp_size

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offsets: dict[str, int],
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> tuple[str, None]:
        """Joins the trainer's group at this replica's offset (the gateway assigns them)."""
        offset = rank_offsets[self.worker_id]
        await self.llm.init_weights_update_group(master_address, master_port, offset, world_size, group_name, backend)
        return self.worker_id, None

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], weight_version: str | None, group_name: str
    ) -> tuple[str, str]:
        return self.worker_id, await self.llm.update_weights_from_distributed(
            names, dtypes, shapes, weight_version, group_name
        )

    async def destroy_weights_update_group(self, group_name: str) -> tuple[str, None]:
        await self.llm.destroy_weights_update_group(group_name)
        return self.worker_id, None

    async def integrity_report(self) -> tuple[str, int, EngineStats]:
        """`check_integrity` with the worker id and process id: what fault-injection tests
        reach every replica of a role with (Serve's `broadcast`)."""
        return self.worker_id, os.getpid(), await self.check_integrity()

    async def _answer(self, call: Callable[[], Awaitable[Any]]) -> tuple[str, Any]:
        """(worker id, what `call` returned), or (worker id, the exception it raised)."""
        try:
            return self.worker_id, await call()
        except Exception as error:
            return self.worker_id, error

    def check_health(self) -> None:
        """Ray Serve's health probe: a dead engine restarts the replica."""
        if not self.llm.is_running:
            raise RuntimeError(f"engine of worker {self.worker_id} is not running")

    def __del__(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        channels = getattr(self, "channels", None)
        if channels is not None:
            channels.close()
        stop = getattr(self, "_metrics_stop", None)
        if stop is not None:
            stop.set()
        agent, self.agent = getattr(self, "agent", None), None
        if agent is not None:
            agent.close()
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()
            self.llm = None

    def _export_metrics(self) -> None:
        exporter = EngineMetrics(self.role)
        while not self._metrics_stop.wait(METRICS_INTERVAL_S):
            llm = self.llm
            if llm is None:
                return
            exporter.export(llm.stats(), self.admission.num_queued)

    def _admit(self, call: GenerateCall) -> None:
        """Admission control (workers/admission.py); a shed request never reaches the engine."""
        self.admission.admit(call.request_id, len(call.prompt_token_ids), self.llm.stats(), self.worker_id)


def _with_core_process(config: EngineConfig) -> EngineConfig:
    """A replica runs its engine core in a process of its own unless told otherwise or
    sharded (engine/api/engine_process.py says why)."""
    if config.runner.core_process is not None:
        return config
    runner = config.runner.model_copy(update={"core_process": config.parallel.tensor_parallel_size == 1})
    return config.model_copy(update={"runner": runner})


def _in_ray() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:
        return False


def _serve_identity() -> tuple[str | None, str | None]:
    """(rank, full replica id) when running inside a Ray Serve replica; the full id is also
    the replica's actor name, which is how the serving layer reaches it."""
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:  # not inside a Serve replica
        return None, None
    return f"r{context.rank.rank}", context.replica_id.to_full_id_str()
