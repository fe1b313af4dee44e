"""Which requests speculate each step, with which drafts, and how well it pays.

After a step, every running request that decodes next gets up to k drafts from the
proposer: n-gram prompt lookup over its own tokens (`ngram`), or a drafter with a model
(drafter.py), batched over those requests: a draft model run k times (`draft_model`,
draft_proposer.py), Medusa heads on the target's last hidden state (`medusa`,
medusa_proposer.py) or an EAGLE drafter run k times on the target's hidden states (`eagle`,
eagle_proposer.py); their q goes with the drafts through `draft_probs`. The hidden states
reach the heads through `take_hidden_states`, after each step. The scheduler schedules them behind the request's last sampled
token; the model runner verifies them (spec_decode/verify.py); `record` then counts what
the target accepted.

Drafts that are rejected cost a verification pass for nothing, so a request whose drafts do
not pay pauses: after every WINDOW drafted tokens, a request that had fewer than MIN_RATE of
them accepted drafts nothing for COOLDOWN steps, twice as long after each further bad window
(up to MAX_COOLDOWN), and back to COOLDOWN after a good one. The same holds for both
methods: a paused request costs the draft model nothing either.

Structured output: drafts are cut at the first token the request's grammar refuses, and
each verified position is masked by the grammar state after the drafts before it
(RequestGrammar.fill_bitmasks looks ahead and rolls the matcher back; the tokens accepted
in the end advance it for real).

Requests that do not speculate: beam search (its beams advance one token per step together),
the prefill side of a P/D handover (it stops at the first token), and the shared-prefix
request of an n > 1 group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..config import SpeculativeConfig
from ..core.request import Request, RequestStatus
from ..core.scheduler_output import HiddenRows
from .drafter import Drafter
from .ngram_proposer import NgramProposer

WINDOW = 8  # drafted tokens per judgement
MIN_RATE = 0.25  # accepted / drafted below which a request pauses
COOLDOWN = 16  # steps without drafts after a first bad window
MAX_COOLDOWN = 256


@dataclass(slots=True)
class _Pacing:
    """One request's recent drafts, and how long it pauses."""

    drafted: int = 0
    accepted: int = 0
    paused_steps: int = 0
    cooldown: int = COOLDOWN

    def judge(self) -> None:
        if self.drafted < WINDOW:
            return
        if self.accepted < MIN_RATE * self.drafted:
            self.paused_steps = self.cooldown
            self.cooldown = min(self.cooldown * 2, MAX_COOLDOWN)
        else:
            self.cooldown = COOLDOWN
        self.drafted = self.accepted = 0


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since the engine started (names follow vLLM's spec_decode_* metrics); the
    rates derived from them are EngineStats.spec_acceptance_rate and _mean_acceptance_length."""

    num_drafts: int = 0  # verification passes: one per request per step with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position j


class Speculator:
    """`drafter`: a draft model's, Medusa heads' or an EAGLE drafter's proposer; None: n-gram lookup."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: Drafter | None = None) -> None:
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)
        self.drafter = drafter
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k)
        self._pacing: dict[str, _Pacing] = {}  # running requests only

    def propose(self, requests: Iterable[Request]) -> None:
        """Sets `spec_token_ids` of every request that decodes next and may speculate."""
        pacing, self._pacing = self._pacing, {}
        drafting: list[tuple[Request, int]] = []
        for request in requests:
            pace = self._pacing[request.request_id] = pacing.get(request.request_id) or _Pacing()
            room = self._room(request)
            if room <= 0:
                continue
            if pace.paused_steps:
                pace.paused_steps -= 1
                continue
            drafting.append((request, room))
        if self.drafter is not None:
            self.drafter.retain(set(self._pacing))
            if drafting:
                batch = [r for r, _ in drafting]
                for request, drafts in zip(batch, self.drafter.propose(batch, [room for _, room in drafting])):
                    request.spec_token_ids = drafts  # drawn under the grammar's masks already
            return
        for request, room in drafting:
            drafts = self.proposer.propose(request.all_token_ids)[:room]
            if request.grammar is not None and drafts:
                drafts = request.grammar.valid_drafts(drafts)  # a draft the grammar refuses can never be accepted
            request.spec_token_ids = drafts

    def take_hidden_states(self, hidden_states: dict[str, HiddenRows]) -> None:
        """The target's hidden states from the step just run (medusa and eagle draft from them)."""
        if self.drafter is not None and hidden_states:
            self.drafter.take_hidden_states(hidden_states)

    def draft_probs(self, spec_token_ids: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """q of the drafts a step verifies ([k, V] per request; absent: one-hot on the drafts)."""
        if self.drafter is None:
            return {}
        probs = {rid: self.drafter.draft_probs(rid, len(drafts)) for rid, drafts in spec_token_ids.items()}
        return {rid: q for rid, q in probs.items() if q is not None}

    def check_integrity(self) -> None:
        if self.drafter is not None:
            self.drafter.check_integrity()

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pace = self._pacing.get(request_id)
        if pace is not None:
            pace.drafted += num_drafts
            pace.accepted += num_accepted
            pace.judge()
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1

    def _room(self, request: Request) -> int:
        """How many drafts the request may verify next step (0: none)."""
        if (
            request.status != RequestStatus.RUNNING
            or request.num_tokens - request.num_computed_tokens != 1
            or not request.needs_sampling
            or request.is_prefill_side
            or request.sampling_params.use_beam_search
        ):
            return 0
        # Every draft accepted still leaves room for the token after them, within max_tokens
        # and the context.
        return min(
            self.k,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
