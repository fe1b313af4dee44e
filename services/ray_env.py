"""Importing Ray with the settings Baton relies on.

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` must be set before `import ray`: with it Ray binds
loopback only; without it Ray rewrites 127.0.0.1 to the machine's address and a
multi-node local cluster can hang connecting to its own GCS.
"""

from __future__ import annotations

import os

_DEFAULTS = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def import_ray():
    for key, value in _DEFAULTS.items():
        os.environ.setdefault(key, value)
    import ray

    return ray


def ensure_ray(**init_kwargs):
    """The Ray module, connected to a cluster (a local one is started if none is running)."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, **init_kwargs)
    return ray
