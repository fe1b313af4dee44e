"""A running Baton (real local Ray cluster, real Redis, tiny model), once per test module."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from baton.services.launcher.launcher import LocalDeployment, resolve_config
from testlib.models import tiny_model

pytestmark = pytest.mark.ray

MAX_WAITING = 40


@pytest.fixture(scope="module")
def baton_app():
    model = tiny_model("llama")
    config = resolve_config(
        None,
        str(model),
        {
            "mode": "colocated",
            "server": {"http_port": 0, "grpc_port": 0},
            "engine": {
                "model": {"max_model_len": 256},
                "cache": {"num_kv_blocks": 128},
                "scheduler": {"max_num_seqs": 16},
            },
            "colocated": {"max_waiting_requests": MAX_WAITING, "ray_actor_options": {"num_cpus": 1}},
        },
    )
    run_dir = Path(tempfile.mkdtemp(prefix="baton-", dir="/tmp"))
    with LocalDeployment(config, run_dir, num_cpus=4) as deployment:
        yield deployment
