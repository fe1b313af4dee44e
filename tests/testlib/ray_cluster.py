"""A local Ray cluster for tests: loopback only, its own temp dir, stopped at the end."""

from __future__ import annotations

import contextlib
import tempfile

from baton.services.ray_env import import_ray


@contextlib.contextmanager
def local_ray(num_cpus: int = 4):
    ray = import_ray()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
