"""Builds the Serve application from a `BatonConfig`: plain functions binding plain classes.

colocated:      gateway -> colocated (EngineWorker x N)
disaggregated:  gateway -> prefill (EngineWorker x P), decode (EngineWorker x D)
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .. import metrics
from ..autoscaling.scale_to_zero import cold_start_waits
from ..config import BatonConfig, Role
from ..disaggregation.client import DisaggregatedClient
from ..gateway.api_keys import ApiKeys, AuthConfig
from ..gateway.engine_client import ColocatedClient, EngineClient, use_local_sockets
from ..gateway.gateway import Gateway
from ..gateway.migration import DEFAULT_MAX_MIGRATIONS, MigratingClient
from ..gateway.proxy_hook import setup_proxy
from ..gateway.request_limits import RequestLimits
from ..gateway.tls import DIRECT_INGRESS_ENV
from ..gateway.weight_admin import WeightAdmin
from ..ray_env import import_ray
from ..router.live_replicas import LIVE_REPLICAS
from ..workers.engine_worker import EngineWorker

HEALTH_CHECK_PERIOD_S = 5.0
logger = logging.getLogger(__name__)


class ServeGateway(Gateway):
    """The gateway as Serve builds it: from the handles of the engine deployments. It reads its
    API keys itself, in its own process (environment, mounted files), so they never pass
    through Serve's config."""

    def __init__(
        self,
        workers: dict[str, Any],
        tokenizer_path: str,
        mode: str,
        router: str,
        auth: AuthConfig | None = None,
        limits: RequestLimits | None = None,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        cold_starts: dict[str, float] | None = None,
        multiplex: bool = True,
        local_sockets: bool = True,
    ) -> None:
        use_local_sockets(local_sockets)
        for role, timeout_s in (cold_starts or {}).items():  # roles at zero are waited for, not refused
            LIVE_REPLICAS.allow_cold_start(role, timeout_s)
        if os.environ.get(DIRECT_INGRESS_ENV) == "1":  # this replica binds the ports: as the proxy would
            setup_proxy()
        api_keys = ApiKeys.from_config(auth or AuthConfig())
        logger.info("gateway: %s", api_keys.describe())
        super().__init__(
            make_engine_client(mode, workers, max_migrations, multiplex),
            tokenizer_path,
            mode,
            export_metrics=True,
            router=router,
            api_keys=api_keys,
            limits=limits,
            weight_admin=WeightAdmin(workers),
        )


def make_engine_client(
    mode: str, workers: dict[str, Any], max_migrations: int = DEFAULT_MAX_MIGRATIONS, multiplex: bool = True
) -> EngineClient:
    """The client for the mode, with request migration around it (gateway/migration.py);
    `multiplex`: outputs on one channel per engine replica (gateway/output_channels.py)."""
    if mode == "colocated":
        inner: EngineClient = ColocatedClient(workers["colocated"], multiplex=multiplex)
    else:
        inner = DisaggregatedClient(workers["prefill"], workers["decode"], multiplex)
    return MigratingClient(inner, max_migrations, on_migration=metrics.record_migration)


def build_app(config: BatonConfig, grace_period_s: float | None = None):
    """`grace_period_s`: how long a stopping replica lets its in-flight requests finish (Serve's
    `graceful_shutdown_timeout_s`, on every deployment; None keeps Serve's default, 20 s)."""
    import_ray()
    from ray import serve

    stop_options = {} if grace_period_s is None else {"graceful_shutdown_timeout_s": grace_period_s}
    if config.gateway.autoscaling is not None and config.gateway.autoscaling.policy is not None:
        # Its rules read engine signals (services/autoscaling/policy.py); the gateway has none.
        raise ValueError("gateway.autoscaling.policy: Baton's signal policy is for engine roles only")
    router_config = config.router_config() if config.router.redis is not None else None
    workers = {role: _engine_deployment(config, role, router_config, stop_options) for role in config.roles}
    gateway = serve.deployment(
        serve.ingress()(ServeGateway), name="gateway", **config.gateway.serve_options(), **stop_options
    )
    tokenizer = config.engine.model.tokenizer or config.engine.model.model
    return gateway.bind(
        workers,
        tokenizer,
        config.mode,
        replica_choice(config),
        config.server.auth,
        config.server.limits,
        config.gateway.max_migrations,
        cold_start_waits(config),
        config.gateway.multiplex_outputs,
        config.gateway.local_output_sockets,
    )


def replica_choice(config: BatonConfig) -> str:
    """How the engine replicas are picked: the prefix-aware router needs Redis, and without it
    Serve's own power-of-two choice is what runs."""
    if config.router.placement == "prefix_aware" and config.router.redis is None:
        return "power_of_two"
    return config.router.placement


def _engine_deployment(config: BatonConfig, role: Role, router_config, stop_options: dict[str, float]):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from ..router.serve_request_router import BatonRequestRouter, PowerOfTwoRequestRouter, RoundRobinRequestRouter

    section = config.deployment(role)
    engine_config = config.engine_config(role)
    options = section.engine_serve_options(engine_config.scheduler.max_num_seqs)
    choice = replica_choice(config)
    if choice == "prefix_aware":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=BatonRequestRouter,
            request_router_kwargs={"router_config": _json_config(router_config), "role": role},
        )
    else:  # every router reports its live replicas to the gateway (router/live_replicas.py)
        router_class = RoundRobinRequestRouter if choice == "round_robin" else PowerOfTwoRequestRouter
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router_class, request_router_kwargs={"role": role}
        )
    deployment = serve.deployment(
        EngineWorker, name=role, health_check_period_s=HEALTH_CHECK_PERIOD_S, **options, **stop_options
    )
    return deployment.bind(role, engine_config, config.served_model_name, router_config, section.admission_limits())


def _json_config(router_config) -> dict:
    """Serve wants JSON request-router kwargs. An explicit Redis password goes in as is (it
    then shows in Serve's config); prefer `redis.password_env`, which keeps it out."""
    data = router_config.model_dump(mode="json")
    if router_config.redis.password is not None:
        data["redis"]["password"] = router_config.redis.password.get_secret_value()
    return data
