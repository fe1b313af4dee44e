"""Serve's shutdown, without the error Ray reports on every normal stop.

`serve.shutdown()` blocks on `ServeController.graceful_shutdown()`, a call that by design
never returns: the controller shuts the applications and proxies down, then kills itself
while the call is still running. The controller is an actor with infinite task retries, so
the caller's core worker reports the killed call to the driver: "(raylet) Task
ServeController.graceful_shutdown failed. There are infinite retries remaining, so the task
will be retried. Error: The actor is dead because it was killed by `ray.kill`."

Asked with `wait=False`, the same call only sets the controller's shutdown flag and returns;
its control loop then does the same shutdown and exits, with no call of ours in flight. We
wait for its name to go away instead (a named actor is deregistered when it dies).
"""

from __future__ import annotations

import logging
import time

from ..ray_env import import_ray

logger = logging.getLogger(__name__)

POLL_S = 0.1


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """Shuts Serve's controller, proxies and applications down (as `serve.shutdown()` does)."""
    ray = import_ray()
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve.context import _get_global_client, _set_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    client.shutdown_cached_handles()
    ray.get(client._controller.graceful_shutdown.remote(wait=False), timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while _controller_alive(ray, SERVE_CONTROLLER_NAME, SERVE_NAMESPACE):
        if time.monotonic() >= deadline:
            logger.warning("Serve's controller did not stop within %g s; Ray's shutdown stops it", timeout_s)
            break
        time.sleep(POLL_S)
    _set_global_client(None)


def _controller_alive(ray, name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True
