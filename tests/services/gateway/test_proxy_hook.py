"""The hook Serve's proxy calls, in this process (no Ray): the function Serve gives its gRPC
server an address with binds the host and TLS from the environment, and uvicorn's TLS context
requires client certificates once it has a CA. Both replacements are undone after each test."""

from __future__ import annotations

import socket
import ssl

import grpc
import pytest
import uvicorn.config
from baton.services.gateway import proxy_hook, tls
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from ray.serve._private import default_impl
from testlib.pki import make_pki


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path / "pki")


@pytest.fixture
def hook(monkeypatch, pki):
    """setup_proxy() with TLS and mTLS settings in the environment; Serve's functions restored after."""
    monkeypatch.setattr(default_impl, "add_grpc_address", default_impl.add_grpc_address)
    monkeypatch.setattr(uvicorn.config, "create_ssl_context", uvicorn.config.create_ssl_context)
    env = tls.proxy_environment(
        tls.TLSConfig(cert_file=str(pki.server_cert_file), key_file=str(pki.server_key_file),
                      client_ca_file=str(pki.ca_file)),
        "127.0.0.1",
    )  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert proxy_hook.setup_proxy() == []


async def test_the_grpc_address_gets_the_host_and_mtls(hook, pki):
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    default_impl.add_grpc_address(server, f"[::]:{port}")  # what Serve's proxy calls
    await server.start()
    try:
        ca, cert, key = (p.read_bytes() for p in (pki.ca_file, pki.client_cert_file, pki.client_key_file))
        credentials = grpc.ssl_channel_credentials(ca, key, cert)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        without_cert = grpc.ssl_channel_credentials(ca)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", without_cert) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


def test_uvicorn_requires_client_certificates_when_given_a_ca(hook, pki):
    common = {"certfile": pki.server_cert_file, "keyfile": pki.server_key_file, "password": None,
              "ssl_version": ssl.PROTOCOL_TLS_SERVER, "cert_reqs": ssl.CERT_NONE, "ciphers": None}  # fmt: skip
    assert uvicorn.config.create_ssl_context(**common, ca_certs=str(pki.ca_file)).verify_mode == ssl.CERT_REQUIRED
    assert uvicorn.config.create_ssl_context(**common, ca_certs=None).verify_mode == ssl.CERT_NONE


def test_an_unreadable_file_fails_the_proxy_naming_the_variable(monkeypatch, pki, tmp_path):
    monkeypatch.setattr(default_impl, "add_grpc_address", default_impl.add_grpc_address)
    monkeypatch.setattr(uvicorn.config, "create_ssl_context", uvicorn.config.create_ssl_context)
    monkeypatch.setenv(tls.CERT_FILE_ENV, str(tmp_path / "missing.pem"))
    monkeypatch.setenv(tls.KEY_FILE_ENV, str(pki.server_key_file))
    with pytest.raises(RuntimeError, match=f"{tls.CERT_FILE_ENV}: cannot read"):
        proxy_hook.setup_proxy()
