"""`baton serve`: a local Ray cluster, a local Redis (unless the config names one), and the
application, stopped in order on SIGTERM, SIGINT (Ctrl-C) or SIGHUP: stop accepting, let
in-flight requests finish within the grace period, shut Serve and Ray down, stop the Redis,
exit 0. A second signal skips the rest of the drain (stop_signals.py).

`LocalDeployment` is the same start-up as a context manager; the tests use it too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import BatonConfig, load_config
from ..ray_env import import_ray
from .local_redis import LocalRedis, free_port
from .stop_signals import StopRequested, StopSignals, ray_keeps_our_sigterm_handler

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "local.yaml"
# How often processes push metrics to Ray's exporter (Ray's default is 10 s).
METRICS_REPORT_INTERVAL_MS = 2000
# How long a stop lets in-flight requests finish: under Kubernetes' default termination grace
# (30 s), leaving time for Serve, Ray and Redis to stop after it.
DEFAULT_GRACE_PERIOD_S = 20.0
DRAIN_POLL_S = 0.25
GRPC_SERVICERS = [
    "baton.v1.inference_pb2_grpc.add_InferenceServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def baton_home() -> Path:
    return Path(os.environ.get("BATON_HOME", Path.cwd() / ".baton"))


def default_model() -> Path:
    """The embedded default: a tiny random Llama, built once and cached."""
    from ..model.tiny import make_tiny_model

    path = baton_home() / "models" / "tiny-llama"
    if not (path / "model.safetensors").exists():
        logger.info("building the tiny default model in %s (once)", path)
        make_tiny_model(path, arch="llama", preset="tiny")
    return path


def resolve_config(
    config_path: str | Path | None, model: str | None, overrides: dict[str, Any] | None = None
) -> BatonConfig:
    import yaml

    path = Path(config_path) if config_path else DEFAULT_CONFIG
    raw = yaml.safe_load(path.read_text()) or {}
    merged = dict(overrides or {})
    configured_model = ((raw.get("engine") or {}).get("model") or {}).get("model")
    if model or not configured_model:
        engine = dict(merged.get("engine", {}))
        engine["model"] = {**engine.get("model", {}), "model": str(model or default_model())}
        merged["engine"] = engine
    return load_config(path, merged)


def local_num_cpus(config: BatonConfig) -> int:
    """Logical CPUs for a local Ray: this machine's, or what the config reserves if that is more.

    Logical CPUs only decide what Ray will schedule; on a small machine the replicas then share
    its cores (each engine runs the torch threads its config gives it), instead of a replica
    waiting forever for a CPU that does not exist."""
    requested = math.ceil(config.num_cpus_requested())
    available = os.cpu_count() or 1
    if requested > available:
        logger.info(
            "the config reserves %d CPUs, this machine has %d: Ray gets %d logical CPUs",
            requested,
            available,
            requested,
        )
    return max(available, requested)


@dataclass
class LocalDeployment:
    """Ray + Redis + the application, on this machine."""

    config: BatonConfig
    run_dir: Path
    num_cpus: int | None = None
    metrics_export_port: int | None = None  # Ray's Prometheus endpoint (None: Ray's default)
    redis: LocalRedis | None = None
    grpc_address: str = ""
    http_address: str = ""
    metrics_address: str = ""  # Prometheus text format, Ray's exporter on this node
    grace_period_s: float | None = None  # each replica's drain budget when stopped (None: Serve's 20 s)
    signals: StopSignals | None = None  # `baton serve`'s handlers, installed again right after ray.init
    _started_ray: bool = field(default=False, repr=False)
    _deployed: bool = field(default=False, repr=False)

    def start(self) -> LocalDeployment:
        ray = import_ray()
        from ray import serve
        from ray.serve.config import gRPCOptions

        from ..serve_app.builder import build_app

        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.config
        if config.router.redis is None:
            self.redis = LocalRedis(self.run_dir / "redis")
            config = config.model_copy(
                update={"router": config.router.model_copy(update={"redis": _redis_config(self.redis.url)})}
            )
            self.config = config
        if not ray.is_initialized():
            self._started_ray = True  # before: a stop after a half-done ray.init still shuts it down
            with ray_keeps_our_sigterm_handler() if self.signals is not None else contextlib.nullcontext():
                ray.init(
                    include_dashboard=False,
                    num_cpus=self.num_cpus or local_num_cpus(config),
                    _temp_dir=str(self.run_dir / "ray"),
                    log_to_driver=False,
                    _metrics_export_port=self.metrics_export_port or free_port(),
                    _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
                )
        if self.signals is not None:
            self.signals.install(interrupt_start=True)  # ray.init replaced them (stop_signals.py)
        server = config.server
        http_port = server.http_port or free_port()
        grpc_port = server.grpc_port or free_port()
        serve.start(
            proxy_location="HeadOnly",  # one proxy: several nodes on one machine would clash on the ports
            http_options={"host": server.http_host, "port": http_port, "request_timeout_s": server.request_timeout_s},
            grpc_options=gRPCOptions(
                port=grpc_port, grpc_servicer_functions=GRPC_SERVICERS, request_timeout_s=server.request_timeout_s
            ),
        )
        self._deployed = True  # from here a stop drains what may have started
        serve.run(build_app(config, self.grace_period_s), name=config.name, route_prefix="/")
        self.grpc_address = f"127.0.0.1:{grpc_port}"
        node = ray.nodes()[0] if ray.nodes() else {}
        self.metrics_address = f"http://127.0.0.1:{node.get('MetricsExportPort', self.metrics_export_port)}/metrics"
        self.http_address = f"http://{server.http_host}:{http_port}"
        return self

    def drain(self, timeout_s: float) -> bool:
        """Stops accepting and lets in-flight requests finish: deleting the application makes the
        proxies refuse new calls to it (gRPC NOT_FOUND, HTTP 404) while each replica stops once
        its ongoing requests are done, or after its `grace_period_s`. True if all were done
        within `timeout_s`."""
        from ray import serve

        if not self._deployed:
            return True
        serve.delete(self.config.name, _blocking=False)
        deadline = time.monotonic() + timeout_s
        while self.config.name in serve.status().applications:
            if time.monotonic() >= deadline:
                return False
            time.sleep(DRAIN_POLL_S)
        return True

    def stop(self, drain_s: float | None = None) -> None:
        """Shuts Serve, Ray and the local Redis down, after a drain of up to `drain_s` if given."""
        try:
            self.stop_serving(drain_s)
        finally:
            self.stop_processes()

    def stop_serving(self, drain_s: float | None = None) -> None:
        """The drain (if `drain_s`) and Serve's shutdown: the part a second signal may cut short."""
        if not import_ray().is_initialized():
            return  # Serve's calls would start a Ray of their own
        from ray import serve

        if drain_s is not None and not self.drain(drain_s):
            logger.warning("in-flight requests did not finish within %g s: they are cut", drain_s)
        serve.shutdown()

    def stop_processes(self) -> None:
        """Ray (every process it started: replicas, proxies, raylet, GCS) and the local Redis."""
        if self._started_ray:
            import_ray().shutdown()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _redis_config(url: str):
    from ..router.config import RedisConfig

    return RedisConfig(url=url)


