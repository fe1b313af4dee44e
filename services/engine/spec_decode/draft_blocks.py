"""The draft model's own KV blocks: a plain free list, apart from the target's pool.

Draft K/V is never shared between requests, never hashed into the prefix cache and never
announced to the router: the pool has no hashes and publishes no events. A request holds
the blocks for every position the draft has written (its real tokens and the drafts fed
back), and gives them all back when it stops speculating (finished, preempted, paused out).
"""

from __future__ import annotations


class DraftBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"draft_num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._owned: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_ids(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def grow(self, request_id: str, num_blocks: int) -> list[int] | None:
        """The request's blocks, grown to at least `num_blocks`; None (nothing taken) when the
        pool is short."""
        owned = self._owned.setdefault(request_id, [])
        missing = num_blocks - len(owned)
        if missing > len(self._free):
            return None
        for _ in range(max(missing, 0)):
            owned.append(self._free.pop())
        return owned

    def free(self, request_id: str) -> None:
        self._free.extend(reversed(self._owned.pop(request_id, [])))

    def request_ids(self) -> list[str]:
        return list(self._owned)

    def check_integrity(self) -> None:
        """free + used == total, and no block is both free and owned, or owned twice."""
        used = [b for blocks in self._owned.values() for b in blocks]
        assert len(used) + len(self._free) == self.num_blocks, "draft blocks: free + used != total"
        assert len(set(used) | set(self._free)) == self.num_blocks, "draft blocks: a block is held twice"
