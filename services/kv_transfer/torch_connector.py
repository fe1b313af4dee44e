"""KV handover over torch.distributed: gloo on CPU, NCCL on CUDA.

Every rank runs a TCPStore server (its endpoint). It is both the control channel and the
rendezvous for data groups:

  control   a queue in the prefill rank's store: the decode rank pushes a request (one
            one-way message); the prefill rank's server thread pops them in order
  data      one 2-rank process group per (decode rank, prefill rank) pair, built lazily on a
            PrefixStore of the prefill rank's store (prefill = rank 0, decode = rank 1), reused,
            and rebuilt under a new generation after a failure. Its name holds both ends and
            the generation; the transfers of one pair run one at a time (a message of one
            landing in another's receive would abort the process inside gloo). Adding or
            removing a replica never touches the other pairs' groups.

One transfer, pipelined layer by layer (the next layer is in flight while one is packed
or unpacked):

    decode                                   prefill
    request {id, blocks, pair, gen} ----->   claim the lease (refused if it ended; waited
                                             for if not announced yet)
    (plans its receive meanwhile: the        post the ack's receive
     layout follows from the block ids)
    recv header  <-----------------------    header [status, blocks, layout, checksum]
    recv K/V, layer by layer <-----------    send layer by layer (wire_layout.py: slices of the
                                             cache where blocks are consecutive, else gathered)
    write into its own blocks, verify
    send ack ---------------------------->   finished_sending: the lease can be released

Every socket listens on the advertised host only (a TCPStore alone would bind every interface;
gloo's default device binds the address the hostname resolves to): the store takes a socket
bound here, and the groups' gloo device is made for that host.

Both sides time out (the groups' timeout); a failed pair is dropped and rebuilt under the
next generation, and the decode side reports the failure so its engine recomputes.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..model.cpu_tuning import run_torch_serially_in_this_thread
from ..roles import Role
from . import wire_layout
from .config import KVTransferConfig
from .connector import KVConnector, TransferError, advertised_host
from .types import KVRecvTask

logger = logging.getLogger(__name__)

_TAG = 0
_OK, _EXPIRED = 0, 1
_QUEUE = "requests"
_SERVER_WAIT = datetime.timedelta(minutes=5)
_STOP = "stop"


class TorchDistributedConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, tp_rank: int, device: torch.device) -> None:
        super().__init__(config)
        self.rank = tp_rank
        self.device = device
        self.uid = uuid.uuid4().hex[:12]
        self.timeout = datetime.timedelta(seconds=config.timeout_s)
        self.host = advertised_host(config.host)
        self.store = _store_listening_on(self.host, self.timeout)
        self._endpoint = f"{self.host}:{self.store.port}"
        self.kv_caches: list[torch.Tensor] = []
        self._closed = threading.Event()
        # Serial torch in the transfer threads: the engine thread keeps the only OpenMP team.
        self._send_pool = ThreadPoolExecutor(4, "kv-send", initializer=run_torch_serially_in_this_thread)
        # Receiving side.
        self._recv_pool = ThreadPoolExecutor(4, "kv-recv", initializer=run_torch_serially_in_this_thread)
        self._clients: dict[str, dist.TCPStore] = {}
        self._generations: dict[str, int] = {}
        # Data groups by pair key, and one lock per pair (a group runs one transfer at a time).
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._pair_locks: dict[str, threading.Lock] = {}
        self._server = None
        if config.role is Role.PREFILL:
            self._server = threading.Thread(target=self._serve, name="kv-transfer-server", daemon=True)
            self._server.start()

    # -- KVConnector ------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def _forget_kv_caches(self) -> None:
        self.kv_caches = []  # a receive still writing holds its own plan's views until it ends

    def start_recv(self, task: KVRecvTask) -> None:
        with self._lock:
            self._pending.add(task.request_id)
        self._recv_pool.submit(self._recv, task)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._lock.notify_all()  # claims waiting for a lease give up
        if self._server is not None:  # wake the server thread from its wait
            self.store.queue_push(_QUEUE, _STOP)
        self._send_pool.shutdown(wait=False, cancel_futures=True)
        self._recv_pool.shutdown(wait=False, cancel_futures=True)
        self._groups.clear()
        self._clients.clear()

    # -- decode side ------------------------------------------------------------------

    def _recv(self, task: KVRecvTask) -> None:
        start = time.monotonic()
        endpoint = task.params.source_endpoints[self.rank]
        try:
            with self._pair_lock(endpoint):
                received = self._recv_locked(task, endpoint)
            with self._lock:
                self._status.finished_recving.add(task.request_id)
                self._status.bytes_received += received
                self._status.recv_seconds += time.monotonic() - start
        except Exception as error:  # any failure: the engine recomputes this request
            logger.warning("KV transfer %s from %s failed: %s", task.request_id, endpoint, error)
            self._drop_pair(endpoint)
            with self._lock:
                self._status.failed_recving[task.request_id] = f"{type(error).__name__}: {error}"
        finally:
            with self._lock:
                self._pending.discard(task.request_id)

    def _recv_locked(self, task: KVRecvTask, endpoint: str) -> int:
        store = self._client(endpoint)
        pair = self._pair_name(endpoint, self._generations.get(endpoint, 0))
        request = {
            "transfer_id": task.params.transfer_id,
            "blocks": list(task.src_block_ids),
            "pair": pair,
            "verify": self.config.verify,
        }
        store.queue_push(_QUEUE, json.dumps(request))
        group = self._group(pair, store, rank=1)
        header = torch.zeros(4, dtype=torch.int64, device=self.device)
        header_work = group.recv([header], 0, _TAG)
        # While the request travels: the sender picks the layout from the same block ids.
        expected_layout = wire_layout.choose_layout(task.src_block_ids)
        plan = wire_layout.incoming(self.kv_caches, task.src_block_ids, task.dst_block_ids, expected_layout)
        header_work.wait()
        status, num_blocks, layout, checksum = header.tolist()
        if status == _EXPIRED:
            raise TransferError("the prefill side's lease expired")
        if num_blocks != len(task.dst_block_ids) or layout != expected_layout:
            raise TransferError(
                f"header announces {num_blocks} blocks in layout {layout}, "
                f"expected {len(task.dst_block_ids)} in layout {expected_layout}"
            )
        works = [group.recv([buffer], 0, _TAG) for buffer, _ in plan]  # all posted: messages arrive back to back
        crc = 0
        for (buffer, finish), work in zip(plan, works):
            work.wait()
            if self.config.verify:
                crc = zlib.crc32(_bytes(buffer), crc)
            if finish is not None:
                finish()
        if self.config.verify and crc != checksum:
            raise TransferError(f"checksum mismatch ({crc:#x} != {checksum:#x})")
        group.send([torch.ones(1, dtype=torch.int64, device=self.device)], 0, _TAG).wait()
        return sum(buffer.numel() * buffer.element_size() for buffer, _ in plan)

    def _client(self, endpoint: str) -> dist.TCPStore:
        client = self._clients.get(endpoint)
        if client is None:
            host, port = endpoint.rsplit(":", 1)
            client = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
            self._clients[endpoint] = client
        return client

    def _pair_name(self, endpoint: str, generation: int) -> str:
        """The data group's name: its store prefix on the prefill side, and its key in `_groups`.

        It names both ends (this rank, the prefill rank's endpoint): a decode rank receives
        from many prefill ranks, each over a group of its own."""
        return f"pair/{self.uid}/{self.rank}/{endpoint}/{generation}"

    def _drop_pair(self, endpoint: str) -> None:
        """After a failure: forget the group (and the store client); the next transfer uses a new generation."""
        with self._lock:
            generation = self._generations.get(endpoint, 0)
            self._generations[endpoint] = generation + 1
            self._groups.pop(self._pair_name(endpoint, generation), None)
            self._clients.pop(endpoint, None)

    # -- prefill side -----------------------------------------------------------------

    def _serve(self) -> None:
        """Takes requests off this rank's queue, in order, and hands them to the send pool.

        Blocks in the store's `queue_pop` (no polling latency); `close` wakes it with a sentinel."""
        # A connection of its own: a blocking pop holds its connection, and the send threads
        # need the store (group rendezvous) meanwhile.
        host, port = self._endpoint.rsplit(":", 1)
        queue = dist.TCPStore(host, int(port), is_master=False, timeout=_SERVER_WAIT)
        while not self._closed.is_set():
            try:
                raw = queue.queue_pop(_QUEUE)
            except dist.DistStoreError:  # nothing for a while (c10d logs a warning): wait again
                continue
            if raw == _STOP.encode():
                return
            self._send_pool.submit(self._send, json.loads(raw))

    def _send(self, request: dict) -> None:
        transfer_id, pair = request["transfer_id"], request["pair"]
        blocks = self._claim(transfer_id, request["blocks"])
        ok = False
        try:
            with self._pair_lock(pair):
                faults = self.faults
                if faults.drop:
                    raise TransferError("dropped by fault injection")
                if faults.delay_s:
                    time.sleep(faults.delay_s)
                group = self._group(pair, self.store, rank=0)
                self._drop_older_generations(pair)
                self._send_blocks(group, blocks, request["verify"], faults.corrupt)
            ok = True
        except Exception as error:
            logger.warning("KV transfer %s to %s failed: %s", transfer_id, pair, error)
            with self._lock:
                self._groups.pop(pair, None)
        finally:
            if blocks is not None:
                self._unpin(transfer_id, ok)

    def _send_blocks(self, group, blocks: tuple[int, ...] | None, verify: bool, corrupt: bool) -> None:
        if blocks is None:
            header = torch.tensor([_EXPIRED, 0, 0, 0], dtype=torch.int64, device=self.device)
            group.send([header], 1, _TAG).wait()
            return
        ack = torch.zeros(1, dtype=torch.int64, device=self.device)
        ack_work = group.recv([ack], 1, _TAG)  # posted first: the receiver's ack goes out without a wait
        layout = wire_layout.choose_layout(blocks)
        messages = wire_layout.outgoing(self.kv_caches, blocks, layout)
        crc = 0
        if verify:  # the checksum goes in the header, so go over the data first
            messages = list(messages)
            for message in messages:
                crc = zlib.crc32(_bytes(message), crc)
        header = torch.tensor([_OK, len(blocks), layout, crc], dtype=torch.int64, device=self.device)
        group.send([header], 1, _TAG).wait()
        works, in_flight = [], []
        for index, message in enumerate(messages):  # packed layers are gathered while earlier ones fly
            if corrupt and index == 0:  # a damaged copy: never touch the cache itself
                message = message.clone()
                message.view(torch.uint8).view(-1)[0] ^= 0xFF
            works.append(group.send([message], 1, _TAG))
            in_flight.append(message)  # keep each buffer alive until its send completes
        for work in works:
            work.wait()
        ack_work.wait()

    def _claim(self, transfer_id: str, requested: list[int]) -> tuple[int, ...] | None:
        """The requested blocks, pinned against release; None: refused. A lease not announced
        yet is waited for, up to the timeout (the decode side waits as long for the header)."""
        deadline = time.monotonic() + self.config.timeout_s
        with self._lock:
            while (pinned := self._pin(transfer_id, requested)) is None and not self._closed.is_set():
                if (left := deadline - time.monotonic()) <= 0:
                    break
                self._lock.wait(timeout=left)
        return tuple(requested) if pinned else None

    def _drop_older_generations(self, pair: str) -> None:
        prefix, _, generation = pair.rpartition("/")
        with self._lock:
            for key in [k for k in self._groups if k.rpartition("/")[0] == prefix and k != pair]:
                del self._groups[key]

    # -- groups -----------------------------------------------------------------------

    def _group(self, pair: str, store: dist.Store, rank: int) -> dist.ProcessGroup:
        with self._lock:
            group = self._groups.get(pair)
        if group is None:
            prefixed = dist.PrefixStore(pair, store)
            if self.device.type == "cuda":
                group = dist.ProcessGroupNCCL(prefixed, rank, 2, dist.ProcessGroupNCCL.Options())
            else:
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                options._timeout = self.timeout
                group = dist.ProcessGroupGloo(prefixed, rank, 2, options)
            with self._lock:
                self._groups[pair] = group
        return group

    def _pair_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._pair_locks.setdefault(key, threading.Lock())


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().view(torch.uint8).cpu().numpy())


def _store_listening_on(host: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore server on a free port of `host` alone."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.bind(address)
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # The store owns the socket from here on (it closes it when it shuts down).
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=listener.detach()
    )
