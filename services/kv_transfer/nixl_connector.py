"""KV handover over NVIDIA NIXL: the decode rank pulls the prefill rank's blocks with
one-sided READs; the prefill side never pushes, it only answers.

Each rank owns one NIXL agent (`baton-<uid>`, UCX backend) with every layer's cache
registered as NIXL memory (DRAM on CPUs, VRAM on GPUs). UCX picks the path the two ranks
share: RDMA (InfiniBand/RoCE), NVLink/CUDA IPC, shared memory, or TCP. The endpoint is
"host:port/agent-name", where the port is the agent's metadata listener. Control messages
are NIXL notifications (small JSON documents between agents):

    decode                                        prefill
    fetch the prefill agent's metadata, send
    its own (so the prefill can answer) <----->   listener thread
    claim {claim, transfer_id, blocks, verify} -> pin the leased blocks (a claim for a lease not
                                                  announced yet waits; one that ended is refused)
               <- grant {cache layout, crc32}     or: refused {reason} (the lease expired)
    READ the blocks into its own: one descriptor
    per layer, K/V half and run of blocks
    consecutive on both sides
    check the crc32 (verify mode)
    done {claim, ok} ------------------------->   unpin: finished_sending (ok) or failed_sending

Early READ: once a prefill rank's cache layout is known (from its first grant), the decode
side posts the READ as it sends the claim instead of after the grant, taking the grant's
round trip (up to the prefill loop's half-millisecond poll) off the handover. The data
counts only when the grant arrives: a grant means the claim pinned a live lease, and a
lease is taken when its request finishes and never revives once ended, so the blocks held
the finished prompt, unfreed, for the whole READ. A refusal cancels the READ and the
receive fails (the engine recomputes), as before.

Every wait has a deadline. The decode side gives up `timeout_s` after `start_recv`: it
cancels its READ, sends done {ok: false} and reports failed_recving (its engine recomputes).
The prefill side unpins a claim that got no "done" within `timeout_s` (a decode that died)
and reports failed_sending; `remove_leases` waits for pins, so freed blocks are never read
after reuse.

All agent calls run on one thread per connector, a loop over a work queue that polls
notifications and READ states (NIXL has no blocking wait): every 50 us while this rank
awaits a grant or a READ, every half millisecond while anything else is live, else every
10 ms. That polling also drives UCX: the agent runs no progress thread of its own (which
spins a core per agent); READs over RDMA, NVLink or shared memory need no help from the
prefill side, READs over TCP advance as its loop polls. The first transfer from a new
prefill rank also waits for the metadata exchange (NIXL's listeners poll every 100 ms).
Fault injection acts on the grant: drop never answers, delay_s answers late,
corrupt announces a wrong checksum. A one-sided READ cannot damage the data, so corrupt
exercises the checksum comparison, not damaged bytes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ..model.cpu_tuning import run_torch_serially_in_this_thread
from .config import KVTransferConfig
from .connector import TransferError, advertised_host
from .nixl_agent import Mailbox, create_agent
from .nixl_layout import CacheLayout, checksum, encode_blocks
from .nixl_prefill import NixlPrefillSide
from .types import KVRecvTask
from .wire_layout import runs

logger = logging.getLogger(__name__)

_RECEIVING_POLL_S = 0.00005  # while this rank awaits a grant or a READ: a short burst
_ACTIVE_POLL_S = 0.0005  # while receives, claims or leases are live (a prefill rank: usually)
_IDLE_POLL_S = 0.01


@dataclass(slots=True)
class _Recv:
    """Decode side: one receive, connecting -> claimed -> reading (or refused, closed: no "done" owed)."""

    task: KVRecvTask
    peer: str  # the prefill rank's agent
    claim_id: int
    started: float
    deadline: float
    stage: str = "connecting"
    handle: Any = None  # the READ, while it runs
    checksum: int | None = None  # announced by the grant (verify mode)
    granted: bool = False
    read_done: bool = False


class NixlConnector(NixlPrefillSide):
    """The agent, its loop and the decode side; the prefill side (claims) is NixlPrefillSide's."""

    def __init__(self, config: KVTransferConfig, tp_rank: int, device: torch.device) -> None:
        super().__init__(config)
        self.rank = tp_rank
        self.device = device
        self.name = f"baton-{uuid.uuid4().hex[:12]}"
        self._agent, port = create_agent(self.name)
        self._mail = Mailbox(self._agent, self.name, config.timeout_s)
        self._endpoint = f"{advertised_host(config.host)}:{port}/{self.name}"
        self.kv_caches: list[torch.Tensor] = []
        self._layout: CacheLayout | None = None
        self._registered = None
        # The loop thread's own.
        self._recvs: dict[int, _Recv] = {}
        self._peers: set[str] = set()  # agents whose metadata was asked for
        self._layouts: dict[str, CacheLayout] = {}  # prefill agents' cache layouts, from their grants
        self._claim_ids = itertools.count(1)
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-nixl-{tp_rank}", daemon=True)
        self._thread.start()

    # -- KVConnector ------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._call(lambda: self._register(kv_caches))

    def add_leases(self, leases: dict[str, tuple[int, ...]]) -> None:
        super().add_leases(leases)
        self._work.put(None)  # wake the loop: claims may be waiting for these

    def start_recv(self, task: KVRecvTask) -> None:
        with self._lock:
            self._pending.add(task.request_id)
        started = time.monotonic()
        self._work.put(lambda: self._begin_recv(task, started))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._work.put(None)
        self._thread.join(timeout=self.config.timeout_s)
        if self._thread.is_alive():
            logger.warning("NIXL connector %s did not stop within %gs", self.name, self.config.timeout_s)

    # -- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        run_torch_serially_in_this_thread()  # the engine thread keeps the only OpenMP team
        try:
            while not self._closed.is_set():
                self._do_work(self._poll_interval())
                try:
                    self._step(time.monotonic())
                except Exception:  # keep serving: one bad message or call must not stop every transfer
                    logger.exception("NIXL connector %s: step failed", self.name)
        finally:
            self._teardown()

    def _do_work(self, timeout: float) -> None:
        try:
            item = self._work.get(timeout=timeout)
            while True:
                if item is not None:
                    try:
                        item()
                    except Exception:
                        logger.exception("NIXL connector %s: work item failed", self.name)
                item = self._work.get_nowait()
        except queue.Empty:
            return

    def _poll_interval(self) -> float:
        if any(recv.stage in ("claimed", "reading") for recv in self._recvs.values()):
            return _RECEIVING_POLL_S
        with self._lock:
            has_leases = bool(self._leases)
        return _ACTIVE_POLL_S if has_leases or self._recvs or self._claims or self._mail else _IDLE_POLL_S

    def _step(self, now: float) -> None:
        for peer, op, message in self._mail.receive():
            self._on_message(peer, op, message)
        self._advance_recvs(now)
        self._advance_claims(now)
        self._mail.flush(now)

    def _on_message(self, peer: str, op: str, message: dict) -> None:
        if op == "claim":
            self._on_claim(peer, message)
        elif op == "grant":
            self._on_grant(peer, message)
        elif op == "refused":
            self._on_refused(peer, message)
        elif op == "done":
            self._on_done(peer, message)
        else:
            logger.warning("NIXL connector %s: unknown message %r from %s", self.name, op, peer)

    def _call(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the loop thread and waits for it."""
        done: Future[None] = Future()

        def work() -> None:
            try:
                done.set_result(fn())
            except BaseException as error:
                done.set_exception(error)

        self._work.put(work)
        done.result(timeout=self.config.timeout_s)

    def _register(self, kv_caches: list[torch.Tensor]) -> None:
        layout = CacheLayout.of(kv_caches)
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
        self._registered = self._agent.register_memory(kv_caches)
        self.kv_caches, self._layout = kv_caches, layout

    def _teardown(self) -> None:
        for recv in list(self._recvs.values()):
            recv.stage = "closed"
            self._fail(recv, TransferError("the connector closed"))
        try:
            if self._registered is not None:
                self._agent.deregister_memory(self._registered)
            for peer in self._peers:
                if self._agent.check_remote_metadata(peer):
                    self._agent.remove_remote_agent(peer)
        except Exception as error:
            logger.warning("NIXL connector %s: cleanup failed: %s", self.name, error)
        self._agent = self._mail = None  # the agent stops its threads as it is destroyed, here on the loop thread
        with self._lock:
            self._num_pins.clear()
            self._lock.notify_all()

    # -- decode side ------------------------------------------------------------------

    def _begin_recv(self, task: KVRecvTask, started: float) -> None:
        endpoint = task.params.source_endpoints[self.rank]
        address, _, peer = endpoint.partition("/")
        recv = _Recv(task, peer, next(self._claim_ids), started, started + self.config.timeout_s)
        self._recvs[recv.claim_id] = recv
        try:
            if not peer or ":" not in address:
                raise TransferError(f"{endpoint!r} is not a NIXL endpoint (host:port/agent)")
            if self._layout is None:
                raise TransferError("no KV cache registered")
            if peer not in self._peers:  # ask for its metadata, and send ours so it can answer
                host, port = address.rsplit(":", 1)
                self._agent.fetch_remote_metadata(peer, host, int(port))
                self._agent.send_local_metadata(host, int(port))
                self._peers.add(peer)
        except Exception as error:
            self._fail(recv, error)

    def _advance_recvs(self, now: float) -> None:
        for recv in list(self._recvs.values()):
            try:
                if recv.stage == "connecting" and self._agent.check_remote_metadata(recv.peer):
                    claim = {
                        "op": "claim",
                        "claim": recv.claim_id,
                        "transfer_id": recv.task.params.transfer_id,
                        "blocks": encode_blocks(recv.task.src_block_ids),
                        "verify": self.config.verify,
                    }
                    self._mail.send(recv.peer, claim, now)
                    recv.stage = "claimed"
                    if recv.peer in self._layouts:  # an early READ (module docstring)
                        self._mail.flush(now)  # the claim first: a READ may run to its end in the call
                        self._start_read(recv, self._layouts[recv.peer])
                elif recv.stage == "reading" and recv.handle is not None:
                    state = self._agent.check_xfer_state(recv.handle)
                    if state == "DONE":
                        self._read_done(recv, now)
                        continue
                    if state == "ERR":
                        raise TransferError("the READ failed")
                if now > recv.deadline:
                    raise TransferError(f"timed out after {self.config.timeout_s:g}s ({recv.stage})")
            except Exception as error:
                self._fail(recv, error)

    def _on_grant(self, peer: str, message: dict) -> None:
        recv = self._recvs.get(message["claim"])
        if recv is None or recv.peer != peer or recv.stage not in ("claimed", "reading") or recv.granted:
            self._mail.send(peer, {"op": "done", "claim": message["claim"], "ok": False}, time.monotonic())
            return  # given up: let it unpin
        try:
            recv.checksum = message.get("checksum")
            recv.granted = True
            layout = CacheLayout.from_message(message["layout"])
            early = self._layouts.get(peer)
            self._layouts[peer] = layout
            if recv.stage == "claimed":
                self._start_read(recv, layout)
            elif layout != early:
                raise TransferError("the prefill rank's cache layout changed under an early READ")
            elif recv.read_done:
                self._finish(recv, time.monotonic())
        except Exception as error:
            self._fail(recv, error)

    def _start_read(self, recv: _Recv, remote: CacheLayout) -> None:
        local = self._layout
        if len(remote.bases) != len(local.bases) or remote.block_bytes != local.block_bytes:
            raise TransferError("the prefill rank's KV cache is shaped differently")
        src, dst = recv.task.src_block_ids, recv.task.dst_block_ids
        segments = runs(src, dst)  # runs consecutive on both sides: one descriptor each
        recv.stage = "reading"
        if not segments:
            self._read_done(recv, time.monotonic())
            return
        agent = self._agent
        local_descs = agent.get_xfer_descs(local.descriptors([(dst[i], n) for i, n in segments]), local.mem_type)
        remote_descs = agent.get_xfer_descs(remote.descriptors([(src[i], n) for i, n in segments]), remote.mem_type)
        recv.handle = agent.initialize_xfer("READ", local_descs, remote_descs, recv.peer)
        state = agent.transfer(recv.handle)
        if state == "ERR":
            raise TransferError("posting the READ failed")
        if state == "DONE":
            self._read_done(recv, time.monotonic())

    def _read_done(self, recv: _Recv, now: float) -> None:
        self._release(recv)
        recv.read_done = True
        if recv.granted:
            self._finish(recv, now)

    def _finish(self, recv: _Recv, now: float) -> None:
        """The READ is done and the grant is in."""
        dst = recv.task.dst_block_ids
        if recv.checksum is not None:
            crc = checksum(self.kv_caches, dst)
            if crc != recv.checksum:
                raise TransferError(f"checksum mismatch ({crc:#x} != {recv.checksum:#x})")
        self._mail.send(recv.peer, {"op": "done", "claim": recv.claim_id, "ok": True}, now)
        del self._recvs[recv.claim_id]
        with self._lock:
            self._status.finished_recving.add(recv.task.request_id)
            self._status.bytes_received += 2 * len(self.kv_caches) * len(dst) * self._layout.block_bytes
            self._status.recv_seconds += time.monotonic() - recv.started
            self._pending.discard(recv.task.request_id)

    def _on_refused(self, peer: str, message: dict) -> None:
        recv = self._recvs.get(message["claim"])
        if recv is not None and recv.peer == peer and recv.stage in ("claimed", "reading") and not recv.granted:
            recv.stage = "refused"  # nothing pinned over there: no "done" owed (an early READ is cancelled)
            self._fail(recv, TransferError(message.get("reason", "refused")))

    def _fail(self, recv: _Recv, error: Exception) -> None:
        logger.warning("KV transfer %s from %s failed: %s", recv.task.request_id, recv.peer, error)
        self._recvs.pop(recv.claim_id, None)
        self._release(recv)  # before reporting: the engine may reuse the blocks at once
        with self._lock:
            self._status.failed_recving[recv.task.request_id] = f"{type(error).__name__}: {error}"
            self._pending.discard(recv.task.request_id)
        if recv.stage in ("claimed", "reading"):  # unpin the blocks over there now, not at its timeout
            self._mail.send(recv.peer, {"op": "done", "claim": recv.claim_id, "ok": False}, time.monotonic())
        elif recv.stage == "connecting" and recv.peer in self._peers:
            try:
                if not self._agent.check_remote_metadata(recv.peer):
                    self._peers.discard(recv.peer)  # never reached: the next receive asks again
            except Exception as check_error:
                logger.warning("NIXL connector %s: %s", self.name, check_error)

    def _release(self, recv: _Recv) -> None:
        """Frees the READ's handle; one still running is cancelled."""
        handle, recv.handle = recv.handle, None
        if handle is not None:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as error:  # NIXL keeps it and retries when the agent goes
                logger.warning("KV transfer %s: cancelling the READ failed: %s", recv.task.request_id, error)
