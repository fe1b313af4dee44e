"""Binds a Serve replica's own gRPC server to its node's address instead of every interface.

Serve 2.60 starts one gRPC server per replica for calls between deployments, bound to
`[::]:0` (replica.py, `_on_initialized`, through `add_port_to_grpc_server`). Its peers reach
it at the replica's node IP (RunningReplicaInfo carries node_ip and the port), so that
address is the only one it needs; on a local cluster it is loopback. Baton's deployments
call `bind_to_node_ip` from their constructors, which Serve runs before `_on_initialized`.
The replacement checks what it replaces, so a Serve whose internals moved fails at start
instead of listening everywhere.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("ray.serve")

_ALL_INTERFACES = "[::]:0"


def bind_to_node_ip() -> None:
    """In a Serve replica's process: its inter-deployment gRPC server listens on the node IP."""
    import ray
    from ray.serve._private import replica

    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if not callable(add_port):
        raise RuntimeError("this Ray Serve has no replica.add_port_to_grpc_server: Baton cannot bind its replica port")
    if getattr(add_port, "baton_binds", None) is not None:
        return
    host = ray.util.get_node_ip_address()

    def add_port_to_grpc_server(server, address: str) -> int:
        if address == _ALL_INTERFACES:
            address = f"[{host}]:0" if ":" in host else f"{host}:0"
        port = add_port(server, address)
        if not port:
            raise RuntimeError(f"the replica's gRPC server could not bind {address}")
        return port

    add_port_to_grpc_server.baton_binds = host
    replica.add_port_to_grpc_server = add_port_to_grpc_server
