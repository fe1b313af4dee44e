"""TLS and mTLS with `server.direct_ingress`: every test of test_serve_tls.py, against a
`baton serve` whose gateway replica serves both ports itself. Serve hands the replica's HTTP
server the same `ssl_*` options as its proxy's; the gateway replica installs the proxy hook
(the gRPC bind on server.grpc_host with TLS credentials, HTTP client certificates required)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from testlib.baton_process import BatonServe, session_pids
from testlib.models import tiny_model
from testlib.pki import ThrowawayPKI
from testlib.sockets import listening_addresses

from . import test_serve_tls as tls_tests
from .test_serve_command import free_ports

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

# Collected here again, against `serving` below.
pki = tls_tests.pki
server = tls_tests.server
test_baton_generate_and_bench_take_the_tls_options = tls_tests.test_baton_generate_and_bench_take_the_tls_options
test_both_apis_listen_on_loopback_only = tls_tests.test_both_apis_listen_on_loopback_only
test_every_port_of_baton_serve_is_a_loopback_one = tls_tests.test_every_port_of_baton_serve_is_a_loopback_one
test_grpc_over_tls_with_a_client_certificate = tls_tests.test_grpc_over_tls_with_a_client_certificate
test_grpc_refuses_without_mtls = tls_tests.test_grpc_refuses_without_mtls
test_https_refuses_a_client_without_a_certificate_and_plaintext = (
    tls_tests.test_https_refuses_a_client_without_a_certificate_and_plaintext
)
test_the_openai_client_over_https_with_a_client_certificate = (
    tls_tests.test_the_openai_client_over_https_with_a_client_certificate
)
test_the_readiness_probe_passes_over_mtls_and_fails_without_a_certificate = (
    tls_tests.test_the_readiness_probe_passes_over_mtls_and_fails_without_a_certificate
)
workdir = tls_tests.workdir


@pytest.fixture(scope="module")
def serving(workdir: Path, pki: ThrowawayPKI) -> Iterator[tuple[BatonServe, int, int]]:
    http_port, grpc_port, metrics_port = free_ports(3)
    flags = ["--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
    flags += [
        "--set", "server.direct_ingress=true",
        "--set", f"server.tls.cert_file={pki.server_cert_file}",
        "--set", f"server.tls.key_file={pki.server_key_file}",
        "--set", f"server.tls.client_ca_file={pki.ca_file}",
    ]  # fmt: skip
    serve = BatonServe(workdir, tiny_model("llama"), 10, extra_args=flags, env={"RAY_TMPDIR": str(workdir / "rt")})
    try:
        serve.wait_ready()
        assert f"HTTP  https://127.0.0.1:{http_port}/v1" in serve.text()
        assert "TLS   mTLS on HTTP and gRPC" in serve.text() and "Ingress direct" in serve.text()
        # The ports are the gateway replica's own, not a proxy's.
        gateway = {
            pid for pid, cmd in session_pids(serve.session_id).items() if "ServeReplica" in cmd and "gateway" in cmd
        }
        assert {("127.0.0.1", http_port), ("127.0.0.1", grpc_port)} <= listening_addresses(gateway)
        yield serve, http_port, grpc_port
    finally:
        if serve.process.poll() is None or session_pids(serve.session_id):
            serve.kill_session()
