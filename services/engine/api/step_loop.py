"""The engine core's step loop, shared by both of AsyncLLM's backends: the thread
(engine/api/engine_thread.py) and the child process (engine/api/engine_child.py).

The backends differ only in how commands reach the loop and where outputs go, so each
passes those two in. No heavy imports here: the child imports this before the model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .outputs import RequestOutput

IDLE_TICK_S = 0.25  # an idle engine refreshes its stats (and hears snapshot requests) this often
POLL_TICK_S = 0.002  # an engine only polling KV transfers waits this long between steps

Failures = list[tuple[str, BaseException]]


def run_step_loop(
    core: Any,
    run_commands: Callable[[float], bool],
    report: Callable[[list[RequestOutput], Failures], None],
) -> None:
    """Steps `core` until `run_commands` says stop.

    `run_commands(timeout)` waits up to `timeout` seconds for a first command (not at all
    when commands are queued), runs every queued one, and returns False to stop the loop.
    `report(outputs, failures)` follows every step, and every idle tick with nothing in it:
    stats change while idle too (aborts free blocks, warm blocks cool).
    """
    timeout = 0.0
    while run_commands(timeout):
        if not (core.needs_step() or core.needs_polling()):
            core.publish_kv_events()  # an idle engine still answers snapshot requests
            report([], [])
            timeout = IDLE_TICK_S
            continue
        outputs = core.step()
        report(outputs, core.take_failures())
        # A step that only polled KV transfers waits a little before the next: no spinning.
        timeout = POLL_TICK_S if core.last_step_num_tokens == 0 else 0.0
