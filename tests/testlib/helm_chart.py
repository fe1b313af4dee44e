"""Rendering the Baton chart (helm/baton) with the real helm binary, for tests/helm.

`HelmChart.render(...)` runs `helm template` and returns the objects it printed, parsed;
`HelmChart.run(...)` returns the finished process (for lint, and for values helm must
refuse). Values come as files (helm/values/*.yaml) and/or dicts written to a temp file.
"""

from __future__ import annotations

import copy
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testlib.helm_binary import REPO_ROOT

CHART_DIR = REPO_ROOT / "helm" / "baton"
VALUES_DIR = REPO_ROOT / "helm" / "values"
# The CRDs are shared data beside the repository (never copied into it).
KUBERAY_CRDS = REPO_ROOT.parent / "shared" / "crds" / "kuberay-v1.7.0"
# The values files `make helm-check` lints, renders and validates (helm/values/<name>.yaml).
VALUES_FILES = ("minimal", "gpu-tp2", "external-redis", "autoscaling", "colocated")
KUBERNETES_VERSION = "1.31.0"
RELEASE = "baton"
NAMESPACE = "llm"
_TIMEOUT_S = 60

Manifest = dict[str, Any]


class HelmFailed(AssertionError):
    pass


@dataclass(frozen=True)
class HelmChart:
    helm: Path
    chart_dir: Path = CHART_DIR

    def run(
        self, command: Sequence[str], values_files: Iterable[Path] = (), overrides: Sequence[dict] = ()
    ) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="baton-values-") as tmp:
            args = [str(self.helm), *command, str(self.chart_dir)]
            if command[0] in ("template", "lint"):  # `install --dry-run` takes the client's own version
                args += ["--kube-version", KUBERNETES_VERSION]
            for path in values_files:
                args += ["-f", str(path)]
            for i, values in enumerate(overrides):
                path = Path(tmp) / f"override-{i}.yaml"
                path.write_text(yaml.safe_dump(values))
                args += ["-f", str(path)]
            return subprocess.run(args, capture_output=True, text=True, timeout=_TIMEOUT_S)

    def render(
        self,
        values_files: Iterable[Path] = (),
        *overrides: dict,
        release: str = RELEASE,
        namespace: str = NAMESPACE,
    ) -> list[Manifest]:
        done = self.run(["template", release, "--namespace", namespace], values_files, overrides)
        if done.returncode != 0:
            raise HelmFailed(f"helm template failed:\n{done.stderr}")
        return [obj for obj in yaml.safe_load_all(done.stdout) if obj]

    def template_error(self, values_files: Iterable[Path] = (), *overrides: dict) -> str:
        """helm's error for values it must refuse (fails the test if helm renders them)."""
        done = self.run(["template", RELEASE, "--namespace", NAMESPACE], values_files, overrides)
        if done.returncode == 0:
            raise AssertionError(f"helm rendered values it should refuse: {overrides}")
        return done.stderr


def values_file(name: str) -> Path:
    return VALUES_DIR / f"{name}.yaml"


def of_kind(objects: list[Manifest], kind: str) -> list[Manifest]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[Manifest], kind: str) -> Manifest:
    (found,) = of_kind(objects, kind)
    return found


def serve_config(objects: list[Manifest]) -> dict[str, Any]:
    """The RayService's serveConfigV2, parsed (KubeRay reads it as YAML text)."""
    return yaml.safe_load(one(objects, "RayService")["spec"]["serveConfigV2"])


def baton_config(objects: list[Manifest]) -> dict[str, Any]:
    """The Baton config in effect: the one handed to the application builder (serveConfigV2
    args.config), with the replica counts and autoscaling Serve's per-deployment options set."""
    (app,) = serve_config(objects)["applications"]
    config = copy.deepcopy(app["args"]["config"])
    for deployment in app.get("deployments", []):
        section = config.setdefault(deployment["name"], {})
        if "autoscaling_config" in deployment:  # over what the args keep of it (Baton's own fields)
            section["autoscaling"] = {**section.get("autoscaling", {}), **deployment["autoscaling_config"]}
        if "num_replicas" in deployment:
            section["num_replicas"] = deployment["num_replicas"]
    return config


def worker_groups(objects: list[Manifest]) -> dict[str, Manifest]:
    cluster = one(objects, "RayService")["spec"]["rayClusterConfig"]
    return {group["groupName"]: group for group in cluster.get("workerGroupSpecs", [])}


def head_group(objects: list[Manifest]) -> Manifest:
    return one(objects, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]


def ray_container(group: Manifest) -> Manifest:
    return group["template"]["spec"]["containers"][0]  # KubeRay runs Ray in container 0
