"""Property-based fuzzing of the HTTP API of a real Baton (colocated, tiny model): request
bodies built from the real request schemas with fields of the wrong type, out of range,
non-finite (raw NaN, Infinity, 1e400), lone surrogates, huge integers, unknown and refused
fields and nested junk; bodies that are no JSON object, no JSON or no UTF-8; wrong content
types, methods and paths. Every answer is a success or a 4xx in OpenAI's error shape whose
message carries no internals; afterwards the server is healthy and its greedy output for a
fixed prompt is what it was before.
"""

from __future__ import annotations

import json
import posixpath
from urllib.parse import unquote

import httpx
import pytest
from baton.services.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from baton.services.gateway.openai_refused import CHAT_REFUSALS, COMPLETION_REFUSALS
from hypothesis import event, given
from hypothesis import strategies as st

from .fuzz_strategies import (
    FIXED_PROMPT,
    MODEL,
    fuzz_settings,
    internals_in,
    junk,
    max_tokens_values,
    mutated,
    num_samples_values,
    schema_fields,
    short_text,
    to_json,
    unknown_names,
)

pytestmark = pytest.mark.ray
CLIENT_ERRORS = frozenset({400, 401, 404, 405, 413, 415, 422, 429})
ERROR_KEYS = {"message", "type", "param", "code"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
COMPLETION_FIELDS = sorted({*schema_fields(CompletionRequest), *COMPLETION_REFUSALS})
CHAT_FIELDS = sorted({*schema_fields(ChatCompletionRequest), *CHAT_REFUSALS})
# Admin routes that take a body: only bodies they must refuse go there (a valid one would
# pause, put to sleep or reload the engine the other examples run on).
ADMIN_BODY_ROUTES = [
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/pause_generation",
    "/sleep",
]
READ_ROUTES = [("GET", "/v1/models"), ("GET", "/health"), ("GET", "/weight_version"), ("GET", "/weight_update_ranks")]
SAMPLE_COUNTS = {"n": num_samples_values, "best_of": num_samples_values}
JSON_TYPE = "application/json"
CONTENT_TYPES = [
    JSON_TYPE,
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=fuzz",
    "application/json; charset=utf-16",
    "application/json; charset=latin-1",
    "application/xml",
    "application/octet-stream",
    "*/*",
    "",
    "application/json, text/plain",
]


def greedy_request() -> dict:
    return {"model": MODEL, "prompt": FIXED_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip


@pytest.fixture(scope="module")
def http(baton_app):
    with httpx.Client(base_url=baton_app.http_address, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def baseline(http) -> list[int]:
    reply = http.post(COMPLETIONS, json=greedy_request())
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def check_error(error: object, status: int) -> None:
    assert isinstance(error, dict) and ERROR_KEYS <= set(error) <= ERROR_KEYS | {"retry_after"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["code"] == status and isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert not internals_in(error["message"]), (internals_in(error["message"]), error["message"])


def check_answer(reply: httpx.Response) -> None:
    """A success, or a client error in OpenAI's shape; a stream's error events likewise."""
    status = reply.status_code
    event(f"HTTP {status}")  # --hypothesis-show-statistics: how often each answer came
    assert status == 200 or status in CLIENT_ERRORS, (status, reply.text[:2000])
    if status == 200 and reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", reply.text[:2000]
        for chunk in map(json.loads, events[:-1]):
            if "error" in chunk:
                check_error(chunk["error"], chunk["error"].get("code"))
                assert chunk["error"]["code"] in CLIENT_ERRORS, chunk
        return
    body = reply.json()
    assert isinstance(body, dict), body
    if status == 200:
        assert "error" not in body, body
    else:
        assert set(body) == {"error"}, body
        check_error(body["error"], status)


def post(http, path: str, content: str | bytes, content_type: str | None = JSON_TYPE) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    return http.post(path, content=content.encode() if isinstance(content, str) else content, headers=headers)


prompts = st.one_of(
    short_text,
    st.lists(short_text, max_size=3),
    st.lists(st.integers(0, 1100), max_size=6),
    st.lists(st.lists(st.integers(-5, 1100), max_size=4), max_size=2),
)
text_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", ""]), "text": short_text}, optional={"image_url": junk}
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "user", "system", "assistant", "tool", "developer", ""])},
        optional={"content": st.one_of(short_text, st.none(), st.lists(text_parts, max_size=2), junk)},
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def completion_bodies(draw) -> dict:
    body = {"model": MODEL, "prompt": draw(prompts), "max_tokens": draw(st.integers(1, 4))}
    body["temperature"] = draw(st.sampled_from([0, 0.7, 1.0]))
    body["stream"] = draw(st.booleans())
    return mutated(draw, body, COMPLETION_FIELDS, {"max_tokens": max_tokens_values, **SAMPLE_COUNTS})


@st.composite
def chat_bodies(draw) -> dict:
    body = {"model": MODEL, "messages": draw(messages), "max_tokens": draw(st.integers(1, 4))}
    if draw(st.booleans()):
        body["max_completion_tokens"] = draw(max_tokens_values)
    body["stream"] = draw(st.booleans())
    guarded = {"max_tokens": max_tokens_values, "max_completion_tokens": max_tokens_values, **SAMPLE_COUNTS}
    return mutated(draw, body, CHAT_FIELDS, guarded)


def test_the_server_answers_before_fuzzing(http, baseline):
    assert len(baseline) == 8


@fuzz_settings(max_examples=180)
@given(completion_bodies())
def test_completion_bodies(http, body):
    check_answer(post(http, COMPLETIONS, to_json(body)))


@fuzz_settings(max_examples=180)
@given(chat_bodies())
def test_chat_bodies(http, body):
    check_answer(post(http, CHAT, to_json(body)))


@st.composite
def raw_bodies(draw) -> bytes:
    """Bodies that are no JSON object, no JSON, not UTF-8 or not UTF-8 JSON."""
    kind = draw(st.sampled_from(["junk", "binary", "truncated", "encoded", "fixed"]))
    if kind == "junk":
        return to_json(draw(junk)).encode()
    if kind == "binary":
        return draw(st.binary(max_size=48))
    if kind == "truncated":
        text = to_json(draw(completion_bodies() | chat_bodies()))
        return text[: draw(st.integers(0, max(0, len(text) - 1)))].encode()
    if kind == "encoded":
        text = to_json(draw(completion_bodies() | chat_bodies()))
        return text.encode(draw(st.sampled_from(["utf-16", "utf-32", "utf-8-sig"])))
    return draw(st.sampled_from(ODD_BODIES))


# Past the parser's recursion limit, a number past Python's 4300 digits, and other oddities.
ODD_BODIES = [
    b"",
    b"{",
    b"}",
    b'{"prompt": "\xff\xfe"}',
    b"\x00",
    b"[]" * 1000,
    b"{" * 5000,
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": "hi", "stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "hi", "seed": 1' + b"0" * 4000 + b"}",
    b'{"prompt": "hi", "prompt": 5}',
    b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}',
]


