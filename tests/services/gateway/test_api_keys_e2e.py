"""API keys on a real local Ray Serve deployment (keys from mounted files): Serve's proxies
pass the header and the metadata through, a request without a key is refused on both APIs,
and another key's Abort leaves the stream running while its owner's ends it."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import grpc
import httpx
import pytest
from baton.services.client import BatonClient
from baton.services.gateway.api_keys import MISSING_KEY, WRONG_KEY
from baton.services.launcher.launcher import LocalDeployment, resolve_config
from testlib.baton_client import collect, greedy_request
from testlib.models import tiny_model

pytestmark = pytest.mark.ray
KEY_A, KEY_B, ADMIN = "sk-e2e-alpha-3c2b1a0f9e8d", "sk-e2e-bravo-8d9e0f1a2b3c", "sk-e2e-admin-5a4b3c2d1e0f"


@pytest.fixture(scope="module")
def keyed_app():
    run_dir = Path(tempfile.mkdtemp(prefix="baton-keys-", dir="/tmp"))
    (run_dir / "api-keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    (run_dir / "admin-keys").write_text(f"{ADMIN}\n")
    auth = {
        "api_keys_file": str(run_dir / "api-keys"),
        "admin_api_keys_file": str(run_dir / "admin-keys"),
        "api_keys_env": None,  # only the files: whatever this shell exports does not count
        "admin_api_keys_env": None,
    }
    config = resolve_config(
        None,
        str(tiny_model("llama")),
        {
            "mode": "colocated",
            "server": {"http_port": 0, "grpc_port": 0, "auth": auth},
            "engine": {"model": {"max_model_len": 1024}, "cache": {"num_kv_blocks": 96}},
            "colocated": {"ray_actor_options": {"num_cpus": 1}},
        },
    )
    with LocalDeployment(config, run_dir, num_cpus=3) as deployment:
        yield deployment


def client(app, key: str | None) -> BatonClient:
    return BatonClient(app.grpc_address, api_key=key)


def test_grpc_without_or_with_a_wrong_key_is_unauthenticated_and_with_one_is_served(keyed_app, monkeypatch):
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    for key, message in ((None, MISSING_KEY), ("sk-wrong", WRONG_KEY)):
        with pytest.raises(grpc.RpcError) as info:
            collect(client(keyed_app, key), greedy_request("def foo(x):", 4))
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
    for key in (KEY_A, KEY_B, ADMIN):
        responses = collect(client(keyed_app, key), greedy_request("def foo(x):", 4))
        assert sum(len(r.token_ids) for r in responses) == 4


def test_http_without_a_key_is_a_401_and_with_one_is_served(keyed_app):
    url = f"{keyed_app.http_address}/v1/completions"
    body = {"prompt": "def foo(x):", "max_tokens": 4, "temperature": 0}
    refused = httpx.post(url, json=body, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["message"] == MISSING_KEY
    served = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{keyed_app.http_address}/health", timeout=30).status_code == 200  # open by default


def test_only_the_owner_aborts_and_another_key_leaves_the_stream_running(keyed_app):
    victim, other, owner = client(keyed_app, KEY_A), client(keyed_app, KEY_B), client(keyed_app, KEY_A)
    request = greedy_request("The quick brown fox", 900)
    request.request_id = "e2e-victim"
    received: list = []
    first = threading.Event()

    def stream():
        for response in victim.generate(request, timeout=120):
            received.append(response)
            first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    assert not other.abort("e2e-victim")
    assert owner.abort("e2e-victim")  # so the other key's try left it running
    reader.join(60)
    assert received[-1].finish_reason == "abort"
    assert sum(len(r.token_ids) for r in received) < 900
