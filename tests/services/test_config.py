"""The service config: the shipped YAML files load, and the CPUs they reserve."""

from __future__ import annotations

from pathlib import Path

import pytest
from baton.services.config import load_config
from baton.services.roles import Role

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
MODEL = {"engine": {"model": {"model": "/models/m"}}}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    config = load_config(path, MODEL)
    assert config.roles


def test_the_default_is_disaggregated_with_the_prefix_aware_router():
    config = load_config(Path(__file__).parents[2] / "configs" / "local.yaml", MODEL)
    assert config.mode == "disaggregated" and config.router.placement == "prefix_aware"


def test_cpus_requested_count_replicas_autoscaling_maxima_and_tp_ranks():
    config = load_config(
        None,
        {
            **MODEL,
            "mode": "disaggregated",
            "gateway": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}},
            "prefill": {"autoscaling": {"min_replicas": 1, "max_replicas": 3}, "ray_actor_options": {"num_cpus": 1}},
            "decode": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
        },
    )
    assert config.num_cpus_requested() == pytest.approx(0.5 + 3 * 1 + 2 * 0.5)
    tp = load_config(None, {**MODEL, "engine": {**MODEL["engine"], "parallel": {"tensor_parallel_size": 2}}})
    assert tp.num_cpus_requested() == pytest.approx(0.25 + 1 + 2)  # the replica, and one CPU per rank


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_each_deployment_hands_its_role_to_the_kv_transfer(mode):
    config = load_config(None, {**MODEL, "mode": mode})
    assert config.roles == ((Role.COLOCATED,) if mode == "colocated" else (Role.PREFILL, Role.DECODE))
    for role in config.roles:
        assert config.engine_config(role).kv_transfer.role is role


@pytest.mark.parametrize(("section", "field"), [("model", "dtype"), ("cache", "kv_cache_dtype")])
def test_a_role_may_not_change_what_the_kv_handover_copies(section, field):
    """The handover copies raw cache bytes: both roles' caches must hold one dtype."""
    value = {field: "bfloat16"}
    overrides = {"decode": {"engine_overrides": {section: value}}}
    with pytest.raises(ValueError, match=f"decode.engine_overrides must not change {field}:"):
        load_config(None, {**MODEL, "mode": "disaggregated", **overrides})
    engine = {**MODEL["engine"], section: {**MODEL["engine"].get(section, {}), **value}}
    assert load_config(None, {"engine": engine, "mode": "disaggregated"}).engine_config(Role.DECODE)
