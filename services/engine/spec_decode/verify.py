"""Speculative verification in the model runner: the target's logits at a request's last
token and at each of its drafts become, through the same penalties, masks and sampling
transforms as a plain step, the distributions the rejection sampler checks the drafts against.

Position j of a request with drafts d_0 .. d_{k-1} is sampled as if d_0 .. d_{j-1} were
already its output: penalties count them, and min_tokens sees them. A request without drafts
in the same batch is a request with k = 0, and samples exactly what the plain Sampler would.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.scheduler_output import SampledToken
from ..execution.sampler import Sampler, SamplingRow
from .rejection_sampler import DraftBatch, RejectionSampler

_rejection_sampler = RejectionSampler()


def position_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The sampling rows of a request's k + 1 verified positions. A constrained request's
    bitmask has one row per position (RequestGrammar.fill_bitmasks)."""
    masks = row.grammar_bitmask
    # replace(): every other field (the logit bias among them) is the request's at each position.
    return [
        dataclasses.replace(
            row,
            output_token_ids=[*row.output_token_ids, *drafts[:j]],
            grammar_bitmask=None if masks is None else masks[j : j + 1],
        )
        for j in range(len(drafts) + 1)
    ]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None] | None = None,
) -> list[list[SampledToken]]:
    """Per request, the accepted drafts and the token after them.

    logits: [sum(k_b + 1), V] request-major, each request's k_b + 1 positions in order;
    rows: each request's row at its first position; drafts: each request's k_b drafts;
    draft_probs: each request's [k_b, V] q (a draft model's), None where q is one-hot on
    the drafts (n-gram drafts, greedy requests)."""
    flat_rows = [r for row, d in zip(rows, drafts) for r in position_rows(row, d)]
    raw_logprobs, processed = sampler.process(logits, flat_rows)
    greedy = [row.params.is_greedy for row in rows]
    # Each row once: greedy rows need only their argmax (a softmax keeps it), random rows the
    # sampling transforms.
    probs = torch.empty_like(processed)
    greedy_rows = [i for i, r in enumerate(flat_rows) if r.params.is_greedy]
    random_rows = [i for i, r in enumerate(flat_rows) if not r.params.is_greedy]
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=logits.device)
        probs[index] = torch.softmax(processed[index], dim=-1)
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs[index] = Sampler.probabilities(processed[index], [flat_rows[i].params for i in random_rows])
    draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=logits.device)
    batch = DraftBatch(
        num_draft_tokens=[len(d) for d in drafts],
        draft_token_ids=draft_ids,
        target_probs=probs,
        draft_probs=_stack_q(draft_probs, drafts, draft_ids, probs),
        is_greedy=greedy,
        generators=[row.generator for row in rows],
    )
    result = _rejection_sampler(batch)
    out, first_row = [], 0
    for d, tokens in zip(drafts, result.token_ids):
        out.append(
            [
                Sampler.sampled_token(raw_logprobs, first_row + j, flat_rows[first_row + j], t)
                for j, t in enumerate(tokens)
            ]
        )
        first_row += len(d) + 1
    return out


def _stack_q(
    draft_probs: list[torch.Tensor | None] | None,
    drafts: list[list[int]],
    draft_ids: torch.Tensor,
    target_probs: torch.Tensor,
) -> torch.Tensor | None:
    """[D, V] q in the batch's layout, one-hot rows where a request has none; None when no
    request has q. A draft model may run on another device than the verifying rank."""
    if draft_probs is None or all(q is None for q in draft_probs):
        return None
    vocab, device, dtype = target_probs.shape[1], target_probs.device, target_probs.dtype
    parts, first = [], 0
    for q, d in zip(draft_probs, drafts):
        if q is None:
            parts.append(torch.nn.functional.one_hot(draft_ids[first : first + len(d)], vocab).to(dtype))
        else:
            parts.append(q[: len(d)].to(device=device, dtype=dtype))
        first += len(d)
    return torch.cat(parts)


def sample_and_verify(
    sampler: Sampler,
    logits: torch.Tensor,
    request_ids: list[str],
    rows: list[SamplingRow],
    spec: dict[str, list[int]],
    draft_probs: dict[str, torch.Tensor],
) -> dict[str, list]:
    """A step's tokens when some requests have drafts: those go through verification (k + 1
    logits rows each), the others through the plain sampler (one row each), so a draft in the
    batch costs its own request alone."""
    plain_rows, spec_rows = [], []  # logits row indices
    plain, speculating = [], []  # positions in request_ids
    row = 0
    for i, rid in enumerate(request_ids):
        n = len(spec.get(rid, ())) + 1
        if n == 1:
            plain.append(i)
            plain_rows.append(row)
        else:
            speculating.append(i)
            spec_rows.extend(range(row, row + n))
        row += n
    out: dict[str, list] = {}
    if plain:
        tokens = sampler(logits[plain_rows], [rows[i] for i in plain])
        out.update((request_ids[i], [token]) for i, token in zip(plain, tokens))
    drafts = [spec[request_ids[i]] for i in speculating]
    probs = [draft_probs.get(request_ids[i]) for i in speculating]
    verified = verify(sampler, logits[spec_rows], [rows[i] for i in speculating], drafts, probs)
    out.update((request_ids[i], tokens) for i, tokens in zip(speculating, verified))
    return {rid: out[rid] for rid in request_ids}