def _is_json_object(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except (ValueError, RecursionError):  # what the server's parser raises too
        return False


@fuzz_settings(max_examples=120)
@given(st.sampled_from([COMPLETIONS, CHAT]), raw_bodies(), st.sampled_from(CONTENT_TYPES))
def test_bodies_that_are_no_json_object(http, path, data, content_type):
    check_answer(post(http, path, data, content_type))


@fuzz_settings(max_examples=60)
@given(st.sampled_from([COMPLETIONS, CHAT]), completion_bodies() | chat_bodies(), st.sampled_from(CONTENT_TYPES))
def test_request_bodies_with_any_content_type(http, path, body, content_type):
    check_answer(post(http, path, to_json(body), content_type))


admin_bodies = st.one_of(
    raw_bodies().filter(lambda data: not _is_json_object(data)),
    st.builds(
        lambda extra, rest: {**rest, **extra},
        st.dictionaries(unknown_names, junk, min_size=1, max_size=2),
        st.dictionaries(st.sampled_from(["mode", "level", "model_path", "group_name", "names"]), junk, max_size=2),
    ).map(lambda body: to_json(body).encode()),
)


@fuzz_settings(max_examples=45)
@given(st.sampled_from(ADMIN_BODY_ROUTES), admin_bodies, st.sampled_from(CONTENT_TYPES))
def test_admin_routes_refuse_what_they_cannot_read(http, path, data, content_type):
    reply = post(http, path, data, content_type)
    assert reply.status_code in CLIENT_ERRORS, (reply.status_code, reply.text[:2000])
    check_answer(reply)


paths = st.one_of(
    st.sampled_from([COMPLETIONS, CHAT, "/v1/models", "/health", *ADMIN_BODY_ROUTES, *(p for _, p in READ_ROUTES)]),
    st.from_regex(r"\A/(v1/)?[a-zA-Z0-9_.~%-]{0,24}(/[a-zA-Z0-9_.%-]{1,8})?/?\Z"),
    st.sampled_from([f"{p}/" for _, p in READ_ROUTES] + [f"{COMPLETIONS}/", f"{CHAT}/"]),
)


@fuzz_settings(max_examples=60)
@given(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "POST"]), paths)
def test_methods_and_paths(http, method, path):
    """Every route a method does not serve, and unknown paths: 404 / 405 in OpenAI's shape."""
    if method == "POST":  # only paths that are no route: POST on a route is the body tests' job
        path = f"/fuzz{path}"
    route = posixpath.normpath(unquote(path))  # where the server routes it (dot segments, %-escapes)
    if method in ("GET", "HEAD") and route in {p for _, p in READ_ROUTES} and not path.endswith("/"):
        return  # served
    reply = http.request(method, path, content=b"null", headers={"content-type": JSON_TYPE})
    assert reply.status_code in CLIENT_ERRORS, (method, path, reply.status_code, reply.text[:500])
    if method != "HEAD":  # HEAD's answer has no body
        check_answer(reply)


def test_a_body_over_the_limit_is_a_413(http):
    reply = post(http, COMPLETIONS, b"x" * (4 * 1024 * 1024 + 1))
    assert reply.status_code == 413 and set(reply.json()) == {"error"}
    check_error(reply.json()["error"], 413)


def test_the_server_is_healthy_and_unchanged_after_fuzzing(http, baseline):
    health = http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    reply = http.post(COMPLETIONS, json=greedy_request())
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == baseline
