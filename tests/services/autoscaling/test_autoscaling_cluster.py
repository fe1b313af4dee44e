"""Baton's signal policy on a real local Ray cluster: prefill and decode autoscale (1..2
replicas, a quarter CPU each) on what their replicas report, the tiny model, a real Redis.

  prefill  a burst of long prompts (one token each, so decode never sees them) scales prefill
           to 2 while decode stays at 1; after the burst and the down delay it is back to 1
  decode   long streams over a small decode KV cache push KV usage over its target (and
           preempt): decode scales to 2 while prefill stays at 1; then a light load lets it
           scale down with streams in flight on it: none fails, every greedy output equals
           the offline engine's, and the replicas left have every block back
  after each scale-down, Redis holds nothing of the replica that left (load row, registry,
  block marks in its slot, its own keys)
"""

from __future__ import annotations

import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from baton.services.client import BatonClient
from baton.services.engine import LLM, SamplingParams
from baton.services.launcher.launcher import LocalDeployment, resolve_config
from testlib.baton_client import greedy_request
from testlib.models import tiny_model

from .redis_leftovers import RedisView

pytestmark = pytest.mark.ray

SCALE_UP_WITHIN_S = 90.0  # load start -> a second replica RUNNING (its start competes with the load for 2 cores)
SCALE_DOWN_WITHIN_S = 60.0  # load end -> back to one replica (the down delay included)
DOWN_DELAY_S = 3.0
LONG_PROMPTS = [f"Burst {i}: " + "the with statement wraps a block of code in a context. " * 30 for i in range(16)]
STREAM_PROMPTS = [f"def handler_{i}(request, context):" for i in range(8)]
HEAVY_TOKENS = 400  # 8 of these need ~3x the decode replica's KV cache
LIGHT_TOKENS = 120


def autoscaling(**knobs) -> dict:
    return {
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 0.5,
        "downscale_delay_s": DOWN_DELAY_S,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2.0,
        "policy": {"policy_kwargs": knobs},
    }


def config():
    return resolve_config(
        None,
        str(tiny_model("llama")),
        {
            "mode": "disaggregated",
            "server": {"http_port": 0, "grpc_port": 0},
            "engine": {
                "model": {"max_model_len": 512},
                "cache": {"num_kv_blocks": 256},
                "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 32},  # long prompts take many steps
                "kv_transfer": {"timeout_s": 2.0, "lease_s": 5.0},
            },
            "prefill": {
                "ray_actor_options": {"num_cpus": 0.25},
                # a second replica once the queued prompts are ~20 ms of the replica's measured
                # prefill work: the burst's queue holds several times that on any CPU. At 0.1 s a
                # fast one (a Zen 4, ~1,300 tokens queued) sat at the threshold, and the policy
                # asked for 2, then 1, then 2 (each second replica stopped while it started)
                "autoscaling": autoscaling(ttft_target_s=0.02, prefill_tokens_per_s=2000.0),
            },
            "decode": {
                "ray_actor_options": {"num_cpus": 0.25},
                "engine_overrides": {"cache": {"num_kv_blocks": 64}},  # 1024 tokens: 8 heavy streams overflow it
                "autoscaling": autoscaling(kv_usage_target=0.8),
            },
        },
    )


