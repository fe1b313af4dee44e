"""Forced tool calls without Ray: the schema the output must match, the 400s of tool choices
Baton cannot serve, and the response shaped from a fake stream of text deltas, read back by
the unmodified `openai` client (whole and streamed)."""

from __future__ import annotations

import json
import random

import openai
import pytest
from baton.services.engine.api.sampling_params import StructuredOutputKind
from baton.services.gateway.openai_api import build_http_app
from baton.services.gateway.tool_calls import CallArrayParser, ChatTool, forced_tool_call
from fastapi.testclient import TestClient

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "now", "description": "the time"}},
]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGUMENTS = '{"city": "Pa\\"ris", "unit": "c"}'
CALLS = f'[{{"name": "get_weather", "parameters": {ARGUMENTS}}}, {{"name": "now", "parameters": {{}}}}]'


def chunks_of(text: str, seed: int = 0) -> list[str]:
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        step = rng.randint(1, 4)
        pieces.append(text[i : i + step])
        i += step
    return pieces


def deltas_of(text: str, finish: str = "stop") -> list[tuple[int, str, str | None]]:
    pieces = chunks_of(text)
    return [(0, piece, finish if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]


@pytest.fixture
def client_for(fake_gateway):
    """client_for(generated text, finish) -> (openai.OpenAI over the fake, its engine client)."""

    def make(text: str = "", finish: str = "stop"):
        gateway, engine_client = fake_gateway(deltas=deltas_of(text, finish) if text else None)
        http = TestClient(build_http_app(gateway.openai))
        return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http), engine_client

    return make


def forced(tool_choice, parallel_tool_calls=None):
    return forced_tool_call([ChatTool(**t) for t in TOOLS], tool_choice, parallel_tool_calls)


def test_named_function_output_is_its_parameters():
    assert forced(NAMED).schema() == WEATHER_PARAMETERS
    no_parameters = {"type": "function", "function": {"name": "now"}}
    assert forced(no_parameters).schema() == {"type": "object", "properties": {}}


def test_required_output_is_an_array_of_calls():
    schema = forced("required").schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first["properties"] == {
        "name": {"type": "string", "enum": ["get_weather"]},
        "parameters": WEATHER_PARAMETERS,
    }
    assert first["required"] == ["name", "parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert forced("required", parallel_tool_calls=False).schema()["maxItems"] == 1


def test_required_hoists_defs_to_the_root():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    parameters = {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "$defs": {"point": point}}
    tools = [ChatTool(type="function", function={"name": f, "parameters": parameters}) for f in ("a", "b")]
    schema = forced_tool_call(tools, "required", None).schema()
    assert schema["$defs"] == {"point": point}
    assert all("$defs" not in call["properties"]["parameters"] for call in schema["items"]["anyOf"])
    other = {**parameters, "$defs": {"point": {"type": "string"}}}
    tools[1] = ChatTool(type="function", function={"name": "b", "parameters": other})
    with pytest.raises(ValueError, match="point"):
        forced_tool_call(tools, "required", None).schema()


def test_call_array_parser_streams_what_the_whole_text_gives():
    whole = CallArrayParser()
    whole.feed(CALLS)
    calls = whole.tool_calls()
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [json.loads(ARGUMENTS), {}]
    for seed in range(20):
        parser, streamed = CallArrayParser(), {}
        for piece in chunks_of(CALLS, seed):
            for delta in parser.feed(piece):
                if "id" in delta:
                    assert delta["function"] == {"name": calls[delta["index"]]["function"]["name"], "arguments": ""}
                streamed[delta["index"]] = streamed.get(delta["index"], "") + delta["function"]["arguments"]
        assert streamed == {0: ARGUMENTS, 1: "{}"}


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_call_reaches_the_engine_as_a_json_schema(client_for, tool_choice):
    client, engine_client = client_for("{}")
    client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    constraint = engine_client.calls[-1].params.structured_output
    assert constraint.kind is StructuredOutputKind.JSON
    assert json.loads(constraint.spec) == forced(tool_choice).schema()


def test_named_call_response(client_for):
    client, _ = client_for(ARGUMENTS)
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(ARGUMENTS)


def test_required_calls_response(client_for):
    client, _ = client_for(CALLS)
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    calls = response.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "now"]
    assert [c.function.arguments for c in calls] == [ARGUMENTS, "{}"]
    assert len({c.id for c in calls}) == 2 and response.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "tool_choice,text,expected",
    [
        (NAMED, ARGUMENTS, [("get_weather", ARGUMENTS)]),
        ("required", CALLS, [("get_weather", ARGUMENTS), ("now", "{}")]),
    ],
    ids=["named", "required"],
)
def test_streamed_tool_call_deltas(client_for, tool_choice, text, expected):
    client, _ = client_for(text)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.content is None for c in chunks)
    calls: dict[int, list] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in calls:  # the first delta of a call: id, type, name, no arguments yet
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.arguments == ""
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index][1] += delta.function.arguments
    assert [tuple(calls[i]) for i in sorted(calls)] == expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_call_cut_by_max_tokens_ends_length(client_for):
    client, _ = client_for(ARGUMENTS[:10], finish="length")
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED)
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.tool_calls[0].function.arguments == ARGUMENTS[:10]


def test_tool_choice_none_ignores_the_tools(client_for):
    client, engine_client = client_for()
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert engine_client.calls[-1].params.structured_output is None
    assert response.choices[0].message.content == "ok" and response.choices[0].message.tool_calls is None


REFUSED_CHOICES = [
    ({"tools": TOOLS}, "tool_choice", ["auto", "model-specific", '"required"', '"none"']),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", ["auto", "parser", '"required"', '"function"']),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", ["'fly'"]),
    ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice", ["allowed_tools", "supported"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name", ["required"]),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}], "tool_choice": "required"}, "tools[0]", ["function"]),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", ["get_weather"]),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        ["response_format"],
    ),
]


@pytest.mark.parametrize(
    "body,param,words", REFUSED_CHOICES, ids=[str(b.get("tool_choice"))[:30] for b, *_ in REFUSED_CHOICES]
)
def test_tool_choices_baton_cannot_serve_are_400(client_for, body, param, words):
    client, engine_client = client_for()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, **body)
    assert info.value.body["param"] == param
    assert all(word in info.value.body["message"] for word in words), info.value.body["message"]
    assert engine_client.calls == []
