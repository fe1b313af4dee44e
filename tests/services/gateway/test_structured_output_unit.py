"""Output constraints and refused parameters without Ray: what reaches the engine client for
every OpenAI and gRPC form, and the 400 / INVALID_ARGUMENT of every bad or refused one."""

from __future__ import annotations

import json

import grpc
import pytest
from baton.services.engine.api.sampling_params import StructuredOutputKind as Kind
from baton.services.engine.api.sampling_params import StructuredOutputParams
from baton.services.engine.errors import InvalidRequestError
from baton.services.gateway import grpc_api
from baton.services.gateway.openai_api import build_http_app
from baton.v1 import inference_pb2 as pb
from fastapi.testclient import TestClient

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


@pytest.fixture
def http(fake_gateway):
    gateway, engine_client = fake_gateway()
    return TestClient(build_http_app(gateway.openai)), engine_client


def post(http, body: dict, chat: bool = False):
    client, engine_client = http
    path = "/v1/chat/completions" if chat else "/v1/completions"
    reply = client.post(path, json={**(CHAT if chat else COMPLETION), **body})
    params = engine_client.calls[-1].params if engine_client.calls and reply.status_code == 200 else None
    return reply, params


def refused(reply, param: str, *words: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert all(word in error["message"] for word in words), error["message"]


ACCEPTED = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputParams(Kind.JSON_OBJECT)),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}},
        StructuredOutputParams(Kind.JSON, COMPACT),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputParams(Kind.JSON, COMPACT)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, StructuredOutputParams(Kind.JSON, COMPACT)),
    ({"structured_outputs": {"json": True}}, StructuredOutputParams(Kind.JSON, "true")),
    ({"structured_outputs": {"regex": r"\d{3}"}}, StructuredOutputParams(Kind.REGEX, r"\d{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputParams(Kind.CHOICE, choices=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputParams(Kind.GRAMMAR, 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputParams(Kind.JSON_OBJECT)),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"guided_json": SCHEMA}, StructuredOutputParams(Kind.JSON, COMPACT)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputParams(Kind.JSON, COMPACT)),
    ({"guided_regex": "[ab]+"}, StructuredOutputParams(Kind.REGEX, "[ab]+")),
    ({"guided_choice": ["x"]}, StructuredOutputParams(Kind.CHOICE, choices=("x",))),
    ({"guided_grammar": 'root ::= "b"'}, StructuredOutputParams(Kind.GRAMMAR, 'root ::= "b"')),
    # Whitespace: compact by default; vLLM's and xgrammar's names both open it.
    (
        {"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": False}},
        StructuredOutputParams(Kind.JSON, COMPACT, any_whitespace=True),
    ),
    (
        {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
        StructuredOutputParams(Kind.JSON_OBJECT),
    ),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"any_whitespace": True}},
        StructuredOutputParams(Kind.JSON_OBJECT, any_whitespace=True),
    ),
    (
        {"structured_outputs": {"regex": "a", "backend": "xgrammar", "disable_fallback": True}},
        StructuredOutputParams(Kind.REGEX, "a"),
    ),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("body,expected", ACCEPTED, ids=[json.dumps(b)[:60] for b, _ in ACCEPTED])
def test_each_form_reaches_the_engine(http, chat, body, expected):
    reply, params = post(http, body, chat)
    assert reply.status_code == 200, reply.text
    assert params.structured_output == expected


def test_disable_additional_properties_closes_every_object(http):
    nested = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {}}},
        "$defs": {"d": {"type": "object"}},
    }
    reply, params = post(http, {"guided_json": nested, "structured_outputs": {"disable_additional_properties": True}})
    schema = json.loads(params.structured_output.spec)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["a"]["additionalProperties"] is False
    assert schema["$defs"]["d"]["additionalProperties"] is False
    reply, _ = post(http, {"guided_regex": "a", "structured_outputs": {"disable_additional_properties": True}})
    refused(reply, "structured_outputs.disable_additional_properties", "JSON")


CONFLICTS = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice", "structured_outputs.regex"),
    ({"structured_outputs": {"json": SCHEMA}, "guided_json": SCHEMA}, "guided_json", "structured_outputs.json"),
    (
        {
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            "structured_outputs": {"json_object": True},
        },
        "structured_outputs.json_object",
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize("body,second,first", CONFLICTS)
def test_two_constraints_are_refused_naming_both(http, body, second, first):
    reply, _ = post(http, body)
    refused(reply, second, first, "one output constraint")


BAD = [
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json", "an object or a boolean", "an array"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json", "a number"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}},
        "response_format.json_schema.schema",
        "not valid JSON",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "required",
    ),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", "structural_tag", "json_schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
    ({"guided_regex": ""}, "guided_regex", "empty"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar", "empty"),
    (
        {"structured_outputs": {"whitespace_pattern": " *", "json_object": True}},
        "structured_outputs.whitespace_pattern",
        "not supported",
    ),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag", "not supported"),
    (
        {"structured_outputs": {"json_object": True, "any_whitespace": True, "disable_any_whitespace": True}},
        "structured_outputs.any_whitespace",
        "contradicts",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[1] for c in BAD])
def test_bad_constraints_are_400_naming_the_field(http, case):
    body, param, *words = case
    reply, _ = post(http, body)
    refused(reply, param, *words)
    assert http[1].calls == []  # refused before it reached a worker


