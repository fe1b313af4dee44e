"""The decode side of the NIXL handover (nixl_connector.py describes the protocol): each
receive connects to its prefill rank's agent, claims the lease's blocks, READs them into
its own (early, before the grant, once the peer's layout is known) and answers "done". It
runs on the connector's loop thread, like everything NIXL.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from .config import KVTransferConfig
from .connector import TransferError
from .nixl_layout import CacheLayout, checksum, encode_blocks
from .nixl_prefill import NixlPrefillSide
from .types import KVRecvTask
from .wire_layout import runs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Recv:
    """Decode side: one receive, connecting -> claimed -> reading (or refused, closed: no "done" owed)."""

    task: KVRecvTask
    peer: str  # the prefill rank's agent
    claim_id: int
    started: float
    deadline: float
    stage: str = "connecting"  # or "refreshing": the peer's metadata again, after it re-registered
    handle: Any = None  # the READ, while it runs
    checksum: int | None = None  # announced by the grant (verify mode)
    granted: bool = False
    read_done: bool = False


class NixlDecodeSide(NixlPrefillSide):
    """NixlConnector's half that receives; the connector supplies the agent, the mailbox,
    its rank and the registered caches and layout that READs land in."""

    _agent: Any
    rank: int
    name: str

    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__(config)
        # The loop thread's own.
        self._recvs: dict[int, _Recv] = {}
        self._peers: set[str] = set()  # agents whose metadata was asked for
        self._layouts: dict[str, CacheLayout] = {}  # prefill agents' cache layouts, from their grants
        self._claim_ids = itertools.count(1)

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
                        self._early_read(recv)
                elif recv.stage == "refreshing" and self._agent.check_remote_metadata(recv.peer):
                    self._start_read(recv, self._layouts[recv.peer])
                elif recv.stage == "reading" and recv.handle is not None:
                    state = self._agent.check_xfer_state(recv.handle)
                    if state == "DONE":
                        self._read_done(recv, now)
                        continue
                    if state == "ERR" and not recv.granted:  # an early READ: redone once the grant is in
                        self._release(recv)
                        recv.stage = "claimed"
                    elif state == "ERR":
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
            if early is not None and layout != early:  # it registered new caches (woke up): read those
                self._release(recv)
                recv.read_done = False
                self._refresh_peer(recv)
            elif recv.stage == "claimed":
                try:
                    self._start_read(recv, layout)
                except Exception as error:  # metadata fetched while it had no caches (asleep)?
                    logger.info(
                        "KV transfer %s: READ not posted (%s); fetching metadata again", recv.task.request_id, error
                    )
                    self._release(recv)
                    self._refresh_peer(recv)
            elif recv.read_done:
                self._finish(recv, time.monotonic())
        except Exception as error:
            self._fail(recv, error)

    def _early_read(self, recv: _Recv) -> None:
        """A READ before the grant; one that cannot be posted waits for the grant instead."""
        try:
            self._start_read(recv, self._layouts[recv.peer])
        except Exception as error:  # e.g. the peer's registration changed: the grant says how
            logger.info(
                "KV transfer %s: early READ not posted (%s); waiting for the grant", recv.task.request_id, error
            )
            self._release(recv)
            recv.stage = "claimed"

    def _refresh_peer(self, recv: _Recv) -> None:
        """The peer's memory registration changed: its metadata here is stale. Fetch it again;
        the READ starts once it is in (stage "refreshing")."""
        host, port = recv.task.params.source_endpoints[self.rank].partition("/")[0].rsplit(":", 1)
        self._agent.remove_remote_agent(recv.peer)
        self._agent.fetch_remote_metadata(recv.peer, host, int(port))
        recv.stage = "refreshing"

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
        if recv.stage in ("claimed", "reading", "refreshing"):  # unpin the blocks over there now, not at its timeout
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
