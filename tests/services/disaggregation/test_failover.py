"""One replica per role on a real local Ray cluster, each killed by PID (SIGKILL): while the
decode replica is gone every new request is answered within a second (UNAVAILABLE, never a
hang) and succeeds once Serve has replaced it; while the prefill replica is gone requests
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


def refused_over_http(deployment) -> httpx.Response:
    """The first HTTP answer while the decode replica is gone (a 503, once the gateway knows)."""
    body = {"model": "baton-tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    for _ in range(50):
        start = time.monotonic()
        response = httpx.post(f"{deployment.http_address}/v1/completions", json=body, timeout=30)
        if response.status_code != 200:
            assert time.monotonic() - start < 5.0
            return response
        time.sleep(0.1)
    raise AssertionError("never refused")


def until_served(client: BatonClient, expected: list[int], timeout_s: float = 120) -> list[tuple[float, object]]:
    """Requests one after another until one succeeds; every answer before it is checked."""
    answers, start = [], time.monotonic()
    while True:
        seconds, result, _ = attempt(client)
        answers.append((seconds, result))
        if not isinstance(result, grpc.RpcError):
            assert result == expected
            return answers
        assert time.monotonic() - start < timeout_s, answers[-3:]
        time.sleep(0.2)


def test_with_the_decode_replica_gone_requests_get_unavailable_at_once(deployment, client, expected):
    assert attempt(client)[1] == expected  # the handles know their replicas
    (victim,) = replica_pids("decode")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    http = refused_over_http(deployment)
    answers = until_served(client, expected)
    recovered_s = time.monotonic() - killed_at
    refusals = [(s, r) for s, r in answers if isinstance(r, grpc.RpcError)]
    print(
        f"decode kill: {len(refusals)} refusals, slowest {max((s for s, _ in refusals), default=0):.3f}s; "
        f"served again {recovered_s:.1f}s after the kill"
    )
    assert refusals, "the replica cannot be back at once"
    assert all(r.code() == grpc.StatusCode.UNAVAILABLE for _, r in refusals), refusals
    # The first request can meet the death itself (its call fails); every later one is refused up front.
    assert all(s < ANSWER_BOUND_S for s, _ in refusals[1:]), refusals
    assert refusals[0][0] < 5.0, refusals[0]
    assert http.status_code == 503 and int(http.headers["retry-after"]) >= 1, (http.status_code, http.text)
    assert "no decode replica is running" in http.json()["error"]["message"]


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
