"""Baton's service configuration: one validated, typed model loaded from YAML.

Each component receives only its own section: the gateway its `gateway` section and the
router's, each engine worker its role's engine config (the shared `engine` section with
the role's `engine_overrides` merged in) and the worker-side router settings. Cross-field
checks run at load: prefill and decode share the model and block size, and tensor
parallelism must divide the model's heads (checked when the model's config is read).

    name, mode, server        the Serve application, its endpoints, where API keys come from (server.auth),
                              request size bounds (server.limits), TLS on both APIs (server.tls)
    engine                    EngineConfig shared by every role (services/engine/config.py)
    gateway                   the ingress deployment (gRPC + OpenAI HTTP)
    colocated | prefill, decode   the engine deployments (mode picks which exist)
    router                    Redis connection, index, policy, worker side (services/router/config.py)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .autoscaling.config import AutoscalingConfig, GatewayAutoscalingConfig
from .engine.config import EngineConfig
from .gateway.api_keys import AuthConfig
from .gateway.migration import DEFAULT_MAX_MIGRATIONS
from .gateway.request_limits import RequestLimits
from .gateway.tls import TLSConfig
from .roles import Role
from .router.config import IndexConfig, PolicyConfig, RedisConfig, RouterConfig, WorkerConfig
from .workers.admission import AdmissionLimits

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ServerConfig(BaseModel):
    model_config = _FROZEN

    http_host: str = Field("127.0.0.1", description="HTTP (OpenAI API) listen address")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: pick a free one)")
    grpc_host: str = Field(
        "127.0.0.1",
        description="gRPC listen address (set in Serve's proxy by Baton's hook, services/gateway/tls.py)",
    )
    grpc_port: int = Field(9000, ge=0, le=65535, description="gRPC port (0: pick a free one)")
    metrics_port: int = Field(
        8080,
        ge=0,
        le=65535,
        description="Prometheus port of `baton serve`'s local Ray (0: pick a free one); the chart's Ray pods use 8080",
    )
    request_timeout_s: float | None = Field(None, gt=0, description="Server-side cap on one request's duration")
    direct_ingress: bool | Literal["auto"] = Field(
        "auto",
        description="The gateway replica serves HTTP and gRPC on http_port/grpc_port itself (Ray Serve's direct "
        "ingress) instead of Serve's proxy actor relaying every chunk (1.2-1.5x on serving): it needs one gateway "
        "replica and a Ray that `baton serve` starts. `auto`: on where those hold, else the proxy; `true` refuses "
        "a config that cannot run it (services/launcher/direct_ingress.py)",
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig,
        description="API keys: the environment variables and files they are read from (never the keys)",
    )
    limits: RequestLimits = Field(
        default_factory=RequestLimits,
        description="Request size and prompt length bounds, checked before work is spent; tokenizer threads",
    )
    tls: TLSConfig = Field(
        default_factory=TLSConfig,
        description="TLS on both APIs (HTTP and gRPC): certificate, key, and a client CA for mTLS; files read at start",
    )


class ActorOptions(BaseModel):
    model_config = _FROZEN

    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per replica (tensor-parallel ranks take their own)")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom resources, e.g. {prefill_node: 0.5} to pin replicas to nodes"
    )


class DeploymentConfig(BaseModel):
    model_config = _FROZEN

    num_replicas: int = Field(1, ge=1, description="Replicas (ignored when autoscaling is set)")
    autoscaling: AutoscalingConfig | None = Field(None, description="Scale replicas with load instead")
    max_ongoing_requests: int = Field(256, ge=1, description="Requests a replica handles at once")
    ray_actor_options: ActorOptions = Field(default_factory=ActorOptions, description="Resources per replica")

    def serve_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options`."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": self.ray_actor_options.model_dump(),
        }
        if self.autoscaling is None:
            options["num_replicas"] = self.num_replicas
        else:
            options["autoscaling_config"] = self.autoscaling.serve_config()
        return options


class GatewayConfig(DeploymentConfig):
    autoscaling: GatewayAutoscalingConfig | None = Field(None, description="Scale replicas with load instead")
    ray_actor_options: ActorOptions = Field(
        default_factory=lambda: ActorOptions(num_cpus=0.25), description="Resources per replica"
    )
    max_ongoing_requests: int = Field(
        1024,
        ge=1,
        description="Calls a replica takes at once; above server.limits.max_inflight_requests, so a generation "
        "request over that bound is shed by the gateway (429) rather than held in Serve's proxy",
    )
    max_queued_requests: int = Field(
        128,
        ge=-1,
        description="Calls Serve's proxy queues while every gateway replica is at max_ongoing_requests (then 429 "
        "with Retry-After); -1: no bound",
    )
    max_migrations: int = Field(
        DEFAULT_MAX_MIGRATIONS,
        ge=0,
        description="Times a request whose worker died continues on another one (0: the loss reaches the client)",
    )
    multiplex_outputs: bool = Field(
        True,
        description="Each engine replica sends a step's outputs for all of this gateway's requests as one message "
        "(one output channel per replica) rather than one per request (1.3x output tok/s at concurrency 16)",
    )
    local_output_sockets: bool = Field(
        True,
        description="An output channel to an engine replica on the gateway's own Ray node goes over a Unix socket "
        "instead of a Ray stream (a few ms less to each output; services/local_channel.py)",
    )

    def serve_options(self) -> dict[str, Any]:
        options = super().serve_options()
        options["max_queued_requests"] = self.max_queued_requests
        # Serve's own refusal of a call over the queue bound: a 429 with Retry-After, as the gateway's.
        options["backpressure_config"] = {"status_code": 429, "retry_after_s": GATEWAY_QUEUE_RETRY_AFTER_S}
        return options


GATEWAY_QUEUE_RETRY_AFTER_S = 1.0  # a gateway slot frees when any of its requests ends

# Calls a replica takes beyond what its engine holds: they reach admission control and get its
# 429 (naming the bound) rather than waiting unseen in a caller's handle.
ADMISSION_HEADROOM = 32


class EngineDeploymentConfig(DeploymentConfig):
    engine_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Engine settings for this role only, e.g. {scheduler: {max_num_seqs: 64}}"
    )
    # Admission control (services/workers/admission.py): a request over any bound gets 429 /
    # RESOURCE_EXHAUSTED with Retry-After, before the engine sees it.
    max_waiting_requests: int = Field(
        512, ge=1, description="Overload bound: beyond this many requests waiting to start, new ones get 429"
    )
    max_waiting_prompt_tokens: int | None = Field(
        None, ge=1, description="Overload bound on the prompt tokens waiting for prefill (None: none)"
    )
    max_queue_delay_s: float | None = Field(
        30.0,
        gt=0,
        description="Overload bound on a new request's estimated wait to start (its TTFT's queueing part); None: none",
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests a replica takes at once (None: more than its engine holds, max_num_seqs + "
        "max_waiting_requests, so the backlog waits where admission control and the gauges see it and a call "
        "over the bound is refused there)",
    )
    max_queued_requests: int = Field(
        128,
        ge=-1,
        description="Calls a gateway's handle queues for this deployment while every replica is full "
        "(then 429); -1: no bound",
    )

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_waiting_requests, self.max_waiting_prompt_tokens, self.max_queue_delay_s)

    def engine_serve_options(self, max_num_seqs: int) -> dict[str, Any]:
        options = self.serve_options()
        held = max_num_seqs + self.max_waiting_requests
        options["max_ongoing_requests"] = self.max_ongoing_requests or held + ADMISSION_HEADROOM
        options["max_queued_requests"] = self.max_queued_requests
        return options


class RouterSection(BaseModel):
    model_config = _FROZEN

    redis: RedisConfig | None = Field(
        None, description="Redis for the index and registry; None: `baton serve` starts one"
    )
    placement: Literal["prefix_aware", "power_of_two", "round_robin"] = Field(
        "prefix_aware",
        description="How the gateway picks engine replicas: Baton's prefix-aware router, Serve's default "
        "(power of two choices), or round robin",
    )
    index: IndexConfig = IndexConfig()
    policy: PolicyConfig = PolicyConfig()
    worker: WorkerConfig = WorkerConfig()


class BatonConfig(BaseModel):
    model_config = _FROZEN

    name: str = Field("baton", description="Serve application name (gRPC clients send it as `application` metadata)")
    mode: Literal["colocated", "disaggregated"] = Field("colocated", description="One engine role, or prefill + decode")
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = Field(description="Engine settings shared by every role")
    gateway: GatewayConfig = GatewayConfig()
    colocated: EngineDeploymentConfig = EngineDeploymentConfig()
    prefill: EngineDeploymentConfig = EngineDeploymentConfig()
    decode: EngineDeploymentConfig = EngineDeploymentConfig()
    router: RouterSection = RouterSection()

    @model_validator(mode="after")
    def _roles_agree(self) -> BatonConfig:
        engines = {role: self.engine_config(role) for role in self.roles}  # validates the merged overrides
        for role, engine in engines.items():
            if engine.model.model != self.engine.model.model:
                raise ValueError(f"{role}.engine_overrides must not change the model")
            if engine.cache.block_size != self.engine.cache.block_size:
                raise ValueError(f"{role}.engine_overrides must not change block_size: prefill and decode share it")
            if engine.model.dtype != self.engine.model.dtype:
                raise ValueError(f"{role}.engine_overrides must not change dtype: the KV handover copies raw bytes")
            if engine.cache.kv_cache_dtype != self.engine.cache.kv_cache_dtype:
                raise ValueError(
                    f"{role}.engine_overrides must not change kv_cache_dtype: the KV handover copies raw bytes"
                )
        if self.server.limits.max_inflight_requests >= self.gateway.max_ongoing_requests:
            raise ValueError(
                f"server.limits.max_inflight_requests ({self.server.limits.max_inflight_requests}) must be below "
                f"gateway.max_ongoing_requests ({self.gateway.max_ongoing_requests}): over it, Serve's proxy would "
                "hold requests back unseen instead of the gateway shedding them"
            )
        if self.mode == "disaggregated":
            tp = {role: engines[role].parallel.tensor_parallel_size for role in ("prefill", "decode")}
            if tp["prefill"] != tp["decode"]:
                raise ValueError(
                    f"prefill tensor_parallel_size ({tp['prefill']}) != decode ({tp['decode']}): rank i of a "
                    "prefill group sends its heads to rank i of the decode group, so the sizes must match"
                )
        return self

    @property
    def roles(self) -> tuple[Role, ...]:
        return (Role.COLOCATED,) if self.mode == "colocated" else (Role.PREFILL, Role.DECODE)

    @property
    def served_model_name(self) -> str:
        return self.engine.model.served_model_name or Path(self.engine.model.model).name

    def deployment(self, role: Role) -> EngineDeploymentConfig:
        return getattr(self, role)

    def num_cpus_requested(self) -> float:
        """Logical CPUs the application reserves at its largest: every replica (autoscaling at
        its maximum) and, under tensor parallelism, each replica's rank actors (one CPU each)."""

        def replicas(deployment: DeploymentConfig) -> int:
            return deployment.num_replicas if deployment.autoscaling is None else deployment.autoscaling.max_replicas

        total = replicas(self.gateway) * self.gateway.ray_actor_options.num_cpus
        for role in self.roles:
            deployment, tp = self.deployment(role), self.engine_config(role).parallel.tensor_parallel_size
            total += replicas(deployment) * (deployment.ray_actor_options.num_cpus + (tp if tp > 1 else 0))
        return total

    def engine_config(self, role: Role) -> EngineConfig:
        """The shared engine section, the role's overrides, and the role's side of the handover."""
        overrides = self.deployment(role).engine_overrides
        merged = _deep_merge(self.engine.model_dump(), overrides)
        merged["kv_transfer"] = {**merged.get("kv_transfer", {}), "role": Role(role)}
        return EngineConfig.model_validate(merged)

    def router_config(self) -> RouterConfig:
        section = self.router
        if section.redis is None:
            raise ValueError("router.redis is not set (baton serve starts a local Redis when it is missing)")
        return RouterConfig(
            model=self.served_model_name,
            block_size=self.engine.cache.block_size,
            redis=section.redis,
            index=section.index,
            policy=section.policy,
            worker=section.worker,
        )


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> BatonConfig:
    """Reads YAML, merges `overrides` (e.g. {"engine": {"model": {"model": DIR}}}), validates.

    Errors name the file and the offending field.
    """
    raw = read_config_file(path) if path is not None else {}
    merged = _deep_merge(raw, overrides or {})
    try:
        return BatonConfig.model_validate(merged)
    except ValidationError as e:
        raise ValueError(f"invalid config{f' {path}' if path else ''}:\n{e}") from e


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's YAML, unvalidated; errors name the file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} must be a mapping at the top level")
    return raw


