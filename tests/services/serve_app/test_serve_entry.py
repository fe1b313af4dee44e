"""services/serve_app/serve_entry.py, the import path the chart's serveConfigV2 names: the rendered
args go through Serve's own builder call and app build (no cluster needed), and the
serveConfigV2 deployment overrides apply to the deployments Baton builds."""

from __future__ import annotations

import pydantic
import pytest
import yaml
from baton.services.config import BatonConfig
from baton.services.serve_app.serve_entry import ServeArgs, app, load_serve_config
from testlib.helm_chart import VALUES_FILES, baton_config, serve_config


def _build(spec: dict):
    # What Serve's build task does with an application's import_path and args (Ray 2.60).
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    built = build_app(call_user_app_builder_with_args_if_necessary(app, spec["args"]), name=spec["name"])
    return {deployment.name: deployment for deployment in built.deployments}


@pytest.mark.parametrize("name", VALUES_FILES)
def test_rendered_args_build_the_application(rendered, name: str):
    (spec,) = serve_config(rendered(name))["applications"]
    config = BatonConfig.model_validate(spec["args"]["config"])
    deployments = _build(spec)
    assert sorted(deployments) == sorted(["gateway", *config.roles])
    for deployment in deployments.values():  # a stopping replica's drain budget: the chart's grace period
        assert deployment._deployment_config.graceful_shutdown_timeout_s == spec["args"]["grace_period_s"]
    effective = BatonConfig.model_validate(baton_config(rendered(name)))  # with Serve's per-deployment options
    for override in spec["deployments"]:
        override = dict(override)
        name = override.pop("name")
        # Serve applies these over the code's options; it checks that the replica fits bundle 0.
        deployment = deployments[name].options(**override)
        options = deployment._deployment_config
        section = effective.gateway if name == "gateway" else effective.deployment(name)
        if section.autoscaling is None:
            assert options.num_replicas == section.num_replicas
        else:
            assert options.autoscaling_config.max_replicas == section.autoscaling.max_replicas
        if name != "gateway":
            assert deployment.ray_actor_options["resources"] == {f"baton_{name}": 1.0}


def test_inline_config_is_merged_over_the_file(tmp_path):
    path = tmp_path / "baton.yaml"
    path.write_text(
        yaml.safe_dump({"mode": "colocated", "engine": {"model": {"model": "/models/a", "dtype": "float16"}}})
    )
    config = load_serve_config(ServeArgs(config_path=str(path), config={"engine": {"model": {"model": "/models/b"}}}))
    assert (config.mode, config.engine.model.model, config.engine.model.dtype) == ("colocated", "/models/b", "float16")


def test_args_need_a_config():
    with pytest.raises(ValueError, match="need `config`"):
        load_serve_config(ServeArgs())


def test_invalid_configs_name_the_field():
    with pytest.raises(ValueError, match="num_replicas"):
        load_serve_config(ServeArgs(config={"engine": {"model": {"model": "/m"}}, "decode": {"num_replicas": 0}}))


def test_unknown_args_are_refused():
    with pytest.raises(pydantic.ValidationError, match="redis_password"):
        ServeArgs.model_validate({"config": {}, "redis_password": "x"})


def test_replica_choice_is_what_runs():
    from baton.services.config import load_config
    from baton.services.serve_app.builder import replica_choice

    redis = {"router": {"redis": {"url": "redis://127.0.0.1:1"}}}
    assert replica_choice(load_config(None, {"engine": {"model": {"model": "/m"}}, **redis})) == "prefix_aware"
    # Without Redis the prefix-aware router cannot run: Serve's own choice does.
    assert replica_choice(load_config(None, {"engine": {"model": {"model": "/m"}}})) == "power_of_two"
    config = load_config(None, {"engine": {"model": {"model": "/m"}}, "router": {"placement": "round_robin"}})
    assert replica_choice(config) == "round_robin"
