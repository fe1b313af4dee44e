"""The engine loop's body: add requests, run steps, abort. One owner thread at a time.

A step reads: schedule -> run the model -> update requests -> publish KV events:

    scheduler_output = scheduler.schedule()
    runner_output    = executor.execute_model(scheduler_output)
    self._update(runner_output)

How a user request becomes engine requests (n > 1, beam search) is core/request_group.py's.
"""

from __future__ import annotations

import logging
import time

from ..kv_transfer.types import KVTransferParams
from ..model.config import ModelArch, load_model_arch
from .api.handover import Handover
from .api.input_processor import InputProcessor, PreparedRequest
from .api.output_processor import OutputProcessor
from .api.outputs import RequestOutput
from .api.sampling_params import SamplingParams
from .api.tokenizer import load_tokenizer
from .config import EngineConfig
from .core.kv_events import KVEventPublisher, NullKVEventPublisher
from .core.request import Request
from .core.request_group import MemberKind, RequestGroups
from .core.scheduler import Scheduler
from .core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from .engine_setup import check_engine_config, create_executor, create_speculator, resolve_max_model_len
from .errors import InvalidRequestError
from .execution.executor import Executor
from .stats import EngineStats
from .step_metrics import DevicePeaks, StepCostModel, StepWindow
from .structured_output.grammar_compiler import GrammarCompiler
from .weight_updates import WeightUpdates

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        kv_event_publisher: KVEventPublisher | None = None,
        executor: Executor | None = None,
        worker_id: str = "",
    ) -> None:
        """`worker_id`: the serving layer's name for this engine, named in KV transfer
        params and outputs ("" offline)."""
        self.config = config
        self.arch: ModelArch = load_model_arch(config.model.model)
        check_engine_config(config, self.arch)
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        self.executor = executor or create_executor(config, self.arch)
        self.num_kv_blocks = self.executor.num_kv_blocks
        self.max_model_len = resolve_max_model_len(config, self.arch, self.num_kv_blocks)
        if config.runner.cuda_graphs:
            max_model_len = self.max_model_len
            self.executor.run_on_ranks(lambda rank: rank.capture_decode_graphs(max_model_len))
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.num_kv_blocks, self.max_model_len, config.kv_transfer.lease_s
        )
        self.scheduler.handover.kv_cache_dtype = self.executor.kv_cache_dtype
        self.publisher = kv_event_publisher or NullKVEventPublisher()
        eos = frozenset(
            self.arch.eos_token_ids
            or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, eos, config.structured_output)
        self.inputs = InputProcessor(config, self.arch, self.tokenizer, self.max_model_len, self.grammars)
        self.worker_id = worker_id
        self.speculator = create_speculator(config, self.arch, self.tokenizer, self.max_model_len, self.num_kv_blocks)
        self.outputs = OutputProcessor(self.tokenizer, worker_id, self.config.scheduler.stream_interval)
        self.groups = RequestGroups(
            self.scheduler, self.outputs, eos, self.arch.vocab_size, config.model.seed, self._transfer_params
        )
        # Structured output: prepared requests whose grammar is still compiling, and those
        # whose grammar failed (handed to the caller by take_failures).
        self.waiting_for_grammar: list[PreparedRequest] = []
        self._failures: list[tuple[str, InvalidRequestError]] = []
        self.last_step_num_tokens = 0
        self.step_costs = StepCostModel(
            self.arch, self.executor.dtype_bytes, config.parallel.tensor_parallel_size, self.executor.kv_cache_dtype
        )
        self.step_window = StepWindow()
        self.device_peaks = DevicePeaks.resolve(
            self.executor.device_name, config.runner.peak_tflops, config.runner.peak_memory_tbs
        )
        # Weight updates, pause and sleep (weight_updates.py), called between steps.
        self.weights = WeightUpdates(self)

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
        handover: Handover | None = None,
    ) -> PreparedRequest:
        """Tokenizes and validates without touching engine state (see InputProcessor.prepare)."""
        return self.inputs.prepare(request_id, prompt, params, cache_salt, arrival_time, handover)

    def submit(self, prepared: PreparedRequest) -> None:
        """Queues a prepared request (on the thread that runs `step`); one whose grammar is
        still compiling waits beside the scheduler until it is ready. While generation is
        paused it is held; while asleep it is refused (EngineSleepingError)."""
        self.weights.check_accepting()
        if self.weights.hold(prepared):
            return
        if prepared.grammar is not None and not prepared.grammar.done():
            if self.groups.is_known(prepared.request_id) or self._is_compiling(prepared.request_id):
                raise InvalidRequestError("request_id", f"{prepared.request_id!r} is already in use")
            self.waiting_for_grammar.append(prepared)
            return
        self.groups.add(prepared)

    def abort_request(self, request_id: str) -> None:
        """Stops a request wherever it is and frees its blocks; its output says "abort"."""
        held = self.weights.take_held(request_id)
        if held is not None:
            self.groups.add(held)  # registered only to end with an "abort" output like any other
        self.waiting_for_grammar = [p for p in self.waiting_for_grammar if p.request_id != request_id]
        self.groups.abort(request_id)

    def abort_all(self) -> None:
        """Aborts every request in flight (pause_generation("abort")); one still compiling its
        grammar fails with an error, as it has no output to end."""
        for prepared in self.waiting_for_grammar:
            self._failures.append(
                (prepared.request_id, InvalidRequestError("request", "aborted by pause_generation('abort')"))
            )
        self.waiting_for_grammar = []
        for request_id in list(self.groups.groups):
            self.groups.abort(request_id)

    def take_failures(self) -> list[tuple[str, InvalidRequestError]]:
        """Requests refused after `submit` (their grammar failed to compile or timed out)."""
        failures, self._failures = self._failures, []
        return failures

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self.outputs.states) or bool(self.waiting_for_grammar)

    def needs_step(self) -> bool:
        """Whether `step` has anything to do (the async loop idles otherwise): requests to run,
        unless paused with "keep" or asleep, or outputs to hand out."""
        if self.weights.stashed:
            return True
        if not self.weights.halts_steps:
            return self.has_unfinished_requests()
        return any(state.touched for state in self.outputs.states.values())  # aborts while held

    def needs_polling(self) -> bool:
        """KV transfers in flight or leases held: steps must keep running to see them end."""
        return self.scheduler.has_kv_transfers

    # -- one step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.weights.halts_steps:  # paused with "keep" or asleep: only aborts report
            self.last_step_num_tokens = 0
            self.publish_kv_events()
            return self.weights.stamp(self.outputs.take_outputs())
        if self.waiting_for_grammar:
            self._admit_compiled()
        scheduler_output = self.scheduler.schedule()
        scheduler_output.grammar_bitmasks = self.groups.grammar_bitmasks(scheduler_output)
        if self.speculator is not None:
            scheduler_output.spec_draft_probs = self.speculator.draft_probs(scheduler_output.spec_token_ids)
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        if (
            not scheduler_output.is_empty
            or scheduler_output.finished_req_ids
            or scheduler_output.block_copies
            or scheduler_output.has_kv_work
            or self.scheduler.has_kv_transfers
        ):
            start = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            if not scheduler_output.is_empty:
                self._record_step_cost(scheduler_output, time.perf_counter() - start)
            self._update(scheduler_output, runner_output)
            if self.speculator is not None:
                self.speculator.take_hidden_states(runner_output.hidden_states)
            if runner_output.kv_transfer:
                self.scheduler.update_kv_transfer(runner_output.kv_transfer)
        self.groups.fork_completed_prefixes()
        if self.speculator is not None:
            self.speculator.propose(self._may_speculate())
        self.publish_kv_events()
        return self.weights.stamp(self.outputs.take_outputs())

    def publish_kv_events(self) -> None:
        """Hands this step's KV events (and a snapshot, if asked for) to the publisher."""
        events = self.scheduler.take_kv_events()
        if events:
            self.publisher.publish(events)
        if self.publisher.wants_snapshot():
            self.publisher.publish_snapshot(self.scheduler.kv_snapshot())

    def stats(self) -> EngineStats:
        step_seconds, mfu, mbu = self.step_window.utilisation(self.device_peaks)
        spec = {}
        if self.speculator is not None:
            s = self.speculator.stats
            spec = {
                "spec_num_drafts": s.num_drafts,
                "spec_num_draft_tokens": s.num_draft_tokens,
                "spec_num_accepted_tokens": s.num_accepted_tokens,
                "spec_accepted_per_position": tuple(s.accepted_per_position),
            }
            if (drafter := self.speculator.drafter) is not None and drafter.pool is not None:
                spec["num_draft_kv_blocks"] = drafter.pool.num_blocks
                spec["num_free_draft_kv_blocks"] = drafter.pool.num_free_blocks
        return EngineStats(
            **self.scheduler.stats(),
            **spec,
            num_kv_blocks=self.num_kv_blocks,
            step_seconds=step_seconds,
            model_flops_utilization=mfu,
            memory_bandwidth_utilization=mbu,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.speculator is not None:
            self.speculator.check_integrity()  # the draft model's own blocks

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
        self.publisher.close()

    # -- internals --------------------------------------------------------------------

    def _is_compiling(self, request_id: str) -> bool:
        return any(p.request_id == request_id for p in self.waiting_for_grammar)

    def _admit_compiled(self) -> None:
        """Queues the requests whose grammar compiled; fails those whose grammar did not."""
        now, still_compiling = time.monotonic(), []
        for prepared in self.waiting_for_grammar:
            timed_out = prepared.grammar_timed_out(now)
            if timed_out is not None:
                self._failures.append((prepared.request_id, timed_out))
            elif not prepared.grammar.done():
                still_compiling.append(prepared)
            else:
                try:
                    self.groups.add(prepared)
                except InvalidRequestError as error:
                    self._failures.append((prepared.request_id, error))
        self.waiting_for_grammar = still_compiling

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        now = time.monotonic()
        drafts = scheduler_output.spec_token_ids
        for request_id, sampled in runner_output.sampled.items():
            num_drafts = len(drafts.get(request_id, ()))
            request = self.scheduler.get_request(request_id) if num_drafts else None
            if request is not None:  # None: aborted while the step ran
                self.scheduler.settle_drafts(request, num_drafts, len(sampled) - 1)
                self.speculator.record(request_id, num_drafts, len(sampled) - 1)
            self.groups.on_sampled(request_id, sampled, now)

    def _may_speculate(self) -> list[Request]:
        """Running requests other than beams (a group's beams advance one token per step
        together; their params say greedy, not beam search)."""
        members = self.groups.members
        return [
            r
            for r in self.scheduler.running_requests()
            if (member := members.get(r.request_id)) is None or member.kind is not MemberKind.BEAM
        ]

    def _record_step_cost(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        pairs = context = 0
        for request_id, num_queries in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.get_request(request_id)
            if request is None:
                continue
            end = request.num_computed_tokens  # already advanced past this step's tokens
            pairs += num_queries * end - num_queries * (num_queries - 1) // 2  # causal: query i sees end - q + i + 1
            context += end
        flops, num_bytes = self.step_costs.cost(scheduler_output.total_num_scheduled_tokens, pairs, context)
        self.step_window.add(seconds, flops, num_bytes)

    def _transfer_params(self, request: Request) -> KVTransferParams:
        """Where a decode worker fetches a leased request's prompt K/V."""
        return KVTransferParams(
            transfer_id=request.request_id,
            source_worker_id=self.worker_id,
            source_endpoints=self.executor.kv_endpoints,
            block_ids=tuple(self.scheduler.block_ids(request.request_id)),
            num_tokens=request.num_computed_tokens,
            block_size=self.config.cache.block_size,
            tp_size=self.config.parallel.tensor_parallel_size,
            weight_version=self.weights.weight_version,
            kv_cache_dtype=self.executor.kv_cache_dtype,
        )
