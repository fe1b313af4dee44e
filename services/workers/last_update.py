"""The fleet's last update from disk, where an engine replica that starts later finds it.

A replica Serve adds after an update (a replacement, autoscaling) would otherwise serve the
weights it was deployed with, as version "0". Once every replica has committed an update,
the gateway has each one record it (gateway/weight_admin.py); a replica that starts later
replays it before its constructor returns, so before Serve routes it a request:

    key    baton/<application>/<startup model>   (another model's replicas never read it)
    value  {"path": DIR | null, "weight_version": V}

A trainer's update cannot be replayed (its tensors are gone): it records a null path, and a
replica that starts after it logs that it serves its startup weights as "0" (so do the
outputs), until the next update. A folder that cannot be loaded any more (deleted since)
is logged the same way. The record lives in Ray's cluster-wide key-value store (the GCS),
so it outlives every replica, and goes with the cluster. Outside a Serve replica (tests,
`LLM`) nothing is recorded or replayed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

_NAMESPACE = "baton"


def record(model: str, path: str | None, weight_version: str) -> bool:
    """Records the update every replica of this fleet committed; False outside Serve."""
    key = _key(model)
    if key is None:
        return False
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(
        key, json.dumps({"path": path, "weight_version": weight_version}), namespace=_NAMESPACE
    )
    return True


def replay(llm: Any, model: str) -> str | None:
    """Loads the recorded update into `llm` (an AsyncLLM, idle, just built) and returns its
    version; None when there is none to replay. Blocks: it runs from a constructor."""
    key = _key(model)
    if key is None:
        return None
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(key, namespace=_NAMESPACE)
    if raw is None:
        return None
    recorded = json.loads(raw)
    path, version = recorded["path"], recorded["weight_version"]
    if path is None:
        logger.warning(
            "the fleet is on weight version %r, pushed by a trainer: this replica cannot load it and "
            'serves its startup weights as version "0" until the next update',
            version,
        )
        return None
    # Serve runs a constructor on its event loop's thread, so the update gets a loop of its own.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(asyncio.run, llm.update_weights_from_disk(path, version)).result()
        except Exception as error:
            logger.error(
                "the fleet is on weight version %r from %s, which this replica cannot load (%s): it serves its "
                'startup weights as version "0" until the next update',
                version,
                path,
                error,
            )
            return None


def _key(model: str) -> str | None:
    try:
        from ray import serve

        application = serve.get_replica_context().app_name
    except Exception:  # not inside a Serve replica
        return None
    return f"baton/{application}/{model}"
