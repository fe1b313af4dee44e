"""The typed contracts of one engine step: scheduler -> model runner -> scheduler.

The model runner keeps each request's tokens and block table between steps, so the
scheduler sends a request in full once (`NewRequestData`) and afterwards only what
changed (`CachedRequestData`). The same objects go to every tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kv_transfer.types import KVRecvTask, KVTransferStatus
from ..api.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt + any output so far (a request resumed after preemption)
    num_prompt_tokens: int  # penalties treat token_ids[:num_prompt_tokens] as the prompt
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens whose K/V are already in those blocks (prefix hit)
    seed: int  # per-request sampling seed (the user's, or one drawn by the engine)
    needs_sampling: bool = True  # False: fill the blocks, produce no token


@dataclass(slots=True)
class CachedRequestData:
    request_id: str
    new_token_ids: list[int]  # tokens appended since the runner last saw the request
    new_block_ids: list[int]  # blocks appended to its table
    block_ids: list[int] | None  # the whole table, when it changed in place (resume, copy on write)
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    # Requests the runner has not seen (or has dropped since), in full.
    scheduled_new_reqs: list[NewRequestData]
    # Requests the runner already holds: only what changed.
    scheduled_cached_reqs: list[CachedRequestData]
    # Tokens to compute this step, per request; the batch order is this dict's order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted since the last step: the runner drops their blocks, keeps their state.
    preempted_req_ids: set[str] = field(default_factory=set)
    # KV block copies (src, dst) to perform before the forward pass (copy on write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Prefill side: blocks now leased for a decode worker to fetch (transfer id -> blocks) ...
    kv_leases_added: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # ... and leases ended (the blocks may be reused once the runner stops serving them).
    kv_leases_removed: list[str] = field(default_factory=list)
    # Decode side: prompts whose K/V to fetch into already allocated blocks.
    kv_recvs: list[KVRecvTask] = field(default_factory=list)
    # Structured output: the allowed next tokens (int32 bitmask rows) of each constrained
    # request that samples this step: [1, words], or [k + 1, words] with k drafts.
    grammar_bitmasks: dict[str, torch.Tensor] = field(default_factory=dict)
    # Speculative decoding: the draft tokens each request verifies this step. Its scheduled
    # tokens are its last sampled token followed by these.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # ... and the distribution q each was drawn from ([k, V] per request), from a draft model
    # sampling at temperature > 0; absent: q is one-hot on the drafts (n-gram, greedy).
    spec_draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_kv_work(self) -> bool:
        return bool(self.kv_leases_added or self.kv_leases_removed or self.kv_recvs)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float  # raw log-softmax of the model's logits
    rank: int  # 1 = most likely token
    # Top-N (token id, logprob), most likely first; empty unless logprobs were asked for.
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # On a request's first token when it asked for prompt logprobs: one entry per prompt
    # token after the first, each that token's logprob given the tokens before it.
    prompt_logprobs: list[SampledToken] | None = None


@dataclass(slots=True)
class HiddenRows:
    """The target's final hidden states (after its last norm, as fed to the LM head) at
    consecutive positions of one request: what Medusa heads and an EAGLE drafter draft from."""

    first_position: int
    rows: torch.Tensor  # [num_positions, hidden_size]


@dataclass(slots=True)
class ModelRunnerOutput:
    # One entry per request that reached the end of its tokens this step: the token it
    # sampled, or with drafts the accepted drafts and the one token after them.
    sampled: dict[str, list[SampledToken]]
    # KV transfers that ended since the last step (None without a connector).
    kv_transfer: KVTransferStatus | None = None
    # Speculative methods medusa / eagle only (rank 0): per request, the hidden states at
    # its last accepted position (medusa) or at every position this step verified (eagle).
    hidden_states: dict[str, HiddenRows] = field(default_factory=dict)
