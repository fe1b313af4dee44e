"""A request's state inside the engine: tokens, progress, and how it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ...kv_transfer.types import KVTransferParams
from ..api.handover import Handover, KVPath
from ..api.sampling_params import SamplingParams
from ..structured_output.request_grammar import RequestGrammar
from .block_hash import BlockHash, ExtraKeys, hash_request_tokens


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # decode side of a handover: blocks allocated, KV in flight
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved against the context limit
    seed: int = 0  # sampling seed: the user's, or one the engine drew
    extra_keys: ExtraKeys = ()  # first-block hash keys (cache salt)
    arrival_time: float = field(default_factory=time.monotonic)
    # Whether the engine samples when this request reaches the end of its tokens. Off for
    # the shared-prefix request of an n > 1 group, which only fills the prompt's blocks.
    needs_sampling: bool = True
    # Disaggregation: the prefill side ends at the first token (its blocks leased if it goes
    # on); the decode side receives the prompt's K/V before it runs.
    handover: Handover | None = None
    grammar: RequestGrammar | None = None  # structured output: what the output has matched so far

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not scheduled yet)
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    block_hashes: list[BlockHash] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    kv_path: KVPath | None = None  # decode side: TRANSFERRED or RECOMPUTED once known; MIGRATED
    # Speculative decoding: draft tokens proposed for the next step, verified there. They are
    # never in all_token_ids (nor hashed into the prefix cache) until the target accepts them.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        if self.handover is not None and self.handover.is_resume:
            self.kv_path = KVPath.MIGRATED  # recomputed here from prompt + the tokens already streamed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill_side(self) -> bool:
        return self.handover is not None and self.handover.is_prefill

    @property
    def remote_kv(self) -> KVTransferParams | None:
        """Decode side of a handover: where the prompt's K/V is."""
        return None if self.handover is None else self.handover.remote_kv

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of every full block of the request's tokens (computed incrementally)."""
        if len(self.block_hashes) < self.num_tokens // block_size:
            self.block_hashes = hash_request_tokens(
                self.all_token_ids, block_size, self.extra_keys, start=self.block_hashes
            )
        return self.block_hashes
