"""What the chart tells Ray Serve and Baton: serveConfigV2 against Serve's own schema and
Baton's config model, and the worker groups that carry each engine role."""

from __future__ import annotations

import math

import pytest
import yaml
from baton.services.config import BatonConfig, load_config
from baton.services.launcher.launcher import GRPC_SERVICERS
from testlib.helm_chart import (
    VALUES_FILES,
    baton_config,
    head_group,
    of_kind,
    one,
    ray_container,
    serve_config,
    values_file,
    worker_groups,
)


@pytest.mark.parametrize("name", VALUES_FILES)
def test_serve_config_is_valid_for_serve_and_baton(rendered, name: str, tmp_path):
    from ray.serve.schema import ServeDeploySchema

    objects = rendered(name)
    serve = serve_config(objects)
    ServeDeploySchema.model_validate(serve)  # what KubeRay hands to Serve's REST API
    (app,) = serve["applications"]
    assert app["import_path"] == "baton.services.serve_app.serve_entry:app"
    assert serve["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICERS
    assert serve["http_options"]["host"] == "0.0.0.0"

    config = BatonConfig.model_validate(baton_config(objects))
    assert config.server.http_host == "0.0.0.0"
    assert serve["http_options"]["port"] == config.server.http_port
    assert serve["grpc_options"]["port"] == config.server.grpc_port
    # The ConfigMap holds the same config, and it loads like configs/*.yaml.
    path = tmp_path / "baton.yaml"
    path.write_text(one(objects, "ConfigMap")["data"]["baton.yaml"])
    assert load_config(path) == config
    assert yaml.safe_load(path.read_text()) == baton_config(objects)


def test_changing_replica_counts_keeps_the_code_version(chart):
    """Serve restarts every replica of an application whose code version (a hash of its
    args) changes; replica counts and autoscaling live outside the args, so a `helm upgrade`
    that only scales adds or drains replicas of that deployment."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    def code_version(*overrides: dict) -> str:
        (app,) = serve_config(chart.render([values_file("minimal")], *overrides))["applications"]
        return get_app_code_version(ServeApplicationSchema.model_validate(app))

    base = code_version()
    scaled = {"config": {"decode": {"num_replicas": 3}, "prefill": {"num_replicas": 2}, "gateway": {"num_replicas": 2}}}
    assert code_version(scaled) == base

    def autoscaled(max_replicas: int) -> dict:
        return {"config": {"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": max_replicas}}}}

    # Turning autoscaling on is a code change to Serve (its policy is hashed); new bounds are not.
    assert code_version(autoscaled(4)) == code_version(autoscaled(8))
    assert code_version({"config": {"decode": {"max_waiting_requests": 64}}}) != base  # a real change still is one


@pytest.mark.parametrize("name", VALUES_FILES)
def test_each_engine_role_is_pinned_to_its_worker_group(rendered, name: str):
    objects = rendered(name)
    config = BatonConfig.model_validate(baton_config(objects))
    groups = worker_groups(objects)
    assert sorted(groups) == sorted(config.roles)
    for role in config.roles:
        pin = f"baton_{role}"
        assert config.deployment(role).ray_actor_options.resources[pin] == 1
        assert list(groups[role]["resources"]) == [pin]  # no other group offers it
        assert "resources" not in head_group(objects)


def test_gpu_tp2_puts_gpus_on_the_worker_groups_only(rendered):
    objects = rendered("gpu-tp2")
    config = BatonConfig.model_validate(baton_config(objects))
    assert config.engine_config("prefill").parallel.tensor_parallel_size == 2
    assert "nvidia.com/gpu" not in str(ray_container(head_group(objects))["resources"])
    for role, group in worker_groups(objects).items():
        resources = ray_container(group)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 8
        assert resources["limits"]["rdma/rdma_shared_device_a"] == 1
        assert group["template"]["spec"]["hostNetwork"] is True
        assert ray_container(group)["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        section = config.deployment(role)
        assert section.ray_actor_options.num_gpus == 0  # the TP ranks take the GPUs, not the replica
        assert group["replicas"] == math.ceil(section.num_replicas / 4)  # 4 replicas (8 GPUs / TP 2) a pod
        assert group["resources"] == {f"baton_{role}": "4"}


def test_tensor_parallel_roles_reserve_their_ranks_with_the_replica(rendered):
    """Serve reserves a placement group per replica: bundle 0 holds the replica and rank 0,
    bundle i rank i; the engine's TP executor reuses it (tp_executor.py)."""
    (app,) = serve_config(rendered("gpu-tp2"))["applications"]
    by_name = {d["name"]: d for d in app["deployments"] if "placement_group_bundles" in d}
    assert sorted(by_name) == ["decode", "prefill"]
    for role, deployment in by_name.items():
        assert deployment["placement_group_strategy"] == "STRICT_PACK"
        assert deployment["placement_group_bundles"] == [
            {"CPU": 2, "GPU": 1, f"baton_{role}": 1},
            {"CPU": 1, "GPU": 1},
        ]


def test_single_gpu_replicas_ask_for_their_gpu(rendered):
    objects = rendered("colocated")
    config = BatonConfig.model_validate(baton_config(objects))
    assert config.colocated.ray_actor_options.num_gpus == 1
    (app,) = serve_config(objects)["applications"]
    assert not any("placement_group_bundles" in d for d in app["deployments"])  # none without tensor parallelism
    assert ray_container(worker_groups(objects)["colocated"])["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_in_chart_redis_is_wired_through_a_secret(rendered):
    objects = rendered("minimal")
    config = BatonConfig.model_validate(baton_config(objects))
    service = [s for s in of_kind(objects, "Service") if s["metadata"]["name"] == "baton-redis"]
    assert config.router.redis is not None and config.router.redis.password is None
    assert config.router.redis.password_env == "BATON_REDIS_PASSWORD"
    assert config.router.redis.url == "redis://baton-redis.llm.svc:6379"
    assert service and service[0]["spec"]["ports"][0]["port"] == 6379
    secret = one(objects, "Secret")
    assert secret["metadata"]["name"] == "baton-redis" and len(secret["data"]["redis-password"]) >= 40
    (app,) = serve_config(objects)["applications"]
    assert app["args"].keys() == {"config", "grace_period_s"}
    expected = {
        "name": "BATON_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "baton-redis", "key": "redis-password"}},
    }
    for group in [head_group(objects), *worker_groups(objects).values()]:  # Serve builds the app on any node
        assert expected in ray_container(group)["env"]
    redis = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "--save" in redis["args"]  # persistence off by default
    assert "volumeClaimTemplates" not in one(objects, "StatefulSet")["spec"]


def test_user_supplied_redis_password_goes_into_the_secret(chart):
    objects = chart.render([values_file("minimal")], {"redis": {"auth": {"password": "s3cret"}}})
    assert one(objects, "Secret")["data"]["redis-password"] == "czNjcmV0"  # base64


def test_external_redis_renders_no_redis(rendered):
    objects = rendered("external-redis")
    assert not of_kind(objects, "StatefulSet") and not of_kind(objects, "Secret")
    assert not [s for s in of_kind(objects, "Service") if "redis" in s["metadata"]["name"]]
    config = BatonConfig.model_validate(baton_config(objects))
    assert config.router.redis.url == "rediss://redis.cache.svc:6380"
    assert (config.router.redis.db, config.router.redis.key_prefix) == (2, "baton-prod")
    assert config.router.redis.password_env == "BATON_REDIS_PASSWORD"
    secret = {"secretKeyRef": {"name": "baton-redis", "key": "password"}}
    assert {"name": "BATON_REDIS_PASSWORD", "valueFrom": secret} in ray_container(head_group(objects))["env"]


def test_redis_without_auth_reads_no_password(chart):
    objects = chart.render([values_file("minimal")], {"redis": {"auth": {"enabled": False}}})
    assert BatonConfig.model_validate(baton_config(objects)).router.redis.password_env is None
    assert not of_kind(objects, "Secret")
    redis = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" not in redis["args"] and "env" not in redis


def test_no_redis_leaves_the_router_without_one(rendered):
    objects = rendered("colocated")
    assert BatonConfig.model_validate(baton_config(objects)).router.redis is None
    assert not of_kind(objects, "StatefulSet") and not of_kind(objects, "Secret")
    assert all(e["name"] != "BATON_REDIS_PASSWORD" for e in ray_container(head_group(objects)).get("env", []))


def test_autoscaling_sizes_worker_groups_from_replica_bounds(rendered):
    objects = rendered("autoscaling")
    cluster = one(objects, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    config = BatonConfig.model_validate(baton_config(objects))
    groups = worker_groups(objects)
    for role in ("prefill", "decode"):
        bounds = config.deployment(role).autoscaling
        group = groups[role]
        assert (group["minReplicas"], group["maxReplicas"]) == (
            math.ceil(bounds.min_replicas / 2),
            math.ceil(bounds.max_replicas / 2),
        )
        assert group["replicas"] == group["minReplicas"]
    assert config.gateway.autoscaling.max_replicas == 4 and config.gateway.autoscaling.policy is None


def test_signal_autoscaling_reaches_serve_as_its_policy(rendered):
    """The engine roles' `autoscaling.policy` goes to Serve's per-deployment options (not the
    args) with its policy_function filled in, and Serve builds Baton's policy from it."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

    objects = rendered("autoscaling")
    (app,) = serve_config(objects)["applications"]
    options = {d["name"]: d for d in app["deployments"]}
    assert "autoscaling" not in app["args"]["config"]["prefill"]
    for role, knob, value in (("prefill", "ttft_target_s", 1.0), ("decode", "kv_usage_target", 0.7)):
        serve = ServeAutoscalingConfig(**options[role]["autoscaling_config"])
        assert serve.policy.policy_function == "baton.services.autoscaling.policy:BatonAutoscalingPolicy"
        policy = _resolve_policy_callable(serve.policy)  # what Serve's controller runs
        assert getattr(policy.knobs, knob) == value and policy.knobs.max_prefill_decode_ratio == 1.5
    config = BatonConfig.model_validate(baton_config(objects))
    assert config.prefill.autoscaling.policy.policy_kwargs.ttft_target_s == 1.0
    assert config.decode.autoscaling.policy.policy_kwargs.tpot_target_s == 0.05
    assert "policy" not in options["gateway"]["autoscaling_config"]


def test_a_role_scaled_to_zero_tells_the_gateway_to_wait_for_it(rendered):
    """Serve gets the bounds without Baton's cold-start timeout (it refuses unknown fields);
    the args keep the wait, so the gateway waits for decode's cold start instead of a 503."""
    from baton.services.autoscaling.scale_to_zero import cold_start_waits
    from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

    objects = rendered("autoscaling")
    (app,) = serve_config(objects)["applications"]
    options = {d["name"]: d for d in app["deployments"]}
    serve = ServeAutoscalingConfig(**options["decode"]["autoscaling_config"])
    assert (serve.min_replicas, serve.max_replicas) == (0, 8)
    assert "cold_start_timeout_s" not in options["decode"]["autoscaling_config"]
    assert cold_start_waits(BatonConfig.model_validate(app["args"]["config"])) == {"decode": 300.0}
    assert "autoscaling" not in app["args"]["config"]["prefill"]  # prefill at zero runs on decode: nothing to wait for


def test_fixed_replicas_keep_the_autoscaler_off(rendered):
    cluster = one(rendered("minimal"), "RayService")["spec"]["rayClusterConfig"]
    assert "enableInTreeAutoscaling" not in cluster
    for group in cluster["workerGroupSpecs"]:
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1


def test_request_timeout_reaches_both_proxies(chart):
    objects = chart.render([values_file("minimal")], {"config": {"server": {"request_timeout_s": 300}}})
    serve = serve_config(objects)
    assert serve["http_options"]["request_timeout_s"] == serve["grpc_options"]["request_timeout_s"] == 300


@pytest.mark.parametrize("name", VALUES_FILES)
def test_worker_pods_hold_the_replicas_they_offer_room_for(rendered, name: str):
    """replicasPerPod replicas (each with its TP ranks) fit in one pod's CPUs and GPUs."""
    objects = rendered(name)
    config = BatonConfig.model_validate(baton_config(objects))
    for role, group in worker_groups(objects).items():
        per_pod = int(group["resources"][f"baton_{role}"])
        tp = config.engine_config(role).parallel.tensor_parallel_size
        options = config.deployment(role).ray_actor_options
        limits = ray_container(group)["resources"]["limits"]
        ranks = tp if tp > 1 else 0  # TP ranks are actors of their own, a CPU and a GPU each
        assert per_pod * (options.num_cpus + ranks) <= _cpus(limits["cpu"])
        assert per_pod * (ranks or options.num_gpus) <= limits.get("nvidia.com/gpu", 0)


def _cpus(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)
