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
    # The caller's output channel (workers/output_channels.py): once it is open on the
    # replica, the outputs go there instead of onto this call's own stream. None: they never do.
    channel: str | None = None


@dataclass(slots=True)
class DecodeCall:
    """Continue a request prefilled elsewhere: its decode-side handover (first token, K/V)."""

    call: GenerateCall
    handover: Handover


@dataclass(frozen=True, slots=True)
class OpenChannel:
    """Opens a gateway's output channel on one engine replica; the request routers send it to
    the replica named (its Serve replica id), and only there."""

    channel: str
    replica: str
    node: str = ""  # the gateway's Ray node: a replica on it offers a local socket (local_channel.py)


@dataclass(frozen=True, slots=True)
class ChannelOffer:
    """On a call's stream: the call's channel is not open on this replica (named) yet."""

    replica: str


@dataclass(frozen=True, slots=True)
class MovedToChannel:
    """On a call's stream: every later output of the call comes on its channel, from this replica."""

    replica: str


@dataclass(frozen=True, slots=True)
class StartsOnChannel:
    """On a channel, ahead of a request's first output there: nothing of the request went on
    its call's own stream, so the gateway may follow the channel before MovedToChannel comes."""

    request_id: str


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
