"""KV handover efficiency on CPU (gloo): the torch.distributed connector moving a prompt's
blocks between two processes, against raw gloo send/recv of the same bytes between the
same two processes, in one run.

    python bench/kv_transfer.py [--tokens 2048] [--repeats 5]

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
from baton.services.engine.cpu_tuning import tune_malloc_for_cpu_inference

LAYERS, BLOCK, HEADS, DIM, NUM_BLOCKS = 8, 16, 4, 64, 512


def kv_caches() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)]


def producer(conn, num_blocks: int, repeats: int) -> None:
    from baton.services.kv_transfer.config import KVTransferConfig
    from baton.services.kv_transfer.torch_connector import TorchDistributedConnector

    torch.set_num_threads(1)
    tune_malloc_for_cpu_inference()  # as in an engine process
    connector = TorchDistributedConnector(KVTransferConfig(role="producer", host="127.0.0.1"), 0, torch.device("cpu"))
    connector.register_kv_caches(kv_caches())
    blocks = tuple(range(num_blocks))
    connector.add_leases({f"t{i}": blocks for i in range(repeats)})
    conn.send(connector.endpoint)
    # Raw baseline: a plain gloo group, the same bytes as one tensor per layer.
    host, port = conn.recv()
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=60))
    payload = [torch.randn(2, num_blocks, BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    for _ in range(repeats):
        works = [group.send([t], 1, 0) for t in payload]
        for work in works:
            work.wait()
    conn.recv()  # wait for the consumer to finish before closing
    connector.close()


def consumer(conn, endpoint: str, num_blocks: int, repeats: int) -> None:
    from baton.services.kv_transfer.config import KVTransferConfig
    from baton.services.kv_transfer.torch_connector import TorchDistributedConnector
    from baton.services.kv_transfer.types import KVRecvTask, KVTransferParams

    torch.set_num_threads(1)
    tune_malloc_for_cpu_inference()
    connector = TorchDistributedConnector(KVTransferConfig(role="consumer", host="127.0.0.1"), 0, torch.device("cpu"))
    connector.register_kv_caches([torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)])
    handover = []
    for i in range(repeats):
        params = KVTransferParams(f"t{i}", "p", (endpoint,), tuple(range(num_blocks)), num_blocks * BLOCK, BLOCK, 1)
        start = time.perf_counter()
        connector.start_recv(KVRecvTask(f"t{i}", params, params.block_ids, tuple(range(num_blocks))))
        while connector.has_pending():
            time.sleep(0.0005)
        status = connector.poll()
        assert f"t{i}" in status.finished_recving, status
        handover.append(time.perf_counter() - start)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    conn.send(("127.0.0.1", store.port))
    group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
    buffers = [torch.empty(2, num_blocks, BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    raw = []
    for _ in range(repeats):
        start = time.perf_counter()
        works = [group.recv([b], 0, 0) for b in buffers]
        for work in works:
            work.wait()
        raw.append(time.perf_counter() - start)
    conn.send(None)
    conn.send((handover, raw))
    connector.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    num_blocks = args.tokens // BLOCK
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    prod = ctx.Process(target=producer, args=(p_child, num_blocks, args.repeats))
    prod.start()
    endpoint = p_conn.recv()
    cons = ctx.Process(target=consumer, args=(c_child, endpoint, num_blocks, args.repeats))
    cons.start()
    p_conn.send(c_conn.recv())  # the raw group's store address
    c_conn.recv()
    p_conn.send(None)
    handover, raw = c_conn.recv()
    prod.join()
    cons.join()
    size = LAYERS * 2 * num_blocks * BLOCK * HEADS * DIM * 4
    h, r = statistics.median(handover), statistics.median(raw)
    print(f"{args.tokens}-token prompt: {num_blocks} blocks x {LAYERS} layers = {size / 2**20:.1f} MiB")
    print(
        f"handover (connector, incl. request, header, write into blocks, ack): {h * 1000:7.1f} ms  "
        f"{size / h / 2**30:5.2f} GiB/s"
    )
    print(
        f"raw gloo send/recv of the same bytes:                              {r * 1000:7.1f} ms  "
        f"{size / r / 2**30:5.2f} GiB/s"
    )
    print(f"handover / raw bandwidth: {r / h:.2f}x (goal >= 0.8x)")


if __name__ == "__main__":
    main()
