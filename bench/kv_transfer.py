"""KV handover efficiency on CPU: a connector moving a prompt's blocks between two
processes, against the raw transport moving the same bytes between the same two processes,
in one run.

    python bench/kv_transfer.py [--transport torch|nixl] [--tokens 2048] [--repeats 15]

torch: the torch.distributed connector vs raw gloo send/recv of one tensor per layer.
nixl:  the NIXL connector vs a raw NIXL READ (UCX) between two bare agents, one descriptor
       per layer.

The KV cache is shaped like the benchmark model's (8 layers, 4 KV heads x 64, float32,
blocks of 16): a 2048-token prompt is 128 blocks, 32 MiB.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import time

import torch
import torch.distributed as dist
from baton.services.model.cpu_tuning import tune_malloc_for_cpu_inference

LAYERS, BLOCK, HEADS, DIM, NUM_BLOCKS = 8, 16, 4, 64, 512
# How often the handover's end, and a raw NIXL READ's, are checked: the same for both, so
# neither ratio carries the other's polling delay (raw gloo's end is a blocking wait).
COMPLETION_POLL_S = 0.00005


def kv_caches() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)]


def connector(role: str, transport: str):
    from baton.services.kv_transfer.config import KVTransferConfig
    from baton.services.kv_transfer.factory import create_connector

    torch.set_num_threads(1)
    tune_malloc_for_cpu_inference()  # as in an engine process
    config = KVTransferConfig(role=role, host="127.0.0.1", transport=transport)
    return create_connector(config, 0, torch.device("cpu"))


def producer(conn, transport: str, num_blocks: int, repeats: int) -> None:
    sender = connector("prefill", transport)
    sender.register_kv_caches(kv_caches())
    blocks = tuple(range(num_blocks))
    sender.add_leases({f"t{i}": blocks for i in range(repeats)})
    conn.send(sender.endpoint)
    payload = [torch.randn(2, num_blocks, BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    if transport == "nixl":
        raw_nixl_source(conn, payload)
    else:
        raw_gloo_sender(conn, payload, repeats)
    conn.recv()  # wait for the consumer to finish before closing
    sender.close()


def raw_gloo_sender(conn, payload: list[torch.Tensor], repeats: int) -> None:
    """Raw baseline: a plain gloo group, the same bytes as one tensor per layer."""
    host, port = conn.recv()
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=60))
    for _ in range(repeats):
        works = [group.send([t], 1, 0) for t in payload]
        for work in works:
            work.wait()


def raw_nixl_source(conn, payload: list[torch.Tensor]) -> None:
    """Raw baseline: a bare agent exposing the payload; the consumer READs it. It polls its
    notifications meanwhile, as the connector's loop does (UCX over TCP advances that way)."""
    from baton.services.kv_transfer.nixl_agent import load_nixl

    nixl_agent, nixl_agent_config = load_nixl()
    agent = nixl_agent("raw-source", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory(payload)
    rows = [(t.data_ptr(), t.numel() * t.element_size(), 0) for t in payload]
    conn.send((agent.get_agent_metadata(), rows))
    while not conn.poll(0.0005):  # until the consumer is done
        agent.get_new_notifs()


def consumer(conn, transport: str, endpoint: str, num_blocks: int, repeats: int) -> None:
    from baton.services.kv_transfer.types import KVRecvTask, KVTransferParams

    receiver = connector("decode", transport)
    receiver.register_kv_caches([torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)])
    handover = []
    for i in range(repeats):
        params = KVTransferParams(f"t{i}", "p", (endpoint,), tuple(range(num_blocks)), num_blocks * BLOCK, BLOCK, 1)
        start = time.perf_counter()
        receiver.start_recv(KVRecvTask(f"t{i}", params, params.block_ids, tuple(range(num_blocks))))
        while receiver.has_pending():  # noticed within 50 us, as the raw NIXL READ's end is
            time.sleep(COMPLETION_POLL_S)
        status = receiver.poll()
        assert f"t{i}" in status.finished_recving, status
        handover.append(time.perf_counter() - start)
    buffers = [torch.empty(2, num_blocks, BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    raw = raw_nixl_reads(conn, buffers, repeats) if transport == "nixl" else raw_gloo_receives(conn, buffers, repeats)
    conn.send(None)
    conn.send((handover, raw))
    receiver.close()


def raw_gloo_receives(conn, buffers: list[torch.Tensor], repeats: int) -> list[float]:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    conn.send(("127.0.0.1", store.port))
    group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
    raw = []
    for _ in range(repeats):
        start = time.perf_counter()
        works = [group.recv([b], 0, 0) for b in buffers]
        for work in works:
            work.wait()
        raw.append(time.perf_counter() - start)
    return raw


def raw_nixl_reads(conn, buffers: list[torch.Tensor], repeats: int) -> list[float]:
    """One READ of every layer's bytes per repeat, polled as the connector polls a READ."""
    import numpy as np
    from baton.services.kv_transfer.nixl_agent import load_nixl

    nixl_agent, nixl_agent_config = load_nixl()
    agent = nixl_agent("raw-reader", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory(buffers)
    metadata, rows = conn.recv()
    source = agent.add_remote_agent(metadata)
    local = agent.get_xfer_descs(
        np.array([(b.data_ptr(), b.numel() * b.element_size(), 0) for b in buffers], dtype=np.uint64), "DRAM"
    )
    remote = agent.get_xfer_descs(np.array(rows, dtype=np.uint64), "DRAM")
    raw = []
    for _ in range(repeats):
        start = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, source)
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            time.sleep(COMPLETION_POLL_S)
            state = agent.check_xfer_state(handle)
        assert state == "DONE", state
        raw.append(time.perf_counter() - start)
        agent.release_xfer_handle(handle)
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("torch", "nixl"), default="torch")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    num_blocks = args.tokens // BLOCK
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    prod = ctx.Process(target=producer, args=(p_child, args.transport, num_blocks, args.repeats))
    prod.start()
    endpoint = p_conn.recv()
    cons = ctx.Process(target=consumer, args=(c_child, args.transport, endpoint, num_blocks, args.repeats))
    cons.start()
    if args.transport == "torch":
        p_conn.send(c_conn.recv())  # the raw group's store address
    else:
        c_conn.send(p_conn.recv())  # the raw source agent's metadata and descriptors
    c_conn.recv()
    p_conn.send(None)
    handover, raw = c_conn.recv()
    prod.join()
    cons.join()
    size = LAYERS * 2 * num_blocks * BLOCK * HEADS * DIM * 4
    h, r = statistics.median(handover), statistics.median(raw)
    print(f"{args.tokens}-token prompt: {num_blocks} blocks x {LAYERS} layers = {size / 2**20:.1f} MiB")
    print(
        f"handover (connector: request, transfer into its blocks, ack):      {h * 1000:7.1f} ms  "
        f"{size / h / 2**30:5.2f} GiB/s"
    )
    raw_name = (
        "raw gloo send/recv of the same bytes" if args.transport == "torch" else "raw NIXL READ of the same bytes"
    )
    print(f"{raw_name + ':':<67}{r * 1000:7.1f} ms  {size / r / 2**30:5.2f} GiB/s")
    print(f"handover / raw bandwidth: {r / h:.2f}x (goal >= 0.8x)")


if __name__ == "__main__":
    main()
