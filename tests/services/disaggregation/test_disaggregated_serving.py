"""Disaggregated serving on a 2-node Ray cluster on one machine: prefill pinned to one node,
decode to the other, the KV cache handed over with gloo, the decode side speculating (n-gram
drafts). Outputs equal the offline engine without speculation; every failure of the handover
still gives the right tokens and leaves no block behind."""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from baton.services.client import BatonClient
from baton.services.engine import LLM, SamplingParams
from baton.services.kv_transfer.config import FaultInjection
from baton.services.launcher.launcher import LocalDeployment, resolve_config
from baton.services.ray_env import import_ray
from baton.v1 import inference_pb2 as pb
from testlib.baton_client import collect, greedy_request, worker_stats
from testlib.models import tiny_model

pytestmark = pytest.mark.ray

SHORT = "def foo(x):"
LONG = "The with statement wraps a block of code. " * 12  # > 100 tokens: several blocks, chunked
MAX_TOKENS = 16


def config():
    return resolve_config(
        None,
        str(tiny_model("llama")),
        {
            "mode": "disaggregated",
            "server": {"http_port": 0, "grpc_port": 0},
            "engine": {
                "model": {"max_model_len": 512},
                "cache": {"num_kv_blocks": 128},
                "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 64},  # long prompts are chunked
                "kv_transfer": {"timeout_s": 2.0, "lease_s": 5.0, "verify": True, "allow_fault_injection": True},
            },
            "prefill": {"ray_actor_options": {"num_cpus": 0.5, "resources": {"prefill_node": 1}}},
            "decode": {
                "ray_actor_options": {"num_cpus": 0.5, "resources": {"decode_node": 1}},
                # Speculation runs where decoding runs: every test here also checks that it
                # leaves the decode side's greedy output unchanged.
                "engine_overrides": {"speculative": {"method": "ngram", "num_speculative_tokens": 3}},
            },
        },
    )


