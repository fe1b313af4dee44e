"""Forced tool calls: chat `tools` with `tool_choice` "required" or a named function.

Without a model-specific parser Baton cannot tell a tool call from text, so it calls tools
only when the request forces one, and then decides the output's shape itself: the output is
constrained to a JSON schema, and the response carries the call as `message.tool_calls`.

    tool_choice {"type": "function", "function": {"name": "f"}}
        output: f's arguments, an object matching f's `parameters`   {"city": "Paris"}
    tool_choice "required"
        output: an array of one or more calls                          [{"name": "f",
                                                                         "parameters": {...}}, ...]
        (`parallel_tool_calls: false`: exactly one)

A named call generates the arguments alone, so every generated token streams as an argument
chunk. "required" uses vLLM's array form, so a model that learned vLLM's forced calls (and a
client reading the raw text) sees the same output. A function without `parameters` takes
`{}`. `$defs` of the functions are hoisted to the array schema's root, where their
`#/$defs/...` references resolve.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..engine.errors import InvalidRequestError

EMPTY_ARGUMENTS = {"type": "object", "properties": {}}
SUPPORTED_CHOICES = '"required", {"type": "function", "function": {"name": ...}} or "none"'


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always match the schema


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: FunctionDefinition | None = None


@dataclass(frozen=True, slots=True)
class ForcedToolCall:
    functions: list[FunctionDefinition]  # the callable ones: one when named
    is_named: bool  # tool_choice named a function: the output is its arguments
    max_calls: int | None = None  # "required" with parallel_tool_calls false: 1

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output must match (see the module docstring)."""
        if self.is_named:
            return self.functions[0].parameters or EMPTY_ARGUMENTS
        defs: dict[str, Any] = {}
        calls = [_call_schema(function, defs) for function in self.functions]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.max_calls is not None:
            schema["maxItems"] = self.max_calls
        if defs:
            schema["$defs"] = defs
        return schema

    def parser(self) -> ToolCallParser:
        """A parser for one choice's output, fed as it streams."""
        if self.is_named:
            return NamedCallParser(self.functions[0].name)
        return CallArrayParser()


def forced_tool_call(
    tools: list[ChatTool] | None, tool_choice: str | dict[str, Any] | None, parallel_tool_calls: bool | None
) -> ForcedToolCall | None:
    """What tools and tool_choice ask for; None when the output is plain text."""
    if tool_choice == "none" or (not tools and tool_choice is None):
        return None  # as OpenAI does: the tools are not called
    if not tools:
        raise InvalidRequestError("tool_choice", "is only allowed when tools are given")
    functions = _functions(tools)
    if tool_choice is None or tool_choice == "auto":
        raise InvalidRequestError(
            "tool_choice",
            f"auto tool choice (the default when tools are given) needs a model-specific tool-call "
            f"parser, which Baton does not have; supported: {SUPPORTED_CHOICES}",
        )
    if tool_choice == "required":
        return ForcedToolCall(functions, is_named=False, max_calls=None if parallel_tool_calls is not False else 1)
    name = _named_function(tool_choice)
    chosen = [function for function in functions if function.name == name]
    if not chosen:
        known = ", ".join(repr(f.name) for f in functions)
        raise InvalidRequestError("tool_choice", f"names the function {name!r}, which is not in tools ({known})")
    return ForcedToolCall(chosen, is_named=True)


def _functions(tools: list[ChatTool]) -> list[FunctionDefinition]:
    functions = []
    for i, tool in enumerate(tools):
        if tool.type != "function" or tool.function is None:
            raise InvalidRequestError(f"tools[{i}]", f"only function tools are supported, got type {tool.type!r}")
        if not tool.function.name:
            raise InvalidRequestError(f"tools[{i}].function.name", "must not be empty")
        functions.append(tool.function)
    names = [f.name for f in functions]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidRequestError("tools", f"function names must be unique; repeated: {', '.join(repeated)}")
    return functions


def _named_function(tool_choice: str | dict[str, Any]) -> str:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
        raise InvalidRequestError("tool_choice.function.name", "is required")
    shown = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
    raise InvalidRequestError("tool_choice", f"{shown!r} is not supported; supported: {SUPPORTED_CHOICES}")


