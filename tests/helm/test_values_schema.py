"""Values helm must refuse, and values.schema.json's `config` kept in step with BatonConfig."""

from __future__ import annotations

import json
from typing import Any

import pytest
from baton.services.config import BatonConfig
from testlib.helm_chart import CHART_DIR, HelmChart, values_file

_REFUSED = [
    ({"config": {"prefill": {"num_replicas": "two"}}}, "at '/config/prefill/num_replicas': got string, want integer"),
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"config": {"prefill": {"replicas": 2}}}, "additional properties 'replicas' not allowed"),
    ({"config": {"mode": "split"}}, "at '/config/mode'"),
    ({"workers": {"decode": {"gpus": "8"}}}, "at '/workers/decode/gpus': got string, want integer"),
    ({"head": {"rayStartParams": {"num-cpus": 0}}}, "at '/head/rayStartParams/num-cpus': got number, want string"),
    ({"config": {"decode": {"autoscaling": {"min_replicas": 1}}}}, "missing property 'max_replicas'"),
    (
        {"config": {"gateway": {"autoscaling": {"min_replicas": 0, "max_replicas": 2}}}},
        "at '/config/gateway/autoscaling/min_replicas'",
    ),
    (
        {
            "config": {
                "decode": {
                    "autoscaling": {
                        "min_replicas": 1,
                        "max_replicas": 2,
                        "policy": {"policy_kwargs": {"kv_usage_target": 2}},
                    }
                }
            }
        },
        "at '/config/decode/autoscaling/policy/policy_kwargs/kv_usage_target'",
    ),
    (
        {
            "config": {
                "prefill": {
                    "autoscaling": {"min_replicas": 1, "max_replicas": 2, "policy": {"policy_function": "my:policy"}}
                }
            }
        },
        "at '/config/prefill/autoscaling/policy/policy_function'",
    ),
    ({"config": {"engine": {"cache": {"block_size": 12}}}}, "at '/config/engine/cache/block_size'"),
    ({"config": {"engine": {"model": {"model": ""}}}}, "config.engine.model.model is required"),
    ({"workers": {"prefill": {"gpus": 1}}}, "must both be 0 or both > 0"),
    (
        {
            "config": {"engine": {"parallel": {"tensor_parallel_size": 2}}},
            "workers": {"prefill": {"gpus": 1}, "decode": {"gpus": 1}},
        },
        "workers.prefill.gpus (1) is less than replicasPerPod (1) x tensor_parallel_size (2)",
    ),
    ({"workers": {"decode": {"rayStartParams": {"num-gpus": "1"}}}}, "workers.decode.rayStartParams.num-gpus"),
    ({"redis": {"external": {"url": "redis://r:6379"}}}, "give redis.auth.password or redis.auth.existingSecret"),
    ({"redis": {"external": {"url": "http://r:6379"}}}, "at '/redis/external/url'"),
    ({"fullnameOverride": "1baton"}, "must start with a letter"),
]


@pytest.mark.parametrize(("values", "message"), _REFUSED, ids=[message[:40] for _, message in _REFUSED])
def test_helm_refuses_bad_values(chart: HelmChart, values: dict, message: str):
    error = chart.template_error([values_file("minimal")], values)
    assert message in error, error


def test_lint_strict_fails_on_bad_values(chart: HelmChart):
    done = chart.run(["lint", "--strict"], [values_file("minimal")], [{"config": {"prefill": {"num_replicas": "two"}}}])
    assert done.returncode != 0
    assert "num_replicas" in done.stdout + done.stderr


# BatonConfig fields the chart sets itself, so values.schema.json leaves them out.
# Renamed keys the config still reads (with a warning), so old values files still install.
DEPRECATED_KEYS = {"engine.parallel.worker_timeout_s": "engine.parallel.rank_timeout_s"}
CHART_OWNED = {
    "server.http_host": "0.0.0.0, for Serve's proxies in a pod",
    "server.metrics_port": "baton serve's only: on the Ray pods it is KubeRay's metrics-export-port, 8080",
    "router.redis.url": "from the chart's `redis` section",
    "router.redis.password": "never in the config: a Secret reaches every pod as an env var",
    "router.redis.password_env": "that env var (BATON_REDIS_PASSWORD) when the chart wires a password",
    "engine.kv_transfer.role": "set per deployment by BatonConfig.engine_config",
    "engine.kv_transfer.allow_fault_injection": "a test hook, not for clusters",
}


def test_values_schema_follows_baton_config():
    """Every BatonConfig field (but the chart's own) is in values.schema.json's `config`, with a
    type the model accepts, and nothing else is: a new config field must be added to the chart."""
    values_schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    model_schema = BatonConfig.model_json_schema()
    values_config = _resolve(values_schema, values_schema["properties"]["config"])
    problems = _compare(_Schema(values_schema), values_config, _Schema(model_schema), model_schema, "")
    assert not problems, "values.schema.json `config` vs BatonConfig:\n" + "\n".join(problems)


class _Schema:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def object_branch(self, node: dict[str, Any]) -> dict[str, Any]:
        """The node itself, or its object branch when it is `X | None`."""
        node = _resolve(self.root, node)
        for branch in node.get("anyOf", []):
            branch = _resolve(self.root, branch)
            if "properties" in branch:
                return branch
        return node

    def types(self, node: dict[str, Any]) -> set[str]:
        node = _resolve(self.root, node)
        if "anyOf" in node:
            return set().union(*(self.types(branch) for branch in node["anyOf"]))
        if "enum" in node:
            return {_json_type(value) for value in node["enum"]}
        if "const" in node:
            return {_json_type(node["const"])}
        declared = node.get("type", "object" if "properties" in node else None)
        return set(declared) if isinstance(declared, list) else {declared}


def _compare(values: _Schema, vnode: dict, model: _Schema, mnode: dict, path: str) -> list[str]:
    vnode, mnode = values.object_branch(vnode), model.object_branch(mnode)
    vfields, mfields = vnode.get("properties", {}), mnode.get("properties", {})
    problems = []
    for name in sorted(mfields.keys() - vfields.keys()):
        if f"{path}{name}" not in CHART_OWNED:
            problems.append(f"missing in values.schema.json: config.{path}{name}")
    for name in sorted(vfields.keys() - mfields.keys()):
        if f"{path}{name}" not in DEPRECATED_KEYS:
            problems.append(f"not a BatonConfig field: config.{path}{name}")
    for name in sorted(vfields.keys() & mfields.keys()):
        vchild, mchild = vfields[name], mfields[name]
        if "properties" in model.object_branch(mchild):
            problems += _compare(values, vchild, model, mchild, f"{path}{name}.")
            continue
        vtypes, mtypes = values.types(vchild), model.types(mchild)
        if "number" in mtypes:
            mtypes = mtypes | {"integer"}
        if not vtypes <= mtypes:
            problems.append(
                f"config.{path}{name}: values.schema.json allows {sorted(vtypes)}, BatonConfig {sorted(mtypes)}"
            )
    return problems


def _resolve(root: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        *_, section, name = node["$ref"].split("/")  # "#/definitions/x" or "#/$defs/x"
        node = root[section][name]
    return node


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", type(None): "null"}[type(value)]
