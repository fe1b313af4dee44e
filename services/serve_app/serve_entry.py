"""The application builder that Serve config files name: KubeRay's serveConfigV2, `serve deploy`.

    applications:
      - name: baton
        import_path: baton.services.serve_app.serve_entry:app
        route_prefix: /
        args:
          config: {mode: disaggregated, engine: {...}, ...}   # the Baton config inline, and/or
          config_path: /etc/baton/baton.yaml                  # a YAML file (`config` is merged over it)
          grace_period_s: 20                                  # the drain budget of a stopping replica

Serve calls `app(args)` in a task on some node of the cluster, so a `config_path` must exist
on every node (the Helm chart mounts its ConfigMap on every Ray pod). Secrets stay out of
both: the Redis password is read by each process from the variable that
`router.redis.password_env` names (services/router/config.py).
"""

# No `from __future__ import annotations`: Serve reads the builder's parameter annotation at
# run time to turn the `args` dict into `ServeArgs`.
import os
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from ..config import BatonConfig, load_config

if TYPE_CHECKING:
    from ray.serve import Application


class ServeArgs(BaseModel):
    """The `args` of the Serve application."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: dict[str, Any] = Field(default_factory=dict, description="The Baton config (services/config.py), inline")
    config_path: str | None = Field(None, description="A Baton config YAML file; `config` is merged over it")
    grace_period_s: float | None = Field(
        None,
        gt=0,
        description="How long a stopping replica lets in-flight requests finish (Serve's graceful_shutdown_timeout_s "
        "on every deployment; unset: Serve's 20 s). The Helm chart sets it from shutdown.gracePeriodSeconds",
    )


def load_serve_config(args: ServeArgs) -> BatonConfig:
    """The validated Baton config that `args` describe."""
    if args.config_path is None and not args.config:
        raise ValueError("the Serve application's args need `config` (inline) or `config_path` (a YAML file)")
    return load_config(args.config_path, args.config)


def app(args: ServeArgs) -> "Application":
    from ..gateway.tls import DIRECT_INGRESS_ENV
    from .builder import build_app

    config = load_serve_config(args)
    if config.server.direct_ingress is True and os.environ.get(DIRECT_INGRESS_ENV) != "1":
        # Serve reads the mode from its processes' environment; `baton serve` sets it, a cluster's pods must.
        raise ValueError(f"server.direct_ingress: this Ray cluster's processes run without {DIRECT_INGRESS_ENV}=1")
    return build_app(config, args.grace_period_s)
