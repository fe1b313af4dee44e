"""A Baton deployment for Ray tests: the tiny model, free ports, a local Ray cluster and the
local Redis that LocalDeployment starts; everything stopped at the end."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from baton.services.client import BatonClient
from baton.services.launcher.launcher import LocalDeployment, resolve_config

from testlib.models import tiny_model
from testlib.ray_cluster import local_ray


def tiny_config(overrides: dict[str, Any]):
    """The tiny llama's config with `overrides` merged over it, on free ports."""
    return resolve_config(None, str(tiny_model("llama")), {"server": {"http_port": 0, "grpc_port": 0}, **overrides})


@contextlib.contextmanager
def local_baton(overrides: dict[str, Any], num_cpus: int = 4, **deployment: Any) -> Iterator[LocalDeployment]:
    """`tiny_config(overrides)` deployed on a Ray cluster of its own (`deployment`: more
    LocalDeployment fields, e.g. grace_period_s)."""
    with local_ray(num_cpus=num_cpus):
        run_dir = Path(tempfile.mkdtemp(prefix="baton-", dir="/tmp"))
        started = LocalDeployment(tiny_config(overrides), run_dir, **deployment).start()
        try:
            yield started
        finally:
            started.stop()


@contextlib.contextmanager
def grpc_client(deployment: LocalDeployment) -> Iterator[BatonClient]:
    client = BatonClient(deployment.grpc_address)
    try:
        yield client
    finally:
        client.close()
