"""What the gateway sends to engine workers (pickled by Ray between replicas); the router's
Serve request router reads the prompt from these calls to place them."""

from __future__ import annotations

from dataclasses import dataclass

from .engine.api.handover import Handover
from .engine.api.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateCall:
    request_id: str
    prompt_token_ids: list[int]  # tokenized once, by the gateway
    params: SamplingParams  # output_kind DELTA: each streamed output carries only what is new
    cache_salt: str | None = None


@dataclass(slots=True)
class DecodeCall:
    """Continue a request prefilled elsewhere: its decode-side handover (first token, K/V)."""

    call: GenerateCall
    handover: Handover


@dataclass(frozen=True, slots=True)
class WorkerModelInfo:
    model: str
    max_model_len: int
    block_size: int
    tensor_parallel_size: int
    vocab_size: int
    role: str
    worker_id: str
    address: str = ""  # the Ray Serve replica's actor name
