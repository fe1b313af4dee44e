"""Errors the engine raises to its callers.

`InvalidRequestError` names the offending field so that the gRPC and HTTP layers can map
it to INVALID_ARGUMENT / HTTP 400 with a message a user can act on. `ModelLoadError` is the
model package's (it raises it, below the engine); callers catch it from here too.
"""

from ..model.errors import ModelLoadError

__all__ = ["EngineDeadError", "EngineSleepingError", "InvalidRequestError", "ModelLoadError"]


class InvalidRequestError(ValueError):
    """A request or sampling parameter is invalid; raised before any work is scheduled."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # picklable, so it crosses Ray process boundaries intact
        return (type(self), (self.field, self.message))


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an unrecoverable error; every pending request fails."""


class EngineSleepingError(InvalidRequestError):
    """The engine is asleep (`sleep`) or its weights were released (sleep level 2) and no
    update has loaded them: it refuses requests until `wake_up` (and an update). A refusal,
    not a bad request: a serving layer may answer 503 with Retry-After rather than 400."""

    def __init__(self, message: str, field: str = "engine"):
        super().__init__(field, message)

    def __reduce__(self):
        return (type(self), (self.message, self.field))
