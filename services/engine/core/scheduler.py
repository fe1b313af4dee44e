"""Iteration-level scheduler: continuous batching, chunked prefill, preemption.

One rule covers prefill, decode and chunked prefill: every step, a request computes up to
`num_tokens - num_computed_tokens` of its tokens (its prompt at first, then the token it
last sampled), within the step's token budget. Each step:

  1. running requests that are decoding (one token left), oldest first, so a long prompt
     never starves them; then running requests in the middle of their prompt;
  2. waiting requests, oldest first, with their prefix-cache hit, while budget, sequence
     slots (a request receiving its K/V holds one) and blocks last.

When a running request cannot get a block, the most recently admitted running request
(not yet scheduled this step) is preempted: its blocks are freed and it goes back to the
head of the queue, to be recomputed later (its cached prefix usually survives).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ...kv_transfer.types import KVTransferStatus
from ..api.handover import continues_after_prefill
from ..config import CacheConfig, SchedulerConfig
from .kv_cache_manager import KVCacheManager
from .kv_events import KVEvent
from .kv_handover import KVHandover
from .request import Request, RequestStatus
from .scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass(slots=True)
class _RunnerView:
    num_tokens: int  # the runner holds all_token_ids[:num_tokens]
    num_blocks: int  # and the first num_blocks of its block table


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int, max_model_len: int, lease_s: float = 30.0
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = cache.block_size
        self.kv = KVCacheManager(cache.block_size, num_blocks, cache.enable_prefix_caching, cache.warm_window_s)
        self.handover = KVHandover(self.kv, lease_s)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # What the model runner holds of each request; absent: nothing.
        self._runner_views: dict[str, _RunnerView] = {}
        # Requests the runner holds without blocks (preempted): resent with a full table.
        self._needs_full_table: set[str] = set()
        self._finished_since_last: set[str] = set()
        self._preempted_since_last: set[str] = set()
        # Prefix-cache effectiveness, counted when requests are admitted.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0

    # -- queries ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_prefill_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def running_requests(self) -> list[Request]:
        return list(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.get_block_ids(request_id)

    @property
    def has_kv_transfers(self) -> bool:
        """KV transfers in flight or leases held: steps must keep running to see them end."""
        return self.handover.is_active

    def kv_snapshot(self):
        """Every cached block hash, for a publisher that asks for a full snapshot."""
        return self.kv.pool.snapshot()

    def stats(self) -> dict[str, int | float]:
        """This scheduler's share of `EngineStats`: queues, KV cache and handover counters."""
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_waiting_prefill_tokens": self.num_waiting_prefill_tokens,
            "num_free_kv_blocks": self.kv.num_free_blocks,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.num_prefix_cache_queries,
            "prefix_cache_hits": self.num_prefix_cache_hits,
            "num_warm_free_kv_blocks": self.kv.pool.num_warm_free_blocks,
            **self.handover.stats(),
        }

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    # -- request lifecycle ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_forked_request(self, parent: Request, child: Request) -> None:
        """Starts `child` running on the parent's blocks (shared, copied on write)."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        assert (
            child.all_token_ids[: parent.num_computed_tokens] == parent.all_token_ids[: parent.num_computed_tokens]
        ), "a fork must share the parent's computed tokens"
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = max(parent.num_cached_tokens, 0)
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)

    def append_token(self, request: Request, token_id: int, check_stop: bool = True) -> bool:
        """Appends a sampled token; returns True if it finished the request."""
        request.append_output_token(token_id)
        if not check_stop:
            return False
        status, stop_reason = self._stop_status(request, token_id)
        if status is not None:
            self.finish_request(request.request_id, status, stop_reason)
            return True
        return False

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> Request | None:
        """Ends a request (stop, length or abort) and frees its blocks, or leases them when a
        prefilled request continues on a decode worker; idempotent."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        receiving = request.status == RequestStatus.WAITING_FOR_REMOTE_KV
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif receiving:
            self.handover.park(request)  # its blocks are freed once the receive ends
        else:
            self.waiting.remove(request)
        request.status = status
        request.stop_reason = stop_reason
        if (
            request.is_prefill_side
            and status == RequestStatus.FINISHED_LENGTH
            and continues_after_prefill(request.max_tokens, request.num_output_tokens, stopped=False)
        ):
            self.handover.lease(request)  # the decode side fetches the prompt's K/V from these blocks
        elif not receiving:
            self.kv.free(request)
        self._needs_full_table.discard(request_id)
        if self._runner_views.pop(request_id, None) is not None:
            self._finished_since_last.add(request_id)
        return request

    def stop(self, request: Request, stop_reason: str | None = None) -> None:
        """A stop the output processor sees (a stop string, a completed grammar) ends the
        request; on the token that also hit a length limit the stop wins, and a lease taken
        for a decode worker is given back."""
        if not request.is_finished:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop_reason)
            return
        if stop_reason is None and request.status == RequestStatus.FINISHED_STOPPED:
            return  # a completed grammar after EOS or a stop token: keep that reason
        request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_reason
        self.handover.release(request.request_id)

    def is_leased(self, request_id: str) -> bool:
        """Whether a finished request's blocks wait for a decode worker."""
        return request_id in self.handover.leases

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.pool.take_events()

    def update_kv_transfer(self, status: KVTransferStatus) -> None:
        """Applies the runners' transfer report: received prompts start running (or recompute)."""
        self.running.extend(self.handover.on_status(status))

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        preempted_now = False
        self.handover.expire(time.monotonic())

        # 1. Running requests: decodes first, then prompts in the middle of a chunked prefill.
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                continue  # waiting on its group (beam search) or done filling blocks
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim(scheduled, request)
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
                if request.spec_token_ids:  # the budget may have cut the drafts short
                    if num_new > 1:
                        spec[request.request_id] = request.spec_token_ids[: num_new - 1]
                    request.spec_token_ids = []

        # 2. Waiting requests, unless this step had to preempt (memory is short).
        while self.waiting and not preempted_now and budget > 0 and self._has_free_seq_slot():
            request = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if request.remote_kv is not None and request.kv_path is None and self.handover.accepts(request):
                if not self._start_receiving(request, hits, num_hit_tokens):
                    break
                continue
            num_new = request.num_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._cap_chunk(num_new, budget)
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.num_prefix_cache_queries += request.num_tokens
            self.num_prefix_cache_hits += num_hit_tokens
            scheduled[request.request_id] = num_new
            budget -= num_new

        return self._make_output(scheduled, spec)

    def preempt_running(self) -> list[str]:
        """Sends every running request back to the queue, its K/V freed, to be recomputed when
        it is next scheduled (a weight update: K/V of the old weights must not be read on)."""
        preempted = list(self.running)
        for request in reversed(preempted):  # appendleft: the queue keeps their order
            self._preempt(request)
        return [request.request_id for request in preempted]

    def settle_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """After a step verified `num_drafts` drafts: the rejected ones' slots hold K/V of
        tokens that never happened, so they count as not computed (the next ones overwrite)."""
        request.num_computed_tokens -= num_drafts - num_accepted

    # -- internals --------------------------------------------------------------------

    def _has_free_seq_slot(self) -> bool:
        return len(self.running) + len(self.handover.receiving) < self.config.max_num_seqs

    def _start_receiving(self, request: Request, hits, num_hit_tokens: int) -> bool:
        """Decode side: blocks for the whole prompt now, its K/V from the prefill worker next.
        The blocks are registered in the prefix cache only once the K/V has arrived."""
        num_remote = request.remote_kv.num_tokens - num_hit_tokens
        if self.kv.allocate_slots(request, num_remote, hits, cache_new_blocks=False) is None:
            return False
        self.waiting.popleft()
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        self.num_prefix_cache_queries += request.num_tokens
        self.num_prefix_cache_hits += num_hit_tokens
        self.handover.start_recv(request)
        return True

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if num_new == 1:
            num_new += len(request.spec_token_ids)  # a decode verifies its drafts in the same pass
        return self._cap_chunk(num_new, budget)

    def _cap_chunk(self, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            num_tokens = min(num_tokens, threshold)
        return min(num_tokens, budget)

    def _pick_victim(self, scheduled: dict[str, int], current: Request) -> Request:
        """The most recently admitted running request not scheduled yet in this step."""
        for request in reversed(self.running):
            if request is current or request.request_id not in scheduled:
                return request
        return current

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        if request.request_id in self._runner_views:
            self._preempted_since_last.add(request.request_id)
            self._needs_full_table.add(request.request_id)

    def _stop_status(self, request: Request, token_id: int) -> tuple[RequestStatus | None, int | None]:
        params = request.sampling_params
        # Before min_tokens the sampler masks EOS and stop tokens; this guard mirrors it.
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
            or request.is_prefill_side  # the rest is decoded elsewhere
        ):
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _make_output(self, scheduled: dict[str, int], spec: dict[str, list[int]]) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        rewritten = self.kv.take_rewritten()
        now = time.monotonic()
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            view = self._runner_views.get(request_id)
            block_ids = self.kv.get_block_ids(request_id)
            if view is None:
                new_reqs.append(
                    NewRequestData(
                        request_id=request_id,
                        token_ids=list(request.all_token_ids),
                        num_prompt_tokens=request.num_prompt_tokens,
                        sampling_params=request.sampling_params,
                        block_ids=block_ids,
                        num_computed_tokens=request.num_computed_tokens,
                        seed=request.seed,
                        needs_sampling=request.needs_sampling,
                    )
                )
            else:
                full_table = request_id in self._needs_full_table or request_id in rewritten
                cached_reqs.append(
                    CachedRequestData(
                        request_id=request_id,
                        new_token_ids=request.all_token_ids[view.num_tokens :],
                        new_block_ids=[] if full_table else block_ids[view.num_blocks :],
                        block_ids=block_ids if full_table else None,
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            self._runner_views[request_id] = _RunnerView(request.num_tokens, len(block_ids))
            self._needs_full_table.discard(request_id)
            request.num_computed_tokens += num_new
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        leases_added, leases_removed, recvs = self.handover.take_updates()
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=self._finished_since_last,
            preempted_req_ids=self._preempted_since_last,
            block_copies=self.kv.take_block_copies(),
            kv_leases_added=leases_added,
            kv_leases_removed=leases_removed,
            kv_recvs=recvs,
            spec_token_ids=spec,
        )
        self._finished_since_last = set()
        self._preempted_since_last = set()
        return output
