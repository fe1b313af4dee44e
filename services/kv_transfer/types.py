"""What the handover exchanges. Block i of the prefill side's table maps to block i of the
decode side's (both use the same block size), so a transfer is a list of block pairs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """Returned by the prefill worker with the first token; the decode worker receives with it."""

    transfer_id: str  # unique per request (the request id)
    source_worker_id: str
    source_endpoints: tuple[str, ...]  # each prefill TP rank's connector endpoint ("host:port[/agent]")
    block_ids: tuple[int, ...]  # prefill-side blocks holding the prompt's K/V, in order
    num_tokens: int  # tokens whose K/V they hold (the prompt)
    block_size: int
    tp_size: int
    weight_version: str | None = None  # of the weights that computed it (None: not checked)
    kv_cache_dtype: str | None = None  # what the prefill side's cache holds (None: not checked)


@dataclass(frozen=True, slots=True)
class KVRecvTask:
    """Scheduler -> decode-side runner: fetch these blocks into those."""

    request_id: str
    params: KVTransferParams
    src_block_ids: tuple[int, ...]  # prefill-side blocks still needed (after local prefix hits)
    dst_block_ids: tuple[int, ...]  # decode-side blocks to fill, same length


@dataclass(slots=True)
class KVTransferStatus:
    """Runner -> scheduler: transfers that ended since the last report (per rank, merged)."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> reason
    finished_sending: set[str] = field(default_factory=set)  # acknowledged by the receiver
    failed_sending: set[str] = field(default_factory=set)
    bytes_received: int = 0
    recv_seconds: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.finished_recving or self.failed_recving or self.finished_sending or self.failed_sending)

    def merge(self, other: KVTransferStatus) -> None:
        self.finished_recving |= other.finished_recving
        self.failed_recving.update(other.failed_recving)
        self.finished_sending |= other.finished_sending
        self.failed_sending |= other.failed_sending
        self.bytes_received += other.bytes_received
        self.recv_seconds += other.recv_seconds
