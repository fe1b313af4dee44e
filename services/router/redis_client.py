"""A redis-py client from `RedisConfig`: URL, credentials, TLS, database and timeouts.

Commands are never retried by the client: a router that cannot reach Redis within its
timeout routes without it (router.py), and a worker retries on its own schedule
(worker_agent.py); redis-py's default retries would stall both for seconds instead.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .config import RedisConfig


def create_redis_client(config: RedisConfig, socket_timeout_s: float | None = None) -> redis.Redis:
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
