"""Replica deaths under load on a real local Ray cluster: 2 prefill + 2 decode replicas, a real
redis-server (the prefix router's), faults injected by killing a replica's process by PID
(SIGKILL). No stream fails, and every greedy output equals the offline engine's."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from baton.services.client import BatonClient
from baton.services.engine import LLM, SamplingParams
from baton.v1 import inference_pb2 as pb
from testlib.baton_client import greedy_request
from testlib.local_baton import grpc_client, local_baton
from testlib.models import tiny_model
from testlib.ray_processes import replica_pids
from testlib.serve_deploy import deploy_from_config

pytestmark = pytest.mark.ray

PROMPTS = [f"def handler_{i}(request, context):" for i in range(8)]
LONG_PROMPTS = [f"Request {i}: " + "the with statement wraps a block of code. " * 20 for i in range(8)]
MAX_TOKENS = 160  # long enough that every stream is still running when the kill lands
# The scale-down test's streams outlast the replica's drain budget (GRACE_PERIOD_S) on a
# fast CPU too: 400 tokens took under 2 s on a Zen 4.
LONG_OUTPUT = 1600
GRACE_PERIOD_S = 2.0


OVERRIDES = {
    "mode": "disaggregated",
    "engine": {
        "model": {"max_model_len": 2048},
        "cache": {"num_kv_blocks": 1024},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 32},  # long prompts take many steps
        "kv_transfer": {"timeout_s": 2.0, "lease_s": 5.0},
    },
    "prefill": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}},
    "decode": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}},
}


@pytest.fixture(scope="module")
def deployment():
    # A short drain budget: the scale-down test outlasts it, so both drain paths run.
    with local_baton(OVERRIDES, grace_period_s=GRACE_PERIOD_S) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def client(deployment):
    with grpc_client(deployment) as client:
        yield client


@pytest.fixture(scope="module")
def offline():
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=1024, max_model_len=2048)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = PROMPTS + LONG_PROMPTS
    outputs = llm.generate(prompts, params)
    long = llm.generate(PROMPTS, SamplingParams(max_tokens=LONG_OUTPUT, temperature=0, ignore_eos=True))
    llm.shutdown()
    return {p: o.token_ids for p, o in zip(prompts, outputs)} | {
        ("long", p): o.token_ids for p, o in zip(PROMPTS, long)
    }


class Streams:
    """`prompts` streamed at once, each in its own thread; `started` once each has a token."""

    def __init__(self, client: BatonClient, prompts: list[str], max_tokens: int = MAX_TOKENS, request=None) -> None:
        self.request = request or (lambda prompt: greedy_request(prompt, max_tokens))
        self.tokens: dict[str, list[int]] = {p: [] for p in prompts}
        self.kv_paths: dict[str, str] = {}
        self.errors: list[BaseException] = []
        self.first_token = threading.Barrier(len(prompts) + 1, timeout=60)
        self.threads = [threading.Thread(target=self._run, args=(client, p)) for p in prompts]
        for thread in self.threads:
            thread.start()

    def _run(self, client: BatonClient, prompt: str) -> None:
        waited = False
        try:
            for response in client.generate(self.request(prompt), timeout=120):
                self.tokens[prompt] += response.token_ids
                self.kv_paths[prompt] = response.timings.kv_path or self.kv_paths.get(prompt, "")
                if not waited and len(self.tokens[prompt]) >= 2:  # decoding: past the handover
                    waited = True
                    self.first_token.wait()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.errors.append(error)
            if not waited:
                self.first_token.abort()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=180)

    def assert_tokens(self, expected: dict[str, list[int]]) -> None:
        """Each stream's tokens equal `expected`'s; a mismatch names where each stream parts."""
        assert not self.errors, self.errors
        parted = {}
        for prompt, want in expected.items():
            got = self.tokens[prompt]
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                parted[prompt] = (
                    f"{len(got)} tokens against {len(want)}, parting at {at}: got {got[max(0, at - 3) : at + 5]}, "
                    f"expected {want[max(0, at - 3) : at + 5]} (kv_path {self.kv_paths.get(prompt)!r})"
                )
        assert not parted, parted


def wait_for_replicas(role: str, count: int, timeout_s: float = 120) -> float:
    start = time.monotonic()
    while len(replica_pids(role)) < count:
        assert time.monotonic() - start < timeout_s, f"{role} not back to {count} replicas"
        time.sleep(0.5)
    return time.monotonic() - start


def settle(role: str, timeout_s: float = 30) -> None:
    """Both replicas of `role` have all their blocks back and nothing in flight."""
    from ray import serve

    handle = serve.get_deployment_handle(role, app_name="baton")
    deadline = time.monotonic() + timeout_s
    while True:
        reports = {worker_id: stats for worker_id, _, stats in handle.broadcast("integrity_report").results()}
        if len(reports) == 2 and all(
            s.num_free_kv_blocks == s.num_kv_blocks and s.num_kv_leases == 0 and s.num_kv_receiving == 0
            for s in reports.values()
        ):
            return
        assert time.monotonic() < deadline, reports
        time.sleep(0.2)


def test_a_decode_replica_killed_mid_stream_loses_no_stream(deployment, client, offline):
    from ray import serve

    wait_for_replicas("decode", 2)
    settle("decode")
    handle = serve.get_deployment_handle("decode", app_name="baton")
    streams = Streams(client, PROMPTS)
    streams.first_token.wait()  # every stream is on a decode replica, mid-way
    reports = handle.broadcast("integrity_report").results()
    _, busiest, _ = max(reports, key=lambda report: report[2].num_running)  # the one holding most streams
    killed_at = time.monotonic()
    os.kill(busiest, signal.SIGKILL)
    streams.join()
    done_after_s = time.monotonic() - killed_at
    streams.assert_tokens({p: offline[p] for p in PROMPTS})
    migrated = [p for p, path in streams.kv_paths.items() if path == "migrated"]
    assert migrated, streams.kv_paths  # the victim held some of them
    replaced_after_s = wait_for_replicas("decode", 2)
    print(
        f"decode kill: {len(migrated)}/8 streams migrated, all done {done_after_s:.2f}s after the kill; "
        f"replica replaced after {replaced_after_s:.1f}s more"
    )
    settle("decode")
    settle("prefill")


def test_a_prefill_replica_killed_under_load_loses_no_request(deployment, client, offline):
    """The victim holds requests when it dies (prefilling or queued); each is sent again to the
    other prefill replica (counted as outcome=retried) or, handed over already, recomputed on
    the decode side (kv_path recomputed)."""
    import re

    import httpx
    from ray import serve

    def num_retried() -> float:
        text = httpx.get(deployment.metrics_address, timeout=10).text
        series = re.findall(r"^ray_baton_request_migrations_total\{(.*)\} ([0-9.e+-]+)$", text, re.MULTILINE)
        return sum(float(v) for labels, v in series if 'role="prefill"' in labels and 'outcome="retried"' in labels)

    wait_for_replicas("prefill", 2)
    handle = serve.get_deployment_handle("prefill", app_name="baton")
    retried_before = num_retried()
    results: dict[str, list[int]] = {}
    kv_paths: dict[str, str] = {}
    errors: list[BaseException] = []

    def run(prompt: str) -> None:
        try:
            tokens = []
            for response in client.generate(greedy_request(prompt, MAX_TOKENS), timeout=120):
                tokens += response.token_ids
                kv_paths[prompt] = response.timings.kv_path or kv_paths.get(prompt, "")
            results[prompt] = tokens
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(p,)) for p in LONG_PROMPTS]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while True:  # until a prefill replica holds some of them (prefilling: 14 chunks each, or queued)
        reports = handle.broadcast("integrity_report").results()
        _, victim, held = max(reports, key=lambda report: report[2].num_running + report[2].num_waiting)
        if held.num_running + held.num_waiting >= 2:
            break
        assert time.monotonic() < deadline, reports
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=180)
    done_after_s = time.monotonic() - killed_at
    assert not errors, errors
    assert results == {p: offline[p] for p in LONG_PROMPTS}
    recomputed = sum(path == "recomputed" for path in kv_paths.values())
    num_held = held.num_running + held.num_waiting
    deadline = time.monotonic() + 40  # Ray exports the gateway's counters every few seconds
    while (retried := num_retried() - retried_before) + recomputed < num_held and time.monotonic() < deadline:
        time.sleep(0.5)
    replaced_after_s = wait_for_replicas("prefill", 2)
    print(
        f"prefill kill: the victim held {held.num_running} running + {held.num_waiting} waiting; {retried:g} sent "
        f"again, {recomputed} recomputed on decode; all 8 done {done_after_s:.2f}s after the kill; replica replaced "
        f"after {replaced_after_s:.1f}s"
    )
    assert retried + recomputed >= 1, (retried, kv_paths)  # what the victim held went elsewhere
    settle("prefill")
    settle("decode")


def test_a_replica_that_misses_its_heartbeats_is_fenced_off(deployment, client, offline):
    """SIGSTOP: the process lives (Serve still lists it) but stops heartbeating; once its
    heartbeat lapses no request is placed on it, and after SIGCONT it takes requests again."""
    from ray import serve

    wait_for_replicas("decode", 2)
    settle("decode")
    handle = serve.get_deployment_handle("decode", app_name="baton")
    stopped_worker, stopped_pid, _ = handle.broadcast("integrity_report").results()[0]
    os.kill(stopped_pid, signal.SIGSTOP)
    try:
        time.sleep(deployment.config.router.worker.heartbeat_ttl_s + 1.0)
        for prompt in PROMPTS:
            responses = list(client.generate(greedy_request(prompt, 24), timeout=30))
            assert [t for r in responses for t in r.token_ids] == offline[prompt][:24]
            assert responses[-1].timings.decode_worker != stopped_worker
    finally:
        os.kill(stopped_pid, signal.SIGCONT)
    # Until the resumed replica's next load report it is still fenced off, and one stream at a
    # time may keep going to the replica that holds its prefix: several streams at once, for
    # as long as a load report can take on a busy machine.
    placed = set()
    deadline = time.monotonic() + 30.0
    while stopped_worker not in placed and time.monotonic() < deadline:
        streams = [threading.Thread(target=lambda p=p: placed.add(first_worker(client, p))) for p in PROMPTS[:4]]
        for stream in streams:
            stream.start()
        for stream in streams:
            stream.join()
    assert stopped_worker in placed, placed
    settle("decode")


def first_worker(client: BatonClient, prompt: str) -> str:
    """The decode worker that served a short greedy stream of `prompt`."""
    return list(client.generate(greedy_request(prompt, 4), timeout=30))[-1].timings.decode_worker


SCHEMA = {  # bounded: the tiny model closes it well within max_tokens
    "type": "object",
    "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 12, "maxItems": 12}},
    "required": ["flags"],
    "additionalProperties": False,
}


def constrained_request(prompt: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParameters(max_tokens=200, temperature=0, json_schema=json.dumps(SCHEMA))
    return pb.GenerateRequest(text=prompt, sampling=sampling)


def test_constrained_streams_migrate_by_replaying_their_tokens(deployment, client):
    """The new decode replica rebuilds each stream's grammar matcher from the tokens already
    streamed: the JSON still validates and equals the undisturbed greedy output."""
    from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams
    from ray import serve

    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=1024, max_model_len=2048)
    constraint = StructuredOutputParams(StructuredOutputKind.JSON, json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=200, temperature=0, structured_output=constraint)
    expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
    llm.shutdown()
    wait_for_replicas("decode", 2)
    settle("decode")
    handle = serve.get_deployment_handle("decode", app_name="baton")
    streams = Streams(client, PROMPTS, request=constrained_request)
    streams.first_token.wait()
    _, busiest, _ = max(handle.broadcast("integrity_report").results(), key=lambda report: report[2].num_running)
    os.kill(busiest, signal.SIGKILL)
    streams.join()
    streams.assert_tokens(expected)
    assert "migrated" in streams.kv_paths.values(), streams.kv_paths
    wait_for_replicas("decode", 2)
    settle("decode")


# Last in this module: it leaves the application deployed from a config, with one decode replica.
def test_scaling_decode_down_mid_stream_loses_nothing(deployment, client, offline):
    """Deployed as KubeRay does (a Serve config; testlib/serve_deploy.py), a lower decode
    count only drains one decode replica: it takes nothing new, its worker leaves the
    router's ranking as the drain starts (retired by the gateway's request router, while the
    replica still streams), its streams that outlast the drain budget (GRACE_PERIOD_S) are
    migrated when its process goes. Nothing else restarts."""
    from baton.services.router.router import PrefixRouter
    from ray import serve

    config = deployment.config
    deploy_from_config(config, {"prefill": 2, "decode": 2}, GRACE_PERIOD_S)  # from here, config deploys
    wait_for_replicas("decode", 2)
    settle("decode")
    others = replica_pids("prefill") + replica_pids("gateway")
    decode_pids = replica_pids("decode")
    router = PrefixRouter.from_config(config.router_config())
    assert len(router.route_decode("probe", 8, record=False).ranked) == 2
    streams = Streams(client, PROMPTS, LONG_OUTPUT)
    streams.first_token.wait()
    handle = serve.get_deployment_handle("decode", app_name="baton")
    running = [report[2].num_running for report in handle.broadcast("integrity_report").results()]
    assert min(running) > 0, running  # the burst spread: the replica drained below holds streams
    retired = {}  # when the drained worker left the ranking, and which decode processes ran then

    def watch() -> None:
        while len(router.route_decode("probe", 8, record=False).ranked) > 1 and time.monotonic() < asked + 60:
            time.sleep(0.05)
        retired["after_s"] = time.monotonic() - asked
        retired["alive"] = [pid for pid in decode_pids if os.path.exists(f"/proc/{pid}")]

    asked = time.monotonic()
    watcher = threading.Thread(target=watch)
    watcher.start()
    deploy_from_config(config, {"prefill": 2, "decode": 1}, GRACE_PERIOD_S)  # returns once it is done
    watcher.join()
    # Both decode processes still ran: the worker left the ranking at the drain's start, not
    # when its replica exited or its heartbeat lapsed.
    assert retired["alive"] == decode_pids, retired
    streams.join()
    streams.assert_tokens({p: offline["long", p] for p in PROMPTS})
    migrated = [p for p, path in streams.kv_paths.items() if path == "migrated"]
    deadline = time.monotonic() + 60
    while len(replica_pids("decode")) > 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len(router.route_decode("probe", 8, record=False).ranked) == 1  # and it stays out
    print(f"scale-down: the drained worker left the ranking {retired['after_s']:.2f} s after the deploy")
    print(f"scale-down: {len(migrated)}/8 streams outlasted the drain budget and were migrated")
    assert migrated, streams.kv_paths  # the drained replica's streams outlasted its budget
    assert replica_pids("prefill") + replica_pids("gateway") == others  # a lightweight update: no restart
    (report,) = handle.broadcast("integrity_report").results()
    assert report[2].num_free_kv_blocks == report[2].num_kv_blocks
