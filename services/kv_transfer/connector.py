"""The worker-side connector: one per tensor-parallel rank, holding that rank's KV cache.
Each transport subclasses `KVConnector`; `factory.create_connector` picks the configured one.

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

A send request can arrive before its lease: the engine tells the connector about a lease at
its next step, while the first token is already on its way to the decode side. A claim
(`_pin`) for a lease not announced yet waits for it; one for a lease that ended is refused at
once.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict

import torch

from .config import FaultInjection, KVTransferConfig
from .types import KVRecvTask, KVTransferStatus

_NUM_ENDED_REMEMBERED = 4096  # ended leases kept, to refuse late claims at once


class KVConnector(ABC):
    """A transport. The bookkeeping every transport shares lives here: what ended since the
    last `poll`, the receives in flight, the leases and the claims pinning them (all under
    `_lock`, which transports also use for their own state), and the test faults."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.faults = FaultInjection()
        self._lock = threading.Condition()
        self._status = KVTransferStatus()  # what ended since the last poll
        self._pending: set[str] = set()  # request ids of receives in flight
        # Prefill side: leased blocks by transfer id, the leases that ended lately, and how
        # many claims are reading each lease's blocks.
        self._leases: dict[str, tuple[int, ...]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._num_pins: dict[str, int] = {}

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The rank's per-layer caches, each [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    def release_kv_caches(self) -> None:
        """Sleep: ends every lease (waiting out sends that read them; later claims are refused,
        so their decode side recomputes), then lets go of the caches, so their memory is freed
        with the runner's. `register_kv_caches` takes the new ones on wake."""
        with self._lock:
            leased = list(self._leases)
        self.remove_leases(leased)
        self._forget_kv_caches()

    @abstractmethod
    def _forget_kv_caches(self) -> None:
        """Drops every reference to the registered caches (NIXL: deregisters them first)."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Where peers reach this rank ("host:port"; NIXL: "host:port/agent-name")."""

    def add_leases(self, leases: dict[str, tuple[int, ...]]) -> None:
        """Prefill side: these blocks may now be sent to whoever asks for the transfer."""
        with self._lock:
            self._leases.update(leases)
            self._lock.notify_all()  # claims may be waiting for these

    def remove_leases(self, transfer_ids: list[str]) -> None:
        """Prefill side: stop serving these (waits for a send in flight to finish)."""
        deadline = time.monotonic() + self.config.timeout_s
        with self._lock:
            for transfer_id in transfer_ids:
                self._leases.pop(transfer_id, None)
                self._ended[transfer_id] = None
            while len(self._ended) > _NUM_ENDED_REMEMBERED:
                self._ended.popitem(last=False)
            # Blocks may be reused right after this returns: wait out claims still reading them.
            while any(self._num_pins.get(t) for t in transfer_ids) and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(timeout=left)

    @abstractmethod
    def start_recv(self, task: KVRecvTask) -> None:
        """Decode side: fetch a transfer's blocks in the background."""

    def poll(self) -> KVTransferStatus:
        """Transfers that ended since the last call."""
        with self._lock:
            status, self._status = self._status, KVTransferStatus()
        return status

    def has_pending(self) -> bool:
        """Whether receives are in flight. The engine learns of their ends from `poll` (the
        scheduler knows what it is receiving); callers that need quiet, such as tests, wait on this."""
        with self._lock:
            return bool(self._pending)

    def _pin(self, transfer_id: str, block_ids: tuple[int, ...] | list[int]) -> bool | None:
        """A claim: pins the blocks if the lease holds them. False: refused (the lease ended, or
        does not hold them); None: the lease is not announced yet (ask again)."""
        with self._lock:
            leased = self._leases.get(transfer_id)
            if leased is None:
                return False if transfer_id in self._ended else None
            if not set(block_ids) <= set(leased):
                return False
            self._num_pins[transfer_id] = self._num_pins.get(transfer_id, 0) + 1
            return True

    def _unpin(self, transfer_id: str, ok: bool) -> None:
        """A pinned claim ended: finished_sending (ok) or failed_sending."""
        with self._lock:
            left = self._num_pins.get(transfer_id, 0) - 1
            if left > 0:
                self._num_pins[transfer_id] = left
            else:
                self._num_pins.pop(transfer_id, None)
            (self._status.finished_sending if ok else self._status.failed_sending).add(transfer_id)
            self._lock.notify_all()

    def set_faults(self, faults: FaultInjection) -> None:
        """Test hook: how the sending side misbehaves from now on (config must allow it)."""
        if not self.config.allow_fault_injection:
            raise PermissionError("fault injection is disabled (kv_transfer.allow_fault_injection)")
        self.faults = faults

    @abstractmethod
    def close(self) -> None: ...


class TransferError(RuntimeError):
    """One transfer failed (refused, timed out, corrupt): its receive is reported failed."""


def advertised_host(host: str) -> str:
    """`auto`: the Ray node's IP when inside Ray (reachable by the other pods), else loopback."""
    if host != "auto":
        return host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
