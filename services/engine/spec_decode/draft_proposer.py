"""Draft-model drafting: a smaller model with the target's vocabulary proposes k tokens per
request, one forward pass per token, batched over the requests that speculate this step.

Each request's drafts come with q, drawn through the target's sampling transforms
(draft_sampling.py); greedy requests draft the argmax and keep no q.

The draft's KV cache is its own (DraftBlockPool). For a request with tokens t[0 .. L):

    draft K/V valid up to c    fed back last time: the drafts d_0 .. d_{k-2}
    pass 0     t[c .. L)       catches up (the whole prompt the first time)  -> d_0, q_0
    pass j     d_{j-1} at L+j-1                                               -> d_j, q_j

c rolls back on rejection: it is where the drafts fed last time stop agreeing with the
tokens the target accepted (at most L - 1: the last token is always fed, for its logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.request import Request
from ..execution.sampler import LogitBias, Sampler
from .draft_blocks import DraftBlockPool
from .draft_runner import DraftRunner, DraftSequence
from .draft_sampling import Drafting, draft_probs_of, sample_drafts, start_drafting
from .drafter import Drafter


@dataclass(slots=True)
class _DraftState:
    """What one request's draft K/V holds: `num_verified` real tokens, then `fed` drafts."""

    generator: torch.Generator
    logit_bias: LogitBias | None  # the request's, on the draft's device
    num_verified: int = 0
    fed: list[int] = field(default_factory=list)

    def num_valid(self, token_ids: list[int]) -> int:
        """Positions whose draft K/V matches the request's tokens (rolled back past a rejection)."""
        valid = self.num_verified
        for draft in self.fed:
            if valid >= len(token_ids) - 1 or token_ids[valid] != draft:
                break
            valid += 1
        return min(valid, len(token_ids) - 1)


class DraftProposer(Drafter):
    def __init__(self, runner: DraftRunner, pool: DraftBlockPool, sampler: Sampler) -> None:
        super().__init__(pool, runner)
        self.sampler = sampler
        self.block_size = runner.block_size
        self._states: dict[str, _DraftState] = {}

    @torch.inference_mode()
    def propose(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Drafts for each request (at most its room; [] where the draft's blocks ran out)."""
        self._probs = {}
        batch: list[Drafting] = []
        sequences: list[DraftSequence] = []
        for request, room in zip(requests, rooms):
            state = self._states.get(request.request_id)
            if state is None:
                state = self._states[request.request_id] = _DraftState(
                    torch.Generator(device=self.runner.device),
                    LogitBias.build(request.sampling_params.logit_bias, self.runner.device),
                )
            tokens = request.all_token_ids
            start = state.num_valid(tokens)
            # Positions written: the real tokens, then every draft but the last.
            blocks = self.pool.grow(request.request_id, -(-(len(tokens) + room - 1) // self.block_size))
            if blocks is None:
                continue
            state.num_verified, state.fed = len(tokens), []
            batch.append(start_drafting(request, state.generator, state.logit_bias, room))
            sequences.append(DraftSequence(blocks, start, tokens[start:]))
        step = 0
        while sequences:
            active = [d for d in batch if not d.is_done]
            sample_drafts(self.sampler, active, self.runner.last_logits(sequences))
            step += 1
            sequences = []
            for d in active:
                if d.is_done or len(d.drafts) >= d.room:
                    d.is_done = True
                    continue
                state = self._states[d.request.request_id]
                state.fed.append(d.drafts[-1])
                position = state.num_verified + step - 1
                sequences.append(DraftSequence(self.pool.block_ids(d.request.request_id), position, [d.drafts[-1]]))
        self._probs = draft_probs_of(batch)
        drafts = {d.request.request_id: d.drafts for d in batch}
        return [drafts.get(r.request_id, []) for r in requests]
