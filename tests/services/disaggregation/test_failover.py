"""One replica per role on a real local Ray cluster, each killed by PID (SIGKILL): while the
decode replica is gone every new request, the first one too, is answered within a second on
both APIs (UNAVAILABLE; 503 with Retry-After; never a hang) and succeeds, with the same
greedy output, once Serve has replaced it; while the prefill replica is gone requests
are prefilled on the decode side and succeed."""

from __future__ import annotations

import os
import signal
import time

import grpc
import httpx
import pytest
from baton.services.client import BatonClient
from baton.services.engine import LLM, SamplingParams
from testlib.baton_client import greedy_request
from testlib.local_baton import grpc_client, local_baton
from testlib.models import tiny_model
from testlib.ray_processes import replica_pids

pytestmark = pytest.mark.ray

PROMPT = "def handler(request, context):"
MAX_TOKENS = 12
ANSWER_BOUND_S = 1.0  # the bound for an answer while a role has no replica


@pytest.fixture(scope="module")
def deployment():
    overrides = {
        "mode": "disaggregated",
        "engine": {"model": {"max_model_len": 512}, "cache": {"num_kv_blocks": 128}},
        "prefill": {"ray_actor_options": {"num_cpus": 0.25}},
        "decode": {"ray_actor_options": {"num_cpus": 0.25}},
    }
    with local_baton(overrides) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def client(deployment):
    with grpc_client(deployment) as client:
        yield client


@pytest.fixture(scope="module")
def expected():
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=128, max_model_len=512)
    tokens = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0].token_ids
    llm.shutdown()
    return tokens


def attempt(client: BatonClient) -> tuple[float, list[int] | grpc.RpcError, str]:
    """(seconds to the answer, the tokens or the error, the kv_path)."""
    start = time.monotonic()
    tokens, kv_path = [], ""
    try:
        for response in client.generate(greedy_request(PROMPT, MAX_TOKENS), timeout=30):
            tokens += response.token_ids
            kv_path = response.timings.kv_path or kv_path
    except grpc.RpcError as error:
        return time.monotonic() - start, error, kv_path
    return time.monotonic() - start, tokens, kv_path


def over_http(deployment) -> tuple[float, httpx.Response]:
    """(seconds to the answer, the answer) of the greedy completion over HTTP."""
    body = {"model": "baton-tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    response = httpx.post(f"{deployment.http_address}/v1/completions", json=body, timeout=30)
    return time.monotonic() - start, response


def until_served(deployment, client: BatonClient, expected: list[int], text: str, timeout_s: float = 120):
    """A gRPC and an HTTP request, one after another, until both succeed in one round; every
    answer before is kept: ([(seconds, tokens or RpcError)], [(seconds, HTTP response)])."""
    over_grpc, over_http_, start = [], [], time.monotonic()
    while True:
        seconds, result, _ = attempt(client)
        over_grpc.append((seconds, result))
        over_http_.append(over_http(deployment))
        grpc_ok, http_ok = not isinstance(result, grpc.RpcError), over_http_[-1][1].status_code == 200
        if grpc_ok:
            assert result == expected
        if http_ok:
            assert over_http_[-1][1].json()["choices"][0]["text"] == text
        if grpc_ok and http_ok:
            return over_grpc, over_http_
        assert time.monotonic() - start < timeout_s, (over_grpc[-3:], over_http_[-3:])
        time.sleep(0.2)


def test_with_the_decode_replica_gone_requests_get_unavailable_at_once(deployment, client, expected):
    assert attempt(client)[1] == expected  # the handles know their replicas
    _, before = over_http(deployment)
    assert before.status_code == 200, before.text
    text = before.json()["choices"][0]["text"]
    (victim,) = replica_pids("decode")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    over_grpc, over_http_ = until_served(deployment, client, expected, text)
    recovered_s = time.monotonic() - killed_at
    refusals = [(s, r) for s, r in over_grpc if isinstance(r, grpc.RpcError)]
    http_refusals = [(s, r) for s, r in over_http_ if r.status_code != 200]
    print(
        f"decode kill, 1 + 1: {len(refusals)} gRPC refusals (first {refusals[0][0]:.3f}s, slowest "
        f"{max(s for s, _ in refusals):.3f}s), {len(http_refusals)} HTTP (first {http_refusals[0][0]:.3f}s, slowest "
        f"{max(s for s, _ in http_refusals):.3f}s); both served again {recovered_s:.1f}s after the kill"
    )
    assert refusals and http_refusals, "the replica cannot be back at once"
    assert all(r.code() == grpc.StatusCode.UNAVAILABLE for _, r in refusals), refusals
    # Every refusal, the first one too (the request that meets the death itself), within the bound.
    assert all(s < ANSWER_BOUND_S for s, _ in refusals), refusals
    assert all(s < ANSWER_BOUND_S for s, _ in http_refusals), [(s, r.status_code) for s, r in http_refusals]
    for _, response in http_refusals:
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1, response.text
        assert "no decode replica is running" in response.json()["error"]["message"]


def test_with_the_prefill_replica_gone_requests_prefill_on_the_decode_side(deployment, client, expected):
    assert attempt(client)[1] == expected
    (victim,) = replica_pids("prefill")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    paths = []
    while len(replica_pids("prefill")) == 0 or time.monotonic() - killed_at < 2:
        seconds, result, kv_path = attempt(client)
        assert result == expected, result
        paths.append(kv_path)
        assert seconds < 10, seconds
    assert "local" in paths, paths  # run whole on the decode replica while prefill was gone
