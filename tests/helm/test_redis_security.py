"""Redis with an ACL user and TLS: the in-chart Redis creates the user (its key prefix only,
the default user off) and serves a TLS port only; every Ray pod mounts the CA, and the Baton
config's router.redis names the user, TLS and the CA file (never the password)."""

from __future__ import annotations

import pytest
from baton.services.config import BatonConfig
from testlib.helm_chart import HelmChart, baton_config, head_group, one, ray_container, values_file, worker_groups

SECURED = {"redis": {"auth": {"username": "baton-router"}, "tls": {"enabled": True, "existingSecret": "redis-tls"}}}


def redis_container(objects):
    return one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]


def test_the_in_chart_redis_creates_the_acl_user_and_serves_tls_only(chart: HelmChart):
    objects = chart.render([values_file("minimal")], SECURED)
    container = redis_container(objects)
    args = " ".join(container["args"])
    assert "--port 0 --tls-port 6379" in args and "--tls-ca-cert-file /tls/ca.crt" in args
    assert "--user default off" in args
    assert "--user baton-router on >$(REDIS_PASSWORD) ~baton:* +@all -@dangerous" in args
    assert "--requirepass" not in args
    assert container["readinessProbe"]["exec"]["command"] == [
        "redis-cli", "-p", "6379", "--user", "baton-router", "--tls", "--cacert", "/tls/ca.crt", "ping",
    ]  # fmt: skip
    assert {"name": "tls", "mountPath": "/tls", "readOnly": True} in container["volumeMounts"]
    volumes = one(objects, "StatefulSet")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "redis-tls"}} in volumes


def test_baton_connects_as_the_user_over_tls_with_the_ca(chart: HelmChart):
    objects = chart.render([values_file("minimal")], SECURED)
    redis = BatonConfig.model_validate(baton_config(objects)).router.redis
    assert redis.url == "rediss://baton-redis.llm.svc:6379" and redis.use_tls
    assert redis.username == "baton-router" and redis.password is None
    assert redis.password_env == "BATON_REDIS_PASSWORD"
    assert redis.tls_ca_file == "/etc/baton/redis-tls/ca.crt"
    for group in {"head": head_group(objects), **worker_groups(objects)}.values():
        container = ray_container(group)
        assert {"name": "redis-tls", "mountPath": "/etc/baton/redis-tls", "readOnly": True} in container["volumeMounts"]
        secret = {"secretName": "redis-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
        assert {"name": "redis-tls", "secret": secret} in group["template"]["spec"]["volumes"]


def test_the_user_follows_the_key_prefix(chart: HelmChart):
    values = {"config": {"router": {"redis": {"key_prefix": "team-a"}}}, "redis": {"auth": {"username": "a"}}}
    args = " ".join(redis_container(chart.render([values_file("minimal")], values))["args"])
    assert "~team-a:*" in args and "--tls-port" not in args


def test_without_the_new_values_redis_is_as_before(chart: HelmChart):
    objects = chart.render([values_file("minimal")])
    args = redis_container(objects)["args"]
    assert args[:4] == ["--dir", "/data", "--port", "6379"] and "--requirepass" in args and "--user" not in args
    redis = baton_config(objects)["router"]["redis"]
    assert redis["url"].startswith("redis://") and "username" not in redis and "tls_ca_file" not in redis


def test_tls_without_a_secret_is_refused(chart: HelmChart):
    error = chart.template_error([values_file("minimal")], {"redis": {"tls": {"enabled": True}}})
    assert "redis.tls.enabled needs redis.tls.existingSecret" in error


@pytest.mark.parametrize(
    "values",
    [{"redis": {"tls": {"enabled": "yes"}}}, {"redis": {"auth": {"username": 3}}}, {"redis": {"tls": {"x": 1}}}],
)
def test_the_schema_refuses_bad_redis_security_values(chart: HelmChart, values):
    assert "values don't meet the specifications of the schema" in chart.template_error(
        [values_file("minimal")], values
    )


def test_the_secured_render_passes_kubernetes_and_kuberay_schemas(chart: HelmChart):
    from testlib.crd_schema import CRDValidator
    from testlib.helm_chart import KUBERAY_CRDS, of_kind

    from .test_kubernetes_schemas import CUSTOM_KINDS, k8s_errors, pod_templates

    mtls = {"tls": {"existingSecret": "baton-tls", "requireClientCert": True}}
    objects = chart.render([values_file("minimal")], SECURED, mtls)
    errors = [e for obj in objects if obj["kind"] not in CUSTOM_KINDS for e in k8s_errors(obj)]
    (rayservice,) = of_kind(objects, "RayService")
    for group, template in pod_templates(rayservice).items():
        errors += k8s_errors(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": template}
        )
    if KUBERAY_CRDS.is_dir():
        errors += CRDValidator(KUBERAY_CRDS / "ray.io_rayservices.yaml").errors(rayservice)
    assert not errors, "\n".join(errors)
