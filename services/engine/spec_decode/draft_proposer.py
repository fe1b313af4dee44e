"""Draft-model drafting: a smaller model with the target's vocabulary proposes k tokens per
request, one forward pass per token, batched over the requests that speculate this step.

Each request's drafts come with q, the distribution each was drawn from after the same
penalties, masks (grammar included) and sampling transforms as the target applies at that
position (the target's Sampler, fed the drafts before it as output), so the rejection
sampler can check them exactly. Greedy requests draft the argmax and keep no q.

The draft's KV cache is its own (DraftBlockPool). For a request with tokens t[0 .. L):

    draft K/V valid up to c    fed back last time: the drafts d_0 .. d_{k-2}
    pass 0     t[c .. L)       catches up (the whole prompt the first time)  -> d_0, q_0
    pass j     d_{j-1} at L+j-1                                               -> d_j, q_j

c rolls back on rejection: it is where the drafts fed last time stop agreeing with the
tokens the target accepted (at most L - 1: the last token is always fed, for its logits).
Random draws use a generator seeded from the request's seed and L, so a seeded request
drafts the same tokens whatever else runs, even after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.request import Request
from ..execution.sampler import LogitBias, Sampler, SamplingRow
from .draft_blocks import DraftBlockPool
from .draft_runner import DraftRunner, DraftSequence


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


@dataclass(slots=True)
class _Drafting:
    """One request during a propose call."""

    request: Request
    state: _DraftState
    room: int  # drafts wanted
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q of each draft (random requests)
    is_done: bool = False


class DraftProposer:
    def __init__(self, runner: DraftRunner, pool: DraftBlockPool, sampler: Sampler) -> None:
        self.runner = runner
        self.pool = pool
        self.sampler = sampler
        self.block_size = runner.block_size
        self._states: dict[str, _DraftState] = {}
        self._probs: dict[str, torch.Tensor] = {}  # [k, V] q of the last drafts, random requests only

    def retain(self, request_ids: set[str]) -> None:
        """Frees the draft state and blocks of every request not in `request_ids`."""
        for request_id in [r for r in self._states if r not in request_ids]:
            del self._states[request_id]
            self.pool.free(request_id)

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """[num_drafts, V] q of the request's first drafts (None: greedy, one-hot q)."""
        probs = self._probs.get(request_id)
        return None if probs is None else probs[:num_drafts]

    @torch.inference_mode()
    def propose(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Drafts for each request (at most its room; [] where the draft's blocks ran out)."""
        self._probs = {}
        batch: list[_Drafting] = []
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
            if not request.sampling_params.is_greedy:
                state.generator.manual_seed(_draft_seed(request.seed, len(tokens)))
            batch.append(_Drafting(request, state, room))
            sequences.append(DraftSequence(blocks, start, tokens[start:]))
        step = 0
        while sequences:
            active = [d for d in batch if not d.is_done]
            self._sample(active, self.runner.last_logits(sequences))
            step += 1
            sequences = []
            for d in active:
                if d.is_done or len(d.drafts) >= d.room:
                    d.is_done = True
                    continue
                d.state.fed.append(d.drafts[-1])
                position = d.state.num_verified + step - 1
                sequences.append(DraftSequence(self.pool.block_ids(d.request.request_id), position, [d.drafts[-1]]))
        for d in batch:
            if d.probs:
                self._probs[d.request.request_id] = torch.stack(d.probs[: len(d.drafts)])
        drafts = {d.request.request_id: d.drafts for d in batch}
        return [drafts.get(r.request_id, []) for r in requests]

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        assert set(self.pool.request_ids()) <= set(self._states), "draft blocks held by a request without state"

    def _sample(self, active: list[_Drafting], logits: torch.Tensor) -> None:
        """Appends each request's next draft (and its q), through the target's transforms."""
        rows = [self._sampling_row(d) for d in active]
        _, processed = self.sampler.process(logits, rows)
        tokens = processed.argmax(dim=-1).tolist()
        random_rows = [i for i, d in enumerate(active) if not d.request.sampling_params.is_greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            probs = Sampler.probabilities(processed[index], [active[i].request.sampling_params for i in random_rows])
            for j, i in enumerate(random_rows):
                noise = torch.empty_like(probs[j]).exponential_(generator=active[i].state.generator)
                tokens[i] = int((probs[j] / noise).argmax())
                active[i].probs.append(probs[j])
        for d, token in zip(active, tokens):
            d.drafts.append(token)
            params, grammar = d.request.sampling_params, d.request.grammar
            if grammar is not None:
                # A draft after the grammar's end is cut (the row after an end allows anything).
                valid = grammar.valid_drafts(d.drafts)
                if len(valid) < len(d.drafts):
                    d.drafts, d.is_done = valid, True
            stops = params.stop_token_ids if params.ignore_eos else (*params.stop_token_ids, *d.request.eos_token_ids)
            if token in stops and len(d.request.output_token_ids) + len(d.drafts) > params.min_tokens:
                d.is_done = True  # nothing after a stop is ever kept

    @staticmethod
    def _sampling_row(d: _Drafting) -> SamplingRow:
        request = d.request
        # The grammar's state after the drafts so far (a fresh tensor: the matcher is rolled back).
        mask = None if request.grammar is None else request.grammar.fill_bitmasks(d.drafts)[-1:]
        return SamplingRow(
            params=request.sampling_params,
            generator=d.state.generator,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=[*request.output_token_ids, *d.drafts],
            grammar_bitmask=mask,
            logit_bias=d.state.logit_bias,
        )


def _draft_seed(seed: int, num_tokens: int) -> int:
    """A stream apart from the target's (seeded with `seed` itself), one per position."""
    return (seed * 6364136223846793005 + num_tokens * 1442695040888963407 + 0x5DEECE66D) % 2**63
