"""Malformed HTTP bodies get OpenAI-shaped 400s that name the field and carry no internals;
streams end with usage only when asked; rejections are one log line. No Ray: the FastAPI
app over a fake engine client."""

from __future__ import annotations

import logging

import pytest
from baton.services.gateway.openai_api import build_http_app
from baton.services.serving_errors import INTERNAL_ERROR
from fastapi.testclient import TestClient

JSON = {"content-type": "application/json"}
CHAT = [{"role": "user", "content": "hi"}]
INTERNALS = ('File "', '.py"', ", line ", "pydantic", "errors.pydantic.dev", "{'type'", "'loc'", "Error:", "Traceback")


@pytest.fixture
def http(fake_gateway):
    gateway, engine_client = fake_gateway()
    client = TestClient(build_http_app(gateway.openai), raise_server_exceptions=False)
    client.engine_client = engine_client
    return client


def error_of(reply, status: int = 400) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == ("invalid_request_error" if status == 400 else error["type"])
    assert error["code"] == status
    assert not any(marker in error["message"] for marker in INTERNALS), error["message"]
    return error


@pytest.mark.parametrize(
    "content,headers,message",
    [
        ("null", JSON, "the request body must be a JSON object, not null"),
        ("[1, 2]", JSON, "the request body must be a JSON object, not an array"),
        ('"hi"', JSON, "the request body must be a JSON object, not a string"),
        ("hello", {"content-type": "text/plain"}, "the request body must be a JSON object, sent with Content-Type"),
        (
            "prompt=hi",
            {"content-type": "application/x-www-form-urlencoded"},
            "the request body must be a JSON object, sent",
        ),
        ("", JSON, "the request body is empty; it must be a JSON object"),
        ("{bad", JSON, "invalid JSON at line 1 column 2: Expecting property name enclosed in double quotes"),
        ('{"prompt": "hi",\n "max_tokens": }', JSON, "invalid JSON at line 2 column 16: Expecting value"),
        (b'{"prompt": "\xff"}', JSON, "the request body could not be read as JSON: it must be UTF-8 JSON text"),
        ("[" * 100_000 + "]" * 100_000, JSON, "the request body is nested too deeply to read"),
        (
            '{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}",
            JSON,
            "a number in the request body has too many digits",
        ),
    ],
    ids=[
        "null",
        "list",
        "string",
        "text-plain",
        "form",
        "empty",
        "bad-json",
        "bad-json-line-2",
        "not-utf8",
        "too-deep",
        "too-many-digits",
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_no_json_object_is_a_400_saying_so(http, path, content, headers, message):
    error = error_of(http.post(path, content=content, headers=headers))
    assert error["message"].startswith(message) and error["param"] is None


@pytest.mark.parametrize(
    "path,body,param,message",
    [
        ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt: is required"),
        ("/v1/completions", {"prompt": 5}, "prompt", "prompt: must be a valid string or a valid list"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": "many"},
            "max_tokens",
            "max_tokens: must be a valid integer",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
        (
            "/v1/chat/completions",
            {"messages": [{"content": "hi"}]},
            "messages[0].role",
            "messages[0].role: is required",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages", "messages: must have at least 1 item"),
        (
            "/v1/completions",
            {"prompt": "hi", "structured_outputs": {"jsn": {}}},
            "structured_outputs.jsn",
            "structured_outputs.jsn: is not a known field",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": 3}}},
            "response_format.json_schema.name",
            None,
        ),
    ],
    ids=["missing", "union", "int", "content", "role", "empty-list", "extra-key", "nested"],
)
def test_a_field_of_the_wrong_shape_is_named_by_its_path(http, path, body, param, message):
    error = error_of(http.post(path, json=body))
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert message is None or error["message"].startswith(message)
    assert "Input should" not in error["message"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "a\\udfffb"]}', "prompt[1]"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', "stop[0]"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(http, path, body, param):
    error = error_of(http.post(path, content=body, headers=JSON))
    assert (
        error["param"] == param and "lone surrogate" in error["message"] and "TextEncodeInput" not in error["message"]
    )
    assert http.engine_client.calls == []


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN", "1e400"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"])
@pytest.mark.parametrize(
    "path,base",
    [
        ("/v1/completions", '"prompt": "hi"'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}]'),
    ],
)
def test_a_non_finite_float_is_a_400_naming_the_field(http, path, base, name, literal):
    error = error_of(http.post(path, content=f'{{{base}, "{name}": {literal}}}', headers=JSON))
    assert error["param"] == name and error["message"] == f"{name}: must be a finite number"


def test_unknown_paths_and_methods_answer_in_openai_shape(http):
    assert error_of(http.get("/v1/nope"), 404)["message"] == "GET /v1/nope does not exist"
    assert error_of(http.get("/v1/completions"), 405)["type"] == "invalid_request_error"


def stream_chunks(http, path, body) -> list[str]:
    reply = http.post(path, json={**body, "stream": True})
    assert reply.status_code == 200
    return [line for line in reply.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    "path,body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})]
)
def test_usage_chunk_only_with_include_usage(http, path, body):
    assert not any('"usage"' in chunk for chunk in stream_chunks(http, path, body))
    assert not any(
        '"usage"' in c for c in stream_chunks(http, path, {**body, "stream_options": {"include_usage": False}})
    )
    chunks = stream_chunks(http, path, {**body, "stream_options": {"include_usage": True}})
    assert '"usage"' in chunks[-2] and '"choices": []' in chunks[-2] and chunks[-1] == "data: [DONE]"


def test_unset_max_tokens_is_16_on_completions_and_the_context_on_chat(http):
    http.post("/v1/completions", json={"prompt": "hi"})
    http.post("/v1/chat/completions", json={"messages": CHAT})
    http.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 5, "max_tokens": 9})
    assert [call.params.max_tokens for call in http.engine_client.calls] == [16, None, 5]


def test_a_rejection_is_one_log_line_and_a_server_error_a_traceback(fake_gateway, caplog):
    gateway, _ = fake_gateway(error=RuntimeError("boom"))
    http = TestClient(build_http_app(gateway.openai), raise_server_exceptions=False)
    with caplog.at_level(logging.INFO, logger="baton.services.gateway.gateway"):
        http.post("/v1/completions", content="null", headers=JSON)
        http.post("/v1/completions", json={"prompt": "hi", "temperature": -1})
        rejections = [r for r in caplog.records if r.name == "baton.services.gateway.gateway"]
        assert len(rejections) == 2 and all(r.levelno == logging.INFO and r.exc_info is None for r in rejections)
        caplog.clear()
        # The client is not told the error's own text (it may hold internals); the log has it.
        assert error_of(http.post("/v1/completions", json={"prompt": "hi"}), 500)["message"] == INTERNAL_ERROR
    (failure,) = [r for r in caplog.records if r.name == "baton.services.gateway.gateway"]
    assert failure.levelno == logging.ERROR and failure.exc_info is not None and "boom" in failure.getMessage()


def test_a_trailing_slash_is_a_404_not_a_redirect(http):
    error = error_of(http.get("/v1/models/"), 404)
    assert error["message"] == "GET /v1/models/ does not exist"


@pytest.mark.parametrize("value", [False, 3, "text", {"a": 1}])
def test_modalities_that_are_not_a_list_are_a_400_naming_it(http, value):
    body = {"messages": CHAT, "modalities": value}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "modalities", error
