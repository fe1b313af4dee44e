"""A local deployment: a local Ray cluster, a local Redis (unless the config names one) and the
application, started in order and stopped in order (drain, Serve, Ray, Redis). `baton serve`
(serve_command.py) runs one until a stop signal; the tests and benchmarks use it as a context
manager. The config it starts from is resolved here too: the file, overrides, and the embedded
tiny model when none is named.
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

from ..config import BatonConfig, load_config, read_config_file
from ..gateway.tls import GRPC_HOST_ENV, proxy_environment
from ..ray_env import SERVE_ENV, import_ray
from .direct_ingress import check_ingress_ports, direct_ingress_environment, resolve_direct_ingress
from .local_redis import LocalRedis
from .ports import free_listen_port
from .serve_shutdown import shutdown_serve
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
# baton.v1.Inference and grpc.health.v1.Health, with request parsers that answer malformed
# bytes with INVALID_ARGUMENT (gateway/grpc_servicers.py); the Helm chart names the same.
GRPC_SERVICERS = [
    "baton.services.gateway.grpc_servicers.add_inference_servicer_to_server",
    "baton.services.gateway.grpc_servicers.add_admin_servicer_to_server",
    "baton.services.gateway.grpc_servicers.add_health_servicer_to_server",
]


def baton_home() -> Path:
    return Path(os.environ.get("BATON_HOME", Path.cwd() / ".baton"))


def default_config_path() -> Path:
    """`BATON_CONFIG` (the image sets it), else the repository's configs/local.yaml."""
    return Path(os.environ.get("BATON_CONFIG") or DEFAULT_CONFIG)


def default_model() -> Path:
    """The embedded default: a tiny random Llama, built once and cached."""
    from ..model.tiny import make_tiny_model

    path = baton_home() / "models" / "tiny-llama"
    if not (path / "model.safetensors").exists():
        print(f"building the tiny default model in {path} (once)", flush=True)
        make_tiny_model(path, arch="llama", preset="tiny")
    return path


def resolve_config(
    config_path: str | Path | None, model: str | None, overrides: dict[str, Any] | None = None
) -> BatonConfig:
    """The config file (default: `default_config_path()`), then `overrides`, then `model`; the
    tiny default model when none of them names one."""
    path = Path(config_path) if config_path else default_config_path()
    raw = read_config_file(path)
    merged = dict(overrides or {})
    configured_model = _model_of(merged) or _model_of(raw)
    if model or not configured_model:
        engine = dict(merged.get("engine", {}))
        engine["model"] = {**engine.get("model", {}), "model": str(model or default_model())}
        merged["engine"] = engine
    return load_config(path, merged)


