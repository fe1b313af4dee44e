"""Redis availability: a circuit breaker that logs each change of state once."""

from __future__ import annotations

import logging

from baton.services.router.availability import Availability
from testlib.fake_clock import FakeClock


def test_outages_are_logged_once_and_retried_after_the_interval(caplog):
    clock = FakeClock(100.0)
    availability = Availability("router", retry_interval_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING):
        assert availability.should_try()
        assert availability.record_failure(ConnectionError("refused"))
        assert not availability.record_failure(ConnectionError("refused"))
        assert not availability.should_try()
        clock.now += 1.0
        assert availability.should_try()
        assert availability.record_success()
        assert not availability.record_success()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "router: Redis is unavailable (refused); retrying every 1.00s",
        "router: Redis is reachable again",
    ]
    assert availability.num_failures == 2 and availability.is_available
