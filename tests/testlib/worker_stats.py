"""Waiting on an engine worker's block accounting in tests that call it without Ray."""

from __future__ import annotations

import asyncio


async def wait_for_stats(worker, condition, timeout_s: float = 10.0):
    """The worker's integrity-checked stats once `condition(stats)` holds (fails after timeout_s)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition(stats := await worker.check_integrity()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out; last stats {stats}"
        await asyncio.sleep(0.02)
    return stats
