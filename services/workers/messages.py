"""What the gateway sends to engine workers (pickled by Ray between replicas)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.api.sampling_params import SamplingParams
from ..kv_transfer.types import KVTransferParams


@dataclass(slots=True)
class GenerateCall:
    request_id: str
    prompt_token_ids: list[int]  # tokenized once, by the gateway
    params: SamplingParams  # output_kind DELTA: each streamed output carries only what is new
    cache_salt: str | None = None


@dataclass(slots=True)
class DecodeCall:
    """Continue a request prefilled elsewhere: its first token and where its K/V is."""

    call: GenerateCall
    first_token_ids: list[int]
    kv: KVTransferParams


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
