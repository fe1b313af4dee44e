"""The application builder that Serve config files name: KubeRay's serveConfigV2, `serve deploy`.

    applications:
      - name: baton
        import_path: baton.services.app.serve_entry:app
        route_prefix: /
        args:
          config: {mode: disaggregated, engine: {...}, ...}   # the Baton config inline, and/or
          config_path: /etc/baton/baton.yaml                  # a YAML file (`config` is merged over it)
          redis_password_env: BATON_REDIS_PASSWORD            # router.redis.password from this variable

Serve calls `app(args)` in a task on some node of the cluster, so the file and the variable
must be there on every node (the Helm chart mounts and sets them on every Ray pod). The
password stays out of the Serve config and out of the ConfigMap.
"""

# No `from __future__ import annotations`: Serve checks the builder's parameter annotation
# at run time to turn the `args` dict into `ServeArgs`.
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from ..config import BatonConfig, load_config

if TYPE_CHECKING:
    from ray.serve import Application


class ServeArgs(BaseModel):
    """The `args` of the Serve application."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: dict[str, Any] = Field(default_factory=dict, description="The Baton config (services/config.py), inline")
    config_path: str | None = Field(None, description="A Baton config YAML file; `config` is merged over it")
    redis_password_env: str | None = Field(
        None, description="Environment variable holding router.redis.password (kept out of the Serve config)"
    )


def load_serve_config(args: ServeArgs, environ: Mapping[str, str] = os.environ) -> BatonConfig:
    """The validated Baton config that `args` describe, with the Redis password filled in."""
    if args.config_path is None and not args.config:
        raise ValueError("the Serve application's args need `config` (inline) or `config_path` (a YAML file)")
    config = load_config(args.config_path, args.config)
    if args.redis_password_env is None:
        return config
    password = environ.get(args.redis_password_env)
    if not password:
        raise ValueError(
            f"args.redis_password_env names {args.redis_password_env!r}, which is not set on this node "
            "(the Secret holding the Redis password is not mounted)"
        )
    redis = config.router.redis
    if redis is None:
        raise ValueError("args.redis_password_env is set, but the config has no router.redis")
    redis = redis.model_copy(update={"password": SecretStr(password)})
    return config.model_copy(update={"router": config.router.model_copy(update={"redis": redis})})


def app(args: ServeArgs) -> "Application":
    from .builder import build_app

    return build_app(load_serve_config(args))
