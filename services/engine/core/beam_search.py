"""Beam search over forked requests that share KV blocks by reference counting.

Every live beam is an engine request that computes one token per step and reports the
top 2W log-probabilities of its next token. Once all W beams have reported, the group
picks the next beams the way Hugging Face does:

  candidates = {(beam, token): beam.score + logprob(token)}, best 2W of them
  EOS candidates ranked below W finish as hypotheses; the others, best first, fill W beams
  a beam chosen k > 1 times is forked k - 1 times (blocks shared, copied on write)
  a beam not chosen is freed

Scores are cumulative raw log-probabilities; a finished beam is ranked by
score / num_generated_tokens ** length_penalty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..api.sampling_params import SamplingParams
from .request import Request
from .scheduler_output import SampledToken


@dataclass(slots=True)
class Beam:
    request: Request
    score: float  # cumulative logprob of its generated tokens


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float


@dataclass(slots=True)
class BeamSearchGroup:
    request_id: str
    params: SamplingParams  # the user's (use_beam_search=True)
    eos_token_ids: frozenset[int]
    beams: list[Beam]
    finished: list[Hypothesis] = field(default_factory=list)
    reports: dict[str, SampledToken] = field(default_factory=dict)
    num_forks: int = 0

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def is_done(self) -> bool:
        return not self.beams

    def report(self, request_id: str, sampled: SampledToken) -> bool:
        """Stores one beam's candidates; True once every live beam has reported."""
        self.reports[request_id] = sampled
        return all(b.request.request_id in self.reports for b in self.beams)

    def advance(
        self,
        fork: Callable[[Request, str], Request],
        append: Callable[[Request, int], None],
        drop: Callable[[Request], None],
    ) -> None:
        """Chooses the next beams. `fork(parent, new_id)` copies a beam (sharing its blocks),
        `append` adds a token to a beam, `drop` frees a beam."""
        candidates = []
        for order, beam in enumerate(self.beams):
            for token_id, logprob in self.reports[beam.request.request_id].top_logprobs:
                candidates.append((beam.score + logprob, order, beam, token_id))
        self.reports.clear()
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam order
        chosen: dict[int, list[tuple[float, int]]] = {}
        num_chosen = 0
        for rank, (score, _, beam, token_id) in enumerate(candidates[: 2 * self.width]):
            if token_id in self.eos_token_ids and not self.params.ignore_eos:
                if rank < self.width:
                    self._add_hypothesis(beam.request.output_token_ids + [token_id], score)
                continue
            chosen.setdefault(id(beam), []).append((score, token_id))
            num_chosen += 1
            if num_chosen == self.width:
                break

        next_beams: list[Beam] = []
        for beam in self.beams:
            picks = chosen.get(id(beam))
            if not picks:
                drop(beam.request)
                continue
            for score, token_id in picks[1:]:  # forks first: they copy the tokens before the append
                self.num_forks += 1
                child = fork(beam.request, f"{self.request_id}/beam{self.num_forks}")
                append(child, token_id)
                next_beams.append(Beam(child, score))
            append(beam.request, picks[0][1])
            next_beams.append(Beam(beam.request, picks[0][0]))
        next_beams.sort(key=lambda b: -b.score)
        self.beams = next_beams

        num_generated = len(self.beams[0].request.output_token_ids) if self.beams else 0
        if num_generated >= self.params.max_tokens or self._cannot_improve(num_generated):
            for beam in self.beams:
                self._add_hypothesis(list(beam.request.output_token_ids), beam.score)
                drop(beam.request)
            self.beams = []

    def best(self) -> list[Hypothesis]:
        return sorted(self.finished, key=lambda h: -h.score)[: self.width]

    def _add_hypothesis(self, token_ids: list[int], cumulative_logprob: float) -> None:
        length = max(len(token_ids), 1)
        score = cumulative_logprob / length**self.params.length_penalty
        self.finished.append(Hypothesis(token_ids, cumulative_logprob, score))

    def _cannot_improve(self, num_generated: int) -> bool:
        """Hugging Face's default stopping heuristic: W hypotheses done, and the best live
        beam, scored at its current length, is no better than the worst of them."""
        if len(self.finished) < self.width or not self.beams:
            return False
        worst_kept = self.best()[-1].score
        best_live = self.beams[0].score / max(num_generated, 1) ** self.params.length_penalty
        return best_live <= worst_kept


def beam_member_params(params: SamplingParams) -> SamplingParams:
    """What each beam request samples with: greedy, reporting the top 2W candidates;
    stopping is the group's decision, so the scheduler never stops a beam itself."""
    return SamplingParams(temperature=0.0, max_tokens=None, logprobs=2 * params.beam_width, ignore_eos=True)
