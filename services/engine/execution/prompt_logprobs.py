"""Prompt logprobs: each prompt token's logprob given the tokens before it, from the logits
of the prompt positions a step runs, for the requests that ask (`prompt_logprobs`).

    prompt      t0  t1  t2  t3  t4          P = 5 tokens
    logits at   p0  p1  p2  p3  p4
    scores      t1  t2  t3  t4  --          p4's logits sample the first output token

A chunk covering positions [first, first + n) scores positions [first, min(first + n, P - 1)),
so chunked prefill adds its part each step. Entries accumulate in the runner's request
state in position order; a chunk that starts before their end (the prompt recomputed after
a preemption) cuts them back first. The whole list rides on the request's first sampled
token, after which it is not computed again. Such a request never reads the prefix cache
(kv_cache_manager): a cached position has no logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.scheduler_output import SampledToken

# Logits rows materialised at once: a long chunk's [rows, vocab] float tensor stays bounded.
_ROWS_PER_PASS = 512


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt positions of one request that this step's batch computes, and where."""

    request_id: str
    first_position: int  # the first prompt position scored (it scores token first + 1)
    first_row: int  # its row in the flat batch
    num_positions: int


def prompt_span(request_id: str, first: int, num_tokens: int, num_prompt_tokens: int, row: int) -> PromptSpan | None:
    """The positions of a chunk [first, first + num_tokens) that score a prompt token."""
    end = min(first + num_tokens, num_prompt_tokens - 1)
    return PromptSpan(request_id, first, row, end - first) if end > first else None


def score_prompt_spans(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    spans: list[PromptSpan],
    token_ids: dict[str, list[int]],
    num_top: dict[str, int],
    is_sampling_rank: bool,
) -> dict[str, list[SampledToken]]:
    """Per span's request, one entry per scored position (rank 0; {} on the other ranks,
    which still join `compute_logits`, a collective under tensor parallelism)."""
    rows = torch.cat([torch.arange(s.first_row, s.first_row + s.num_positions, device=hidden.device) for s in spans])
    targets = torch.tensor(
        [
            t
            for s in spans
            for t in token_ids[s.request_id][s.first_position + 1 : s.first_position + 1 + s.num_positions]
        ],
        dtype=torch.long,
        device=hidden.device,
    )
    k = max(num_top[s.request_id] for s in spans)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, len(rows), _ROWS_PER_PASS):
        logits = compute_logits(hidden[rows[start : start + _ROWS_PER_PASS]])
        if not is_sampling_rank:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target_logprobs = logprobs.gather(1, targets[start : start + _ROWS_PER_PASS, None])
        chosen.append(target_logprobs[:, 0])
        ranks.append((logprobs > target_logprobs).sum(dim=-1) + 1)
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    if not is_sampling_rank:
        return {}
    chosen_list, rank_list = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
    top_value_list = torch.cat(top_values).tolist() if k else None
    top_id_list = torch.cat(top_ids).tolist() if k else None
    targets_list = targets.tolist()
    out: dict[str, list[SampledToken]] = {}
    i = 0
    for span in spans:
        n = num_top[span.request_id]
        entries = []
        for j in range(i, i + span.num_positions):
            top = list(zip(top_id_list[j][:n], top_value_list[j][:n])) if n else []
            entries.append(SampledToken(targets_list[j], chosen_list[j], rank_list[j], top))
        out[span.request_id] = entries
        i += span.num_positions
    return out
