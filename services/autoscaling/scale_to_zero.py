"""Scale to zero: which engine roles may be at zero replicas by design, and what a request
for one does then.

    role at zero     the first request after it
    prefill          runs whole on a decode replica (disaggregation/client.py): prompts are
                     prefilled on the decode side; the prefill policy brings a replica back
                     when prompts queue there (policy.py)
    decode           waits in the gateway, its call queued in Serve's handle (that queued call
    colocated        is the demand Serve's controller starts a replica for), up to the role's
                     autoscaling.cold_start_timeout_s; then 503 with Retry-After
    gateway          never (config.py refuses min_replicas 0): it is where requests wait

How Serve 2.60 starts a replica for a deployment at zero (its source, pinned by
tests/services/autoscaling/test_scale_to_zero.py): a handle's router counts a call waiting
for a replica as queued and, with zero replicas, pushes its metrics to the controller at
once (`Router.wrap_queued_request`); the controller's `total_num_requests` sums those queued
series with the running ones; and its wrapper around every custom policy answers 1 without
the upscale delay while the deployment is at zero with requests counted
(`_get_cold_start_scale_up_replicas`). Baton's policy says the same (its demand rule), and
keeps a replica while requests are counted, so a call the gateway has withdrawn must not
stay queued: a refused or timed-out call is cancelled.

The gateway learns the waits from the config when it is built (serve_app/builder.py hands
`cold_start_waits` to it, and it registers them, in its own process, with
router/live_replicas.py, which engine_client.guarded reads).
"""

from __future__ import annotations

from typing import Any

from ..roles import Role


def cold_start_waits(config: Any) -> dict[str, float]:
    """Role -> seconds a request waits for it at zero replicas, for the roles whose autoscaling
    allows zero (prefill is not among them: a decode replica takes its prompts)."""
    waits: dict[str, float] = {}
    for role in config.roles:
        scaling = config.deployment(role).autoscaling
        if role != Role.PREFILL and scaling is not None and scaling.scales_to_zero:
            waits[role.value] = scaling.cold_start_timeout_s
    return waits
