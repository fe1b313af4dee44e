"""`server.direct_ingress`: the gateway replica serves HTTP and gRPC itself (Ray Serve 2.60's
"direct ingress"), so a token chunk no longer crosses Serve's proxy actor on its way out.

    client --HTTP/gRPC--> gateway replica --> engine replica        (direct ingress)
    client --> Serve proxy actor --> gateway replica --> engine     (off: Serve's default)

Serve reads the mode from its processes' environment at import, so `baton serve` sets it before
it starts Ray (a Ray already running cannot take it). Each ingress replica asks the controller
for a port in [MIN, MAX); MIN = the configured port and MAX one past it put the gateway replica
on it, and a second one on the node would find no port: hence one gateway replica at most.
Serve's proxies still start (without a proxy Serve starts no replica HTTP server either), on
free ports nobody is told about, on the same hosts. The default, `auto`, runs it wherever it
can (a Ray that `baton serve` starts, one gateway replica) and Serve's proxy elsewhere.

    HTTP   bound on server.http_host (Serve's HTTPOptions.host); `/-/healthz` and `/-/routes`
           are answered by the replica itself (503 "DRAINING" once it stops).
    gRPC   Serve binds `[::]:PORT`, plaintext; the gateway replica installs the proxy hook
           (proxy_hook.setup_proxy) so it listens on server.grpc_host, with server.tls.
    TLS    HTTP gets the proxy's `ssl_*` options from Serve, and the hook's client-certificate
           requirement; the same files, read by the replica (tls.py).
    drain  Serve keeps a direct-ingress replica open for a minimum draining period (30 s by
           default, for a load balancer to deregister it). No balancer stands in front of
           `baton serve`, so the minimum is 0: a stop lasts as long as the in-flight requests,
           up to the grace period (every deployment's graceful_shutdown_timeout_s).
"""

from __future__ import annotations

import logging

from ..config import BatonConfig
from ..gateway.tls import DIRECT_INGRESS_ENV
from .ports import PortInUse, can_bind

logger = logging.getLogger(__name__)


def resolve_direct_ingress(config: BatonConfig, ray_running: bool) -> bool:
    """Whether this `baton serve` runs direct ingress. `true` that cannot run is a ValueError naming
    the setting; `auto` falls back to Serve's proxy, saying why, where `true` would be refused."""
    wanted = config.server.direct_ingress
    if wanted is False:
        return False
    gateway = config.gateway
    most = gateway.num_replicas if gateway.autoscaling is None else gateway.autoscaling.max_replicas
    if ray_running:
        why = "needs a Ray that baton serve starts (Ray was already running here)"
    elif most > 1:
        setting = "autoscaling.max_replicas" if gateway.autoscaling else "num_replicas"
        why = (
            "the gateway replica binds server.http_port and server.grpc_port itself, so one gateway "
            f"replica per node at most (gateway {setting} is {most})"
        )
    else:
        return True
    if wanted is True:
        raise ValueError(f"server.direct_ingress: {why}")
    logger.info("server.direct_ingress auto: Serve's proxy serves the ports; direct ingress %s", why)
    return False


def direct_ingress_environment(http_port: int, grpc_port: int) -> dict[str, str]:
    """What Serve's processes read at import to put the gateway replica on these ports."""
    return {  # Serve's pool is range(MIN, MAX): MAX is one past the port
        DIRECT_INGRESS_ENV: "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + 1),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc_port + 1),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        # A replica's released port is held back for a proxy's sake; with one port, a restarted
        # gateway replica would find none.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def check_ingress_ports(http_host: str, http_port: int, grpc_host: str, grpc_port: int) -> None:
    """PortInUse naming the port the gateway replica is about to bind, if something took it since
    `baton serve` checked (or a LocalDeployment, which checks nothing before). A replica that finds
    its one port taken keeps Serve retrying for minutes rather than failing, so this runs just
    before serve.run; a port taken in the seconds after it still stalls the start."""
    for key, host, port in (("server.http_port", http_host, http_port), ("server.grpc_port", grpc_host, grpc_port)):
        if not can_bind(host, port):
            raise PortInUse(port, key)
