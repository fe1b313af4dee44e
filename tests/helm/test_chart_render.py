"""`helm lint --strict` and `helm template` on every values file; the chart's conventions."""

from __future__ import annotations

import re

import pytest
from testlib.helm_chart import CHART_DIR, VALUES_FILES, HelmChart, of_kind, one, values_file

_SOURCE = re.compile(r"^# Source: baton/templates/(\S+)$", re.MULTILINE)


@pytest.mark.parametrize("name", VALUES_FILES)
def test_lint_strict_passes(chart: HelmChart, name: str):
    done = chart.run(["lint", "--strict"], [values_file(name)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


@pytest.mark.parametrize("name", VALUES_FILES)
def test_template_renders_one_object_per_template(chart: HelmChart, name: str):
    done = chart.run(["template", "baton", "--namespace", "llm"], [values_file(name)])
    assert done.returncode == 0, done.stderr
    sources = _SOURCE.findall(done.stdout)
    assert sources and len(sources) == len(set(sources)), f"a template rendered several objects: {sources}"


def test_templates_are_named_kind_component():
    for path in (CHART_DIR / "templates").glob("*.yaml"):
        kind = path.stem.split("-", 1)[0]
        body = path.read_text()
        assert re.search(rf"^kind: {kind}$", body, re.IGNORECASE | re.MULTILINE), f"{path.name} holds no {kind}"
        assert "-" in path.stem, f"{path.name} is not <kind>-<component>.yaml"


def test_every_values_key_has_a_comment():
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    for number, line in enumerate(lines, 1):
        is_key = re.match(r"^\s*[A-Za-z][\w.-]*:", line)
        if is_key and "#" not in line:
            assert number > 1 and lines[number - 2].strip().startswith("#"), f"values.yaml:{number} has no comment"


def test_minimal_renders_the_default_objects(rendered):
    objects = rendered("minimal")
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == ["ConfigMap", "RayService", "Secret", "Service", "Service", "Service", "StatefulSet"]
    names = {obj["metadata"]["name"] for obj in objects}
    assert {"baton-http", "baton-grpc", "baton-redis", "baton-config", "baton"} <= names


def test_optional_objects_render_when_enabled(rendered):
    objects = rendered("gpu-tp2")
    assert one(objects, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    metrics = [s for s in of_kind(objects, "Service") if s["metadata"]["name"].endswith("-metrics")]
    assert [p["name"] for p in metrics[0]["spec"]["ports"]] == ["metrics"]
    budget = one(objects, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]


def test_disabled_components_render_nothing(chart: HelmChart):
    off = {
        "redis": {"enabled": False},
        "service": {"http": {"enabled": False}, "grpc": {"enabled": False}},
        "serviceMonitor": {"enabled": False},
        "podDisruptionBudget": {"enabled": False},
    }
    objects = chart.render([values_file("minimal")], off)
    assert sorted(obj["kind"] for obj in objects) == ["ConfigMap", "RayService"]


def test_long_names_are_truncated_keeping_suffixes(chart: HelmChart):
    release = "a-release-name-that-is-long-enough-to-hit-the-limit-x"  # 53: helm's own maximum
    objects = chart.render([values_file("gpu-tp2")], release=release)
    names = [obj["metadata"]["name"] for obj in objects]
    kinds_and_names = [(obj["kind"], obj["metadata"]["name"]) for obj in objects]
    assert len(kinds_and_names) == len(set(kinds_and_names)), kinds_and_names
    assert all(len(name) <= 63 and not name.endswith("-") for name in names), names
    for suffix in ("-http", "-grpc", "-redis", "-config", "-metrics", "-workers"):
        assert any(name.endswith(suffix) for name in names), suffix
    assert len(one(objects, "RayService")["metadata"]["name"]) <= 47  # KubeRay appends up to 16 characters
    for obj in objects:
        assert all(len(str(v)) <= 63 for v in obj["metadata"]["labels"].values())


def test_notes_explain_how_to_call_the_service(chart: HelmChart):
    done = chart.run(["install", "baton", "--dry-run=client", "--namespace", "llm"], [values_file("gpu-tp2")])
    assert done.returncode == 0, done.stderr
    notes = done.stdout[done.stdout.index("NOTES:") :]
    assert "kubectl -n llm port-forward svc/baton-http 8000:8000" in notes
    assert '"model": "llama-3.1-70b"' in notes
    assert "grpcurl -plaintext -H 'application: baton' 127.0.0.1:9000 baton.v1.Inference/GetModelInfo" in notes
    assert "password in Secret baton-redis" in notes
    done = chart.run(["install", "baton", "--dry-run=client"], [values_file("colocated")])
    assert "WARNING: no Redis" in done.stdout and "grpcurl" not in done.stdout


def test_the_ray_log_monitor_is_off_in_every_group_unless_asked(chart: HelmChart):
    def start_params(objects) -> dict[str, dict]:
        cluster = one(objects, "RayService")["spec"]["rayClusterConfig"]
        groups = {"head": cluster["headGroupSpec"]}
        groups.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
        return {name: group["rayStartParams"] for name, group in groups.items()}

    for name in ("minimal", "gpu-tp2"):  # colocated; prefill and decode
        params = start_params(chart.render([values_file(name)]))
        assert len(params) >= 2 and all(p["include-log-monitor"] == "false" for p in params.values()), params
    params = start_params(
        chart.render(
            [values_file("minimal")], {"head": {"rayStartParams": {"include-log-monitor": "true", "num-cpus": "0"}}}
        )
    )
    assert params["head"] == {"include-log-monitor": "true", "num-cpus": "0", "dashboard-host": "0.0.0.0"}
