"""The NetworkPolicies (networkPolicy.*): Ray pods open to each other on every port and to
the outside on the API ports only, Redis open to the release's pods only.

Checked on the rendered output: the objects pass Kubernetes 1.31's schemas (kubernetes-validate
strict, as test_kubernetes_schemas.py), their selectors are evaluated against the labels of the
pod templates the same render holds, and the ports against the Baton config's. Not checked: a
CNI enforcing them (no cluster here).
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from testlib.helm_chart import (
    KUBERNETES_VERSION,
    VALUES_FILES,
    HelmChart,
    Manifest,
    baton_config,
    head_group,
    of_kind,
    one,
    ray_container,
    values_file,
    worker_groups,
)

ON = {"networkPolicy": {"enabled": True}}
NODES = [{"ipBlock": {"cidr": "10.0.0.0/16"}}]
# gpu-tp2 runs its worker groups on the host network, which needs the nodes as peers.
ON_FOR = {name: ON for name in VALUES_FILES} | {"gpu-tp2": {"networkPolicy": {"enabled": True, "clusterPeers": NODES}}}
PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def ray_pod_labels(objects: list[Manifest]) -> dict[str, dict[str, str]]:
    groups = {"head": head_group(objects), **worker_groups(objects)}
    return {name: group["template"]["metadata"]["labels"] for name, group in groups.items()}


def redis_pod_labels(objects: list[Manifest]) -> dict[str, str]:
    return one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]


def policy(objects: list[Manifest], suffix: str) -> Manifest:
    (found,) = [p for p in of_kind(objects, "NetworkPolicy") if p["metadata"]["name"].endswith(suffix)]
    return found


def ports_of(rule: Manifest) -> list[int]:
    return sorted(p["port"] for p in rule.get("ports", []))


def peers_matching_release(rule: Manifest, labels: dict[str, str]) -> bool:
    """A `from` peer that admits a pod of this namespace with these labels (pod selector only)."""
    return any(
        "podSelector" in peer and "namespaceSelector" not in peer and matches(peer["podSelector"], labels)
        for peer in rule.get("from", [])
    )


@pytest.fixture(scope="module")
def enabled(chart: HelmChart):
    cache: dict[str, list[Manifest]] = {}

    def render(name: str) -> list[Manifest]:
        if name not in cache:
            cache[name] = chart.render([values_file(name)], ON_FOR[name])
        return cache[name]

    return render


@pytest.mark.parametrize("name", VALUES_FILES)
def test_policies_pass_kubernetes_validate_strict(enabled, name: str):
    policies = of_kind(enabled(name), "NetworkPolicy")
    assert policies
    for obj in policies:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["apiVersion"] == "networking.k8s.io/v1"
        assert obj["spec"]["policyTypes"] == ["Ingress"]


@pytest.mark.parametrize("name", VALUES_FILES)
def test_off_by_default_renders_no_policy(rendered, name: str):
    assert not of_kind(rendered(name), "NetworkPolicy")


def test_disabled_renders_nothing(chart: HelmChart):
    objects = chart.render([values_file("minimal")], {"networkPolicy": {"enabled": False, "apiFrom": PROMETHEUS}})
    assert not of_kind(objects, "NetworkPolicy")
    templates = ["templates/networkpolicy-ray.yaml", "templates/networkpolicy-redis.yaml"]
    show = [arg for path in templates for arg in ("--show-only", path)]
    done = chart.run(["template", "baton", "--namespace", "llm", *show], [values_file("minimal")])
    assert done.returncode != 0 and "could not find template" in done.stderr


@pytest.mark.parametrize("name", VALUES_FILES)
def test_ray_policy_selects_exactly_the_ray_pods(enabled, name: str):
    objects = enabled(name)
    selector = policy(objects, "-ray")["spec"]["podSelector"]
    pods = ray_pod_labels(objects)
    assert set(pods) == {"head", *worker_groups(objects)}
    for group, labels in pods.items():
        assert matches(selector, labels), f"the Ray policy misses the {group} pods: {labels}"
    for redis in of_kind(objects, "StatefulSet"):
        assert not matches(selector, redis["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("name", VALUES_FILES)
def test_release_pods_reach_ray_pods_on_every_port(enabled, name: str):
    """The engine ports (Ray, the KV handover) open between the release's pods: a rule with no
    `ports` (every port) whose peers admit the head, every worker group and Redis."""
    objects = enabled(name)
    internal = [r for r in policy(objects, "-ray")["spec"]["ingress"] if "ports" not in r]
    assert len(internal) == 1
    (rule,) = internal
    pods = list(ray_pod_labels(objects).values()) + [
        s["spec"]["template"]["metadata"]["labels"] for s in of_kind(objects, "StatefulSet")
    ]
    for labels in pods:
        assert peers_matching_release(rule, labels), labels
    # ... and nobody else: the pod selector is the release's, in this namespace.
    assert not peers_matching_release(rule, {**pods[0], "app.kubernetes.io/instance": "other-release"})
    assert all(peer.get("ipBlock") is None or peer in NODES for peer in rule["from"])


@pytest.mark.parametrize("name", VALUES_FILES)
def test_only_the_api_ports_are_open_to_anyone(enabled, name: str):
    objects = enabled(name)
    cfg = baton_config(objects)["server"]  # the config the application is built with
    ingress = policy(objects, "-ray")["spec"]["ingress"]
    open_rules = [r for r in ingress if "from" not in r]
    assert [ports_of(r) for r in open_rules] == [sorted([cfg["http_port"], cfg["grpc_port"]])]
    # Those are the ports the Ray containers serve the APIs on.
    for group in [head_group(objects), *worker_groups(objects).values()]:
        ports = {p["name"]: p["containerPort"] for p in ray_container(group)["ports"]}
        assert ports["serve"] == cfg["http_port"] and ports["grpc"] == cfg["grpc_port"]
    # Everything else that names ports has peers: metrics off, the dashboard for the operator.
    restricted = {port for r in ingress if "from" in r for port in ports_of(r)}
    assert restricted == {8265}


def test_api_ports_follow_the_config(chart: HelmChart):
    server = {"config": {"server": {"http_port": 8100, "grpc_port": 9100}}}
    objects = chart.render([values_file("minimal")], ON, server)
    (api,) = [r for r in policy(objects, "-ray")["spec"]["ingress"] if "from" not in r]
    assert ports_of(api) == [8100, 9100]
    assert all(p["protocol"] == "TCP" for p in api["ports"])


def test_api_from_restricts_the_api_ports(chart: HelmChart):
    ingress_ns = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    objects = chart.render([values_file("minimal")], {"networkPolicy": {"enabled": True, "apiFrom": ingress_ns}})
    ingress = policy(objects, "-ray")["spec"]["ingress"]
    assert all("from" in r for r in ingress if "ports" in r), "no port open to anyone"
    (api,) = [r for r in ingress if ports_of(r) == [8000, 9000]]
    assert api["from"] == ingress_ns


def test_metrics_port_only_with_allow_metrics_from(chart: HelmChart):
    values = {"networkPolicy": {"enabled": True, "allowMetricsFrom": PROMETHEUS}}
    objects = chart.render([values_file("minimal")], values)
    (metrics,) = [r for r in policy(objects, "-ray")["spec"]["ingress"] if ports_of(r) == [8080]]
    assert metrics["from"] == PROMETHEUS
    metrics_port = {p["name"]: p["containerPort"] for p in ray_container(head_group(objects))["ports"]}["metrics"]
    assert metrics_port == 8080
    kubernetes_validate.validate(policy(objects, "-ray"), KUBERNETES_VERSION, strict=True)


def test_dashboard_is_open_to_the_kuberay_operator_only(enabled):
    (dashboard,) = [r for r in policy(enabled("minimal"), "-ray")["spec"]["ingress"] if ports_of(r) == [8265]]
    operator = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "kuberay"}
    (peer,) = dashboard["from"]
    assert peer["namespaceSelector"] == {} and matches(peer["podSelector"], operator)
    assert not matches(peer["podSelector"], {"app.kubernetes.io/name": "something-else"})


@pytest.mark.parametrize("name", [n for n in VALUES_FILES if n not in ("external-redis", "colocated")])
def test_redis_open_to_the_release_pods_only(enabled, name: str):
    objects = enabled(name)
    redis = policy(objects, "-redis")["spec"]
    assert matches(redis["podSelector"], redis_pod_labels(objects))
    for labels in ray_pod_labels(objects).values():
        assert not matches(redis["podSelector"], labels)
    (rule,) = redis["ingress"]
    port = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert ports_of(rule) == [port]
    for labels in ray_pod_labels(objects).values():
        assert peers_matching_release(rule, labels)
    assert not peers_matching_release(rule, {"app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": "x"})
    assert all("namespaceSelector" not in peer for peer in rule["from"])


@pytest.mark.parametrize("name", ["external-redis", "colocated"])
def test_no_redis_policy_without_in_chart_redis(enabled, name: str):
    objects = enabled(name)
    assert not of_kind(objects, "StatefulSet")
    assert [p["metadata"]["name"] for p in of_kind(objects, "NetworkPolicy")] == ["baton-ray"]


def test_host_network_needs_cluster_peers(chart: HelmChart):
    error = chart.template_error([values_file("gpu-tp2")], ON)
    assert "networkPolicy.clusterPeers" in error and "hostNetwork" in error
    objects = chart.render([values_file("gpu-tp2")], ON_FOR["gpu-tp2"])
    (internal,) = [r for r in policy(objects, "-ray")["spec"]["ingress"] if "ports" not in r]
    assert NODES[0] in internal["from"]
    assert NODES[0] in policy(objects, "-redis")["spec"]["ingress"][0]["from"]


def test_extra_ingress_is_appended(chart: HelmChart):
    job = {"ports": [{"port": 10001, "protocol": "TCP"}], "from": PROMETHEUS}
    objects = chart.render([values_file("minimal")], {"networkPolicy": {"enabled": True, "extraIngress": [job]}})
    assert policy(objects, "-ray")["spec"]["ingress"][-1] == job


@pytest.mark.parametrize(
    "bad",
    [
        {"apiFrom": [{"ipBlock": {}}]},  # ipBlock needs a cidr
        {"apiFrom": [{}]},  # an empty peer would admit everything
        {"allowMetricsFrom": [{"podSelectors": {}}]},  # a typo
        {"clusterPeers": "10.0.0.0/8"},  # a list of peers, not a CIDR
        {"enable": True},  # unknown key
    ],
)
def test_schema_refuses_bad_values(chart: HelmChart, bad: dict):
    error = chart.template_error([values_file("minimal")], {"networkPolicy": {"enabled": True, **bad}})
    assert "at '/networkPolicy" in error, error