def config_override(assignment: str) -> dict[str, Any]:
    """`section.key=value` (what `baton serve --set` takes) as a nested override. The value is
    read as YAML (`8000` is an int, `true` a bool, `null` None, `[a, b]` a list); the model
    validates it at load. A key that names no config field fails here, naming it."""
    key, has_value, text = assignment.partition("=")
    path = key.strip().split(".")
    if not has_value or not all(path):
        raise ValueError(f"--set {assignment!r}: expected section.key=value, e.g. server.http_port=8001")
    _check_key(path)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--set {key}: cannot read {text!r} as a YAML value: {e}") from e
    for part in reversed(path):
        value = {part: value}
    return value


def config_overrides(assignments: list[str]) -> dict[str, Any]:
    """Several `--set` assignments merged, later ones winning."""
    merged: dict[str, Any] = {}
    for assignment in assignments:
        merged = _deep_merge(merged, config_override(assignment))
    return merged


def _check_key(path: list[str]) -> None:
    model: type[BaseModel] = BatonConfig
    for depth, name in enumerate(path):
        field = model.model_fields.get(name)
        where = ".".join(path[:depth]) or "the config"
        if field is None:
            known = ", ".join(model.model_fields)
            raise ValueError(f"unknown config key {'.'.join(path)!r}: {where} has no {name!r} (it has {known})")
        section = _section_model(field.annotation)
        if section is None:
            if depth + 1 < len(path) and not _is_mapping(field.annotation):
                raise ValueError(
                    f"unknown config key {'.'.join(path)!r}: {'.'.join(path[: depth + 1])} is a value, not a section"
                )
            return  # a value, or a free-form mapping (engine_overrides, resources)
        model = section


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The config model a field holds (also through `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _is_mapping(annotation: Any) -> bool:
    return get_origin(annotation) is dict or any(get_origin(arg) is dict for arg in get_args(annotation))


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
