"""Turns the last-position logits of a batch into tokens, per request settings.

Order of operations for one row (the statistical tests compute the same distribution):

  raw logprobs = log_softmax(logits)                   (what `logprobs` reports)
  logit bias   + each row's bias on its tokens          (one sparse add for the batch)
  penalties    repetition (prompt + output), presence and frequency (output)
  masks        allowed_token_ids; the grammar's bitmask (structured output); EOS/stop
               tokens before min_tokens, unless the grammar allows nothing else
  greedy       argmax                                   (temperature 0)
  random       / temperature -> top-k -> top-p -> min-p -> softmax -> one draw

Draws use the exponential race (argmax of p / Exp(1) noise), one generator per request,
so a request's samples depend only on its seed, never on its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api.sampling_params import SamplingParams
from ..core.scheduler_output import SampledToken
from ..structured_output.bitmask import apply_bitmask


@dataclass(frozen=True, slots=True)
class LogitBias:
    """A request's `logit_bias` as device tensors, built once when the request arrives."""

    token_ids: torch.Tensor  # [m] int64
    values: torch.Tensor  # [m] float32

    @classmethod
    def build(cls, bias: dict[int, float] | None, device: torch.device) -> LogitBias | None:
        if not bias:
            return None
        token_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        return cls(token_ids, torch.tensor(list(bias.values()), dtype=torch.float32, device=device))


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    grammar_bitmask: torch.Tensor | None = None  # [1, vocab / 32] int32: the tokens it allows
    logit_bias: LogitBias | None = None  # params.logit_bias on the device


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        raw_logprobs, logits = self.process(logits, rows)
        tokens = self._sample(logits, rows).tolist()
        return [self.sampled_token(raw_logprobs, i, row, token) for i, (row, token) in enumerate(zip(rows, tokens))]

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(raw logprobs where any row asks for logprobs, else None; the logits after penalties
        and masks), the two things sampling and speculative verification start from."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.needs_logprobs for r in rows) else None
        logits = _apply_logit_bias(logits, rows)
        logits = self._apply_penalties(logits, rows)
        return raw_logprobs, self._apply_masks(logits, rows)

    @staticmethod
    def sampled_token(raw_logprobs: torch.Tensor | None, i: int, row: SamplingRow, token: int) -> SampledToken:
        """Row i's token, with its logprob, rank and top-N when the row asks for them."""
        if not row.params.needs_logprobs:
            return SampledToken(token, None, 0)
        row_logprobs = raw_logprobs[i]
        logprob = row_logprobs[token]
        rank = int((row_logprobs > logprob).sum()) + 1
        top: list[tuple[int, float]] = []
        if row.params.logprobs:
            values, ids = row_logprobs.topk(row.params.logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        return SampledToken(token, float(logprob), rank, top)

    # -- processors -------------------------------------------------------------------

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            params = row.params
            if not params.has_penalties:
                continue
            vocab = logits.shape[1]
            output = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, device=logits.device).scatter_add_(
                0, output, torch.ones_like(output, dtype=torch.float)
            )
            if params.repetition_penalty != 1.0:
                seen = counts > 0
                prompt = torch.tensor(row.prompt_token_ids, dtype=torch.long, device=logits.device)
                seen[prompt] = True
                row_logits = logits[i]
                penalised = torch.where(
                    row_logits > 0,
                    row_logits / params.repetition_penalty,
                    row_logits * params.repetition_penalty,
                )
                logits[i] = torch.where(seen, penalised, row_logits)
            logits[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        return logits

    def _apply_masks(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        constrained = [i for i, row in enumerate(rows) if row.grammar_bitmask is not None]
        if constrained:
            apply_bitmask(logits, constrained, torch.cat([rows[i].grammar_bitmask for i in constrained]))
        for i, row in enumerate(rows):
            params = row.params
            if params.allowed_token_ids is not None:
                allowed = torch.full_like(logits[i], float("-inf"))
                allowed[params.allowed_token_ids] = 0.0
                logits[i] += allowed
            if len(row.output_token_ids) < params.min_tokens:
                banned = list(params.stop_token_ids)
                if not params.ignore_eos:
                    banned.extend(self.eos_token_ids)
                if banned:
                    kept = logits[i].clone()
                    logits[i, banned] = float("-inf")
                    if row.grammar_bitmask is not None and torch.isinf(logits[i]).all():
                        logits[i] = kept  # a complete grammar only allows its end: min_tokens yields
        return logits

    # -- sampling ---------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not random_rows:
            return greedy
        index = torch.tensor(random_rows, device=logits.device)
        probs = self.probabilities(logits[index], [rows[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            noise = torch.empty_like(probs[j]).exponential_(generator=rows[i].generator)
            greedy[i] = (probs[j] / noise).argmax()
        return greedy

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from (temperature, top-k, top-p, min-p)."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]
        vocab = logits.shape[1]
        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            threshold = torch.tensor(min_p, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = torch.where(probs < threshold, 0.0, probs)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Adds every biased row's values at its token ids, in one indexed add."""
    biased = [(i, row.logit_bias) for i, row in enumerate(rows) if row.logit_bias is not None]
    if not biased:
        return logits
    row_index = torch.cat([torch.full_like(bias.token_ids, i) for i, bias in biased])
    token_ids = torch.cat([bias.token_ids for _, bias in biased])
    values = torch.cat([bias.values for _, bias in biased])
    return logits.index_put_((row_index, token_ids), values, accumulate=True)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) what lies outside each row's top-k, then outside its top-p mass."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    kth_smallest_kept = sorted_logits.gather(1, (vocab - top_k).clamp(min=0)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_smallest_kept, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop the least likely tokens while their total mass stays within 1 - top_p.
    drop = sorted_probs.cumsum(dim=-1) <= 1 - top_p[:, None]
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
