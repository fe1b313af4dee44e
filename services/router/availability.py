"""Whether Redis is usable right now, with one log line per change rather than one per call.

After a failure, callers skip Redis for `retry_interval_s` (a circuit breaker), so a dead
or hanging server costs one timeout per interval instead of one per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Availability:
    def __init__(self, owner: str, retry_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.owner = owner  # names the component in log lines
        self.retry_interval_s = retry_interval_s
        self.is_available = True
        self.num_failures = 0
        self._clock = clock
        self._retry_at = 0.0

    def should_try(self) -> bool:
        return self.is_available or self._clock() >= self._retry_at

    def record_success(self) -> bool:
        """Returns True when this success ends an outage."""
        if self.is_available:
            return False
        self.is_available = True
        logger.warning("%s: Redis is reachable again", self.owner)
        return True

    def record_failure(self, error: BaseException) -> bool:
        """Returns True when this failure starts an outage."""
        self.num_failures += 1
        self._retry_at = self._clock() + self.retry_interval_s
        if not self.is_available:
            return False
        self.is_available = False
        logger.warning("%s: Redis is unavailable (%s); retrying every %.2fs", self.owner, error, self.retry_interval_s)
        return True
