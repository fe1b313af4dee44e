"""How a benchmark reaches a server: one `Backend` per protocol, chosen by name.

grpc     Baton's baton.v1.Inference (streaming Generate)
openai   any OpenAI-compatible HTTP server (/v1/completions or /v1/chat/completions, SSE)
"""

from __future__ import annotations

from typing import Any

from ..errors import BenchInputError
from .base import Backend, BenchRequest, SamplingOptions, ServerInfo

BACKENDS = ("grpc", "openai")

__all__ = ["BACKENDS", "Backend", "BenchRequest", "SamplingOptions", "ServerInfo", "make_backend"]


def make_backend(kind: str, address: str, **options: Any) -> Backend:
    """A backend by name; options are the backend's keyword arguments (e.g. application, endpoint)."""
    if kind == "grpc":
        from .grpc import GrpcBackend

        options.pop("endpoint", None)
        return GrpcBackend(address, **options)
    if kind == "openai":
        from .openai_http import OpenAIHttpBackend

        options.pop("application", None)
        return OpenAIHttpBackend(address, **options)
    raise BenchInputError(f"unknown backend {kind!r}: expected one of {', '.join(BACKENDS)}")
