"""EAGLE drafting: the one-layer drafter (eagle_model.py) runs k passes per request,
batched over the requests that speculate, on the target's hidden states.

For a request with tokens t[0 .. L), the target has handed back h_i for every position
i <= L - 2 it verified (model_runner "all": whole prefill chunks, then the last real
token and the accepted drafts of each step). The drafter's K/V holds the real pairs
(t_{i+1}, h_i) up to `start`:

    pass 0   positions start .. L-2   (t_{i+1}, h_i), the target's      -> g_{L-2} -> d_0, q_0
    pass j   position L-2+j           (d_{j-1}, g_{L-3+j}), its own     -> g       -> d_j, q_j

Passes j >= 1 write K/V from the drafter's own features, which the next step's pass 0
overwrites with the target's (the rollback: a rejected or accepted draft's entry never
stays). The K/V is its own (DraftBlockPool: never hashed, never announced); a request
frees it when it stops running. A request the step did not run, or one whose hidden states
skip positions (preempted and recomputed from a prefix-cache hit), drafts nothing until
its features line up again; after a gap the drafter starts over from the first position it
sees (so its context may lack a prefix-cache hit's tokens: drafts differ, output does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.request import Request
from ..core.scheduler_output import HiddenRows
from ..execution.sampler import LogitBias, Sampler
from .draft_blocks import DraftBlockPool
from .draft_sampling import Drafting, draft_probs_of, sample_drafts, start_drafting
from .drafter import Drafter
from .eagle_runner import EagleRunner, EagleSequence


@dataclass(slots=True)
class _EagleState:
    generator: torch.Generator
    logit_bias: LogitBias | None
    base: int  # position of the request's drafter cache index 0
    start: int  # first position whose pair is not in the drafter's K/V yet
    features: torch.Tensor  # [n, H] the target's h at positions start .. start + n - 1

    @property
    def end(self) -> int:
        return self.start + self.features.shape[0]


class EagleProposer(Drafter):
    def __init__(self, runner: EagleRunner, pool: DraftBlockPool, sampler: Sampler) -> None:
        super().__init__(pool, runner)
        self.sampler = sampler
        self.device = runner.device
        self.block_size = runner.block_size
        self._states: dict[str, _EagleState] = {}

    def take_hidden_states(self, hidden_states: dict[str, HiddenRows]) -> None:
        for request_id, hidden in hidden_states.items():
            if hidden.rows.shape[0] == 0:
                continue
            rows = hidden.rows.to(self.device)
            state = self._states.get(request_id)
            if state is not None and hidden.first_position == state.end:
                state.features = torch.cat([state.features, rows])
                continue
            if state is not None:  # a gap: start over where the target's states begin again
                self.pool.free(request_id)
            generator = torch.Generator(device=self.device)
            self._states[request_id] = _EagleState(
                generator, None, hidden.first_position, hidden.first_position, rows.clone()
            )

    @torch.inference_mode()
    def propose(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        self._probs = {}
        batch: list[Drafting] = []
        sequences: list[EagleSequence] = []
        for request, room in zip(requests, rooms):
            state = self._states.get(request.request_id)
            num_tokens = request.num_tokens
            if state is None or state.end != num_tokens - 1 or state.start == state.end:
                continue
            # Cache indices written: up to position L - 2 for real, then one per draft but the last.
            num_slots = num_tokens + room - 2 - state.base
            blocks = self.pool.grow(request.request_id, -(-num_slots // self.block_size))
            if blocks is None:
                continue
            if state.logit_bias is None and request.sampling_params.logit_bias:
                state.logit_bias = LogitBias.build(request.sampling_params.logit_bias, self.device)
            tokens = request.all_token_ids[state.start + 1 : num_tokens]
            sequences.append(EagleSequence(blocks, state.start - state.base, state.base, tokens, state.features))
            state.start, state.features = num_tokens - 1, state.features[:0]
            batch.append(start_drafting(request, state.generator, state.logit_bias, room))
        active = batch
        step = 0
        while sequences:
            logits, out = self.runner.run(sequences)
            sample_drafts(self.sampler, active, logits)
            step += 1
            sequences, still = [], []
            for i, d in enumerate(active):
                if d.is_done or len(d.drafts) >= d.room:
                    d.is_done = True
                    continue
                state = self._states[d.request.request_id]
                position = d.request.num_tokens - 2 + step
                blocks = self.pool.block_ids(d.request.request_id)
                sequences.append(
                    EagleSequence(blocks, position - state.base, state.base, [d.drafts[-1]], out[i : i + 1])
                )
                still.append(d)
            active = still
        self._probs = draft_probs_of(batch)
        drafts = {d.request.request_id: d.drafts for d in batch}
        return [drafts.get(r.request_id, []) for r in requests]
