"""`baton serve`'s local start-up: what a local Ray must offer the config."""

from __future__ import annotations

import math

from baton.services.config import load_config
from baton.services.launcher.launcher import local_num_cpus

MODEL = {"engine": {"model": {"model": "/models/m"}}}


def test_a_local_ray_offers_at_least_what_the_config_reserves():
    config = load_config(None, {**MODEL, "colocated": {"num_replicas": 64}})
    assert local_num_cpus(config) == math.ceil(0.25 + 64)
    assert local_num_cpus(load_config(None, MODEL)) >= 2
