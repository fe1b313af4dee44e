"""What a worker tells the registry: who it is (`WorkerInfo`) and how busy it is (`WorkerLoad`).

A worker's id is `name@epoch`. The name is stable (a replica slot, a pod); the epoch is new
on every start and orders starts in time, so entries written by an earlier life of the
same worker can never be mistaken for the current one's.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..roles import Role

if TYPE_CHECKING:  # the engine core pulls in torch; the router only needs the type
    from ..engine.stats import EngineStats

_NAME = re.compile(r"[^\s@{}]+")
_EPOCH = re.compile(r"[0-9a-f]{24}")


# A worker of an older release registers a colocated worker as "both".
_LEGACY_ROLES = {"both": Role.COLOCATED}


def new_epoch() -> str:
    """A fresh epoch: 16 hex digits of wall-clock nanoseconds, then 8 random ones.

    Later starts compare greater as strings, which lets the registry refuse a zombie
    process of an older epoch that heartbeats after its replacement registered.
    """
    return f"{time.time_ns():016x}{secrets.token_hex(4)}"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    name: str  # stable across restarts, e.g. "prefill-0"
    epoch: str  # new_epoch(), new on every start
    role: Role  # its index_roles are the candidate sets it joins
    model: str  # served model name (the index's namespace)
    block_size: int  # KV block size; the router skips workers that disagree with it
    tp_size: int  # tensor-parallel ranks behind this worker
    address: str  # how the serving layer reaches it: the Ray Serve replica id

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"worker name {self.name!r} must be non-empty, without whitespace, '@' or braces")
        if not _EPOCH.fullmatch(self.epoch):
            raise ValueError(f"worker epoch {self.epoch!r} must be 24 lowercase hex digits (see new_epoch())")
        if not isinstance(self.role, Role):
            object.__setattr__(self, "role", Role(self.role))
        if self.block_size < 1 or self.tp_size < 1:
            raise ValueError(f"block_size ({self.block_size}) and tp_size ({self.tp_size}) must be positive")
        if not self.address:
            raise ValueError("worker address must not be empty")

    @property
    def worker_id(self) -> str:
        return f"{self.name}@{self.epoch}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        fields = json.loads(text)
        if fields.get("role") in _LEGACY_ROLES:
            fields["role"] = _LEGACY_ROLES[fields["role"]]
        return cls(**fields)


_FIELDS_OF_FIRST_RELEASE = 5


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests queued, not yet scheduled
    num_waiting_prefill_tokens: int = 0  # prompt tokens of the queued requests
    num_free_kv_blocks: int = 0
    num_kv_blocks: int = 0
    num_warm_free_kv_blocks: int = 0  # free blocks whose cached prefix was in use lately (engine's warm window)

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 0:
                raise ValueError(f"load field {name} must not be negative, got {getattr(self, name)}")

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    @classmethod
    def from_engine_stats(cls, stats: EngineStats) -> WorkerLoad:
        return cls(
            stats.num_running,
            stats.num_waiting,
            stats.num_waiting_prefill_tokens,
            stats.num_free_kv_blocks,
            stats.num_kv_blocks,
            stats.num_warm_free_kv_blocks,
        )

    def encode(self) -> str:
        """Comma-separated integers in field order: cheaper to write and parse than JSON, twice a second per worker."""
        return ",".join(str(getattr(self, name)) for name in self.__slots__)

    @classmethod
    def decode(cls, text: str | bytes) -> WorkerLoad:
        if isinstance(text, bytes):
            text = text.decode()
        fields = text.split(",")
        # A worker of an older release sends fewer fields; the missing ones keep their defaults.
        if not _FIELDS_OF_FIRST_RELEASE <= len(fields) <= len(cls.__slots__):
            raise ValueError(
                f"a load report has {_FIELDS_OF_FIRST_RELEASE} to {len(cls.__slots__)} fields, got {text!r}"
            )
        return cls(*map(int, fields))