@pytest.fixture(scope="module")
def cluster():
    ray = import_ray()
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster records its address there
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"prefill_node": 4},
            "temp_dir": temp_dir,
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=2, resources={"decode_node": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    deployment = LocalDeployment(config(), Path(tempfile.mkdtemp(prefix="baton-", dir="/tmp"))).start()
    yield deployment
    deployment.stop()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    client = BatonClient(cluster.grpc_address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def offline():
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=128, max_model_len=512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {p: o.token_ids for p, o in zip([SHORT, LONG], llm.generate([SHORT, LONG], params))}


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def settle(timeout_s: float = 20.0) -> None:
    """Both sides' block accounting back to full: nothing running, leased or in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {role: worker_stats(role=role) for role in ("prefill", "decode")}
        done = all(
            s.num_free_kv_blocks == s.num_kv_blocks and s.num_kv_leases == 0 and s.num_kv_receiving == 0
            for s in stats.values()
        )
        if done:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def prefill_handle():
    from ray import serve

    return serve.get_deployment_handle("prefill", app_name="baton")


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long-chunked"])
def test_disaggregated_equals_offline(client, offline, prompt):
    responses = collect(client, greedy_request(prompt, MAX_TOKENS))
    assert tokens(responses) == offline[prompt]
    timings = responses[-1].timings
    assert timings.kv_path == "transferred"
    assert timings.prefill_worker.startswith("prefill-") and timings.decode_worker.startswith("decode-")
    assert responses[-1].usage.completion_tokens == MAX_TOKENS
    settle()


def test_prefix_cached_prompt(client, offline):
    collect(client, greedy_request(LONG, MAX_TOKENS))
    responses = collect(client, greedy_request(LONG, MAX_TOKENS))
    assert tokens(responses) == offline[LONG]
    assert responses[-1].usage.cached_tokens > 0
    settle()


def test_first_token_streams_before_the_handover(client, offline):
    stream = client.generate(greedy_request(LONG, MAX_TOKENS))
    first = next(stream)
    assert list(first.token_ids) == offline[LONG][:1] and first.finish_reason == ""
    assert tokens([first, *stream]) == offline[LONG]


@pytest.mark.parametrize(
    "faults",
    [FaultInjection(drop=True), FaultInjection(delay_s=3.0), FaultInjection(corrupt=True)],
    ids=["dropped", "delayed-past-timeout", "corrupted"],
)
def test_failed_handover_recomputes(client, offline, faults):
    prefill_handle().set_kv_faults.remote(faults).result()
    try:
        responses = collect(client, greedy_request(LONG, MAX_TOKENS))
    finally:
        prefill_handle().set_kv_faults.remote(FaultInjection()).result()
    assert tokens(responses) == offline[LONG]
    assert responses[-1].timings.kv_path == "recomputed"
    settle()


def test_prefill_replica_killed_after_the_first_token(cluster, client, offline):
    ray = import_ray()
    replica = ray.get_actor(prefill_handle().model_info.remote().result().address, namespace="serve")
    prefill_handle().set_kv_faults.remote(FaultInjection(delay_s=1.0)).result()  # time to kill it mid-handover
    stream = client.generate(greedy_request(LONG, MAX_TOKENS))
    first = next(stream)
    ray.kill(replica, no_restart=False)
    rest = list(stream)
    assert tokens([first, *rest]) == offline[LONG]
    assert rest[-1].timings.kv_path == "recomputed"
    # Serve replaces the replica; the decode side holds nothing for the lost transfer.
    deadline = time.monotonic() + 60
    while True:
        try:
            assert tokens(collect(client, greedy_request(SHORT, MAX_TOKENS))) == offline[SHORT]
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(1)
    settle()


def test_adding_a_decode_replica_does_not_disturb_running_requests(cluster, client, offline):
    from baton.services.serve_app.builder import build_app
    from ray import serve

    results, errors = [], []

    def run():
        try:
            results.append(tokens(collect(client, greedy_request(LONG, MAX_TOKENS), timeout=120)))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    scaled = cluster.config.model_copy(update={"decode": cluster.config.decode.model_copy(update={"num_replicas": 2})})
    serve.run(build_app(scaled), name=scaled.name, route_prefix="/")
    for t in threads:
        t.join(timeout=180)
    assert not errors and len(results) == 6 and all(r == offline[LONG] for r in results)
    assert tokens(collect(client, greedy_request(SHORT, MAX_TOKENS))) == offline[SHORT]


def test_model_info_reports_both_roles(client):
    info = client.model_info()
    assert list(info.roles) == ["prefill", "decode"] and info.mode == "disaggregated"
    assert info.router == "prefix_aware"


def test_n_samples_run_on_the_decode_side(client):
    request = pb.GenerateRequest(text=SHORT, sampling=pb.SamplingParameters(max_tokens=4, temperature=1.0, n=2, seed=1))
    responses = collect(client, request)
    assert responses[-1].usage.completion_tokens == 8 and responses[-1].timings.kv_path == "local"


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def test_structured_output_survives_the_handover(client):
    """The prefill side samples the first token under the schema; the decode side resumes the
    matcher from it. n > 1 runs whole on a decode worker, each sample under its own matcher."""
    for seed in range(4):
        sampling = pb.SamplingParameters(max_tokens=60, temperature=1.0, seed=seed, json_schema=json.dumps(SCHEMA))
        responses = collect(client, pb.GenerateRequest(text=SHORT, sampling=sampling))
        assert responses[-1].timings.kv_path == "transferred" and responses[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(r.text for r in responses)), SCHEMA)
    sampling = pb.SamplingParameters(max_tokens=30, n=3, temperature=1.0, seed=9, regex=r"[a-z]{3}-[0-9]{2}")
    responses = collect(client, pb.GenerateRequest(text=SHORT, sampling=sampling))
    texts = ["".join(r.text for r in responses if r.index == i) for i in range(3)]
    assert all(re.fullmatch(r"[a-z]{3}-[0-9]{2}", text) for text in texts), texts
    assert responses[-1].timings.kv_path == "local"
    settle()


def test_the_decode_side_speculates_and_streams_accepted_runs(cluster, client):
    """Greedy through both APIs equals the offline engine without speculation; accepted runs
    arrive as deltas of several tokens; the prefill side verifies no drafts."""
    prompt, max_tokens = "hello hello hello", 40
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=128, max_model_len=512)
    (expected,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    before = accepted_on_every_decode_replica()
    responses = collect(client, greedy_request(prompt, max_tokens))
    assert tokens(responses) == expected.token_ids
    assert responses[-1].timings.kv_path == "transferred"
    assert max(len(r.token_ids) for r in responses) > 1, "an accepted run was meant to arrive as one delta"
    body = {
        "model": client.model_info().model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{cluster.http_address}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected.text
    decode = [stats for _, _, stats in decode_handle().broadcast("integrity_report").results()]
    assert accepted_on_every_decode_replica() > before and max(s.spec_acceptance_rate for s in decode) > 0
    assert worker_stats(role="prefill").spec_num_drafts == 0
    settle()


def decode_handle():
    from ray import serve

    return serve.get_deployment_handle("decode", app_name="baton")


def accepted_on_every_decode_replica() -> int:
    """Accepted draft tokens summed over the decode replicas (an earlier test adds one)."""
    return sum(
        stats.spec_num_accepted_tokens for _, _, stats in decode_handle().broadcast("integrity_report").results()
    )
