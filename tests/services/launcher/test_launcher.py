"""`baton serve`'s local start-up: what a local Ray must offer the config."""

from __future__ import annotations

import math

from baton.services.config import load_config
from baton.services.launcher.launcher import DEFAULT_CONFIG, default_config_path, local_num_cpus, resolve_config

MODEL = {"engine": {"model": {"model": "/models/m"}}}


def test_a_local_ray_offers_at_least_what_the_config_reserves():
    config = load_config(None, {**MODEL, "colocated": {"num_replicas": 64}})
    assert local_num_cpus(config) == math.ceil(0.25 + 64)
    assert local_num_cpus(load_config(None, MODEL)) >= 2


def test_a_model_set_by_override_is_used_and_no_tiny_model_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_HOME", str(tmp_path / "home"))
    config = resolve_config(None, None, {"engine": {"model": {"model": "/models/m"}}, "server": {"http_port": 8001}})
    assert (config.engine.model.model, config.server.http_port) == ("/models/m", 8001)
    assert not (tmp_path / "home").exists()


def test_the_default_config_is_baton_config_when_set(tmp_path, monkeypatch):
    path = tmp_path / "baton.yaml"
    path.write_text("name: mine\nengine: {model: {model: /models/m}}\n")
    monkeypatch.setenv("BATON_CONFIG", str(path))
    assert default_config_path() == path
    assert resolve_config(None, None).name == "mine"
    monkeypatch.delenv("BATON_CONFIG")
    assert default_config_path() == DEFAULT_CONFIG