def _call_schema(function: FunctionDefinition, defs: dict[str, Any]) -> dict[str, Any]:
    parameters = dict(function.parameters or EMPTY_ARGUMENTS)
    for name, definition in parameters.pop("$defs", {}).items():
        if defs.setdefault(name, definition) != definition:
            raise InvalidRequestError("tools", f"two functions define $defs {name!r} differently")
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function.name]}, "parameters": parameters},
        "required": ["name", "parameters"],
    }


# -- reading the output back -----------------------------------------------------------


@dataclass(slots=True)
class _Call:
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name: str | None = None
    arguments: str = ""
    num_sent: int = 0  # characters of arguments already streamed
    is_announced: bool = False  # the first delta (id, type, name) went out


class ToolCallParser:
    """Reads one choice's output into tool calls: `feed` each text delta and stream what it
    returns (OpenAI tool-call deltas); `tool_calls` is the whole list at any point."""

    def __init__(self) -> None:
        self._calls: list[_Call] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._read(text)
        deltas = []
        for index, call in enumerate(self._calls):
            if call.name is None:
                continue  # arguments wait until the call's name is known
            if not call.is_announced:
                call.is_announced = True
                function = {"name": call.name, "arguments": ""}
                deltas.append({"index": index, "id": call.id, "type": "function", "function": function})
            if call.num_sent < len(call.arguments):
                deltas.append({"index": index, "function": {"arguments": call.arguments[call.num_sent :]}})
                call.num_sent = len(call.arguments)
        return deltas

    def tool_calls(self) -> list[dict[str, Any]]:
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self._calls
            if c.name is not None
        ]

    def _read(self, text: str) -> None:
        raise NotImplementedError


class NamedCallParser(ToolCallParser):
    """The output is the arguments of one known function."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._calls.append(_Call(name=name))

    def _read(self, text: str) -> None:
        self._calls[0].arguments += text


class CallArrayParser(ToolCallParser):
    """Reads `[{"name": ..., "parameters": {...}}, ...]` a character at a time: tracks
    nesting outside strings, and inside each call object captures the raw text of its
    keys and values; the `parameters` value's text becomes the call's arguments as it comes.

        [ {"name": "f", "parameters": {"a": [1, 2]}} , {...} ]
        ^depth 1       ^value at depth 2, captured until nesting is back at 2
    """

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._in_string = False
        self._is_escaped = False
        self._expects_key = True
        self._key = ""
        self._capture: str | None = None  # "key", or the key whose value is being read
        self._captured = ""
        self._capture_opener = ""

    def _read(self, text: str) -> None:
        for char in text:
            if self._capture is not None and self._continue_capture(char):
                continue
            self._structure(char)

    def _continue_capture(self, char: str) -> bool:
        """Feeds the capture; False when `char` ends a bare value and is structure instead."""
        is_bare = self._capture_opener not in '{["'
        if is_bare and not self._in_string and char in ",}":
            self._end_capture()
            return False
        self._route(char)
        self._track(char)
        if not is_bare and not self._in_string and self._depth == 2:
            self._end_capture()
        return True

    def _structure(self, char: str) -> None:
        if char in " \t\r\n":
            return
        if self._depth == 2:
            if char == '"' and self._expects_key:
                self._start_capture("key", char)
            elif char == ":":
                self._expects_key = False
            elif char == ",":
                self._expects_key = True
            elif char == "}":
                self._depth = 1
            elif not self._expects_key:
                self._start_capture(self._key, char)
            return
        if char in "{[":
            self._depth += 1
            if self._depth == 2:
                self._calls.append(_Call())
                self._expects_key = True
        elif char in "}]":
            self._depth -= 1

    def _start_capture(self, target: str, char: str) -> None:
        self._capture, self._captured, self._capture_opener = target, "", char
        self._route(char)
        self._track(char)

    def _route(self, char: str) -> None:
        if self._capture == "parameters":
            self._calls[-1].arguments += char
        else:
            self._captured += char

    def _track(self, char: str) -> None:
        if self._in_string:
            if self._is_escaped:
                self._is_escaped = False
            elif char == "\\":
                self._is_escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1

    def _end_capture(self) -> None:
        target, text = self._capture, self._captured
        self._capture = None
        if target == "key":
            self._key = _json_string(text)
        elif target == "name":
            self._calls[-1].name = _json_string(text)


def _json_string(text: str) -> str:
    """A captured JSON string's value (a bare value as written)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()
    return value if isinstance(value, str) else text.strip()
