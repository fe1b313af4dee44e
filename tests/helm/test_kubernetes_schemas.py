"""Rendered objects against schemas: Kubernetes 1.31's (kubernetes-validate, strict) for
built-in kinds, KubeRay v1.7.0's CRDs for the RayService and the RayCluster it creates.

kubernetes-validate skips custom resources silently, so those get their own check
(testlib/crd_schema.py). The CRDs are read from ../shared/crds/kuberay-v1.7.0 beside the
repository; without that folder the CRD checks skip, saying so.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import kubernetes_validate
import pytest
from testlib.crd_schema import CRDValidator
from testlib.helm_chart import KUBERAY_CRDS, KUBERNETES_VERSION, VALUES_FILES, Manifest, of_kind, values_file

# Custom resources the chart renders and where each is checked.
CUSTOM_KINDS = {
    "RayService": "KubeRay CRD (test_rayservice_matches_kuberay_crds)",
    "ServiceMonitor": "no CRD here: Prometheus Operator's; checked by test_optional_objects_render_when_enabled",
}
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def k8s_errors(obj: Manifest) -> list[str]:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        return [f"{obj['kind']}/{obj['metadata'].get('name')}: {path}: {e.message}"]
    return []


def pod_templates(rayservice: Manifest) -> dict[str, Manifest]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster.get("workerGroupSpecs", [])})
    return templates


@pytest.fixture(scope="module")
def crds() -> dict[str, CRDValidator]:
    if not KUBERAY_CRDS.is_dir():
        pytest.skip(
            f"KubeRay v1.7.0 CRDs not found at {KUBERAY_CRDS} (shared data beside the repository): "
            "RayService/RayCluster schema checks skipped"
        )
    return {
        "RayService": CRDValidator(KUBERAY_CRDS / "ray.io_rayservices.yaml"),
        "RayCluster": CRDValidator(KUBERAY_CRDS / "ray.io_rayclusters.yaml"),
    }


@pytest.mark.parametrize("name", VALUES_FILES)
def test_builtin_objects_pass_kubernetes_validate_strict(rendered, name: str):
    errors = []
    for obj in rendered(name):
        if obj["kind"] in CUSTOM_KINDS:
            continue
        errors += k8s_errors(obj)  # raises SchemaNotFoundError for a kind Kubernetes 1.31 lacks
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", VALUES_FILES)
def test_ray_pod_templates_pass_kubernetes_validate_strict(rendered, name: str):
    """The head and worker pod templates, as core/v1 PodTemplates (stricter than the CRD's copy of
    the Pod schema: Kubernetes 1.31's own field set), and the RayService's metadata as ObjectMeta."""
    (rayservice,) = of_kind(rendered(name), "RayService")
    errors = []
    for group, template in pod_templates(rayservice).items():
        errors += k8s_errors(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": template}
        )
    errors += k8s_errors({"apiVersion": "v1", "kind": "ConfigMap", "metadata": rayservice["metadata"]})
    assert not errors, "\n".join(errors)


def test_kubernetes_validate_cli_agrees(chart, tmp_path):
    """The command a user would run by hand, on every values file's output at once."""
    files = []
    for name in VALUES_FILES:
        done = chart.run(["template", "baton", "--namespace", "llm"], [values_file(name)])
        files.append(tmp_path / f"{name}.yaml")
        files[-1].write_text(done.stdout)
    command = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", KUBERNETES_VERSION]
    done = subprocess.run([*command, *map(str, files)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ERROR" not in done.stdout, done.stdout + done.stderr
    skipped = {line.split("kind ")[1].split(" ")[0] for line in done.stdout.splitlines() if line.startswith("WARN")}
    assert skipped <= CUSTOM_KINDS.keys(), done.stdout  # it skips custom resources, and only those


def test_custom_kinds_are_unknown_to_kubernetes_validate(rendered):
    """The kinds skipped above really are custom (every other kind must have a schema)."""
    for obj in (obj for name in VALUES_FILES for obj in rendered(name) if obj["kind"] in CUSTOM_KINDS):
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", VALUES_FILES)
def test_rayservice_matches_kuberay_crds(rendered, crds, name: str):
    (rayservice,) = of_kind(rendered(name), "RayService")
    errors = crds["RayService"].errors(rayservice)
    # KubeRay creates a RayCluster from spec.rayClusterConfig: check it as one too.
    cluster = {
        "apiVersion": crds["RayCluster"].api_version,
        "kind": "RayCluster",
        "metadata": {"name": rayservice["metadata"]["name"] + "-abcde"},
        "spec": rayservice["spec"]["rayClusterConfig"],
    }
    errors += crds["RayCluster"].errors(cluster)
    assert rayservice["apiVersion"] == crds["RayService"].api_version
    assert not errors, "\n".join(errors)


def test_crd_check_rejects_what_the_api_server_would(rendered, crds):
    rayservice = copy.deepcopy(of_kind(rendered("minimal"), "RayService")[0])
    group = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    del group["groupName"]
    group["replicas"] = "two"
    group["template"]["spec"]["containers"][0]["gpus"] = 1
    errors = crds["RayService"].errors(rayservice)
    assert len(errors) == 3, errors
    assert any("'groupName' is a required property" in e for e in errors)
    assert any("'gpus' was unexpected" in e for e in errors)


@pytest.mark.parametrize("name", VALUES_FILES)
def test_kuberay_operator_rules(rendered, name: str):
    """What KubeRay's operator checks beyond the schema (ray-operator/.../utils/validation.go)."""
    (rayservice,) = of_kind(rendered(name), "RayService")
    assert len(rayservice["metadata"]["name"]) <= 47 and _DNS_1035.match(rayservice["metadata"]["name"])
    cluster = rayservice["spec"]["rayClusterConfig"]
    autoscaling = cluster.get("enableInTreeAutoscaling", False)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        assert group["template"]["spec"]["containers"], "KubeRay needs the Ray container"
        start = group.get("rayStartParams", {})
        assert "labels" not in start
        if group.get("resources"):
            assert not {"num-cpus", "num-gpus", "memory", "resources"} & start.keys()
    for group in cluster["workerGroupSpecs"]:
        if not autoscaling:
            assert "minReplicas" in group and "maxReplicas" in group
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    env = [e["name"] for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0].get("env", [])]
    assert not {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS"} & set(env), "reserved for GCS fault tolerance"
