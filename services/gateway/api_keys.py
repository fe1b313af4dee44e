"""API keys: who may call the gateway, and who owns a request.

Keys never sit in the YAML. Each kind comes from an environment variable (comma-separated)
and/or a mounted secret file (one key per line, `#` lines ignored), read once when the
gateway starts:

    api keys     BATON_API_KEYS / server.auth.api_keys_file              every rpc and route
    admin keys   BATON_ADMIN_API_KEYS / server.auth.admin_api_keys_file  the same, and
                 administrative calls: Abort of another key's request today; the
                 weight-update calls will take only these

A caller sends `Authorization: Bearer <key>` (HTTP header, gRPC metadata). The key is
compared against every configured key with `hmac.compare_digest` over SHA-256 digests (equal
lengths, no early exit), and is then known only by its fingerprint (`key-` + 12 hex digits
of the digest), which is what in-flight requests record as their owner and what logs may
show. With no key of either kind configured the gateway is open, as it was before keys.
Keys should be random (e.g. `openssl rand -hex 32`): a fingerprint of a guessable key
would let it be guessed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..serving_errors import UnauthenticatedError

MISSING_KEY = "this server requires an API key: send the header (gRPC metadata) `authorization: Bearer <key>`"
WRONG_KEY = "the API key is not valid for this server"
MALFORMED_HEADER = "the authorization header (gRPC metadata) must be `Bearer <key>`"


class AuthConfig(BaseModel):
    """Where the gateway reads its keys (never the keys themselves)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_keys_env: str | None = Field(
        "BATON_API_KEYS", description="Environment variable holding API keys, comma-separated (None: not read)"
    )
    api_keys_file: str | None = Field(None, description="A file of API keys, one per line (a mounted secret)")
    admin_api_keys_env: str | None = Field(
        "BATON_ADMIN_API_KEYS", description="Environment variable holding admin keys, comma-separated"
    )
    admin_api_keys_file: str | None = Field(None, description="A file of admin keys, one per line")
    protect_health: bool = Field(
        False, description="Health checks (HTTP /health, grpc.health.v1) need a key too (default: open)"
    )


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: a key's fingerprint, or None when the gateway has no keys."""

    owner: str | None
    is_admin: bool = False

    def may_act_on(self, owner: str | None) -> bool:
        """Whether this caller may abort a request that `owner` created."""
        return self.is_admin or self.owner == owner


ANONYMOUS = Caller(owner=None)  # every caller of a gateway without keys: all alike, as before keys


class ApiKeys:
    def __init__(self, keys: Iterable[str] = (), admin_keys: Iterable[str] = (), protect_health: bool = False) -> None:
        self._digests = [_digest(k) for k in keys]
        self._admin_digests = [_digest(k) for k in admin_keys]
        self.protect_health = protect_health
        self.sources = ""  # where the keys came from, for the start-up line

    @classmethod
    def from_config(cls, config: AuthConfig, environ: Mapping[str, str] | None = None) -> ApiKeys:
        """Reads the keys where `config` says; an unreadable file is a ValueError naming the file."""
        environ = os.environ if environ is None else environ
        keys = _read_keys(config.api_keys_env, config.api_keys_file, environ)
        admin_keys = _read_keys(config.admin_api_keys_env, config.admin_api_keys_file, environ)
        api_keys = cls(keys, admin_keys, config.protect_health)
        api_keys.sources = ", ".join(
            f"{len(found)} {kind} key{'s' if len(found) != 1 else ''} ({' + '.join(where)})"
            for kind, found, where in (
                ("API", keys, _where(config.api_keys_env, config.api_keys_file, environ)),
                ("admin", admin_keys, _where(config.admin_api_keys_env, config.admin_api_keys_file, environ)),
            )
            if found
        )
        return api_keys

    @property
    def is_enabled(self) -> bool:
        return bool(self._digests or self._admin_digests)

    def describe(self) -> str:
        """One line for the logs and `baton serve`'s start: how many keys, never which."""
        if not self.is_enabled:
            return "no API keys configured (server.auth): the APIs are open to anyone who can reach them"
        health = "need a key too" if self.protect_health else "open"
        return f"API keys required: {self.sources or 'configured'}; health checks {health}"

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller of a request with this `authorization` value; UnauthenticatedError (401 /
        UNAUTHENTICATED) when a key is needed and missing, malformed or wrong."""
        if not self.is_enabled:
            return ANONYMOUS
        if authorization is None or not authorization.strip():
            raise UnauthenticatedError(MISSING_KEY)
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise UnauthenticatedError(MALFORMED_HEADER)
        digest = _digest(key)
        is_admin = _matches(digest, self._admin_digests)
        if not (_matches(digest, self._digests) | is_admin):
            raise UnauthenticatedError(WRONG_KEY)
        return Caller(owner=f"key-{digest.hex()[:12]}", is_admin=is_admin)


def grpc_authorization(grpc_context) -> str | None:
    """The `authorization` metadata of a gRPC call (Serve's context, or grpc's own)."""
    if grpc_context is None:
        return None
    for key, value in grpc_context.invocation_metadata() or ():
        if key.lower() == "authorization":
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


def _matches(digest: bytes, digests: list[bytes]) -> bool:
    """Compares against every key, without stopping at a match."""
    found = False
    for known in digests:
        found |= hmac.compare_digest(digest, known)
    return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _read_keys(env: str | None, path: str | None, environ: Mapping[str, str]) -> list[str]:
    keys = [k.strip() for k in environ.get(env, "").split(",")] if env else []
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read the API key file {path}: {e.strerror}") from None
        except UnicodeDecodeError:  # its message would quote the file's bytes
            raise ValueError(f"cannot read the API key file {path}: it is not UTF-8 text") from None
        keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return [k for k in keys if k]


def _where(env: str | None, path: str | None, environ: Mapping[str, str]) -> list[str]:
    where = []
    if env and environ.get(env, "").strip():
        where.append(f"${env}")
    if path:
        where.append(path)
    return where
