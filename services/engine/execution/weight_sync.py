"""The trainer-to-engine weight channel: a torch.distributed group of its own, bucketed.

The trainer is rank 0 and broadcasts; every engine rank joins as `rank_offset + tp_rank`
and keeps only its shard of what it receives. The group is a process group of its own on
its own `TCPStore` (hosted by rank 0), never the default group, so it lives beside the TP
group: gloo (buffers in host memory) or NCCL (buffers on the group's CUDA device, which
for an engine rank is its weights' device). Everything else is the same for both.

Many tensors share one collective: tensors are grouped by dtype (in the order given) and
flattened into buckets of at most `bucket_bytes` (a larger tensor is a bucket alone). Both
sides derive the same plan from the same (names, dtypes, shapes, bucket_bytes), so only
the buckets' bytes cross the wire:

    names:    a:f32[4]  b:bf16[2]  c:f32[8]  d:f32[100]          bucket_bytes = 64
    buckets:  f32 [a c]    f32 [d]    bf16 [b]
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Small enough that a bucket is received while the one before is written (and, on the CPU,
# below malloc's raised mmap threshold, so buffers come from the heap, not fresh pages); on
# the bench model 64 MiB buckets made an update about half as fast (docs/benchmarks.md).
DEFAULT_BUCKET_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    offset: int  # elements into the bucket
    numel: int


@dataclass(frozen=True, slots=True)
class Bucket:
    dtype: torch.dtype
    entries: tuple[BucketEntry, ...]
    numel: int


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.bfloat16, "bfloat16" and "torch.bfloat16" name the same dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")
    return value


def plan_buckets(
    names: Sequence[str],
    dtypes: Sequence[torch.dtype | str],
    shapes: Sequence[Sequence[int]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> list[Bucket]:
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    if len(set(names)) != len(names):
        raise ValueError("a tensor name is given twice")
    by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        by_dtype.setdefault(as_dtype(dtype), []).append((name, tuple(int(s) for s in shape)))
    buckets: list[Bucket] = []
    for dtype, tensors in by_dtype.items():
        capacity = max(1, bucket_bytes // dtype.itemsize)
        entries: list[BucketEntry] = []
        used = 0
        for name, shape in tensors:
            numel = math.prod(shape)
            if entries and used + numel > capacity:
                buckets.append(Bucket(dtype, tuple(entries), used))
                entries, used = [], 0
            entries.append(BucketEntry(name, shape, used, numel))
            used += numel
        if entries:
            buckets.append(Bucket(dtype, tuple(entries), used))
    return buckets


class WeightSyncGroup:
    """One side's handle on the group (the trainer's or one engine rank's)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
    ) -> None:
        """`device`: NCCL's buffers' CUDA device (default: the current one); gloo's buffers are
        in host memory whatever it says, as before."""
        self.device = _buffer_device(backend, device)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group's world_size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        self._store = store  # kept alive: rank 0 hosts it for the others
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        prefixed = dist.PrefixStore(group_name, store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.process_group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self.process_group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Starts the broadcast; the returned work's `wait()` ends it (keep `tensor` alive)."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        return self.process_group.broadcast([tensor], options)

    def destroy(self) -> None:
        self.process_group = None
        self._store = None


def _buffer_device(backend: str, device: torch.device | str | None) -> torch.device:
    """Refuses what cannot work before anyone waits on the group: an unknown backend, or
    NCCL without CUDA buffers."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend != "nccl":
        raise ValueError(f"weight update groups support backends 'gloo' and 'nccl' (got {backend!r})")
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or not torch.cuda.is_available():
        where = "torch sees no CUDA device" if not torch.cuda.is_available() else f"the buffers would be on {device}"
        raise ValueError(f"weight update backend 'nccl' needs CUDA ({where}); use backend 'gloo'")
    return device


def _plan_header(buckets: Sequence[Bucket], device: torch.device) -> torch.Tensor:
    """What both sides planned, sent first: a trainer with another bucket size or other
    tensors is refused by name instead of filling the wrong bytes."""
    counts = [len(buckets), sum(b.numel for b in buckets), sum(len(b.entries) for b in buckets)]
    return torch.tensor(counts, device=device)


def receive_buckets(group: WeightSyncGroup, buckets: Sequence[Bucket]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine side: each bucket from rank 0 in turn, as (name, view into the bucket). The
    next bucket is already being received while the caller writes this one (two in flight
    at most, so a rank holds two buckets, not a second copy of the model)."""
    expected = _plan_header(buckets, group.device)
    header = torch.empty_like(expected)
    group.broadcast(header, src=0)
    if not torch.equal(header, expected):
        raise ValueError(
            "the trainer's buckets (count, elements, tensors) are "
            f"{header.tolist()}, this engine planned {expected.tolist()}: pass the trainer's "
            "names, dtypes, shapes and bucket_bytes to update_weights_from_distributed"
        )
    pending = iter(buckets)
    in_flight: collections.deque[tuple[Bucket, torch.Tensor, Any]] = collections.deque()

    def post() -> None:
        bucket = next(pending, None)
        if bucket is not None:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=group.device)
            in_flight.append((bucket, flat, group.broadcast_async(flat, src=0)))

    post()
    while in_flight:
        post()
        bucket, flat, work = in_flight.popleft()
        work.wait()
        yield [(e.name, flat[e.offset : e.offset + e.numel].view(e.shape)) for e in bucket.entries]


