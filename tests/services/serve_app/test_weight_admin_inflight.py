"""RL admin calls with requests in flight, on one real disaggregated deployment (1 prefill +
1 decode, local Ray, real Redis):

  - UpdateWeightsFromDisk over gRPC succeeds: its answer names the new version and every
    replica, and greedy output over gRPC then equals Hugging Face on the new weights;
  - pause_generation("abort") over HTTP ends every stream in flight at once (OpenAI's
    finish_reason "stop", short of max_tokens; gRPC's "abort");
  - pause_generation("keep") holds the streams in flight (no token while paused), an
    update from disk lands meanwhile, and after continue_generation they run to max_tokens,
    their last chunk reporting the new version;
  - after each, every KV block is free again on every replica (free + used == total, no
    lease left on the prefill side);
  - a replica that starts after the updates (the decode replica killed, Serve's replacement)
    loads the last one before it serves: the fleet's version, greedy equal to HF on it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import httpx
import pytest
from baton.services.client import BatonClient
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc as pb_grpc
from testlib.baton_client import greedy_request
from testlib.hf import hf_greedy
from testlib.local_baton import local_baton
from testlib.models import tiny_model
from testlib.ray_processes import replica_pids
from testlib.waiting import wait_until

pytestmark = pytest.mark.ray

ROLES = ("prefill", "decode")
PROMPT = "def handler(request, context):"
LONG = 1000  # tokens: seconds of decoding, so a request is still in flight when the pause comes


@pytest.fixture(scope="module")
def deployment():
    overrides = {
        "mode": "disaggregated",
        "engine": {"model": {"max_model_len": 1024}, "cache": {"num_kv_blocks": 256}},
        **{role: {"ray_actor_options": {"num_cpus": 0.25}} for role in ROLES},
    }
    with local_baton(overrides) as deployment:
        yield deployment


def admin(deployment, path: str, body: dict | None = None) -> dict:
    answer = httpx.post(f"{deployment.http_address}{path}", json=body or {}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


class HttpStream(threading.Thread):
    """A streamed completion read in a thread: its text chunks, finish_reason, usage and version."""

    def __init__(self, deployment, max_tokens: int = LONG) -> None:
        super().__init__(daemon=True)
        self.url = f"{deployment.http_address}/v1/completions"
        self.body = {"model": "baton-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        self.body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        self.num_chunks = 0
        self.finish_reason = self.usage = self.weight_version = None
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=180) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                for choice in chunk["choices"]:
                    self.num_chunks += 1
                    self.finish_reason = choice["finish_reason"] or self.finish_reason
                self.usage = chunk.get("usage") or self.usage
                self.weight_version = chunk.get("weight_version") or self.weight_version

    def ended(self) -> HttpStream:
        self.join(timeout=180)
        assert not self.is_alive(), "the stream did not end"
        return self


class GrpcStream(threading.Thread):
    def __init__(self, deployment) -> None:
        super().__init__(daemon=True)
        self.client = BatonClient(deployment.grpc_address)
        self.responses: list[pb.GenerateResponse] = []
        self.start()

    @property
    def num_chunks(self) -> int:
        return len(self.responses)

    def run(self) -> None:
        try:
            for response in self.client.generate(greedy_request(PROMPT, LONG), timeout=180):
                self.responses.append(response)
        finally:
            self.client.close()


def wait_in_flight(streams) -> None:
    """Until every stream has its first tokens: each request runs on the decode side."""
    wait_until(lambda: all(s.num_chunks > 0 for s in streams), 60, what="first tokens")


def integrity_reports() -> list:
    """Every replica's block accounting, each checked (free + used == total) on its engine thread."""
    from ray import serve

    reports = []
    for role in ROLES:
        handle = serve.get_deployment_handle(role, app_name="baton")
        reports += [stats for _, _, stats in handle.broadcast("integrity_report").results()]
    return reports


def wait_all_blocks_free() -> None:
    def all_free():
        reports = integrity_reports()
        return len(reports) == len(ROLES) and all(
            s.num_free_kv_blocks == s.num_kv_blocks and s.num_kv_leases == 0 and s.num_running == 0 for s in reports
        )

    wait_until(all_free, 30, 0.1, what=f"every KV block free on every replica (last: {integrity_reports()})")


