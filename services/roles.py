"""The one vocabulary for what an engine worker does. Config keys, the router's registry,
the KV transfer's side and the metrics' labels all use these values.

    colocated   prefills and decodes its own requests (no handover)
    prefill     runs prompts, keeps their KV blocks under a lease for a decode worker
    decode      receives a prompt's KV blocks from a prefill worker and decodes
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def index_roles(self) -> tuple[Role, ...]:
        """The router's candidate sets this worker joins (a colocated worker is in both)."""
        return (Role.PREFILL, Role.DECODE) if self is Role.COLOCATED else (self,)
