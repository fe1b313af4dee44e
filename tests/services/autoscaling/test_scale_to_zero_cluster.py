"""Scale to zero on a real local Ray cluster (tiny model, real Redis): prefill and decode with
min_replicas 0 under Baton's signal policy, a generous cold-start timeout.

  idle       both roles go to zero replicas, and Redis keeps nothing of the replicas that
             left (registry, load rows, block marks, their own keys)
  cold       the first request after that waits for decode's cold start (prefill stays at
             zero: the prompt is prefilled on decode) and its greedy output equals the
             offline engine's, and the warm run's
"""

from __future__ import annotations

import time

import pytest
from baton.services.client import BatonClient
from baton.services.engine import LLM, SamplingParams
from testlib.baton_client import greedy_request
from testlib.local_baton import grpc_client, local_baton
from testlib.models import tiny_model

from .redis_leftovers import RedisView

pytestmark = pytest.mark.ray

PROMPT = "def scale_to_zero(deployment, idle_s):"
MAX_TOKENS = 24
COLD_START_TIMEOUT_S = 300.0  # a replica's start on 2 shared cores, with room to spare
TO_ZERO_WITHIN_S = 120.0  # last request -> both roles at zero (the down delay and a drain included)


def autoscaling(**extra) -> dict:
    return {
        "min_replicas": 0,
        "max_replicas": 1,
        "upscale_delay_s": 0.5,
        "downscale_delay_s": 2.0,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2.0,
        "policy": {"policy_kwargs": {}},
        **extra,
    }


@pytest.fixture(scope="module")
def deployment():
    overrides = {
        "mode": "disaggregated",
        "engine": {"model": {"max_model_len": 256}, "cache": {"num_kv_blocks": 64}},
        "prefill": {"ray_actor_options": {"num_cpus": 0.25}, "autoscaling": autoscaling()},
        "decode": {
            "ray_actor_options": {"num_cpus": 0.25},
            "autoscaling": autoscaling(cold_start_timeout_s=COLD_START_TIMEOUT_S),
        },
    }
    with local_baton(overrides, grace_period_s=2.0) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def client(deployment):
    with grpc_client(deployment) as client:
        yield client


@pytest.fixture(scope="module")
def offline():
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=64, max_model_len=256)
    (output,) = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    llm.shutdown()
    return output.token_ids


def running(role: str) -> int:
    from ray import serve

    return serve.status().applications["baton"].deployments[role].replica_states.get("RUNNING", 0)


def generate(client: BatonClient) -> tuple[list[int], str, float]:
    start = time.monotonic()
    responses = list(client.generate(greedy_request(PROMPT, MAX_TOKENS), timeout=COLD_START_TIMEOUT_S + 60))
    kv_path = next((r.timings.kv_path for r in responses if r.HasField("timings")), "")
    return [t for r in responses for t in r.token_ids], kv_path, time.monotonic() - start


def wait_for_zero(timeout_s: float) -> float:
    start = time.monotonic()
    while running("prefill") or running("decode"):
        assert time.monotonic() - start < timeout_s, f"not at zero after {timeout_s} s"
        time.sleep(0.25)
    return time.monotonic() - start


def test_idle_roles_go_to_zero_and_the_next_request_waits_for_a_replica(deployment, client, offline):
    warm, _, first_s = generate(client)  # the deployment starts at zero: this is a cold start too
    assert warm == offline
    redis = RedisView(deployment.config.router_config())
    seen = redis.slots()  # every replica that registered: gone after the scale to zero
    assert redis.worker_ids("decode"), "the decode replica that served the request never registered"
    idle_s = wait_for_zero(TO_ZERO_WITHIN_S)
    deadline = time.monotonic() + 10  # a stopping replica deregisters on its way out
    while (left := {w: redis.leftovers(w, slot) for w, slot in seen.items()}) and any(left.values()):
        assert time.monotonic() < deadline, f"Redis still holds entries of replicas that left: {left}"
        time.sleep(0.2)

    cold, kv_path, cold_s = generate(client)
    assert cold == offline == warm
    assert kv_path == "local"  # prefill was at zero: prefilled on decode, not refused
    assert running("decode") == 1
    assert redis.worker_ids("decode") and not set(redis.worker_ids("decode")) & set(seen)  # a new replica, registered
    print(
        f"first request {first_s:.1f} s (from a deployment at zero), both roles at zero {idle_s:.1f} s after it, "
        f"the next request {cold_s:.1f} s (decode's cold start), outputs exact"
    )
