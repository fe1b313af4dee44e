"""The one error the harness raises for bad input, always before any load is sent.

Unknown backend, unreachable server, wrong model or application name, a malformed
dataset file, lengths that do not fit the server's context: each is a `BenchInputError`
whose message says what to change; the command line prints it without a traceback.
"""

from __future__ import annotations


class BenchInputError(ValueError):
    """Bad benchmark input, found before the load starts."""