def test_update_from_disk_over_grpc_matches_hf_and_names_the_new_version(deployment):
    from transformers import AutoTokenizer

    new_dir = tiny_model("llama", seed=2)
    client = BatonClient(deployment.grpc_address)
    try:
        stub = pb_grpc.AdminStub(client.channel)
        request = pb.UpdateWeightsFromDiskRequest(model_path=str(new_dir), weight_version="grpc-1")
        answer = stub.UpdateWeightsFromDisk(request, metadata=client.metadata, timeout=120)
        assert answer.success and answer.weight_version == "grpc-1" and not answer.failed
        assert len(answer.updated) == len(ROLES)
        versions = stub.GetWeightVersion(pb.GetWeightVersionRequest(), metadata=client.metadata, timeout=60)
        assert versions.weight_version == "grpc-1" and set(versions.replicas.values()) == {"grpc-1"}
        responses = list(client.generate(greedy_request(PROMPT, 12), timeout=60))
    finally:
        client.close()
    expected, _ = hf_greedy(new_dir, AutoTokenizer.from_pretrained(new_dir).encode(PROMPT), 12)
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].weight_version == "grpc-1"


def test_pause_abort_ends_every_stream_in_flight_and_frees_every_block(deployment):
    streams = [HttpStream(deployment), HttpStream(deployment)]
    over_grpc = GrpcStream(deployment)
    wait_in_flight([*streams, over_grpc])
    assert admin(deployment, "/pause_generation", {"mode": "abort"})["success"]
    try:
        for stream in streams:
            # OpenAI has no "abort": it reports "stop", which with ignore_eos and no stop
            # strings nothing else gives, and short of max_tokens.
            stream.ended()
            assert stream.finish_reason == "stop" and stream.usage["completion_tokens"] < LONG, vars(stream)
        over_grpc.join(timeout=180)
        assert over_grpc.responses[-1].finish_reason == "abort"
        assert sum(len(r.token_ids) for r in over_grpc.responses) < LONG
        wait_all_blocks_free()
    finally:
        admin(deployment, "/continue_generation")
    assert HttpStream(deployment, max_tokens=8).ended().finish_reason == "length"


def test_pause_keep_holds_streams_across_an_update_then_they_finish_on_the_new_weights(deployment):
    streams = [HttpStream(deployment), HttpStream(deployment)]
    wait_in_flight(streams)
    assert admin(deployment, "/pause_generation", {"mode": "keep"})["success"]
    try:
        time.sleep(1.5)  # chunks already on their way arrive (a loaded gateway can lag)
        held = [s.num_chunks for s in streams]
        time.sleep(1.0)
        assert [s.num_chunks for s in streams] == held, "a paused engine produced tokens"
        assert all(s.is_alive() for s in streams)
        body = {"model_path": str(tiny_model("llama", seed=3)), "weight_version": "kept-2"}
        assert admin(deployment, "/update_weights_from_disk", body)["success"]
        assert [s.num_chunks for s in streams] == held  # the update does not end the pause
    finally:
        admin(deployment, "/continue_generation")
    for stream in streams:
        stream.ended()
        assert stream.finish_reason == "length" and stream.usage["completion_tokens"] == LONG, vars(stream)
        assert stream.weight_version == "kept-2"  # the version its last tokens came from
    wait_all_blocks_free()


def test_grpc_pause_refuses_an_unknown_mode(deployment):
    client = BatonClient(deployment.grpc_address)
    try:
        stub = pb_grpc.AdminStub(client.channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.PauseGeneration(pb.PauseGenerationRequest(mode="later"), metadata=client.metadata, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    finally:
        client.close()
    assert HttpStream(deployment, max_tokens=4).ended().finish_reason == "length"  # nothing paused


def test_a_replica_that_starts_after_an_update_loads_it_before_it_serves(deployment):
    from transformers import AutoTokenizer

    before = httpx.get(f"{deployment.http_address}/weight_version", timeout=30).json()
    assert before["weight_version"] == "kept-2", before  # the last update of this module
    (victim,) = replica_pids("decode")
    os.kill(victim, signal.SIGKILL)

    def replaced() -> dict | None:
        if replica_pids("decode") in ([], [victim]):
            return None
        response = httpx.get(f"{deployment.http_address}/weight_version", timeout=30)
        assert response.status_code == 200, response.text  # answers while a role has no replica
        answer = response.json()
        new = {w: v for w, v in answer["replicas"].items() if w.startswith("decode") and w not in before["replicas"]}
        reached = new and not any(v.startswith("unknown (") for v in new.values())
        return answer if reached and len(answer["replicas"]) == len(ROLES) else None  # the lost one gone

    after = wait_until(replaced, 240, 0.5, what="the decode replica's replacement")
    assert after["weight_version"] == "kept-2", after  # the replacement too, not "0"
    new_dir = tiny_model("llama", seed=3)
    expected, _ = hf_greedy(new_dir, AutoTokenizer.from_pretrained(new_dir).encode(PROMPT), 12)
    client = BatonClient(deployment.grpc_address)
    try:
        responses = list(client.generate(greedy_request(PROMPT, 12), timeout=60))
    finally:
        client.close()
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].weight_version == "kept-2" and responses[-1].timings.kv_path == "transferred"
