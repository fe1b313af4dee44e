"""The replica count of each engine role, as its autoscaling policy last saw it.

Serve 2.60 hands a deployment's policy only that deployment's context (its application-level
policies are marked not yet supported), but the prefill:decode ratio bound needs the other
role's count. Both policies run in the one Serve controller process, so each posts its
deployment's current replicas here and reads its peer's. This module is imported by
reference, never pickled with the policy (Serve pickles the policy's own module by value,
which would give each deployment its own copy), and it is the only process-wide state of
the autoscaler. A count older than `max_age_s` counts as unknown: no bound then.

Decode also posts the prompt tokens waiting on its replicas: with prefill scaled to zero,
prompts are prefilled there, and that queue is what brings a prefill replica back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RoleBoard:
    def __init__(self, max_age_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._max_age_s = max_age_s
        self._clock = clock
        # (app, role) -> (replicas, prompt tokens waiting on them, when posted)
        self._counts: dict[tuple[str | None, str], tuple[int, float, float]] = {}

    def post(self, app_name: str | None, role: str, num_replicas: int, waiting_prompt_tokens: float = 0.0) -> None:
        with self._lock:
            self._counts[(app_name, role)] = (num_replicas, waiting_prompt_tokens, self._clock())

    def current(self, app_name: str | None, role: str) -> int | None:
        entry = self._entry(app_name, role)
        return None if entry is None else entry[0]

    def waiting_prompt_tokens(self, app_name: str | None, role: str) -> float:
        """Prompt tokens waiting on `role`'s replicas when it last posted (0: unknown)."""
        entry = self._entry(app_name, role)
        return 0.0 if entry is None else entry[1]

    def _entry(self, app_name: str | None, role: str) -> tuple[int, float, float] | None:
        with self._lock:
            entry = self._counts.get((app_name, role))
        if entry is None or self._clock() - entry[2] > self._max_age_s:
            return None
        return entry


BOARD = RoleBoard()
