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
receive fails (the engine recomputes), as before. A prefill rank that slept and woke has
new caches, and its metadata here is stale: a grant announcing another layout than the
early READ used, or a READ that cannot be posted after the grant, fetches the metadata
again and reads from the granted layout (an early READ that fails waits for the grant).

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

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..model.cpu_tuning import run_torch_serially_in_this_thread
from .config import KVTransferConfig
from .connector import TransferError, advertised_host
from .nixl_agent import Mailbox, create_agent
from .nixl_decode import NixlDecodeSide
from .nixl_layout import CacheLayout
from .types import KVRecvTask

logger = logging.getLogger(__name__)

_RECEIVING_POLL_S = 0.00005  # while this rank awaits a grant or a READ: a short burst
_ACTIVE_POLL_S = 0.0005  # while receives, claims or leases are live (a prefill rank: usually)
_IDLE_POLL_S = 0.01


class NixlConnector(NixlDecodeSide):
    """The agent and its loop; the decode side (receives) is NixlDecodeSide's, the prefill
    side (claims) NixlPrefillSide's."""

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

    def _forget_kv_caches(self) -> None:
        self._call(self._deregister)

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
        if any(recv.stage in ("claimed", "reading", "refreshing") for recv in self._recvs.values()):
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

    def _deregister(self) -> None:
        """No memory stays registered (pinned, for RDMA) or referenced once the caches go."""
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
        self._registered, self.kv_caches, self._layout = None, [], None

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
