"""A clock that a test moves by hand, for code that takes a `clock` callable (seconds or
milliseconds, whichever the code under test reads)."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
