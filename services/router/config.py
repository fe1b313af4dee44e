"""The router's typed configuration: Redis connection, index, policy and worker side.

`RouterConfig` groups the sections; the gateway gets `redis`, `index` and `policy`, a
worker gets `redis`, `index` and `worker`. The same models become sections of the service
YAML (`configs/*.yaml`), so a field documented here is documented there. The policy's knobs
are explained, with the algorithm, in `policy.py`.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from ..engine.config import CacheConfig

_FROZEN = ConfigDict(frozen=True, extra="forbid")
# A key prefix or model name becomes part of every key: `{prefix}:{<model>}:...` (braces
# form the Redis Cluster hash tag, so they must not appear inside either).
_NAME = re.compile(r"[^\s{}]+")


def check_key_part(kind: str, value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must be non-empty, without whitespace or braces")
    return value


class RedisConfig(BaseModel):
    model_config = _FROZEN

    url: str = Field("redis://127.0.0.1:6379", description="redis:// or rediss:// (TLS) URL, or unix:// socket path")
    username: str | None = Field(None, description="ACL user name (Redis 6+); None: the default user")
    password: SecretStr | None = Field(None, description="Password; overrides one given in the URL")
    password_env: str | None = Field(
        "BATON_REDIS_PASSWORD",
        description="Environment variable read for the password when `password` is unset (how a Kubernetes "
        "Secret reaches every process without appearing in the Serve config)",
    )
    db: int = Field(0, ge=0, description="Database number (ignored by Redis Cluster)")
    tls: bool = Field(False, description="Use TLS (implied by a rediss:// URL)")
    tls_ca_file: str | None = Field(None, description="CA bundle that signs the server's certificate")
    tls_cert_file: str | None = Field(None, description="Client certificate, for mutual TLS")
    tls_key_file: str | None = Field(None, description="Client private key, for mutual TLS")
    tls_verify: bool = Field(True, description="Verify the server's certificate and host name")
    key_prefix: str = Field("baton", description="First part of every key, to share one Redis between deployments")
    connect_timeout_s: float = Field(0.25, gt=0, description="TCP connect timeout")
    socket_timeout_s: float = Field(
        0.25, gt=0, description="Reply timeout on the routing path; a slower Redis counts as unavailable"
    )
    retry_interval_s: float = Field(
        1.0, gt=0, description="After a failure, how long to route without Redis before trying it again"
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {url!r}")
        return url

    @field_validator("key_prefix")
    @classmethod
    def _valid_prefix(cls, prefix: str) -> str:
        return check_key_part("key_prefix", prefix)

    @model_validator(mode="after")
    def _tls_files_need_tls(self) -> RedisConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if not self.use_tls and (self.tls_ca_file or self.tls_cert_file):
            raise ValueError("TLS files are set but TLS is off (set tls: true or use a rediss:// URL)")
        if self.use_tls and urlsplit(self.url).scheme == "unix":
            raise ValueError("TLS is not available over a unix:// socket")
        return self

    def resolved_password(self) -> str | None:
        """The password: the explicit one, else the environment variable's (if set and non-empty)."""
        if self.password is not None:
            return self.password.get_secret_value()
        return os.environ.get(self.password_env) or None if self.password_env else None

    @property
    def use_tls(self) -> bool:
        return self.tls or urlsplit(self.url).scheme == "rediss"


class IndexConfig(BaseModel):
    model_config = _FROZEN

    speculative_ttl_s: float = Field(
        3.0,
        ge=0,
        description="After a placement, the chosen worker counts as holding the prompt's blocks (recorded at "
        "checkpoints, see prefix_index.py) for this long, until its own events arrive (0: off)",
    )
    pending_ttl_s: float = Field(
        5.0,
        gt=0,
        description="A placement counts as load on its worker until a load report newer than it, or this long at most",
    )
    gc_interval_s: float = Field(10.0, gt=0, description="How often a router deletes dead workers' entries")


class WorkerConfig(BaseModel):
    model_config = _FROZEN

    heartbeat_ttl_s: float = Field(
        3.0, gt=0, description="A worker whose last heartbeat is older than this is dead to the router"
    )
    load_report_interval_s: float = Field(
        0.25, gt=0, le=0.5, description="Heartbeat and load report period (the router's load view lags by this)"
    )
    max_queued_events: int = Field(
        100_000,
        ge=1,
        description="Events buffered for Redis; beyond this the buffer is dropped and a snapshot sent instead",
    )
    max_events_per_batch: int = Field(512, ge=1, description="Events applied per Redis round trip")
    snapshot_chunk_size: int = Field(10_000, ge=1, description="Block hashes per command when sending a snapshot")
    socket_timeout_s: float = Field(
        5.0, gt=0, description="Reply timeout for the worker's writes (a large snapshot takes a while)"
    )
    reconnect_interval_s: float = Field(0.5, gt=0, description="How often to retry Redis while it is unavailable")

    @model_validator(mode="after")
    def _ttl_outlives_reports(self) -> WorkerConfig:
        if self.heartbeat_ttl_s < 2 * self.load_report_interval_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must be at least twice load_report_interval_s "
                f"({self.load_report_interval_s}), or one late report would mark a live worker dead"
            )
        return self


class PolicyConfig(BaseModel):
    model_config = _FROZEN

    balance_abs_threshold: int = Field(
        16,
        ge=0,
        description="Imbalance guard: place by load alone when the busiest worker has more than this many "
        "requests over the idlest one ...",
    )
    balance_rel_threshold: float = Field(
        1.5, ge=1.0, description="... and more than this many times the idlest one's requests"
    )
    overlap_weight: float = Field(
        1.0, ge=0, description="Weight of a worker's uncached prompt tokens against its queued tokens (0: load only)"
    )
    eviction_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the warm cached tokens a placement would evict, against its uncached prompt tokens "
        "(0: ignore evictions)",
    )
    temperature: float = Field(
        0.0, ge=0, description="Softmax temperature over costs to spread near-ties (0: always the cheapest)"
    )


class RouterConfig(BaseModel):
    """Every router section; `model` and `block_size` name the index this router reads."""

    model_config = _FROZEN

    model: str = Field(description="Served model name; part of every key, so models never share entries")
    block_size: int = Field(16, description="The engine's KV block size (CacheConfig.block_size)")
    redis: RedisConfig = RedisConfig()
    index: IndexConfig = IndexConfig()
    policy: PolicyConfig = PolicyConfig()
    worker: WorkerConfig = WorkerConfig()

    @field_validator("model")
    @classmethod
    def _valid_model(cls, model: str) -> str:
        return check_key_part("model", model)

    @field_validator("block_size")
    @classmethod
    def _engine_block_size(cls, block_size: int) -> int:
        CacheConfig(block_size=block_size)  # the engine's own check, so the two cannot disagree
        return block_size