def test_unknown_structured_outputs_key_is_400(http):
    reply, _ = post(http, {"structured_outputs": {"regexp": "a"}})
    assert reply.status_code == 400 and "structured_outputs.regexp" in reply.json()["error"]["message"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_compile_error_names_the_users_field(fake_gateway, chat, stream):
    gateway, _ = fake_gateway(error=InvalidRequestError("structured_output.json", "unsupported keyword 'foo'"))
    client = TestClient(build_http_app(gateway.openai))
    body = {
        **(CHAT if chat else COMPLETION),
        "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    }
    reply = client.post("/v1/chat/completions" if chat else "/v1/completions", json={**body, "stream": stream})
    refused(reply, "response_format.json_schema.schema", "unsupported keyword 'foo'")


# -- parameters Baton refuses rather than ignores ----------------------------------------

REFUSED = [
    (False, {"logit_bias": {"x5": -100}}, "logit_bias"),
    (True, {"logit_bias": {"5": 101}}, "logit_bias"),
    (True, {"echo": True}, "echo"),
    (False, {"suffix": "}"}, "suffix"),
    (False, {"best_of": 3, "stream": True}, "best_of"),
    (False, {"best_of": 1, "n": 2}, "best_of"),
    (False, {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    (True, {"functions": [{"name": "f"}]}, "functions"),
    (True, {"function_call": "auto"}, "function_call"),
    (True, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (True, {"modalities": ["text", "audio"]}, "modalities"),
    (True, {"reasoning_effort": "low"}, "reasoning_effort"),
    (True, {"verbosity": "low"}, "verbosity"),
    (True, {"web_search_options": {}}, "web_search_options"),
    (True, {"top_logprobs": 2}, "top_logprobs"),
    (True, {"continue_final_message": True}, "continue_final_message"),
    (True, {"add_generation_prompt": False}, "add_generation_prompt"),
    (True, {"chat_template": "{{ messages }}"}, "chat_template"),
    (True, {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    (False, {"use_beam_search": True}, "use_beam_search"),
    (False, {"bad_words": ["x"]}, "bad_words"),
    (True, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (True, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (False, {"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
    (False, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (
        False,
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
]


@pytest.mark.parametrize("chat,body,param", REFUSED, ids=[p for _, _, p in REFUSED])
def test_unimplemented_parameters_are_400_naming_them(http, chat, body, param):
    reply, _ = post(http, body, chat)
    refused(reply, param)
    assert http[1].calls == []


HARMLESS = [
    (False, {"logit_bias": {}, "echo": False, "suffix": "", "best_of": 2, "n": 2, "stream": True}),
    (True, {"logit_bias": None, "modalities": ["text"], "parallel_tool_calls": True, "add_generation_prompt": True}),
    (True, {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "k"}),
    (True, {"prediction": {"type": "content", "content": "x"}, "safety_identifier": "s", "priority": 0}),
    (False, {"guided_decoding_backend": "xgrammar", "some_future_field": 1, "tool_choice": "none"}),
]


@pytest.mark.parametrize("chat,body", HARMLESS)
def test_fields_that_change_nothing_pass(http, chat, body):
    reply, _ = post(http, body, chat)
    assert reply.status_code == 200, reply.text


def test_allowed_token_ids_reach_the_engine(http):
    _, params = post(http, {"allowed_token_ids": [3, 4]})
    assert params.allowed_token_ids == [3, 4]


# -- gRPC ----------------------------------------------------------------------------------

GRPC_ACCEPTED = [
    (pb.SamplingParameters(), None),
    (pb.SamplingParameters(json_schema=json.dumps(SCHEMA, indent=1)), StructuredOutputParams(Kind.JSON, COMPACT)),
    (
        pb.SamplingParameters(json_schema=json.dumps(SCHEMA), any_whitespace=True),
        StructuredOutputParams(Kind.JSON, COMPACT, any_whitespace=True),
    ),
    (pb.SamplingParameters(regex="[0-9]+"), StructuredOutputParams(Kind.REGEX, "[0-9]+")),
    (
        pb.SamplingParameters(choice=pb.Choices(choices=["a", "b"])),
        StructuredOutputParams(Kind.CHOICE, choices=("a", "b")),
    ),
    (pb.SamplingParameters(grammar='root ::= "x"'), StructuredOutputParams(Kind.GRAMMAR, 'root ::= "x"')),
    (pb.SamplingParameters(json_object=True), StructuredOutputParams(Kind.JSON_OBJECT)),
]


@pytest.mark.parametrize("sampling,expected", GRPC_ACCEPTED)
def test_grpc_oneof_maps_to_the_engine(sampling, expected):
    request = grpc_api.generation_request(pb.GenerateRequest(text="hi", sampling=sampling))
    assert request.params.structured_output == expected
    assert request.constraint_field == (sampling.WhichOneof("structured_output") if expected else None)


GRPC_BAD = [
    (pb.SamplingParameters(json_schema="{oops"), "json_schema", "not valid JSON"),
    (pb.SamplingParameters(json_schema='"a string"'), "json_schema", "a string"),
    (pb.SamplingParameters(json_object=False), "json_object", "must be true"),
    (pb.SamplingParameters(choice=pb.Choices()), "choice", "at least one choice"),
    (pb.SamplingParameters(regex=""), "regex", "empty"),
    (pb.SamplingParameters(grammar=" "), "grammar", "empty"),
]


@pytest.mark.parametrize("sampling,field,words", GRPC_BAD)
async def test_grpc_bad_constraint_is_invalid_argument_naming_the_field(
    fake_gateway, grpc_failure, sampling, field, words
):
    gateway, engine_client = fake_gateway()
    context = await grpc_failure(gateway, pb.GenerateRequest(text="hi", sampling=sampling))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith(f"{field}: ") and words in context.details
    assert engine_client.calls == []


async def test_grpc_compile_error_names_the_proto_field(fake_gateway, grpc_failure):
    gateway, _ = fake_gateway(error=InvalidRequestError("structured_output.regex", "unbalanced parenthesis"))
    context = await grpc_failure(gateway, pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(regex="(a")))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == "regex: unbalanced parenthesis"
