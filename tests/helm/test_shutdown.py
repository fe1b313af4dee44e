"""Stopping a Ray pod: the preStop wait, the drain budget (Ray's node drain and every Serve
deployment's graceful_shutdown_timeout_s) and Kubernetes' termination grace come from one
`shutdown` section and add up."""

from __future__ import annotations

from testlib.helm_chart import HelmChart, head_group, ray_container, serve_config, values_file, worker_groups


def _ray_pods(objects):
    return [head_group(objects), *worker_groups(objects).values()]


def test_every_ray_pod_waits_then_drains_within_its_termination_grace(rendered):
    objects = rendered("minimal")
    for group in _ray_pods(objects):
        container = ray_container(group)
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] == 5 + 20 + 10
        assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
        assert {"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": "20"} in container["env"]
    (app,) = serve_config(objects)["applications"]
    assert app["args"]["grace_period_s"] == 20


def test_the_grace_period_is_set_in_one_place(chart: HelmChart):
    shutdown = {"gracePeriodSeconds": 45, "preStopSeconds": 0, "teardownSeconds": 15}
    objects = chart.render([values_file("minimal")], {"shutdown": shutdown})
    for group in _ray_pods(objects):
        container = ray_container(group)
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] == 60
        assert "lifecycle" not in container  # Kubernetes 1.31 refuses a zero-second sleep
        assert {"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": "45"} in container["env"]
    (app,) = serve_config(objects)["applications"]
    assert app["args"]["grace_period_s"] == 45