@pytest.fixture(scope="module")
def deployment():
    run_dir = Path(tempfile.mkdtemp(prefix="baton-", dir="/tmp"))
    deployment = LocalDeployment(config(), run_dir, num_cpus=4, grace_period_s=2.0).start()
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def client(deployment):
    client = BatonClient(deployment.grpc_address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def offline():
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=256, max_model_len=512)
    expected = {}
    for max_tokens in (HEAVY_TOKENS, LIGHT_TOKENS):
        outputs = llm.generate(STREAM_PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        expected |= {(p, max_tokens): o.token_ids for p, o in zip(STREAM_PROMPTS, outputs)}
    llm.shutdown()
    return expected


class Replicas:
    """Samples the RUNNING replicas of both roles every 0.25 s (Serve's status)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (time, prefill, decode)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ray import serve

        while not self._stop.wait(0.25):
            deployments = serve.status().applications["baton"].deployments
            counts = [deployments[role].replica_states.get("RUNNING", 0) for role in ("prefill", "decode")]
            self.samples.append((time.monotonic(), *counts))

    def now(self, role: str) -> int:
        return self.samples[-1][1 if role == "prefill" else 2] if self.samples else 1

    def max_since(self, role: str, since: float) -> int:
        return max(s[1 if role == "prefill" else 2] for s in self.samples if s[0] >= since)

    def wait(self, role: str, count: int, timeout_s: float) -> float:
        start = time.monotonic()
        while self.now(role) != count:
            assert time.monotonic() - start < timeout_s, f"{role} not at {count} replicas in {timeout_s} s"
            time.sleep(0.1)
        return time.monotonic() - start

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def replicas(deployment):
    sampler = Replicas()
    yield sampler
    sampler.stop()


class Load:
    """`concurrency` client threads sending `make()` requests back to back until stopped."""

    def __init__(self, client: BatonClient, concurrency: int, make) -> None:
        self.results: list[tuple[object, list[int]]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(concurrency)
        self._futures = [self._pool.submit(self._run, client, make, i) for i in range(concurrency)]

    def _run(self, client: BatonClient, make, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            key, request = make(worker, n)
            n += 1
            try:
                tokens = [t for r in client.generate(request, timeout=120) for t in r.token_ids]
                self.results.append((key, tokens))
            except BaseException as error:  # noqa: BLE001 - reported by the test
                self.errors.append(error)

    def stop(self) -> None:
        self._stop.set()
        for future in self._futures:
            future.result(timeout=180)
        self._pool.shutdown()


def gauge(metrics_address: str, name: str, **labels: str) -> float:
    """The largest value of gauge `name` (Ray's `ray_` prefix added) over the series with `labels`."""
    values = [0.0]
    for line in httpx.get(metrics_address, timeout=10).text.splitlines():
        match = re.match(rf"ray_{name}\{{(.*)\}} ([0-9.e+-]+)$", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            values.append(float(match.group(2)))
    return max(values)


def wait_for_gauge(metrics_address: str, name: str, at_least: float, timeout_s: float = 20, **labels) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := gauge(metrics_address, name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def wait_for_router_workers(deployment, role: str, count: int, timeout_s: float = 5.0) -> None:
    """The prefix router's view (Redis registry): a replica that left deregistered as it
    stopped, well before its heartbeat would lapse."""
    from baton.services.router.router import PrefixRouter

    router = PrefixRouter.from_config(deployment.config.router_config())
    deadline = time.monotonic() + timeout_s
    while True:
        if role == "prefill":
            ranked = router.route_prefill_hashes("probe", 8, [], record=False).ranked
        else:
            ranked = router.route_decode("probe", 8, record=False).ranked
        if len(ranked) == count:
            return
        assert time.monotonic() < deadline, f"the router still ranks {len(ranked)} {role} workers"
        time.sleep(0.1)


def registered(deployment, role: str, count: int, timeout_s: float = 10.0) -> dict[str, int]:
    """The `count` replicas of `role` in the router's registry: worker id -> slot."""
    redis = RedisView(deployment.config.router_config())
    deadline = time.monotonic() + timeout_s
    while len(ids := redis.worker_ids(role)) != count:
        assert time.monotonic() < deadline, f"{len(ids)} {role} workers registered, not {count}"
        time.sleep(0.1)
    slots = redis.slots()
    return {worker_id: slots.get(worker_id) for worker_id in ids}


def assert_nothing_left_of_gone(deployment, role: str, before: dict[str, int], timeout_s: float = 10.0) -> None:
    """The replica that went (in `before`, no longer registered) left no load row, registry
    entry, block mark in its slot or key of its own in Redis."""
    redis = RedisView(deployment.config.router_config())
    (gone,) = set(before) - redis.worker_ids(role)
    deadline = time.monotonic() + timeout_s
    while left := redis.leftovers(gone, before[gone]):
        assert time.monotonic() < deadline, f"Redis still holds {left} of {gone}, which left"
        time.sleep(0.2)


def settle(role: str, timeout_s: float = 30) -> None:
    """Every replica of `role` has all its blocks back and nothing in flight."""
    from ray import serve

    handle = serve.get_deployment_handle(role, app_name="baton")
    deadline = time.monotonic() + timeout_s
    while True:
        reports = [stats for _, _, stats in handle.broadcast("integrity_report").results()]
        if all(s.num_free_kv_blocks == s.num_kv_blocks and s.num_kv_leases == 0 for s in reports):
            return
        assert time.monotonic() < deadline, reports
        time.sleep(0.2)


def test_a_burst_of_long_prompts_scales_prefill_and_not_decode(deployment, client, replicas):
    start = time.monotonic()
    burst = Load(client, 6, lambda w, n: (None, greedy_request(LONG_PROMPTS[(w + n) % 16], max_tokens=1)))
    try:
        # the controller's gauges: when the policy asked for 2, and the signal behind it
        desired = wait_for_gauge(
            deployment.metrics_address, "baton_autoscaling_desired_replicas", 2, SCALE_UP_WITHIN_S, role="prefill"
        )
        decided_s = time.monotonic() - start
        queued = gauge(deployment.metrics_address, "baton_autoscaling_signal", role="prefill")
        scale_up_s = decided_s + replicas.wait("prefill", 2, SCALE_UP_WITHIN_S)
        before = registered(deployment, "prefill", 2)
    finally:
        # The load ends when no new prompt is sent: the queued ones drain during stop(), and
        # the policy's downscale delay runs from when its signal fell, while they drain.
        ended = time.monotonic()
        burst.stop()
    assert not burst.errors, burst.errors[:3]
    assert replicas.max_since("decode", start) == 1
    assert desired == 2 and queued > 0, (desired, queued)
    scale_down_s = replicas.wait("prefill", 1, SCALE_DOWN_WITHIN_S)
    assert replicas.max_since("decode", start) == 1
    wait_for_router_workers(deployment, "prefill", 1)
    assert_nothing_left_of_gone(deployment, "prefill", before)
    print(
        f"prefill: asked for 2 after {decided_s:.1f} s of burst ({queued:.0f} prompt tokens queued), "
        f"2 running after {scale_up_s:.1f} s ({len(burst.results)} prompts), back to 1 {scale_down_s:.1f} s after it"
    )
    settle("prefill")
    assert time.monotonic() - ended >= DOWN_DELAY_S


def test_kv_pressure_scales_decode_and_it_scales_down_losing_nothing(deployment, client, replicas, offline):
    replicas.wait("decode", 1, SCALE_DOWN_WITHIN_S)
    start = time.monotonic()

    def stream(max_tokens):
        return lambda w, n: ((p := STREAM_PROMPTS[(w + n) % 8], max_tokens), greedy_request(p, max_tokens))

    heavy = Load(client, 8, stream(HEAVY_TOKENS))
    try:
        wait_for_gauge(
            deployment.metrics_address, "baton_autoscaling_desired_replicas", 2, SCALE_UP_WITHIN_S, role="decode"
        )
        decided_s = time.monotonic() - start
        kv_usage = gauge(deployment.metrics_address, "baton_autoscaling_signal", role="decode", signal="baton_kv_usage")
        preempting = gauge(
            deployment.metrics_address, "baton_autoscaling_signal", role="decode", signal="baton_preemptions_per_s"
        )
        scale_up_s = decided_s + replicas.wait("decode", 2, SCALE_UP_WITHIN_S)
        before = registered(deployment, "decode", 2)
    finally:
        heavy.stop()
    assert replicas.max_since("prefill", start) == 1
    assert kv_usage > 0.8 or preempting > 0  # the signal behind the decision: over its target
    light = Load(client, 2, stream(LIGHT_TOKENS))  # KV usage far under target: one replica is enough
    try:
        light_start = time.monotonic()
        scale_down_s = replicas.wait("decode", 1, SCALE_DOWN_WITHIN_S)
        wait_for_router_workers(deployment, "decode", 1)
        assert_nothing_left_of_gone(deployment, "decode", before)
        time.sleep(1.0)
    finally:
        light.stop()
    assert replicas.max_since("prefill", start) == 1
    for load in (heavy, light):
        assert not load.errors, load.errors[:3]
        for key, tokens in load.results:
            assert tokens == offline[key], key
    print(
        f"decode: asked for 2 after {decided_s:.1f} s on KV usage {kv_usage:.2f}, "
        f"2 running after {scale_up_s:.1f} s ({len(heavy.results)} heavy streams), "
        f"2->1 {scale_down_s:.1f} s into the light load ({len(light.results)} streams, all exact)"
    )
    assert light.results and time.monotonic() - light_start > DOWN_DELAY_S
    settle("decode")
    settle("prefill")
