"""The worker-side connector: one per tensor-parallel rank, holding that rank's KV cache.

The scheduler decides what moves (leases on the prefill side, receive tasks on the decode
side); the model runner hands those decisions to its connector each step and reports the
connector's progress back in `ModelRunnerOutput.kv_transfer`. Transfers run on the
connector's own threads, beside the forward pass:

    prefill rank i                                  decode rank i
    add_leases({id: blocks})   <- send request --   start_recv(task)
    (serves sends of leased blocks)  -- K/V -->     writes them into its blocks
                               <--   ack   --       poll(): finished_recving
    poll(): finished_sending                        (or failed_recving: the engine recomputes)
    remove_leases([id])  waits for a send in flight, so freed blocks are never read after reuse
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch

from .config import FaultInjection, KVTransferConfig
from .types import KVRecvTask, KVTransferStatus


class KVConnector(ABC):
    """A transport. The bookkeeping every transport shares lives here: what ended since the
    last `poll` and the receives in flight (both under `_lock`, which transports also use for
    their own state), and the test faults."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.faults = FaultInjection()
        self._lock = threading.Condition()
        self._status = KVTransferStatus()  # what ended since the last poll
        self._pending: set[str] = set()  # request ids of receives in flight

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The rank's per-layer caches, each [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Where peers reach this rank ("host:port"; NIXL: "host:port/agent-name")."""

    @abstractmethod
    def add_leases(self, leases: dict[str, tuple[int, ...]]) -> None:
        """Prefill side: these blocks may now be sent to whoever asks for the transfer."""

    @abstractmethod
    def remove_leases(self, transfer_ids: list[str]) -> None:
        """Prefill side: stop serving these (waits for a send in flight to finish)."""

    @abstractmethod
    def start_recv(self, task: KVRecvTask) -> None:
        """Decode side: fetch a transfer's blocks in the background."""

    def poll(self) -> KVTransferStatus:
        """Transfers that ended since the last call."""
        with self._lock:
            status, self._status = self._status, KVTransferStatus()
        return status

    def has_pending(self) -> bool:
        """Whether receives are in flight (the engine keeps polling while they are)."""
        with self._lock:
            return bool(self._pending)

    def set_faults(self, faults: FaultInjection) -> None:
        """Test hook: how the sending side misbehaves from now on (config must allow it)."""
        if not self.config.allow_fault_injection:
            raise PermissionError("fault injection is disabled (kv_transfer.allow_fault_injection)")
        self.faults = faults

    @abstractmethod
    def close(self) -> None: ...


def create_connector(config, tp_rank: int, device: torch.device) -> KVConnector:
    """The configured transport's connector for one rank."""
    if config.transport == "nixl":
        from .nixl_connector import NixlConnector

        return NixlConnector(config, tp_rank, device)
    from .torch_connector import TorchDistributedConnector

    return TorchDistributedConnector(config, tp_rank, device)
