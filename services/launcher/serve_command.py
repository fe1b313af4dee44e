"""`baton serve`: a LocalDeployment run until SIGTERM, SIGINT (Ctrl-C) or SIGHUP, then stopped
in order: stop accepting, let in-flight requests finish within the grace period, shut Serve and
Ray down, stop the Redis, exit 0. A second signal skips the rest of the drain (stop_signals.py).
Before anything starts, the config is validated and its ports are checked (ports.py): a failure
is a message naming the key, exit status 2 (config) or 1 (a busy port, in one line), with
nothing started.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..gateway.api_keys import ApiKeys
from . import console_logging
from .launcher import DEFAULT_GRACE_PERIOD_S, LocalDeployment, baton_home, resolve_config
from .ports import PortInUse, check_ports_free, port_in_use_from
from .stop_signals import StopRequested, StopSignals


def serve_forever(
    config_path: str | None,
    model: str | None,
    grace_period_s: float | None = None,
    overrides: dict[str, Any] | None = None,
    log_level: str = console_logging.DEFAULT_LEVEL,
    redis_acl: bool = False,
) -> int:
    """`baton serve`: 0 after a stop by signal; 2 for a bad config and 1 for a busy port, each
    one line on stderr with nothing started."""
    grace_period_s = DEFAULT_GRACE_PERIOD_S if grace_period_s is None else grace_period_s
    signals = StopSignals()
    signals.install()  # until ray.init replaces them; LocalDeployment.start installs them again
    try:
        config = resolve_config(config_path, model, overrides)
        auth = ApiKeys.from_config(config.server.auth).describe()  # the gateway reads them again, itself
        config.server.tls.check_files()
        metrics_port = config.server.metrics_port or None
        check_ports_free(config.server, metrics_port)
    except PortInUse as e:
        return _fail(f"baton serve: {e}", 1)
    except ValueError as e:
        return _fail(f"baton serve: error: {e}", 2)
    run_dir = baton_home() / "r" / str(os.getpid())
    log_file = console_logging.configure(log_level, run_dir)
    deployment = LocalDeployment(
        config,
        run_dir,
        metrics_export_port=metrics_port,
        grace_period_s=grace_period_s,
        signals=signals,
        log_level=log_level,
        redis_acl=redis_acl,
    )
    print(f"starting Baton ({config.mode}, model {config.served_model_name}) ...", flush=True)
    failure: PortInUse | None = None
    try:
        deployment.start()
        signals.serving()
        _print_addresses(deployment, log_file, grace_period_s, auth)
        while not signals.wait(0.5):
            pass
    except StopRequested:
        pass
    except PortInUse as e:  # taken since the check, found before the gateway replica binds it (direct ingress)
        failure = e
    except RuntimeError as e:
        failure = port_in_use_from(e, config.server, metrics_port)  # taken since the check
        if failure is None:
            raise
    finally:
        _stop(deployment, signals, grace_period_s)
    if failure is not None:
        return _fail(f"baton serve: {failure}", 1)
    print("stopped", flush=True)
    return 0


def _print_addresses(deployment: LocalDeployment, log_file: Path, grace_period_s: float, auth: str) -> None:
    config = deployment.config
    print(f"gRPC  {deployment.grpc_address}   (service baton.v1.Inference, metadata application={config.name})")
    print(f"HTTP  {deployment.http_address}/v1   (OpenAI-compatible)")
    if deployment.redis is not None:
        user = f", ACL user {deployment.redis.username}" if deployment.redis.username else ""
        print(f"Redis {deployment.redis.url}   (local, pid {deployment.redis.pid}{user}; restarted if it dies)")
    print(f"Metrics {deployment.metrics_address}   (Prometheus)")
    print(f"Logs  {log_file}   (Ray and Serve: {deployment.ray_logs_dir})")
    print(f"Auth  {auth}")
    print(f"TLS   {config.server.tls.describe()}")
    if config.server.direct_ingress:
        print("Ingress direct: the gateway replica serves both ports (no Serve proxy in the path)")
    print(
        f"Ctrl-C or SIGTERM stops (in-flight requests get {grace_period_s:g} s; a second signal: at once).",
        flush=True,
    )


def _stop(deployment: LocalDeployment, signals: StopSignals, grace_period_s: float) -> None:
    try:
        signals.draining()
        if not signals.is_forced:
            drain_s = grace_period_s if signals.is_requested else None
            if signals.is_requested:
                print(f"{signals.signal_name}: stopping{' (draining)' if drain_s else ''} ...", flush=True)
            deployment.stop_serving(drain_s)
    except KeyboardInterrupt:
        pass
    finally:
        signals.stopping()
        if signals.is_forced:
            print("second signal: stopping at once (in-flight requests are cut)", flush=True)
        deployment.stop_processes()


def _fail(message: str, code: int) -> int:
    print(message, file=sys.stderr, flush=True)
    return code
