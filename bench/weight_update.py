"""Weight updates on the bench model (fp32, CPU): from disk, and from a trainer process over
a gloo group, against a raw torch.distributed broadcast of the same bytes in the same run
(same group, same bucket sizes, preallocated buffers, nothing loaded); and how long
generation pauses for an update (last token before it to the next token of every request).

    python bench/weight_update.py [--reps 5] [--bucket-mb 16] [--requests 8]

The trainer is a separate process (multiprocessing spawn), rank 0 of the group, taking
commands over a queue; the engine is an in-process `LLM` (TP=1).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.execution.weight_sync import (
    FlatWeights,
    WeightSyncGroup,
    broadcast_weights,
    describe,
    plan_buckets,
)
from common import BENCH_MODELS, bench_model
from safetensors.torch import load_file

GROUP = "bench"


def trainer(model_dir: str, port: int, bucket_bytes: int, commands: mp.Queue, ready: mp.Queue) -> None:
    """Rank 0: broadcasts the checkpoint ("update") or the same bytes raw ("raw") on command."""
    torch.set_num_threads(1)
    named = list(load_file(Path(model_dir) / "model.safetensors").items())
    buckets = plan_buckets(*describe(named), bucket_bytes)
    tensors = dict(named)
    flats = [torch.cat([tensors[e.name].reshape(-1) for e in b.entries]) for b in buckets]
    group = WeightSyncGroup("127.0.0.1", port, 0, 2, GROUP)
    ready.put(describe(named))
    flat_weights = FlatWeights(named, bucket_bytes)
    while (command := commands.get()) != "stop":
        if command == "raw":
            for flat in flats:
                group.broadcast(flat)
        elif command == "flat":
            flat_weights.broadcast(group)
        else:
            broadcast_weights(group, named, bucket_bytes)
    group.destroy()


def seeded_bench_model(seed: int) -> Path:
    from baton.services.model.tiny import make_tiny_model

    path = BENCH_MODELS / f"llama-bench-seed{seed}"
    if not (path / "model.safetensors").exists():
        make_tiny_model(path, arch="llama", preset="bench", seed=seed)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generation_pause(llm: LLM, update, num_requests: int) -> float:
    """Seconds from the last step before `update` to the step after it in which every
    running request has a new token (they recompute their K/V on the new weights)."""
    core = llm.core
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i in range(num_requests):
        core.add_request(f"pause-{time.monotonic_ns()}-{i}", list(range(10 + i, 138 + i)), params)
    while (
        min((r.num_output_tokens for r in core.scheduler.running_requests()), default=0) < 8
        or core.scheduler.num_waiting
    ):
        core.step()
    counts = {r.request_id: r.num_output_tokens for r in core.scheduler.requests.values()}
    start = time.perf_counter()
    update()
    while any(r.num_output_tokens <= counts[r.request_id] for r in core.scheduler.requests.values()):
        core.step()
    pause = time.perf_counter() - start
    for request_id in list(counts):
        core.abort_request(request_id)
    core.step()
    return pause


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    bucket_bytes = args.bucket_mb * 2**20
    old_dir, new_dir = bench_model(), seeded_bench_model(1)
    llm = LLM(model=str(old_dir), num_kv_blocks=1024, max_num_batched_tokens=2048)
    num_bytes = sum(t.numel() * t.element_size() for t in load_file(new_dir / "model.safetensors").values())
    mb = num_bytes / 2**20

    ctx = mp.get_context("spawn")
    commands, ready = ctx.Queue(), ctx.Queue()
    port = free_port()
    process = ctx.Process(target=trainer, args=(str(new_dir), port, bucket_bytes, commands, ready))
    process.start()
    llm.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP)
    names, dtypes, shapes = ready.get(timeout=120)
    group = llm.core.executor.rank.weights.groups[GROUP]
    raw_buffers = [torch.empty(b.numel, dtype=b.dtype) for b in plan_buckets(names, dtypes, shapes, bucket_bytes)]

    def raw() -> None:
        commands.put("raw")
        for buffer in raw_buffers:
            group.broadcast(buffer)

    def over_gloo(command: str = "update") -> None:
        commands.put(command)
        llm.update_weights_from_distributed(names, dtypes, shapes, bucket_bytes=bucket_bytes)

    def over_gloo_flat() -> None:
        over_gloo("flat")

    def from_disk() -> None:
        llm.update_weights_from_disk(str(new_dir))

    raw(), over_gloo(), over_gloo_flat()  # warm-up: connections, allocator
    # Interleaved, so that load from elsewhere on the machine hits every kind alike.
    runs: dict[str, list[float]] = {"raw": [], "gloo": [], "flat": [], "disk": []}
    for _ in range(args.reps):
        for kind, fn in (("raw", raw), ("gloo", over_gloo), ("flat", over_gloo_flat), ("disk", from_disk)):
            runs[kind].append(timed(fn, 1))
    raw_best, gloo_s, flat_s, disk_s = (statistics.median(runs[k]) for k in ("raw", "gloo", "flat", "disk"))
    pause_disk = generation_pause(llm, from_disk, args.requests)
    pause_gloo = generation_pause(llm, over_gloo, args.requests)
    commands.put("stop")
    process.join(timeout=60)
    llm.destroy_weights_update_group(GROUP)
    llm.shutdown()

    num_buckets = len(raw_buffers)
    print(
        f"bench model: {mb:.1f} MiB of fp32 weights, {len(names)} tensors, {num_buckets} bucket(s) of <= {args.bucket_mb} MiB"
    )
    print(f"raw gloo broadcast of the same bytes:  {raw_best * 1000:7.1f} ms  ({mb / raw_best:7.1f} MiB/s)")
    print(f"update over the gloo group:            {gloo_s * 1000:7.1f} ms  ({mb / gloo_s:7.1f} MiB/s)")
    print(f"  ratio raw / update:                  {raw_best / gloo_s:7.2f}x  (goal >= 0.8x)")
    print(f"  trainer with FlatWeights (no copy):  {flat_s * 1000:7.1f} ms  ratio {raw_best / flat_s:.2f}x")
    print(f"update from disk:                      {disk_s * 1000:7.1f} ms  ({mb / disk_s:7.1f} MiB/s)")
    print(f"generation pause, {args.requests} decoding requests (128-token prompts, recomputed after the update):")
    print(f"  update from disk:                    {pause_disk * 1000:7.1f} ms")
    print(f"  update over the gloo group:          {pause_gloo * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
