"""The OpenAI request fields that constrain the output, read into one `Constraint`.

    response_format      {"type": "text"} (no constraint) | {"type": "json_object"}
                         | {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs   vLLM's extra body: one of "json" (a schema, object or JSON string),
                         "regex", "choice" (a list), "grammar" (EBNF/GBNF with a `root` rule),
                         "json_object": true; and how JSON is spaced (below)
    guided_json, guided_regex, guided_choice, guided_grammar
                         vLLM's older names for the same, still sent by older clients
    tool_choice          a forced tool call (tool_calls.py) is a JSON schema too

A request carries at most one constraint; two at once are refused naming both, since no
engine can satisfy both without intersecting them. JSON is generated compactly unless
`structured_outputs` allows free whitespace: `"any_whitespace": true` (xgrammar's name) or
`"disable_any_whitespace": false` (vLLM's, where free whitespace is the default; Baton's
default is compact, because small models otherwise fill JSON with spaces until max_tokens).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.api.sampling_params import StructuredOutputKind
from ..engine.errors import InvalidRequestError
from .structured_output import Constraint, constraint_of_kind, json_schema_constraint
from .tool_calls import ForcedToolCall

JSON, JSON_OBJECT = StructuredOutputKind.JSON, StructuredOutputKind.JSON_OBJECT
REGEX, CHOICE, GRAMMAR = StructuredOutputKind.REGEX, StructuredOutputKind.CHOICE, StructuredOutputKind.GRAMMAR


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None  # the output always matches the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`; an unknown key is refused rather than ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: Any = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    any_whitespace: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    backend: str | None = None  # one backend (xgrammar): nothing to choose
    disable_fallback: bool | None = None  # no fallback backend either


class ConstraintFields(BaseModel):
    """The constraint fields of both completions and chat completions."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self, forced_call: ForcedToolCall | None = None) -> Constraint | None:
        """The one constraint the request sets, or None."""
        so = self.structured_outputs or StructuredOutputs()
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(so, name) is not None:
                raise InvalidRequestError(f"structured_outputs.{name}", "is not supported")
        candidates = [
            *self._response_format(),
            ("structured_outputs.json", JSON, so.json_),
            ("structured_outputs.regex", REGEX, so.regex),
            ("structured_outputs.choice", CHOICE, so.choice),
            ("structured_outputs.grammar", GRAMMAR, so.grammar),
            ("structured_outputs.json_object", JSON_OBJECT, so.json_object or None),
            ("guided_json", JSON, self.guided_json),
            ("guided_regex", REGEX, self.guided_regex),
            ("guided_choice", CHOICE, self.guided_choice),
            ("guided_grammar", GRAMMAR, self.guided_grammar),
            ("tool_choice", JSON, forced_call.schema() if forced_call else None),
        ]
        found = [(field, kind, value) for field, kind, value in candidates if value is not None]
        if len(found) > 1:
            raise InvalidRequestError(
                found[1][0], f"cannot be combined with {found[0][0]}: a request takes one output constraint"
            )
        if not found:
            return None
        field, kind, value = found[0]
        if so.disable_additional_properties:
            if kind is not JSON:
                raise InvalidRequestError("structured_outputs.disable_additional_properties", "applies to JSON schemas")
            value = close_objects(_parsed(field, value))
        return _built(field, kind, value, self._any_whitespace(so))

    def _response_format(self) -> list[tuple[str, StructuredOutputKind, Any]]:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return []
        if fmt.type == "json_object":
            return [("response_format", JSON_OBJECT, True)]
        if fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError("response_format.json_schema.schema", "is required for type json_schema")
            return [("response_format.json_schema.schema", JSON, fmt.json_schema.schema_)]
        raise InvalidRequestError(
            "response_format.type", f"{fmt.type!r} is not supported; supported: text, json_object, json_schema"
        )

    @staticmethod
    def _any_whitespace(so: StructuredOutputs) -> bool:
        if so.any_whitespace is not None and so.any_whitespace == so.disable_any_whitespace:
            raise InvalidRequestError(
                "structured_outputs.any_whitespace", "contradicts structured_outputs.disable_any_whitespace"
            )
        if so.any_whitespace is not None:
            return so.any_whitespace
        return so.disable_any_whitespace is False


def _built(field: str, kind: StructuredOutputKind, value: Any, any_whitespace: bool) -> Constraint:
    if kind is JSON:
        return json_schema_constraint(field, value, any_whitespace)
    if kind is JSON_OBJECT:
        return constraint_of_kind(field, kind, any_whitespace=any_whitespace)
    if kind is CHOICE:
        return constraint_of_kind(field, kind, choices=tuple(value))
    return constraint_of_kind(field, kind, spec=value)


def _parsed(field: str, schema: Any) -> Any:
    """The schema as an object (a JSON string parsed), checked as json_schema_constraint does."""
    return json.loads(json_schema_constraint(field, schema).params.spec)


# Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema that leaves
    additionalProperties open gets it closed, so the output holds only named properties."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = close_objects(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [close_objects(item) for item in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: close_objects(sub) for name, sub in closed[key].items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed
