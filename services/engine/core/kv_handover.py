"""The scheduler's side of the KV handover: leases (prefill) and receives (decode).

Prefill side. A request that continues after prefill (see engine/api/handover.py) keeps its blocks:

    finish -> lease(request)      blocks held; the runners learn (transfer id -> block ids)
    sender reports done/failed -> release()   blocks freed; runners forget the lease
    nobody came by `lease_s`   -> expire()    the same, at the deadline

Decode side. A request with a decode-side handover gets blocks for its prompt first (after any local
prefix hit), then waits while the runners receive into them:

    admit -> start_recv()         WAITING_FOR_REMOTE_KV, a KVRecvTask for the runners
    received -> running, the prompt counted as computed (and its full blocks cached)
    failed   -> running, recomputing the prompt locally (from the local hit onwards)
    received, but the weights changed since start_recv -> running, recomputing the whole
             prompt (the K/V and the local hit are both of the old weights; counted as a
             version mismatch, like K/V of other weights refused at admission)

A request aborted while its blocks are being written stays parked until the runners report
the receive over, so those blocks are never handed to anyone else mid-write.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ...kv_transfer.types import KVRecvTask, KVTransferStatus
from ..api.handover import KVPath
from .kv_cache_manager import KVCacheManager, cdiv
from .request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Lease:
    request: Request
    expires_at: float


class KVHandover:
    def __init__(self, kv: KVCacheManager, lease_s: float) -> None:
        self.kv = kv
        self.lease_s = lease_s
        self.leases: dict[str, _Lease] = {}
        self.receiving: dict[str, Request] = {}
        # The weight version each receive's K/V was computed under (the prefill side's, or
        # this engine's at start_recv when the prefill side names none).
        self.recv_versions: dict[str, str] = {}
        self.parked: dict[str, Request] = {}  # aborted mid-receive: blocks freed once it ends
        # Reported to the runners with the next scheduler output.
        self.new_leases: dict[str, tuple[int, ...]] = {}
        self.ended_leases: list[str] = []
        self.new_recvs: list[KVRecvTask] = []
        # Counters (engine stats).
        self.num_recv_ok = 0
        self.num_recv_failed = 0
        self.num_leases_expired = 0
        self.num_version_mismatches = 0
        self.num_dtype_mismatches = 0
        self.bytes_received = 0
        self.recv_seconds = 0.0
        # The engine's weight version (engine/weight_updates.py keeps it current): K/V that
        # a prefill worker computed under another version is recomputed here, never read.
        self.weight_version = "0"
        # What this engine's cache holds (the engine core sets it): K/V of another dtype
        # would be read as garbage, so it is recomputed here instead.
        self.kv_cache_dtype: str | None = None

    def stats(self) -> dict[str, int | float]:
        return {
            "num_kv_leases": len(self.leases),
            "num_kv_receiving": len(self.receiving),
            "kv_recv_ok": self.num_recv_ok,
            "kv_recv_failed": self.num_recv_failed,
            "kv_leases_expired": self.num_leases_expired,
            "kv_version_mismatches": self.num_version_mismatches,
            "kv_dtype_mismatches": self.num_dtype_mismatches,
            "kv_bytes_received": self.bytes_received,
            "kv_recv_seconds": self.recv_seconds,
        }

    @property
    def is_active(self) -> bool:
        """Whether the runners have transfers to finish (the engine keeps polling them)."""
        return bool(self.leases or self.receiving or self.parked or self.new_leases or self.ended_leases)

    # -- prefill side -----------------------------------------------------------------

    def lease(self, request: Request) -> tuple[int, ...]:
        block_ids = tuple(self.kv.get_block_ids(request.request_id))
        self.leases[request.request_id] = _Lease(request, time.monotonic() + self.lease_s)
        self.new_leases[request.request_id] = block_ids
        return block_ids

    def release(self, transfer_id: str) -> None:
        lease = self.leases.pop(transfer_id, None)
        if lease is None:
            return
        self.kv.free(lease.request)
        if self.new_leases.pop(transfer_id, None) is None:
            self.ended_leases.append(transfer_id)

    def expire(self, now: float) -> None:
        for transfer_id in [t for t, lease in self.leases.items() if lease.expires_at <= now]:
            self.num_leases_expired += 1
            self.release(transfer_id)

    # -- decode side ------------------------------------------------------------------

    def accepts(self, request: Request) -> bool:
        """Whether to fetch the request's prompt K/V: not if other weights computed it, nor if
        the prefill side's cache holds another dtype (then the request is recomputed here,
        kv_path RECOMPUTED; the prefill side's lease expires)."""
        params = request.remote_kv
        if None not in (params.kv_cache_dtype, self.kv_cache_dtype) and params.kv_cache_dtype != self.kv_cache_dtype:
            logger.warning(
                "request %s: the prefill worker %s keeps a %s KV cache, this engine a %s one; recomputing the "
                "prompt here (set the same cache.kv_cache_dtype on both services)",
                request.request_id,
                params.source_worker_id,
                params.kv_cache_dtype,
                self.kv_cache_dtype,
            )
            self.num_dtype_mismatches += 1
            request.kv_path = KVPath.RECOMPUTED
            return False
        version = params.weight_version
        if version is None or version == self.weight_version:
            return True
        self.num_version_mismatches += 1
        request.kv_path = KVPath.RECOMPUTED
        return False

    def start_recv(self, request: Request) -> None:
        params = request.remote_kv
        block_size = self.kv.block_size
        first = request.num_computed_tokens // block_size  # blocks below this were local hits
        end = cdiv(params.num_tokens, block_size)
        dst = self.kv.get_block_ids(request.request_id)[first:end]
        self.new_recvs.append(KVRecvTask(request.request_id, params, tuple(params.block_ids[first:end]), tuple(dst)))
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.receiving[request.request_id] = request
        self.recv_versions[request.request_id] = params.weight_version or self.weight_version

    def park(self, request: Request) -> None:
        """An aborted request whose blocks are still being written."""
        self.receiving.pop(request.request_id, None)
        self.parked[request.request_id] = request

    def on_status(self, status: KVTransferStatus) -> list[Request]:
        """Applies the runners' report; returns the requests that can run now."""
        self.bytes_received += status.bytes_received
        self.recv_seconds += status.recv_seconds
        for transfer_id in status.finished_sending | status.failed_sending:
            self.release(transfer_id)
        ready = []
        for request_id in [*status.finished_recving, *status.failed_recving]:
            version = self.recv_versions.pop(request_id, None)
            parked = self.parked.pop(request_id, None)
            if parked is not None:
                self.kv.free(parked)
                continue
            request = self.receiving.pop(request_id, None)
            if request is None:
                continue
            if version != self.weight_version:  # an update landed during the receive
                self.num_version_mismatches += 1
                request.kv_path = KVPath.RECOMPUTED
                request.num_computed_tokens = 0
            elif request_id in status.finished_recving:
                self.num_recv_ok += 1
                request.kv_path = KVPath.TRANSFERRED
                request.num_computed_tokens = request.remote_kv.num_tokens
                self.kv.cache_computed(request)
            else:
                self.num_recv_failed += 1
                request.kv_path = KVPath.RECOMPUTED  # from the local prefix hit onwards
            request.status = RequestStatus.RUNNING
            ready.append(request)
        return ready

    def take_updates(self) -> tuple[dict[str, tuple[int, ...]], list[str], list[KVRecvTask]]:
        updates = (self.new_leases, self.ended_leases, self.new_recvs)
        self.new_leases, self.ended_leases, self.new_recvs = {}, [], []
        return updates