def _model_of(config: dict[str, Any]) -> str | None:
    return ((config.get("engine") or {}).get("model") or {}).get("model")


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
    metrics_export_port: int | None = None  # Ray's Prometheus endpoint (None: a free port)
    redis: LocalRedis | None = None
    grpc_address: str = ""
    http_address: str = ""
    metrics_address: str = ""  # Prometheus text format, Ray's exporter on this node
    grace_period_s: float | None = None  # each replica's drain budget when stopped (None: Serve's 20 s)
    signals: StopSignals | None = None  # `baton serve`'s handlers, installed again right after ray.init
    log_level: str | None = None  # Serve's processes log at this level or INFO, the lower (None: Serve's default)
    ray_logs_dir: Path | None = None  # Ray's and Serve's own logs (the session's logs/ folder), once started
    redis_acl: bool = False  # the local Redis (if started) gets an ACL user with a generated password
    _started_ray: bool = field(default=False, repr=False)
    _deployed: bool = field(default=False, repr=False)

    def start(self) -> LocalDeployment:
        """Starts Redis (unless configured), Ray and the application. A start that fails stops
        what it started before raising (a caller's `with` or `finally` never sees a half-started
        deployment); a stop signal's StopRequested is left to `baton serve`'s orderly stop."""
        try:
            return self._start()
        except StopRequested:
            raise
        except BaseException:
            try:
                self.stop()
            except Exception:  # the start's own error is the one to report
                logger.exception("stopping after a failed start failed too")
            raise

    def _start(self) -> LocalDeployment:
        ray = import_ray()
        from ray import serve
        from ray.serve.config import gRPCOptions

        from ..serve_app.builder import build_app

        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.config
        server = config.server
        server.tls.check_files()
        if server.tls.enabled and ray.is_initialized():  # the proxy hook's settings travel in Ray's environment
            raise ValueError("server.tls needs a Ray that baton serve starts (Ray was already running here)")
        direct = resolve_direct_ingress(config, ray.is_initialized())
        if direct != config.server.direct_ingress:  # `auto` decided: what follows reads a bool
            server = server.model_copy(update={"direct_ingress": direct})
            config = self.config = config.model_copy(update={"server": server})
        http_port = server.http_port or free_listen_port(server.http_host, avoid={server.grpc_port})
        grpc_port = server.grpc_port or free_listen_port(server.grpc_host, avoid={http_port})
        if ray.is_initialized() and os.environ.get(GRPC_HOST_ENV) != server.grpc_host:  # as TLS, it needs Ray's env
            logger.warning("server.grpc_host %s not applied: Ray runs without %s", server.grpc_host, GRPC_HOST_ENV)
        if config.router.redis is None:
            self.redis = LocalRedis(self.run_dir / "redis", username="baton" if self.redis_acl else None)
            config = config.model_copy(
                update={"router": config.router.model_copy(update={"redis": self.redis.redis_config()})}
            )
            self.config = config
        if not ray.is_initialized():
            self._started_ray = True  # before: a stop after a half-done ray.init still shuts it down
            with (
                ray_keeps_our_sigterm_handler() if self.signals is not None else contextlib.nullcontext(),
                _environment(self._environment(http_port, grpc_port)),  # Ray's processes inherit it
            ):
                ray.init(
                    include_dashboard=False,
                    num_cpus=self.num_cpus or local_num_cpus(config),
                    _temp_dir=self.ray_temp_dir(),
                    log_to_driver=False,
                    logging_level=logging.getLogger("ray").level or logging.INFO,
                    _metrics_export_port=self.metrics_export_port or free_listen_port(avoid={http_port, grpc_port}),
                    _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
                )
            _stop_log_monitor(ray)
        if self.signals is not None:
            self.signals.install(interrupt_start=True)  # ray.init replaced them (stop_signals.py)
        self.ray_logs_dir = _ray_logs_dir(ray)
        # Under direct ingress the gateway replica takes the ports; the proxies get free ones.
        if server.direct_ingress:
            taken = {http_port, grpc_port}
            proxy_http_port = free_listen_port(server.http_host, avoid=taken)
            proxy_ports = (proxy_http_port, free_listen_port(server.grpc_host, avoid=taken | {proxy_http_port}))
        else:
            proxy_ports = (http_port, grpc_port)
        serve.start(
            proxy_location="HeadOnly",  # one proxy: several nodes on one machine would clash on the ports
            http_options={
                "host": server.http_host,
                "port": proxy_ports[0],
                "request_timeout_s": server.request_timeout_s,
                **server.tls.http_options(),
            },
            grpc_options=gRPCOptions(
                port=proxy_ports[1], grpc_servicer_functions=GRPC_SERVICERS, request_timeout_s=server.request_timeout_s
            ),
            logging_config=None if self.log_level is None else {"log_level": _serve_log_level(self.log_level)},
        )
        if server.direct_ingress:
            check_ingress_ports(server.http_host, http_port, server.grpc_host, grpc_port)
        self._deployed = True  # from here a stop drains what may have started
        serve.run(build_app(config, self.grace_period_s), name=config.name, route_prefix="/")
        self.grpc_address = f"{_dialled(server.grpc_host)}:{grpc_port}"
        node = ray.nodes()[0] if ray.nodes() else {}
        self.metrics_address = f"http://127.0.0.1:{node.get('MetricsExportPort', self.metrics_export_port)}/metrics"
        scheme = "https" if server.tls.enabled else "http"
        self.http_address = f"{scheme}://{_dialled(server.http_host)}:{http_port}"
        return self

    def _environment(self, http_port: int, grpc_port: int) -> dict[str, str]:
        """What Ray's processes need from us: Serve's settings (unless set here already), the proxy
        hook's, the local Redis's, direct ingress's."""
        server = self.config.server
        env = {name: value for name, value in SERVE_ENV.items() if name not in os.environ}
        env |= proxy_environment(server.tls, server.grpc_host)
        if server.direct_ingress:
            env |= direct_ingress_environment(http_port, grpc_port)
        return env | (self.redis.environment() if self.redis is not None else {})

    def ray_temp_dir(self) -> str | None:
        """Ray's temp folder: `$RAY_TMPDIR/ray` when RAY_TMPDIR is set (Ray's own rule), else the
        run folder's ray/. Ray's socket paths live in it, limited to 107 bytes."""
        return None if os.environ.get("RAY_TMPDIR") else str(self.run_dir / "ray")

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
        if drain_s is not None and not self.drain(drain_s):
            logger.warning("in-flight requests did not finish within %g s: they are cut", drain_s)
        shutdown_serve()

    def stop_processes(self) -> None:
        """Ray (every process it started: replicas, proxies, raylet, GCS) and the local Redis,
        which stops even when Ray's shutdown fails."""
        try:
            if self._started_ray:
                import_ray().shutdown()
        finally:
            if self.redis is not None:
                self.redis.stop()

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """`env` in os.environ for the block (ray.init's processes copy it), then as it was."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _dialled(host: str) -> str:
    """The address a client on this machine dials for a listen address (a wildcard: loopback)."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _stop_log_monitor(ray) -> None:
    """Ray's log monitor reads every Ray process's log files ten times a second to send new
    lines to the drivers that print them. The Ray that `baton serve` starts has one driver,
    which prints none (log_to_driver=False), so the monitor only takes CPU from the engine:
    ~0.012 cores of an idle server (docs/benchmarks.md). `ray start` can leave it out
    (--include-log-monitor=false); `ray.init` cannot, so it is stopped once Ray is up. The
    log files stay where they are (ray_logs_dir): each process writes its own."""
    node = _local_node(ray)
    if node is not None:
        node.kill_log_monitor(check_alive=False)


def _ray_logs_dir(ray) -> Path | None:
    node = _local_node(ray)
    return Path(node.get_logs_dir_path()) if node is not None else None


def _local_node(ray):
    """The Ray node this driver started or joined (Ray 2.60 keeps it private), or None."""
    return ray._private.worker._global_node


def _serve_log_level(level: str) -> str:
    return "DEBUG" if level.lower() == "debug" else "INFO"
