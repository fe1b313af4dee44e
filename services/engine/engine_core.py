"""The engine loop's body: add requests, run steps, abort. One owner thread at a time.

A step reads: schedule -> run the model -> update requests -> publish KV events:

    scheduler_output = scheduler.schedule()
    runner_output    = executor.execute_model(scheduler_output)
    self._update(scheduler_output, runner_output)

A user request maps to engine requests: one for n == 1; for n > 1, a prefill-only request
for all but the last prompt token, forked into n samples that share its blocks; for beam
search, one request per live beam (see beam_search.py).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from ..kv_transfer.types import KVTransferParams
from ..model.config import ModelArch, load_model_arch
from .api.input_processor import InputProcessor, PreparedRequest
from .api.output_processor import OutputProcessor
from .api.outputs import RequestOutput
from .api.sampling_params import SamplingParams
from .api.tokenizer import load_tokenizer
from .config import EngineConfig
from .core.beam_search import Beam, BeamSearchGroup, beam_member_params
from .core.block_hash import request_extra_keys
from .core.kv_events import KVEventPublisher, NullKVEventPublisher
from .core.request import Request, RequestStatus
from .core.scheduler import Scheduler
from .core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from .engine_setup import check_engine_config, create_executor, resolve_max_model_len
from .errors import InvalidRequestError
from .execution.executor import Executor
from .stats import EngineStats
from .step_metrics import DevicePeaks, StepCostModel, StepWindow

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Member:
    """What an engine request is to its user request."""

    user_id: str
    index: int  # sample index (n > 1); unused for prefix and beam members
    kind: str  # "sample" | "prefix" (n > 1 shared prompt) | "beam"


class EngineCore:
    def __init__(
        self, config: EngineConfig, kv_event_publisher: KVEventPublisher | None = None, executor: Executor | None = None
    ) -> None:
        self.config = config
        self.arch: ModelArch = load_model_arch(config.model.model)
        check_engine_config(config, self.arch)
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        self.executor = executor or create_executor(config, self.arch)
        self.num_kv_blocks = self.executor.num_kv_blocks
        self.max_model_len = resolve_max_model_len(config, self.arch, self.num_kv_blocks)
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.num_kv_blocks, self.max_model_len, config.kv_transfer.lease_s
        )
        self.publisher = kv_event_publisher or NullKVEventPublisher()
        self.inputs = InputProcessor(config, self.arch, self.tokenizer, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer)
        eos = self.arch.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        self.eos_token_ids = frozenset(eos)
        self._members: dict[str, _Member] = {}
        self._user_requests: dict[str, list[str]] = {}  # user id -> its live engine request ids
        self._beam_groups: dict[str, BeamSearchGroup] = {}
        self._rng = random.Random(config.model.seed)
        self.worker_id = ""  # set by the serving layer; named in KV transfer params
        self.last_step_num_tokens = 0
        self.step_costs = StepCostModel(self.arch, self.executor.dtype_bytes, config.parallel.tensor_parallel_size)
        self.step_window = StepWindow()
        self.device_peaks = DevicePeaks.resolve(
            self.executor.device_name, config.runner.peak_tflops, config.runner.peak_memory_tbs
        )

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request; raises InvalidRequestError before any work."""
        self.submit(self.prepare(request_id, prompt, params, cache_salt, arrival_time))

    def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        **handover,
    ) -> PreparedRequest:
        """Tokenizes and validates without touching engine state (see InputProcessor.prepare)."""
        return self.inputs.prepare(request_id, prompt, params, cache_salt, arrival_time, **handover)

    def submit(self, prepared: PreparedRequest) -> None:
        """Queues a prepared request (on the thread that runs `step`)."""
        request_id, params, prompt_ids = prepared.request_id, prepared.params, prepared.prompt_token_ids
        if request_id in self._user_requests or request_id in self.outputs.states:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        seed = prepared.seed if prepared.seed is not None else self._rng.getrandbits(63)
        extra_keys = request_extra_keys(prepared.cache_salt)

        def make(
            engine_id: str,
            token_ids: list[int],
            sample_params: SamplingParams,
            sample_seed: int,
            needs_sampling: bool = True,
        ) -> Request:
            return Request(
                engine_id,
                token_ids,
                sample_params,
                self.eos_token_ids,
                prepared.max_tokens,
                sample_seed,
                extra_keys,
                prepared.arrival_time,
                needs_sampling,
            )

        num_samples = params.beam_width if params.use_beam_search else params.n
        self.outputs.add_request(
            request_id, prepared.prompt, prompt_ids, params, prepared.arrival_time, num_samples, prepared.output_prefix
        )
        self._user_requests[request_id] = []
        if params.use_beam_search:
            first = make(f"{request_id}/beam0", prompt_ids, beam_member_params(params), seed)
            self._beam_groups[request_id] = BeamSearchGroup(request_id, params, self.eos_token_ids, [Beam(first, 0.0)])
            self._submit(first, _Member(request_id, 0, "beam"))
        elif params.n == 1:
            request = make(request_id, prompt_ids, params, seed)
            request.kv_lease, request.remote_kv = prepared.kv_lease, prepared.remote_kv
            for token_id in prepared.output_prefix:
                request.append_output_token(token_id)
            self._submit(request, _Member(request_id, 0, "sample"))
        elif len(prompt_ids) == 1:
            for i in range(params.n):
                child = make(f"{request_id}/{i}", prompt_ids, params, _child_seed(seed, i))
                self._submit(child, _Member(request_id, i, "sample"))
        else:
            # Fill the blocks of all but the last prompt token once; the n samples fork from it.
            prefix = make(f"{request_id}/prefix", prompt_ids[:-1], params, seed, needs_sampling=False)
            self._submit(prefix, _Member(request_id, 0, "prefix"))

    def abort_request(self, request_id: str) -> None:
        """Stops a request wherever it is and frees its blocks; its output says "abort"."""
        engine_ids = self._user_requests.pop(request_id, None)
        if engine_ids is None:
            return
        for engine_id in engine_ids:
            self.scheduler.finish_request(engine_id, RequestStatus.FINISHED_ABORTED)
            self._members.pop(engine_id, None)
        self._beam_groups.pop(request_id, None)
        self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._user_requests) or bool(self.outputs.states)

    def needs_polling(self) -> bool:
        """KV transfers in flight or leases held: steps must keep running to see them end."""
        return self.scheduler.handover.is_active

    # -- one step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        if (
            not scheduler_output.is_empty
            or scheduler_output.finished_req_ids
            or scheduler_output.block_copies
            or scheduler_output.has_kv_work
            or self.scheduler.handover.is_active
        ):
            start = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            if not scheduler_output.is_empty:
                self._record_step_cost(scheduler_output, time.perf_counter() - start)
            self._update(scheduler_output, runner_output)
            if runner_output.kv_transfer:
                self.scheduler.update_kv_transfer(runner_output.kv_transfer)
        self._fork_completed_prefixes()
        self.publish_kv_events()
        return self.outputs.take_outputs()

    def publish_kv_events(self) -> None:
        """Hands this step's KV events (and a snapshot, if asked for) to the publisher."""
        events = self.scheduler.take_kv_events()
        if events:
            self.publisher.publish(events)
        if self.publisher.wants_snapshot():
            self.publisher.publish_snapshot(self.scheduler.kv.pool.snapshot())

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        handover = self.scheduler.handover
        step_seconds, mfu, mbu = self.step_window.utilisation(self.device_peaks)
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_waiting_prefill_tokens=self.scheduler.num_waiting_prefill_tokens,
            num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=self.scheduler.num_prefix_cache_queries,
            prefix_cache_hits=self.scheduler.num_prefix_cache_hits,
            num_warm_free_kv_blocks=kv.pool.num_warm_free_blocks,
            num_kv_leases=len(handover.leases),
            num_kv_receiving=len(handover.receiving),
            kv_recv_ok=handover.num_recv_ok,
            kv_recv_failed=handover.num_recv_failed,
            kv_leases_expired=handover.num_leases_expired,
            kv_bytes_received=handover.bytes_received,
            kv_recv_seconds=handover.recv_seconds,
            step_seconds=step_seconds,
            model_flops_utilization=mfu,
            memory_bandwidth_utilization=mbu,
        )

    def _record_step_cost(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        pairs = context = 0
        for request_id, num_queries in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            end = request.num_computed_tokens  # already advanced past this step's tokens
            pairs += num_queries * end - num_queries * (num_queries - 1) // 2  # causal: query i sees end - q + i + 1
            context += end
        flops, num_bytes = self.step_costs.cost(scheduler_output.total_num_scheduled_tokens, pairs, context)
        self.step_window.add(seconds, flops, num_bytes)

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.publisher.close()

    # -- internals --------------------------------------------------------------------

    def _transfer_params(self, request: Request) -> KVTransferParams:
        """Where a decode worker fetches a leased request's prompt K/V."""
        return KVTransferParams(
            transfer_id=request.request_id,
            source_worker_id=self.worker_id,
            source_endpoints=self.executor.kv_endpoints,
            block_ids=tuple(self.scheduler.kv.get_block_ids(request.request_id)),
            num_tokens=request.num_computed_tokens,
            block_size=self.config.cache.block_size,
            tp_size=self.config.parallel.tensor_parallel_size,
        )

    def _submit(self, request: Request, member: _Member) -> None:
        self.scheduler.add_request(request)
        self._adopt(request, member)

    def _adopt(self, request: Request, member: _Member) -> None:
        self._members[request.request_id] = member
        self._user_requests[member.user_id].append(request.request_id)

    def _release(self, request_id: str) -> None:
        member = self._members.pop(request_id, None)
        if member is not None:
            self._user_requests[member.user_id].remove(request_id)
            if not self._user_requests[member.user_id]:
                del self._user_requests[member.user_id]

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        now = time.monotonic()
        for request_id, sampled in runner_output.sampled.items():
            request = self.scheduler.requests.get(request_id)
            member = self._members.get(request_id)
            if request is None or member is None:
                continue  # aborted while the step ran
            if request.first_token_time is None:
                request.first_token_time = now
            if member.kind == "beam":
                group = self._beam_groups[member.user_id]
                if group.report(request_id, sampled):
                    self._advance_beams(group)
                continue
            finished = self.scheduler.append_token(request, sampled.token_id)
            stop_string = self.outputs.on_token(member.user_id, member.index, sampled.token_id, sampled, request)
            if stop_string is not None:
                if finished:  # a length limit and a stop string on the same token: the string wins
                    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_string
                else:
                    self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_string)
                finished = True
            if finished:
                if request.kv_lease and request.status == RequestStatus.FINISHED_LENGTH:
                    self.outputs.set_kv_transfer_params(member.user_id, self._transfer_params(request))
                self.outputs.on_finished(member.user_id, member.index, request)
                self._release(request_id)

    def _fork_completed_prefixes(self) -> None:
        """n > 1: once the shared prompt prefix is computed, fork the n samples from it."""
        for request_id, member in list(self._members.items()):
            if member.kind != "prefix":
                continue
            prefix = self.scheduler.requests[request_id]
            if prefix.status != RequestStatus.RUNNING or prefix.num_computed_tokens < prefix.num_tokens:
                continue
            state = self.outputs.states[member.user_id]
            params, prompt_ids = state.params, state.prompt_token_ids
            for i in range(params.n):
                child = Request(
                    f"{member.user_id}/{i}",
                    prompt_ids,
                    params,
                    self.eos_token_ids,
                    prefix.max_tokens,
                    _child_seed(prefix.seed, i),
                    prefix.extra_keys,
                    prefix.arrival_time,
                )
                self.scheduler.add_forked_request(prefix, child)
                self._adopt(child, _Member(member.user_id, i, "sample"))
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            self._release(request_id)

    def _advance_beams(self, group: BeamSearchGroup) -> None:
        user_id = group.request_id

        def fork(parent: Request, new_id: str) -> Request:
            child = Request(
                new_id,
                parent.prompt_token_ids,
                parent.sampling_params,
                parent.eos_token_ids,
                parent.max_tokens,
                parent.seed,
                parent.extra_keys,
                parent.arrival_time,
                output_token_ids=list(parent.output_token_ids),
            )
            self.scheduler.add_forked_request(parent, child)
            self._adopt(child, _Member(user_id, 0, "beam"))
            return child

        def append(request: Request, token_id: int) -> None:
            self.scheduler.append_token(request, token_id, check_stop=False)

        def drop(request: Request) -> None:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            self._release(request.request_id)

        group.advance(fork, append, drop)
        if group.is_done:
            del self._beam_groups[user_id]
            best = group.best()
            for index in range(group.width):
                if index >= len(best):  # fewer hypotheses than beams (several EOS ids)
                    self.outputs.set_final(user_id, index, [], 0.0, "stop")
                    continue
                hypothesis = best[index]
                ended_by_eos = bool(hypothesis.token_ids) and hypothesis.token_ids[-1] in self.eos_token_ids
                self.outputs.set_final(
                    user_id,
                    index,
                    hypothesis.token_ids,
                    hypothesis.cumulative_logprob,
                    "stop" if ended_by_eos and not group.params.ignore_eos else "length",
                )


def _child_seed(seed: int, index: int) -> int:
    """Sample i of a seeded n > 1 request uses seed + i (as vLLM does)."""
    return (seed + index) % 2**63
