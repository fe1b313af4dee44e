"""A redis-py client from `RedisConfig`: URL, credentials, TLS, database and timeouts.

Commands are never retried by the client: a router that cannot reach Redis within its
timeout routes without it (router.py), and a worker retries on its own schedule
(worker_agent.py); redis-py's default retries would stall both for seconds instead.

A client with credentials or TLS is checked once when it is made (`check_access`): wrong
credentials, a user whose ACL does not cover the key prefix, or a certificate that does not
verify raise RedisAccessError at start, naming what to fix, instead of looking like an outage
the router would route around for ever. A Redis that is not reachable yet is left to the
outage handling, as before.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .config import RedisConfig


class RedisAccessError(redis.AuthenticationError):
    """Redis refused this client's credentials, ACL permissions or TLS: a configuration error."""


def create_redis_client(config: RedisConfig, socket_timeout_s: float | None = None) -> redis.Redis:
    client = _client(config, socket_timeout_s)
    if config.username is not None or config.resolved_password() is not None or config.use_tls:
        check_access(client, config)
    return client


def check_access(client: redis.Redis, config: RedisConfig) -> None:
    """Raises RedisAccessError if Redis refuses this client (see the module docstring)."""
    where = f"Redis at {_without_password(config.url)} (user {config.username or 'default'})"
    probe = f"{config.key_prefix}:access-check"
    try:
        client.exists(probe)  # an ACL limited to `~<prefix>*` allows it; a wrong one refuses it
    except redis.AuthenticationError as e:
        raise RedisAccessError(
            f"{where} refused the credentials ({_first_line(e)}): check router.redis.username and the password "
            f"({'router.redis.password' if config.password else f'${config.password_env}'})"
        ) from e
    except redis.exceptions.NoPermissionError as e:
        raise RedisAccessError(
            f"{where} does not let this user read {probe!r} ({_first_line(e)}): its ACL must allow the commands "
            f"Baton runs on keys `{config.key_prefix}:*` (e.g. `~{config.key_prefix}:* +@all -@dangerous`)"
        ) from e
    except redis.ConnectionError as e:
        if any(sign in str(e) for sign in ("SSL", "certificate", "No such file")):  # a missing TLS file too
            raise RedisAccessError(
                f"{where}: TLS failed ({_first_line(e)}): check router.redis.tls_ca_file, tls_cert_file, tls_key_file"
            ) from e
    except redis.TimeoutError:
        pass  # not answering yet: the router's outage handling retries it


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))


def _client(config: RedisConfig, socket_timeout_s: float | None) -> redis.Redis:
    kwargs = {
        "db": config.db,
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_timeout": socket_timeout_s or config.socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if config.username is not None:
        kwargs["username"] = config.username
    password = config.resolved_password()
    if password is not None:
        kwargs["password"] = password
    url = config.url
    if config.use_tls:
        parts = urlsplit(url)
        url = urlunsplit(parts._replace(scheme="rediss"))
        kwargs |= {
            "ssl_ca_certs": config.tls_ca_file,
            "ssl_certfile": config.tls_cert_file,
            "ssl_keyfile": config.tls_key_file,
            "ssl_cert_reqs": "required" if config.tls_verify else "none",
            "ssl_check_hostname": config.tls_verify,
        }
    return redis.Redis.from_url(url, **kwargs)