def serve_forever(config_path: str | None, model: str | None, grace_period_s: float | None = None) -> int:
    grace_period_s = DEFAULT_GRACE_PERIOD_S if grace_period_s is None else grace_period_s
    signals = StopSignals()
    signals.install()  # until ray.init replaces them; LocalDeployment.start installs them again
    config = resolve_config(config_path, model)
    run_dir = baton_home() / "r" / str(os.getpid())
    deployment = LocalDeployment(config, run_dir, grace_period_s=grace_period_s, signals=signals)
    print(f"starting Baton ({config.mode}, model {config.served_model_name}) ...", flush=True)
    try:
        deployment.start()
        signals.serving()
        print(f"gRPC  {deployment.grpc_address}   (service baton.v1.Inference, metadata application={config.name})")
        print(f"HTTP  {deployment.http_address}/v1   (OpenAI-compatible)")
        if deployment.redis is not None:
            print(f"Redis {deployment.redis.url}   (local)")
        print(f"Metrics {deployment.metrics_address}   (Prometheus)")
        print(
            f"Ctrl-C or SIGTERM stops (in-flight requests get {grace_period_s:g} s; a second signal: at once).",
            flush=True,
        )
        while not signals.wait(0.5):
            pass
    except StopRequested:
        pass
    finally:
        try:
            signals.draining()
            if not signals.is_forced:
                drain_s = grace_period_s if signals.is_requested else None
                print(f"{signals.signal_name or 'exiting'}: stopping{' (draining)' if drain_s else ''} ...", flush=True)
                deployment.stop_serving(drain_s)
        except KeyboardInterrupt:
            pass
        finally:
            signals.stopping()
            if signals.is_forced:
                print("second signal: stopping at once (in-flight requests are cut)", flush=True)
            deployment.stop_processes()
    print("stopped", flush=True)
    return 0
