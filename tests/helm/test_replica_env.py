"""The Serve settings its processes read at import (services/ray_env.py) reach every
Ray container, and a value the operator sets in `extraEnv` wins."""

from __future__ import annotations

from baton.services.ray_env import SERVE_ENV
from testlib.helm_chart import HelmChart, head_group, ray_container, values_file, worker_groups


def _effective_env(container: dict) -> dict[str, str]:
    """What the container's process sees: Kubernetes applies the list in order, a later entry
    of the same name replacing an earlier one."""
    return {entry["name"]: entry.get("value") for entry in container["env"]}


def test_every_ray_container_has_serve_env(rendered):
    objects = rendered("minimal")
    for group in [head_group(objects), *worker_groups(objects).values()]:
        env = _effective_env(ray_container(group))
        assert SERVE_ENV.items() <= env.items(), env


def test_extra_env_overrides_it(chart: HelmChart):
    extra = [{"name": name, "value": "operator's"} for name in SERVE_ENV]
    objects = chart.render([values_file("minimal")], {"extraEnv": extra})
    for group in [head_group(objects), *worker_groups(objects).values()]:
        env = _effective_env(ray_container(group))
        assert all(env[name] == "operator's" for name in SERVE_ENV), env
