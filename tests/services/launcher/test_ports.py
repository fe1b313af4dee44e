"""`baton serve`'s port check, on real sockets: a port someone listens on is refused where the
server would bind it (HTTP on its host, gRPC on every interface, metrics on loopback), with one
line naming the port, the config key and the flag; free ports and port 0 pass."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from baton.services.config import ServerConfig
from baton.services.launcher import ports
from baton.services.launcher.ports import PortInUse, can_bind, check_ports_free, free_listen_port, port_in_use_from


@pytest.fixture
def listening() -> Iterator[int]:
    """A port with a listener on 127.0.0.1, as another server would hold it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_picked_port_lies_outside_the_ranges_ray_takes_ports_from_and_is_free():
    """Ray's workers listen on 10002-19999 and outgoing connections take the kernel's ephemeral
    range: a port picked there before ray.init was taken by the time the gateway replica bound it."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = {free_listen_port() for _ in range(50)}
    assert all(20000 <= port < first_ephemeral for port in picked), sorted(picked)
    assert len(picked) > 1  # random, not a fixed port that two deployments would share
    assert all(can_bind("127.0.0.1", port) for port in picked)


def test_a_held_port_is_not_picked(monkeypatch, listening):
    monkeypatch.setattr(ports.random, "randrange", lambda start, stop: listening)
    monkeypatch.setattr(ports, "_RAY_WORKER_PORTS_END", listening)  # the gap: the held port alone
    monkeypatch.setattr(ports, "_first_ephemeral_port", lambda: listening + 1)
    port = free_listen_port()
    assert port != listening and can_bind("127.0.0.1", port)  # the kernel's pick after the tries


def test_a_port_picked_for_another_server_is_not_picked_again(monkeypatch):
    """HTTP and gRPC ports are both picked before either is bound: the same random port twice put
    the gateway's gRPC server on its HTTP port, and the deployment never started."""
    picks = iter([25000, 25000, 25001])
    monkeypatch.setattr(ports.random, "randrange", lambda start, stop: next(picks))
    monkeypatch.setattr(ports, "can_bind", lambda host, port: True)
    monkeypatch.setattr(ports, "_first_ephemeral_port", lambda: 32768)
    http_port = free_listen_port()
    assert (http_port, free_listen_port(avoid={http_port})) == (25000, 25001)


def test_the_kernels_pick_also_avoids_the_ports_picked_before(monkeypatch):
    monkeypatch.setattr(ports, "_first_ephemeral_port", lambda: ports._RAY_WORKER_PORTS_END)  # no gap
    kernel = iter([41000, 41000, 41001])
    monkeypatch.setattr(ports, "free_port", lambda: next(kernel))
    assert free_listen_port() == 41000
    assert free_listen_port(avoid={41000}) == 41001


def test_a_listened_port_cannot_be_bound_on_its_address_or_every_interface(listening):
    assert not can_bind("127.0.0.1", listening)
    assert not can_bind("::", listening)  # the gRPC proxy's dual-stack bind
    assert can_bind("127.0.0.1", free_port())


@pytest.mark.parametrize(
    ("key", "flag"),
    [("http_port", "--http-port"), ("grpc_port", "--grpc-port"), ("metrics_port", "--metrics-port")],
)
def test_each_busy_port_is_one_line_naming_port_key_and_flag(listening, key, flag):
    ports = {"http_port": 0, "grpc_port": 0, "metrics_port": 0, key: listening}
    metrics_port = ports.pop("metrics_port")
    with pytest.raises(PortInUse) as caught:
        check_ports_free(ServerConfig(**ports), metrics_port)
    message = str(caught.value)
    assert message == (
        f"port {listening} (server.{key}) is already in use: stop what listens there or choose another "
        f"with {flag} N or --set server.{key}=N"
    )
    assert "\n" not in message


def test_free_ports_and_port_0_pass():
    check_ports_free(ServerConfig(http_port=free_port(), grpc_port=free_port()), free_port())
    check_ports_free(ServerConfig(http_port=0, grpc_port=0), None)


def test_two_keys_on_one_port_are_refused():
    port = free_port()
    with pytest.raises(ValueError, match=f"server.http_port and server.grpc_port are both {port}"):
        check_ports_free(ServerConfig(http_port=port, grpc_port=port), None)


def test_serves_bind_error_maps_to_the_same_message():
    server = ServerConfig(http_port=18000, grpc_port=19000)
    error = RuntimeError("Failed to bind to address [::]:19000; set GRPC_VERBOSITY=debug environment variable")
    assert str(port_in_use_from(error, server, 18080)).startswith("port 19000 (server.grpc_port) is already in use")
    assert port_in_use_from(RuntimeError("the model does not fit"), server, None) is None
