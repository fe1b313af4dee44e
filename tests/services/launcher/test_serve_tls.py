"""TLS and mTLS on both APIs of a real `baton serve` (one server for the module, with a
throwaway CA): the openai client over HTTPS and the gRPC client over TLS, each with a client
certificate, are served; without a certificate, with a certificate from another CA, or in
plaintext, neither API serves. Its local Redis has an ACL user (`--redis-acl`). The gRPC port listens on loopback only (Baton's proxy hook),
and a TLS file that cannot be read stops `baton serve` before anything starts, naming its field."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from baton.services.client import BatonClient, ClientTLS
from baton.services.gateway.tls import TLSConfig
from baton.v1 import inference_pb2 as pb
from openai import OpenAI
from testlib.baton_process import BatonServe, session_pids
from testlib.models import tiny_model
from testlib.pki import ThrowawayPKI, make_pki
from testlib.sockets import addresses_listening_on, listening_addresses

from .test_serve_command import baton, free_ports

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bt-tls-", dir="/tmp"))  # short: Ray's socket paths live in it
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pki(workdir) -> ThrowawayPKI:
    return make_pki(workdir / "pki")


@pytest.fixture(scope="module")
def serving(workdir, pki) -> Iterator[tuple[BatonServe, int, int]]:
    http_port, grpc_port, metrics_port = free_ports(3)
    flags = ["--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
    flags += [
        "--set", f"server.tls.cert_file={pki.server_cert_file}",
        "--set", f"server.tls.key_file={pki.server_key_file}",
        "--set", f"server.tls.client_ca_file={pki.ca_file}",
        "--redis-acl",  # and the local Redis behind it with an ACL user and a generated password
    ]  # fmt: skip
    serve = BatonServe(workdir, tiny_model("llama"), 10, extra_args=flags, env={"RAY_TMPDIR": str(workdir / "rt")})
    try:
        serve.wait_ready()
        assert f"HTTP  https://127.0.0.1:{http_port}/v1" in serve.text()
        assert "TLS   mTLS on HTTP and gRPC" in serve.text()
        assert "ACL user baton; restarted if it dies" in serve.text()
        yield serve, http_port, grpc_port
    finally:
        if serve.process.poll() is None or session_pids(serve.session_id):
            serve.kill_session()


@pytest.fixture(scope="module")
def server(serving) -> tuple[int, int]:
    return serving[1:]


def client_tls(pki: ThrowawayPKI, with_cert: bool = True, ca_file: Path | None = None) -> ClientTLS:
    ca = str(ca_file or pki.ca_file)
    if not with_cert:
        return ClientTLS(ca)
    return ClientTLS(ca, str(pki.client_cert_file), str(pki.client_key_file))


def test_the_openai_client_over_https_with_a_client_certificate(server, pki):
    http_port, _ = server
    http_client = httpx.Client(verify=client_tls(pki).ssl_context(), timeout=60)
    client = OpenAI(base_url=f"https://127.0.0.1:{http_port}/v1", api_key="unused", http_client=http_client)
    completion = client.completions.create(model="baton-tiny", prompt="def main():", max_tokens=6, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 6


def test_https_refuses_a_client_without_a_certificate_and_plaintext(server, pki):
    http_port, _ = server
    for tls in (client_tls(pki, with_cert=False), client_tls(pki, ca_file=pki.other_ca_file)):  # the 2nd: wrong CA
        with (
            httpx.Client(verify=tls.ssl_context(), timeout=10) as client,
            pytest.raises((httpx.HTTPError, ssl.SSLError)),
        ):
            client.get(f"https://127.0.0.1:{http_port}/v1/models")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10)


def test_grpc_over_tls_with_a_client_certificate(server, pki):
    _, grpc_port = server
    client = BatonClient(f"127.0.0.1:{grpc_port}", tls=client_tls(pki))
    try:
        assert client.model_info().model == "baton-tiny"
        request = pb.GenerateRequest(text="def main():", sampling=pb.SamplingParameters(max_tokens=5, temperature=0))
        responses = list(client.generate(request, timeout=60))
        assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 5
    finally:
        client.close()


@pytest.mark.parametrize("case", ["no client certificate", "another CA", "plaintext"])
def test_grpc_refuses_without_mtls(server, pki, case):
    _, grpc_port = server
    tls = {
        "no client certificate": client_tls(pki, with_cert=False),
        "another CA": client_tls(pki, ca_file=pki.other_ca_file),
        "plaintext": None,
    }[case]
    client = BatonClient(f"127.0.0.1:{grpc_port}", tls=tls)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=client.metadata, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()


def test_both_apis_listen_on_loopback_only(server):
    http_port, grpc_port = server
    assert addresses_listening_on(grpc_port) == {"127.0.0.1"}  # Serve alone: [::]
    assert addresses_listening_on(http_port) == {"127.0.0.1"}


def test_every_port_of_baton_serve_is_a_loopback_one(serving):
    """Ray's, Serve's proxy and replicas (Serve alone binds a replica's gRPC server on every
    interface), the local Redis: every process of `baton serve`'s session. The KV-transfer
    endpoints are checked in kv_transfer/ (this server is colocated)."""
    serve, http_port, grpc_port = serving
    listening = listening_addresses(set(session_pids(serve.session_id)))
    assert {http_port, grpc_port} <= {port for _, port in listening}
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::1"}, sorted(listening)


def test_the_readiness_probe_passes_over_mtls_and_fails_without_a_certificate(server, pki):
    """The chart's probe for TLS pods (gateway/health_probe.py), run as kubelet runs it."""
    http_port, _ = server
    probe = [sys.executable, "-m", "baton.services.gateway.health_probe", "--serve-port", str(http_port)]
    with_cert = ["--cert-file", str(pki.client_cert_file), "--key-file", str(pki.client_key_file)]
    ready = subprocess.run([*probe, "--raylet-port", "0", *with_cert], capture_output=True, text=True, timeout=30)
    assert ready.returncode == 0, ready.stderr
    refused = subprocess.run([*probe, "--raylet-port", "0"], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and refused.stderr.startswith("not ready: https://localhost:"), refused.stderr
    nothing_there = str(free_ports(1)[0])
    no_raylet = subprocess.run(
        [*probe, "--raylet-port", nothing_there, *with_cert], capture_output=True, text=True, timeout=30
    )
    assert no_raylet.returncode == 1 and "local_raylet_healthz" in no_raylet.stderr, no_raylet.stderr


@pytest.mark.parametrize("field", ["cert_file", "key_file", "client_ca_file"])
def test_an_unreadable_tls_file_stops_baton_serve_naming_its_field(workdir, pki, field):
    files = {"cert_file": pki.server_cert_file, "key_file": pki.server_key_file, "client_ca_file": pki.ca_file}
    files[field] = workdir / "missing.pem"
    sets = [arg for name, path in files.items() for arg in ("--set", f"server.tls.{name}={path}")]
    done = baton("serve", "--model", str(tiny_model("llama")), *sets, env={"BATON_HOME": str(workdir / "home")})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"server.tls.{field}: cannot read {workdir / 'missing.pem'}" in done.stderr


def test_tls_config_checks():
    with pytest.raises(ValueError, match="cert_file and server.tls.key_file must be given together"):
        TLSConfig(cert_file="a.pem")
    with pytest.raises(ValueError, match="client_ca_file needs"):
        TLSConfig(client_ca_file="ca.pem")
    assert TLSConfig().http_options() == {}
    assert TLSConfig(cert_file="c", key_file="k", client_ca_file="ca").http_options() == {
        "ssl_certfile": "c",
        "ssl_keyfile": "k",
        "ssl_ca_certs": "ca",
    }


def test_baton_generate_and_bench_take_the_tls_options(server, pki, workdir):
    http_port, grpc_port = server
    tls = ["--tls-ca", str(pki.ca_file), "--tls-cert", str(pki.client_cert_file), "--tls-key", str(pki.client_key_file)]
    done = baton("generate", "--address", f"127.0.0.1:{grpc_port}", "def main():", "--max-tokens", "4", *tls)
    assert done.returncode == 0 and "4 generated" in done.stderr, done.stderr
    refused = baton("generate", "--address", f"127.0.0.1:{grpc_port}", "x", "--tls-ca", str(pki.ca_file))
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, refused.stderr
    for backend, address in (("grpc", f"127.0.0.1:{grpc_port}"), ("openai", f"https://127.0.0.1:{http_port}/v1")):
        out = workdir / f"bench-{backend}"
        bench = ["bench", "run", "--backend", backend, "--address", address, "--num-requests", "2"]
        bench += ["--input-len", "8", "--output-len", "4", "--out", str(out)]
        if backend == "openai":
            bench += ["--tokenizer", str(tiny_model("llama"))]
        done = baton(*bench, *tls, timeout_s=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (out / "result.json").is_file()


def test_a_client_tls_option_that_cannot_be_used_is_one_line(workdir, pki):
    done = baton("generate", "--address", "127.0.0.1:1", "x", "--tls-ca", str(workdir / "missing.pem"))
    assert done.returncode == 2 and done.stderr.startswith("error: --tls-ca: cannot read"), done.stderr
    done = baton("status", "--address", "127.0.0.1:1", "--tls-cert", str(pki.client_cert_file))
    assert done.returncode == 2 and "give --tls-cert and --tls-key together" in done.stderr, done.stderr
