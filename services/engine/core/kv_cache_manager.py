"""Maps requests to KV-cache blocks: prefix-cache hits, slot allocation, forks, frees.

A request's block table covers its tokens like this (B = block_size):

    tokens:  |<-- num_computed_tokens -->|<-- cache hit -->|<-- num_new_tokens -->|<- lookahead ->|
    blocks:  [ b0 ][ b1 ][ b2 ]...........[ hit blocks  ]..[  new blocks, allocated as needed    ]

The scheduler asks `get_computed_blocks` once when a request starts, then calls
`allocate_slots` every step; None means "not enough free blocks: preempt someone".
Blocks shared by a fork (n > 1, beam search) are copied on write: before a request writes
into a shared, partially filled block, it gets a private copy (a block copy the model
runner performs before the forward pass).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

from .block_hash import BlockHash
from .block_pool import BlockPool, KVCacheBlock
from .request import Request

# A request's num_cached_blocks past any table it can have: it registers no more blocks.
_NEVER_CACHE = sys.maxsize


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        warm_window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, warm_window_s, clock)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Block copies (src, dst) owed before the next forward pass (copy on write).
        self.pending_copies: list[tuple[int, int]] = []
        # Requests whose block table changed in place this step (not just appended to).
        self.rewritten: set[str] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        The last token is never counted as cached: its logits are needed, so at least one
        token is always computed, even when the whole prompt is in the cache.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need logits at every prompt position (vLLM skips the cache too)
        block_hashes = request.update_block_hashes(self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        parent: BlockHash | None = None
        for i, block_hash in enumerate(block_hashes[:max_hit_blocks]):
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            block = self.pool.get_cached_block(block_hash, parent, tokens)
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        cache_new_blocks: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Reserves slots for the next `num_new_tokens` (+ lookahead) tokens of `request`.

        Returns the blocks appended to its table, or None if the free blocks do not
        suffice (nothing is changed then). `cache_new_blocks=False` leaves the blocks out of
        the prefix cache (their K/V will be written by a transfer, not by this step).
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        num_computed = request.num_computed_tokens + num_hit_tokens
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        copy_block = self._shared_partial_block(blocks, num_computed, num_new_tokens)
        # Hit blocks sitting on the free queue stop being free once we take them.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + (copy_block is not None) > self.num_free_blocks - num_revived:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if new_computed_blocks:
            assert not blocks, "prefix hits are only taken when a request starts"
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        if copy_block is not None:
            self._copy_on_write(request.request_id, blocks, copy_block)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)

        # Blocks this step fills are registered now: the forward pass writes every token's
        # K/V before any attention reads it, so a hit taken in this same step is safe.
        if cache_new_blocks:
            self._cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_computed(self, request: Request) -> None:
        """Registers every full block of the request's computed tokens (after a KV transfer)."""
        self._cache_blocks(request, request.num_computed_tokens)

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's blocks by reference (copied on write later)."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so the prefix outlives the suffix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.rewritten.discard(request.request_id)
        self.pool.free_blocks(reversed(blocks))

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_rewritten(self) -> set[str]:
        rewritten, self.rewritten = self.rewritten, set()
        return rewritten

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (a `cleared` event). Requests holding blocks now never
        register more: their next full block's parent is no longer cached, and the cache
        stays prefix-closed (it never holds a block without its parent)."""
        self.pool.reset_prefix_cache()
        for request_id in self.req_to_blocks:
            self.num_cached_blocks[request_id] = _NEVER_CACHE

    def check_integrity(self) -> None:
        """Pool invariants, plus: reference counts equal the number of owning tables."""
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == owners.get(block.block_id, 0), (
                f"{block} has ref_cnt {block.ref_cnt} but {owners.get(block.block_id, 0)} owners"
            )

    # -- internals --------------------------------------------------------------------

    def _shared_partial_block(
        self, blocks: list[KVCacheBlock], num_computed: int, num_new_tokens: int
    ) -> KVCacheBlock | None:
        """The partially filled block the next token lands in, if others share it."""
        if num_new_tokens == 0 or num_computed % self.block_size == 0:
            return None
        index = num_computed // self.block_size
        if index < len(blocks) and blocks[index].ref_cnt > 1:
            return blocks[index]
        return None

    def _copy_on_write(self, request_id: str, blocks: list[KVCacheBlock], shared: KVCacheBlock) -> None:
        (private,) = self.pool.get_new_blocks(1)
        self.pending_copies.append((shared.block_id, private.block_id))
        blocks[blocks.index(shared)] = private
        self.pool.free_blocks([shared])
        self.rewritten.add(request_id)

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        first = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= first:
            return
        block_hashes = request.update_block_hashes(self.block_size)
        self.pool.cache_full_blocks(
            self.req_to_blocks[request.request_id],
            block_hashes,
            request.all_token_ids,
            first,
            num_full,
            self.block_size,
        )
        self.num_cached_blocks[request.request_id] = num_full
