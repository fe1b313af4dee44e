"""Medusa drafting: every head at once on the target's hidden state at the position that
gave the request's newest token, no forward pass of the drafter's own and no KV cache.

For a request with tokens t[0 .. L), the model runner hands back h at position L - 2 (its
logits gave t[L-1]); head j's logits on it propose d_j, the guess for t[L+j]. Each d_j is
drawn through the target's transforms with d_0 .. d_{j-1} as output (draft_sampling.py).
A request whose newest hidden state the step did not produce (it was not scheduled, or was
preempted) drafts nothing until it has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.request import Request
from ..core.scheduler_output import HiddenRows
from ..execution.sampler import LogitBias, Sampler
from .draft_sampling import draft_probs_of, sample_drafts, start_drafting
from .drafter import Drafter, NoKVCache
from .medusa_heads import MedusaHeads


@dataclass(slots=True)
class _HeadState:
    generator: torch.Generator
    logit_bias: LogitBias | None
    hidden: HiddenRows | None = None  # the newest the target handed back


class MedusaProposer(Drafter):
    def __init__(self, heads: MedusaHeads, sampler: Sampler, device: torch.device) -> None:
        super().__init__(None, NoKVCache())  # no KV cache of its own
        self.heads = heads
        self.sampler = sampler
        self.device = device
        self._states: dict[str, _HeadState] = {}

    def take_hidden_states(self, hidden_states: dict[str, HiddenRows]) -> None:
        for request_id, rows in hidden_states.items():
            state = self._states.get(request_id)
            if state is not None:
                state.hidden = rows
            else:
                self._states[request_id] = _HeadState(torch.Generator(device=self.device), None, rows)

    @torch.inference_mode()
    def propose(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        self._probs = {}
        batch, rows = [], []
        for request, room in zip(requests, rooms):
            state = self._states.get(request.request_id)
            if state is None or state.hidden is None or state.hidden.first_position != request.num_tokens - 2:
                continue
            if state.logit_bias is None and request.sampling_params.logit_bias:
                state.logit_bias = LogitBias.build(request.sampling_params.logit_bias, self.device)
            batch.append(start_drafting(request, state.generator, state.logit_bias, room))
            rows.append(state.hidden.rows)
        if batch:
            hidden = torch.cat(rows).to(device=self.device, dtype=self.heads.dtype)
            logits = self.heads(hidden, max(d.room for d in batch))  # [k, B, V]
            for j in range(logits.shape[0]):
                active = [i for i, d in enumerate(batch) if not d.is_done and len(d.drafts) < d.room]
                if not active:
                    break
                index = torch.tensor(active, device=logits.device)
                sample_drafts(self.sampler, [batch[i] for i in active], logits[j, index])
            self._probs = draft_probs_of(batch)
        drafts = {d.request.request_id: d.drafts for d in batch}
        return [drafts.get(r.request_id, []) for r in requests]
