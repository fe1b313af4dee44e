"""Drawing drafts the way the target samples: shared by every drafter with a model (a draft
model, Medusa heads, an EAGLE drafter).

Each draft goes through the target's Sampler (penalties, logit bias, grammar masks, the
sampling transforms), fed the drafts before it as output, so q is the distribution the
draft was drawn from and the rejection sampler can check it exactly. Greedy requests take
the argmax and keep no q. Random draws use a generator seeded from the request's seed and
its length (`draft_seed`), so a seeded request drafts the same tokens whatever else runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.request import Request
from ..execution.sampler import LogitBias, Sampler, SamplingRow


@dataclass(slots=True)
class Drafting:
    """One request during a propose call."""

    request: Request
    generator: torch.Generator
    logit_bias: LogitBias | None  # the request's, on the drafter's device
    room: int  # drafts wanted
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q of each draft (random requests)
    is_done: bool = False


def start_drafting(request: Request, generator: torch.Generator, logit_bias: LogitBias | None, room: int) -> Drafting:
    """A request's drafting, its generator seeded for this position (random requests)."""
    if not request.sampling_params.is_greedy:
        generator.manual_seed(draft_seed(request.seed, request.num_tokens))
    return Drafting(request, generator, logit_bias, room)


def sample_drafts(sampler: Sampler, active: list[Drafting], logits: torch.Tensor) -> None:
    """Appends each request's next draft (and its q), through the target's transforms;
    `logits`: [len(active), V], one row per request in order."""
    rows = [_sampling_row(d) for d in active]
    _, processed = sampler.process(logits, rows)
    tokens = processed.argmax(dim=-1).tolist()
    random_rows = [i for i, d in enumerate(active) if not d.request.sampling_params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = Sampler.probabilities(processed[index], [active[i].request.sampling_params for i in random_rows])
        for j, i in enumerate(random_rows):
            noise = torch.empty_like(probs[j]).exponential_(generator=active[i].generator)
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


def draft_probs_of(batch: list[Drafting]) -> dict[str, torch.Tensor]:
    """[num_drafts, V] q per random request of the batch (greedy ones have none)."""
    return {d.request.request_id: torch.stack(d.probs[: len(d.drafts)]) for d in batch if d.probs and d.drafts}


def _sampling_row(d: Drafting) -> SamplingRow:
    request = d.request
    # The grammar's state after the drafts so far (a fresh tensor: the matcher is rolled back).
    mask = None if request.grammar is None else request.grammar.fill_bitmasks(d.drafts)[-1:]
    return SamplingRow(
        params=request.sampling_params,
        generator=d.generator,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=[*request.output_token_ids, *d.drafts],
        grammar_bitmask=mask,
        logit_bias=d.logit_bias,
    )


def draft_seed(seed: int, num_tokens: int) -> int:
    """A stream apart from the target's (seeded with `seed` itself), one per position."""
    return (seed * 6364136223846793005 + num_tokens * 1442695040888963407 + 0x5DEECE66D) % 2**63
