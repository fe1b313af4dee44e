"""API keys on the HTTP API: 401 in OpenAI's shape before any route runs, every configured key
served, /health open or protected by the flag, the caller recorded as the owner, and no key
in a reply or a log line. No Ray: the FastAPI app over a fake engine client."""

from __future__ import annotations

import logging

import pytest
from baton.services.gateway.api_keys import MALFORMED_HEADER, MISSING_KEY, WRONG_KEY, ApiKeys
from baton.services.gateway.gateway import Gateway
from baton.services.gateway.openai_api import build_http_app
from fastapi.testclient import TestClient

KEY_A, KEY_B, ADMIN = "sk-http-alpha-5f1e2d3c4b5a", "sk-http-bravo-a9b8c7d6e5f4", "sk-http-admin-0a1b2c3d4e5f"
SECRETS = (KEY_A, KEY_B, ADMIN)
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def make_http(fake_gateway, tokenizer_dir):
    """make_http(ApiKeys) -> a TestClient of the gateway's app (.gateway, .engine_client)."""

    def make(api_keys: ApiKeys) -> TestClient:
        _, engine_client = fake_gateway()
        gateway = Gateway(engine_client, tokenizer_dir, api_keys=api_keys)
        client = TestClient(build_http_app(gateway.openai), raise_server_exceptions=False)
        client.gateway, client.engine_client = gateway, engine_client
        return client

    return make


@pytest.fixture
def http(make_http) -> TestClient:
    return make_http(ApiKeys([KEY_A, KEY_B], [ADMIN]))


def unauthenticated(reply, message: str) -> None:
    assert reply.status_code == 401, reply.text
    assert reply.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 401}}
    assert reply.headers["www-authenticate"] == "Bearer"
    assert not any(secret in reply.text for secret in SECRETS)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, MISSING_KEY),
        (bearer("sk-wrong"), WRONG_KEY),
        (bearer(KEY_A + "x"), WRONG_KEY),
        ({"Authorization": KEY_A}, MALFORMED_HEADER),
        ({"Authorization": f"Basic {KEY_A}"}, MALFORMED_HEADER),
        ({"Authorization": "Bearer "}, MALFORMED_HEADER),
    ],
    ids=["missing", "wrong", "longer", "no-scheme", "basic", "empty-bearer"],
)
@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions")])
def test_no_valid_key_is_a_401_before_the_body_is_read(http, method, path, headers, message):
    unauthenticated(http.request(method, path, json=COMPLETION, headers=headers), message)
    assert http.engine_client.calls == []


@pytest.mark.parametrize("path", ["/v1/models", "/docs", "/openapi.json", "/no/such/path"])
def test_every_other_path_needs_a_key_too(http, path):
    unauthenticated(http.get(path), MISSING_KEY)
    assert http.get(path, headers=bearer(KEY_B)).status_code in (200, 404)


@pytest.mark.parametrize("key", SECRETS, ids=["first", "second", "admin"])
def test_each_configured_key_is_served(http, key):
    reply = http.post("/v1/completions", json=COMPLETION, headers=bearer(key))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == "ok"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    streamed = http.post("/v1/chat/completions", json=chat, headers=bearer(key))
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert http.get("/v1/models", headers=bearer(key)).json()["data"][0]["id"] == "tiny"


def test_health_is_open_by_default_and_protected_by_the_flag(make_http):
    open_health = make_http(ApiKeys([KEY_A]))
    assert open_health.get("/health").json() == {"status": "ok"}
    protected = make_http(ApiKeys([KEY_A], protect_health=True))
    unauthenticated(protected.get("/health"), MISSING_KEY)
    unauthenticated(protected.get("/health", headers=bearer("sk-wrong")), WRONG_KEY)
    assert protected.get("/health", headers=bearer(KEY_A)).json() == {"status": "ok"}


def test_without_keys_the_api_is_open_as_before(make_http):
    http = make_http(ApiKeys())
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    assert http.post("/v1/completions", json=COMPLETION, headers=bearer("anything")).status_code == 200
    assert http.get("/v1/models").status_code == 200


def test_the_sending_key_owns_the_request(http, monkeypatch):
    owners = []
    stream = http.gateway.service.stream

    def recording(prepared):
        owners.append(prepared.owner)
        return stream(prepared)

    monkeypatch.setattr(http.gateway.service, "stream", recording)
    for key in (KEY_A, KEY_B, KEY_A):
        http.post("/v1/completions", json=COMPLETION, headers=bearer(key))
    expected = [http.gateway.api_keys.authenticate(f"Bearer {k}").owner for k in (KEY_A, KEY_B, KEY_A)]
    assert owners == expected and owners[0] != owners[1]


def test_a_refused_key_is_one_log_line_that_never_quotes_it(http, caplog):
    with caplog.at_level(logging.DEBUG):
        http.post("/v1/completions", json=COMPLETION, headers=bearer("sk-guessed-key-1234"))
        http.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"Token {KEY_A}"})
        http.post("/v1/completions", json=COMPLETION, headers=bearer(KEY_A))
    gateway_lines = [r for r in caplog.records if r.name == "baton.services.gateway.gateway"]
    assert [r.getMessage() for r in gateway_lines] == [
        f"http request refused, UNAUTHENTICATED: {WRONG_KEY}",
        f"http request refused, UNAUTHENTICATED: {MALFORMED_HEADER}",
    ]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in gateway_lines)
    logged = "\n".join(f"{r.getMessage()} {r.args}" for r in caplog.records)
    assert not any(secret in logged for secret in (*SECRETS, "sk-guessed-key-1234"))
