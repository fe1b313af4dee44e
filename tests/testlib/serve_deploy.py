"""Deploying Baton the way KubeRay and `serve deploy` do: a Serve config naming the builder
(baton.services.serve_app.serve_entry:app) with the Baton config in its args, and per-
deployment options beside it. Serve then treats a change of replica counts alone as a
lightweight update (the same code version): only that deployment's replicas come or drain."""

from __future__ import annotations

import json
import time

from baton.services.config import BatonConfig


def deploy_from_config(
    config: BatonConfig, replicas: dict[str, int], grace_period_s: float | None = None, timeout_s: float = 120
) -> None:
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    args: dict = {"config": json.loads(config.model_dump_json())}
    if grace_period_s is not None:
        args["grace_period_s"] = grace_period_s
    app = ServeApplicationSchema.model_validate(
        {
            "name": config.name,
            "import_path": "baton.services.serve_app.serve_entry:app",
            "route_prefix": "/",
            "args": args,
            "deployments": [{"name": role, "num_replicas": n} for role, n in replicas.items()],
        }
    )
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema(applications=[app]))  # Serve's proxies keep their options
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_serve_status(config.name).app_status.status
        if status == "RUNNING":
            return
        assert status not in ("DEPLOY_FAILED", "UNHEALTHY") and time.monotonic() < deadline, status
        time.sleep(0.5)