@contextlib.contextmanager
def core_left_for_receiving(group: WeightSyncGroup) -> Iterator[None]:
    """Gloo receives on a thread of its own while the engine thread writes the previous
    bucket; with every core in torch's OpenMP team, workers spinning between the writes'
    parallel regions take the core that thread needs (on 2 cores: 70 ms of CPU more than
    receiving and writing alone, an update 25% slower). So the writes leave it one."""
    threads = torch.get_num_threads()
    if group.device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def broadcast_weights(
    group: WeightSyncGroup, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Trainer side (rank 0): sends `named_tensors` in the plan the engine derives from
    `describe(named_tensors)` and the same `bucket_bytes`, flattening the next bucket while
    the previous one is on the wire (`FlatWeights` spares the flattening)."""
    tensors = dict(named_tensors)
    buckets = plan_buckets(*describe(named_tensors), bucket_bytes)

    def flats() -> Iterator[torch.Tensor]:
        for bucket in buckets:
            if len(bucket.entries) == 1:  # no copy for a tensor that is a bucket alone
                yield tensors[bucket.entries[0].name].detach().to(group.device).contiguous().view(-1)
            else:
                yield torch.cat([tensors[e.name].detach().to(group.device).reshape(-1) for e in bucket.entries])

    _send(group, buckets, flats())


class FlatWeights:
    """Trainer side: tensors that live inside their bucket buffers, so `broadcast` copies
    nothing. `tensors[name]` is a view a trainer can make its parameter's storage
    (`param.data = flat.tensors[name]`), as trainers with contiguous parameter buffers do."""

    def __init__(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str = "cpu",  # the group's: "cuda" for NCCL
    ):
        self.names, self.dtypes, self.shapes = describe(named_tensors)
        self.bucket_bytes = bucket_bytes
        self.buckets = plan_buckets(self.names, self.dtypes, self.shapes, bucket_bytes)
        source = dict(named_tensors)
        self.flats: list[torch.Tensor] = []
        self.tensors: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
            for e in bucket.entries:
                self.tensors[e.name] = flat[e.offset : e.offset + e.numel].view(e.shape)
                self.tensors[e.name].copy_(source[e.name])
            self.flats.append(flat)

    def broadcast(self, group: WeightSyncGroup) -> None:
        _send(group, self.buckets, iter(self.flats))


def _send(group: WeightSyncGroup, buckets: Sequence[Bucket], flats: Iterator[torch.Tensor]) -> None:
    """The plan's header, then each bucket; the next is prepared while one is in flight."""
    group.broadcast(_plan_header(buckets, group.device), src=0)
    in_flight: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()
    for flat in flats:
        in_flight.append((flat, group.broadcast_async(flat, src=0)))
        if len(in_flight) > 1:
            in_flight.popleft()[1].wait()
    for _, work in in_flight:
        work.wait()


def describe(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    """(names, dtypes, shapes): what `update_weights_from_distributed` is told."""
    return (
        [name for name, _ in named_tensors],
        [t.dtype for _, t in named_tensors],
        [list(t.shape) for _, t in named_tensors],
    )
