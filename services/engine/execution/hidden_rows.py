"""The target's final hidden states that speculative heads draft from, picked out of one
step's forward pass on rank 0 (views, no copy). Only rows of real tokens leave: a rejected
draft's row is never handed back.

    "last"  (medusa)  per sampling request, the row whose logits gave its newest token:
                      its last real token's row, or its last accepted draft's
    "all"   (eagle)   per request, every row it ran this step (a prefill chunk whole; a
                      decode with drafts its last real token and the accepted drafts)
"""

from __future__ import annotations

from typing import Literal

import torch

from ..core.scheduler_output import HiddenRows, SchedulerOutput

HiddenStatesMode = Literal["last", "all"]
# Which hidden states each speculative method drafts from (absent: none).
HIDDEN_STATES_FOR: dict[str | None, HiddenStatesMode] = {"medusa": "last", "eagle": "all"}


def last_rows(
    so: SchedulerOutput,
    sample_request_ids: list[str],
    first_positions: dict[str, int],
    selected: torch.Tensor,
    sampled: dict[str, list],
) -> dict[str, HiddenRows]:
    """`selected`: the rows the LM head ran on, each request's last real token then its drafts."""
    out, row = {}, 0
    for rid in sample_request_ids:
        num_drafts, num_accepted = len(so.spec_token_ids.get(rid, ())), len(sampled[rid]) - 1
        position = first_positions[rid] + so.num_scheduled_tokens[rid] - num_drafts - 1 + num_accepted
        out[rid] = HiddenRows(position, selected[row + num_accepted : row + num_accepted + 1])
        row += num_drafts + 1
    return out


def verified_rows(
    so: SchedulerOutput,
    flat_starts: dict[str, int],
    first_positions: dict[str, int],
    hidden: torch.Tensor,
    sampled: dict[str, list],
) -> dict[str, HiddenRows]:
    """`hidden`: the whole flat batch; each request's rows are consecutive from its start."""
    out = {}
    for rid, start in flat_starts.items():
        n = so.num_scheduled_tokens[rid]
        drafts = so.spec_token_ids.get(rid)
        if drafts and rid in sampled:
            n -= len(drafts) - (len(sampled[rid]) - 1)  # the rejected drafts' rows
        out[rid] = HiddenRows(first_positions[rid], hidden[start : start + n])
    return out
