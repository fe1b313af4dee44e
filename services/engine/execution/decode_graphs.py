"""CUDA graphs for decode-only steps (engine.runner.cuda_graphs).

A decode step launches about ten kernels per layer, each a few microseconds of GPU work, so
at small batches the host's launch cost sets the step's time, not the GPU. A graph captured
once per batch size replays the whole forward pass with one launch:

    n decode rows -> bucket b >= n (1, 2, 4, then multiples of 8 up to the largest)
                  -> the step's inputs copied into the static buffers' rows [:n]
                  -> rows [n:b] padded: token 0 at position 0, slot -1 (nothing is written to
                     the KV cache), a context of one token (block table row left as it is:
                     any block id there is a real block, read and discarded)
                  -> replay, then rows [:n] of the graph's output

A graph fixes at capture what it reads and writes: the static buffers, the weights and the KV
cache (their addresses), and the attention kernel's launch, whose split-K count is chosen for
`max_model_len`, the longest context any request reaches (each request cuts its own context
into that many splits, kernels/paged_decode_attention.py). A weight update or sleep that puts a
weight or the KV cache in new memory makes every graph stale: `refresh` (called between steps)
compares the addresses with those captured, drops the graphs if any moved, and each bucket is
captured again when a step next needs it.

Mixed steps (any prefill chunk) and batches past the largest bucket run eagerly. The sampler
runs outside the graph: its inputs (grammar masks, penalties, generators) change every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ...model.attention import AttentionMetadata

# capture(fn, pool) -> (replay, output): runs fn under capture into the memory pool; replay()
# runs it again on whatever the static inputs hold now, writing into the same output tensor.
Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    # One run first, on a side stream as torch asks: it compiles the kernels for these shapes
    # and sets up per-stream library state (cuBLAS) outside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the replica's other threads (the KV connector's, the event loop's) may
    # call CUDA while this one captures; only this thread's calls must be capturable.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = fn()
    return graph.replay, output


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, then every multiple of 8, and the largest."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size] + list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_batch_size: int,
        max_model_len: int,
        device: torch.device,
        capture: Capture = cuda_capture,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_batch_size)
        self._capture = capture
        self._pool = torch.cuda.graph_pool_handle() if capture is cuda_capture else None
        rows, max_blocks = self.buckets[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((rows, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._addresses = self._addresses_of(kv_caches)
        self.num_captures = 0  # how many graphs were captured, stale ones included
        self.num_replays = 0

    def fits(self, metadata: AttentionMetadata) -> bool:
        """A decode-only step (one query row per entry) no larger than the largest bucket, whose
        contexts the captured attention covers (a draft's slots may reach past max_model_len)."""
        return (
            metadata.num_decodes == metadata.num_reqs <= self.buckets[-1]
            and metadata.max_seq_len <= self.max_model_len
            and metadata.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The model's hidden states for this step's rows, from the bucket's graph (captured
        now if it has none). The result is a view of the graph's output: the next replay
        overwrites it."""
        n = metadata.num_reqs
        bucket = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.block_tables[:n, : metadata.block_tables.shape[1]].copy_(metadata.block_tables)
        # Padding rows: stale values from a larger step would write its tokens' K/V again.
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[n:bucket].fill_(1)
        replay, output = self._graphs.get(bucket) or self._capture_bucket(bucket)
        replay()
        self.num_replays += 1
        return output[:n]

    def capture_all(self) -> None:
        """Every bucket's graph, largest first (the smaller ones then fit in the memory the
        largest left in the shared pool)."""
        self.slot_mapping.fill_(-1)  # no K/V written while capturing
        self.seq_lens.fill_(1)
        for bucket in reversed(self.buckets):
            if bucket not in self._graphs:
                self._capture_bucket(bucket)

    def refresh(self, kv_caches: list[torch.Tensor]) -> bool:
        """Between steps: drops every graph if a weight or the KV cache moved since capture.
        True if they were dropped."""
        addresses = self._addresses_of(kv_caches)
        changed = addresses != self._addresses
        if changed:
            self.drop()
        self.kv_caches, self._addresses = kv_caches, addresses
        return changed

    def drop(self) -> None:
        """Lets go of every graph (and so of their memory pool) and of the KV cache, before
        sleep frees it."""
        self._graphs.clear()
        self.kv_caches = []
        self._addresses = ()

    def _capture_bucket(self, bucket: int) -> tuple[Callable[[], None], torch.Tensor]:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            num_decodes=bucket,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

        def forward() -> torch.Tensor:
            return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, metadata)

        self._graphs[bucket] = self._capture(forward, self._pool)
        self.num_captures += 1
        return self._graphs[bucket]

    def _addresses_of(self, kv_caches: list[torch.Tensor]) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (*_module_tensors(self.model), *kv_caches))


def _module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor the forward pass reads: parameters and buffers, and the tensors that
    modules hold as plain attributes or inside a dataclass attribute (an int8 weight's scales)."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                fields = (getattr(value, f.name) for f in dataclasses.fields(value))
                tensors.extend(v for v in fields if isinstance(v, torch.Tensor))
    return tensors
