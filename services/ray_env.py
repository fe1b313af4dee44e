"""Importing Ray with the settings Baton relies on.

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` must be set before `import ray`: with it Ray binds
loopback only; without it Ray rewrites 127.0.0.1 to the machine's address and a
multi-node local cluster can hang connecting to its own GCS.
"""

from __future__ import annotations

import os

# What Serve's processes read at import: the launcher puts it in the environment of the Ray it
# starts, the chart in every Ray container's (a value already set there wins).
# - A replica runs Baton's code on its own event loop, not on a second loop in a thread of its
#   own: every request, body chunk and token chunk would cross between the two loops, each
#   crossing a wake-up and a GIL hand-off between two threads of one process. Baton's replicas
#   keep blocking work off the loop (the engine's thread, the tokenizer pool; Serve runs sync
#   methods in a thread pool). Worth 1.2-1.3x serving throughput at 16 streams.
# - The controller's loop runs every 0.5 s, not 0.1 s, and replicas export Serve's cached
#   metrics every second, not ten times a second: each wake-up takes a core from the engine's
#   threads on a small machine. Idle `baton serve` uses a fifth less CPU; a replica's failure
#   or an autoscaling decision is acted on up to 0.4 s later, and Ray's metrics are pushed
#   every 2 s anyway (launcher.METRICS_REPORT_INTERVAL_MS).
# Numbers: docs/benchmarks.md.
SERVE_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}

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
