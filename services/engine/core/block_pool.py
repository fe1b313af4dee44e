"""A fixed pool of KV-cache blocks with reference counts and an LRU prefix cache.

Every block is either used (ref_cnt > 0) or on the free queue (ref_cnt == 0). A free block
may still hold a cached prefix (its hash stays registered): a later request that hits it
revives it in O(1) by unlinking it from the queue. New blocks come from the queue's head,
so the least recently freed cached block is evicted first:

    head (evict first) <-> b7 <-> b3 <-> b9 <-> tail (freed last)

Requests free their blocks tail-first, so the end of a sequence is evicted before its
start (a shorter prefix stays useful longer), and the cache stays prefix-closed: it never
holds a block without its parent, which routers rely on. Twins keep it so: a request that
recomputes a block already cached (its prompt's last block) holds an unregistered twin;
while the twin is in use, evicting the cached copy registers the twin in its place, and
when the twin is freed, the cached copy takes the twin's place in the eviction order.

Warm blocks: free blocks that hold a cached prefix are counted by the second they were
freed, so the pool tells in O(window) how many of them were in use within the last
`warm_window_s` (`num_warm_free_blocks`). Routers read it from load reports: a placement
that needs more blocks than the cold ones (never used, uncached, or idle longer than the
window, and older ones come first off the queue) evicts prefixes that are still in use.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .block_hash import BlockHash
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheSnapshot, KVEvent


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache; kept after it is freed.
    block_hash: BlockHash | None = None
    # What the hash stands for, checked on every hit so a collision can never be served.
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    # Set while the block is an unregistered twin of the cached block of this hash.
    twin_of: BlockHash | None = None
    # The second it was freed, while it is free and cached (BlockPool._warm counts it).
    freed_second: int | None = None
    # Free-queue links (only meaningful while ref_cnt == 0).
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append, and unlink."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free KV-cache blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, block
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        warm_window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self._twins: dict[BlockHash, list[KVCacheBlock]] = {}  # in-use twins of cached blocks
        # second -> free cached blocks freed in it; keys ascend (time only moves forward)
        self._warm: dict[int, int] = {}
        self.warm_window_s = warm_window_s
        self._clock = clock
        self._pending_events: list[KVEvent] = []
        self._next_seq = 0

    # -- queries ----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_warm_free_blocks(self) -> int:
        """Free blocks holding a cached prefix that was in use within the last `warm_window_s`."""
        cutoff = int(self._clock() - self.warm_window_s)
        for second in list(itertools.takewhile(lambda second: second < cutoff, self._warm)):
            del self._warm[second]  # its blocks stay free, just no longer warm
        return sum(self._warm.values())

    def get_cached_block(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> KVCacheBlock | None:
        """The cached block for this hash, if its parent and tokens match exactly."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def cached_block_hashes(self) -> set[BlockHash]:
        """Snapshot of the prefix cache (what a router should index for this worker)."""
        return set(self.cached)

    def snapshot(self) -> KVCacheSnapshot:
        """The cache's hashes, consistent with every event emitted so far."""
        return KVCacheSnapshot(self._next_seq, frozenset(self.cached))

    # -- actions ----------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes blocks from the free queue's head, evicting their cached prefix if any."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} are free")
        blocks = []
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._cool(block)
            if block.block_hash is not None:
                twins = self._twins.get(block.block_hash)
                if twins:  # an in-use twin takes over the registration: the hash stays cached
                    twin = twins[-1]
                    self._unlink_twin(twin)
                    self._register(twin, block.block_hash, block.parent_hash, block.token_ids)
                    block.block_hash, block.parent_hash, block.token_ids = None, None, ()
                else:
                    evicted.append(block.block_hash)
                    self._uncache(block)
            block.ref_cnt = 1
            blocks.append(block)
        if evicted:
            self._emit(BlockRemoved, tuple(evicted))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on blocks shared with another user (a prefix hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self._cool(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        """Drops one reference per block; blocks that reach zero join the queue's tail."""
        for block in blocks_in_eviction_order:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self._warm_up(block)
                if block.twin_of is not None:  # the cached copy takes the twin's place in the order
                    cached = self.cached[self._unlink_twin(block)]
                    if cached.ref_cnt == 0:
                        self.free_queue.remove(cached)
                        self.free_queue.append(cached)
                        self._cool(cached)
                        self._warm_up(cached)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        first: int,
        end: int,
        block_size: int,
    ) -> None:
        """Registers blocks[first:end] (all full) under their hashes and emits `stored`.

        A block whose hash is already cached (two requests computed the same prefix in one
        step) stays unregistered and is simply freed later; the first copy serves hits.
        """
        if not self.enable_caching or first >= end:
            return
        stored: list[BlockHash] = []
        run_parent: BlockHash | None = block_hashes[first - 1] if first > 0 else None
        for i in range(first, end):
            block, block_hash = blocks[i], block_hashes[i]
            parent = block_hashes[i - 1] if i > 0 else None
            if block.block_hash is not None or block_hash in self.cached:
                # Already registered (shared by a fork) or a twin of a cached block: ends the run.
                if block.block_hash is None and block.twin_of is None:
                    block.twin_of = block_hash
                    self._twins.setdefault(block_hash, []).append(block)
                self._emit_stored(stored, run_parent, block_size)
                stored, run_parent = [], block_hash
                continue
            self._register(block, block_hash, parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
            stored.append(block_hash)
        self._emit_stored(stored, run_parent, block_size)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (blocks in use stay in use, just uncached)."""
        for block in list(self.cached.values()):
            self._cool(block)
            self._uncache(block)
        for twins in self._twins.values():
            for twin in twins:
                twin.twin_of = None
        self._twins.clear()
        self._emit(AllBlocksCleared)

    def take_events(self) -> list[KVEvent]:
        events, self._pending_events = self._pending_events, []
        return events

    # -- integrity --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """free + used == total; no block both free and referenced; the cache map is sound."""
        queued = list(self.free_queue)
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued), "a block is on the free queue twice"
        assert len(queued) == self.num_free_blocks, "free count drifted"
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in queued_ids), (
                f"{block} is {'free' if block.block_id in queued_ids else 'unqueued'} with ref_cnt {block.ref_cnt}"
            )
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + self.num_free_blocks == self.num_blocks, "free + used != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block} is registered under another hash"
        num_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert num_hashed == len(self.cached), "a hashed block is missing from the cache map"
        twins = [(h, t) for h, ts in self._twins.items() for t in ts]
        assert len(twins) == sum(1 for b in self.blocks if b.twin_of is not None), "a twin is not listed"
        for block_hash, twin in twins:
            assert twin.twin_of == block_hash and twin.block_hash is None, twin
            assert twin.ref_cnt > 0, f"{twin} is a free twin"
            assert block_hash in self.cached, f"{twin} is the twin of an uncached block"
        for block in self.blocks:
            if block.freed_second is not None:
                assert block.ref_cnt == 0 and block.block_hash is not None, f"{block} is counted warm"
        counted = collections.Counter(b.freed_second for b in queued if b.freed_second in self._warm)
        assert counted == self._warm, f"warm counts drifted: {dict(self._warm)} != {dict(counted)}"

    # -- internals --------------------------------------------------------------------

    def _register(
        self, block: KVCacheBlock, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> None:
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.cached[block_hash] = block

    def _unlink_twin(self, twin: KVCacheBlock) -> BlockHash:
        """Stops treating the block as a twin; returns the hash it was the twin of."""
        block_hash, twin.twin_of = twin.twin_of, None
        twins = self._twins[block_hash]
        twins.remove(twin)
        if not twins:
            del self._twins[block_hash]
        return block_hash

    def _warm_up(self, block: KVCacheBlock) -> None:
        """Counts a block that just joined the free queue, if it holds a cached prefix."""
        if block.block_hash is not None:
            second = block.freed_second = int(self._clock())
            self._warm[second] = self._warm.get(second, 0) + 1

    def _cool(self, block: KVCacheBlock) -> None:
        """Stops counting a block (it left the free queue or lost its prefix)."""
        second, block.freed_second = block.freed_second, None
        count = self._warm.get(second)  # None: not counted, or its second is out of every window
        if count == 1:
            del self._warm[second]
        elif count is not None:
            self._warm[second] = count - 1

    def _uncache(self, block: KVCacheBlock) -> None:
        del self.cached[block.block_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()

    def _emit_stored(self, hashes: list[BlockHash], parent: BlockHash | None, block_size: int) -> None:
        if hashes:
            self._emit(BlockStored, tuple(hashes), parent, len(hashes) * block_size)

    def _emit(self, kind, *fields) -> None:
        self._pending_events.append(kind(self._next_seq, *fields))
        self._next_seq += 1
