"""TLS from a Secret: every Ray pod mounts it and gets the proxy hook's variables, Serve's
http_options get the files (its own schema accepts them), the Baton config's server.tls names
the same files; with requireClientCert the CA too. Without a Secret: nothing of it."""

from __future__ import annotations

import pytest
from baton.services.config import BatonConfig
from baton.services.gateway import tls
from testlib.helm_chart import (
    HelmChart,
    baton_config,
    head_group,
    ray_container,
    serve_config,
    values_file,
    worker_groups,
)

TLS = {"tls": {"existingSecret": "baton-tls"}}
MTLS = {"tls": {"existingSecret": "baton-tls", "requireClientCert": True}}


def ray_pods(objects) -> dict:
    return {"head": head_group(objects), **worker_groups(objects)}


def env_of(group) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in ray_container(group).get("env", [])}


@pytest.mark.parametrize("values", [TLS, MTLS], ids=["tls", "mtls"])
def test_every_ray_pod_mounts_the_secret_and_runs_the_proxy_hook(chart: HelmChart, values):
    objects = chart.render([values_file("minimal")], values)
    mtls = values is MTLS
    for name, group in ray_pods(objects).items():
        pod = group["template"]["spec"]
        assert {"name": "baton-tls", "secret": {"secretName": "baton-tls"}} in pod["volumes"], name
        mounts = ray_container(group)["volumeMounts"]
        assert {"name": "baton-tls", "mountPath": "/etc/baton/tls", "readOnly": True} in mounts, name
        env = env_of(group)
        assert env[tls.HOOK_ENV] == tls.HOOK_PATH and env[tls.GRPC_HOST_ENV] == "0.0.0.0"
        assert env[tls.CERT_FILE_ENV] == "/etc/baton/tls/tls.crt"
        assert env[tls.KEY_FILE_ENV] == "/etc/baton/tls/tls.key"
        assert env.get(tls.CLIENT_CA_FILE_ENV) == ("/etc/baton/tls/ca.crt" if mtls else None)


@pytest.mark.parametrize("values", [TLS, MTLS], ids=["tls", "mtls"])
def test_serve_and_baton_get_the_same_files(chart: HelmChart, values):
    from ray.serve.schema import ServeDeploySchema

    objects = chart.render([values_file("minimal")], values)
    serve = serve_config(objects)
    ServeDeploySchema.model_validate(serve)
    http = serve["http_options"]
    assert http["ssl_certfile"] == "/etc/baton/tls/tls.crt" and http["ssl_keyfile"] == "/etc/baton/tls/tls.key"
    server = BatonConfig.model_validate(baton_config(objects)).server
    assert server.tls.http_options() == {k: v for k, v in http.items() if k.startswith("ssl_")}
    assert server.tls.requires_client_cert is (values is MTLS)
    assert server.grpc_host == "0.0.0.0"


def test_the_ca_entry_and_mount_path_follow_the_values(chart: HelmChart):
    values = {"tls": {"existingSecret": "mine", "requireClientCert": True, "caKey": "clients.pem", "mountPath": "/tls"}}
    objects = chart.render([values_file("minimal")], values)
    assert serve_config(objects)["http_options"]["ssl_ca_certs"] == "/tls/clients.pem"
    assert env_of(head_group(objects))[tls.CLIENT_CA_FILE_ENV] == "/tls/clients.pem"


def test_without_a_secret_nothing_of_tls_renders(chart: HelmChart):
    objects = chart.render([values_file("minimal")])
    assert not any(k.startswith("ssl_") for k in serve_config(objects)["http_options"])
    assert "tls" not in baton_config(objects)["server"]
    for group in ray_pods(objects).values():
        assert tls.HOOK_ENV not in env_of(group)
        assert all(v["name"] != "baton-tls" for v in group["template"]["spec"]["volumes"])


@pytest.mark.parametrize(
    "values",
    [
        {"tls": {"existingSecret": 3}},
        {"tls": {"requireClientCert": "yes"}},
        {"tls": {"mountPath": "relative"}},
        {"tls": {"secret": "x"}},
        {"config": {"server": {"tls": {"cert": "/x"}}}},
    ],
)
def test_the_schema_refuses_bad_tls_values(chart: HelmChart, values):
    assert "values don't meet the specifications of the schema" in chart.template_error(
        [values_file("minimal")], values
    )


@pytest.mark.parametrize("values", [TLS, MTLS], ids=["tls", "mtls"])
def test_workers_get_a_readiness_probe_that_speaks_tls(chart: HelmChart, values):
    """KubeRay's own worker probe fetches Serve's health in plaintext; the chart's replaces it
    (KubeRay keeps a probe the pod has), the head keeps KubeRay's (it checks no Serve route)."""
    objects = chart.render([values_file("minimal")], values)
    http_port = str(BatonConfig.model_validate(baton_config(objects)).server.http_port)
    assert "readinessProbe" not in ray_container(head_group(objects))
    workers = worker_groups(objects)
    assert workers
    for name, group in workers.items():
        command = ray_container(group)["readinessProbe"]["exec"]["command"]
        assert command[:5] == ["python", "-m", "baton.services.gateway.health_probe", "--serve-port", http_port], name
        with_cert = ["--cert-file", "/etc/baton/tls/tls.crt", "--key-file", "/etc/baton/tls/tls.key"]
        assert command[5:] == (with_cert if values is MTLS else []), name


def test_without_tls_kuberay_keeps_its_own_probes(chart: HelmChart):
    objects = chart.render([values_file("minimal")])
    for group in ray_pods(objects).values():
        assert "readinessProbe" not in ray_container(group) and "livenessProbe" not in ray_container(group)
