"""Output channels through real serving (a local Ray cluster, one colocated replica): the
streams of concurrent requests arrive over gRPC and HTTP exactly as the engine produces them
offline, the replica sends fewer messages than outputs (the point of the channel), and a
client that leaves a stream on the channel ends its request on the engine. The gateway and
the replica share the cluster's one node, so the channel is a Unix socket; the same tests run
with the channel on a Ray stream (`gateway.local_output_sockets: false`), and with the
channels off (`gateway.multiplex_outputs: false`: a Ray stream per request), where no output
goes on a channel."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from baton.services.engine import LLM, SamplingParams
from testlib.baton_client import greedy_request
from testlib.local_baton import grpc_client, local_baton
from testlib.models import tiny_model

pytestmark = pytest.mark.ray

PROMPTS = [f"Stream {i}: the quick brown fox jumps over" for i in range(8)]
MAX_TOKENS = 40


@pytest.fixture(
    scope="module", params=[(True, True), (True, False), (False, False)], ids=["socket", "ray-stream", "per-request"]
)
def deployment(request):
    multiplex, local = request.param
    overrides = {
        "mode": "colocated",
        "gateway": {"multiplex_outputs": multiplex, "local_output_sockets": local},
        "engine": {"model": {"max_model_len": 1024}, "cache": {"num_kv_blocks": 512}},
    }
    with local_baton(overrides) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def offline() -> dict[str, list[int]]:
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=256, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    try:
        return {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}
    finally:
        llm.shutdown()


def multiplexed(deployment) -> bool:
    return deployment.config.gateway.multiplex_outputs


def on_socket(deployment) -> bool:
    return multiplexed(deployment) and deployment.config.gateway.local_output_sockets


def worker():
    from ray import serve

    return serve.get_deployment_handle("colocated", app_name="baton")


def test_concurrent_grpc_streams_share_the_channel_and_equal_offline(deployment, offline):
    messages0, outputs0, socket0 = worker().channel_counts.remote().result()
    tokens: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    with grpc_client(deployment) as client:

        def run(prompt: str) -> None:
            try:
                responses = list(client.generate(greedy_request(prompt, MAX_TOKENS), timeout=120))
                tokens[prompt] = [t for r in responses for t in r.token_ids]
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=180)
    assert not errors, errors[:3]
    assert tokens == offline
    messages, outputs, on_sockets = worker().channel_counts.remote().result()
    if not multiplexed(deployment):
        assert (messages, outputs) == (messages0, outputs0)  # nothing went on a channel
        return
    assert outputs - outputs0 > 0  # the outputs came on the channel
    assert messages - messages0 < outputs - outputs0  # several requests' outputs per message
    if on_socket(deployment):
        assert on_sockets - socket0 == messages - messages0  # every message on the socket
    else:
        assert on_sockets == socket0 == 0


def test_an_http_stream_on_the_channel_equals_offline(deployment, offline):
    _, outputs0, _ = worker().channel_counts.remote().result()
    body = {
        "model": deployment.config.served_model_name,
        "prompt": PROMPTS[3],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{deployment.http_address}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    token_ids: list[int] = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                token_ids += chunk["choices"][0].get("token_ids") or []
    _, outputs, _ = worker().channel_counts.remote().result()
    assert (outputs > outputs0) == multiplexed(deployment)
    assert token_ids == offline[PROMPTS[3]]


def test_leaving_a_stream_on_the_channel_ends_its_request(deployment):
    with grpc_client(deployment) as client:
        stream = client.generate(greedy_request("Leave me: once upon a time", 900), timeout=120)
        for _ in range(5):
            next(stream)
        stream.cancel()
    deadline = time.monotonic() + 30
    while True:
        stats = worker().check_integrity.remote().result()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
