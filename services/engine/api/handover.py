"""The P/D handover contract as the engine's callers see it: one typed value per request.

    prefill side   Handover.prefill()                   run the prompt, sample the first token;
                                                        if the request goes on, lease its blocks
    decode side    Handover.decode(first_token_ids, kv) continue from the first token(s) with the
                                                        prompt's K/V fetched from `kv`'s worker
    any side       Handover.resume(token_ids)           continue a request whose worker was lost
                                                        (migration): prompt and tokens already
                                                        streamed are recomputed here

The rules that decide the handover live here and nowhere else: which requests can be split
over two workers at all (`can_disaggregate`), and whether a prefilled request continues on a
decode worker (`continues_after_prefill`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ...kv_transfer.types import KVTransferParams
from ...roles import Role
from .sampling_params import SamplingParams


class KVPath(enum.StrEnum):
    """How a request's prompt K/V got to the worker that decoded it (proto `Timings.kv_path`)."""

    COLOCATED = "colocated"  # one worker prefilled and decoded it
    TRANSFERRED = "transferred"  # prefilled on one worker, its K/V received by the decode worker
    RECOMPUTED = "recomputed"  # the transfer failed or timed out: the decode worker recomputed the prompt
    LOCAL = "local"  # disaggregated, but run whole on a decode worker (n > 1, beam search, no prefill replica)
    MIGRATED = "migrated"  # its worker was lost mid-stream: another one recomputed it and went on
    PREFILL_ONLY = "prefill-only"  # it ended at its first token, on the prefill worker


@dataclass(frozen=True, slots=True)
class Handover:
    role: Role  # PREFILL: the producer side; DECODE: the consumer side
    first_token_ids: tuple[int, ...] = ()  # decode side: tokens the prefill worker generated
    remote_kv: KVTransferParams | None = None  # decode side: where the prompt's K/V (None: recompute it)

    def __post_init__(self) -> None:
        if self.role is Role.PREFILL and (self.first_token_ids or self.remote_kv is not None):
            raise ValueError("a prefill-side handover carries no tokens and no remote K/V")
        if self.role is Role.DECODE and not self.first_token_ids:
            raise ValueError("a decode-side handover needs the tokens generated before it")
        if self.role is Role.COLOCATED:
            raise ValueError("a colocated request has no handover")

    @classmethod
    def prefill(cls) -> Handover:
        return cls(Role.PREFILL)

    @classmethod
    def decode(cls, first_token_ids: Sequence[int], remote_kv: KVTransferParams) -> Handover:
        return cls(Role.DECODE, tuple(first_token_ids), remote_kv)

    @classmethod
    def resume(cls, token_ids: Sequence[int]) -> Handover:
        """A migrated request: `token_ids` were streamed by a worker that is gone; this worker
        recomputes prompt + tokens (no K/V to fetch) and continues with the same parameters,
        the tokens counting towards max_tokens, min_tokens, penalties and the grammar."""
        return cls(Role.DECODE, tuple(token_ids))

    @property
    def is_resume(self) -> bool:
        return self.role is Role.DECODE and self.remote_kv is None

    @property
    def is_prefill(self) -> bool:
        return self.role is Role.PREFILL

    @property
    def is_decode(self) -> bool:
        return self.role is Role.DECODE


def can_disaggregate(params: SamplingParams) -> bool:
    """One sample, no beam search: several samples (n > 1, best_of > 1) share one prompt's
    blocks on one worker. Prompt logprobs split too: the prefill worker sends them with the
    first token."""
    return params.num_samples == 1 and not params.use_beam_search


def continues_after_prefill(max_tokens: int, num_output_tokens: int, stopped: bool) -> bool:
    """A prefilled request goes on to a decode worker unless its first token ended it: a stop
    (EOS, stop token, stop string) or its length limit (`max_tokens`, resolved against the
    context limit, so room in the context is included)."""
    return not stopped and num_output_tokens < max_tokens
