"""The schema check refuses, by keyword and place, what the grammar would not enforce, and
declares required names that `properties` leaves out."""

from __future__ import annotations

import pytest
from baton.services.engine.structured_output.json_schema_check import UnenforceableSchema, prepare_json_schema


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "integer", "not": {"enum": [1]}}, "`not` at / is not supported"),
        ({"properties": {"a": {"if": {}, "then": {}}}}, "`if` at /properties/a"),
        ({"type": "object", "dependencies": {"a": ["b"]}}, "`dependencies` at /"),
        ({"type": "array", "uniqueItems": True}, "`uniqueItems` at /"),
        ({"type": "array", "items": {"type": "array", "contains": {}}}, "`contains` at /items"),
        ({"allOf": [{"required": ["a"]}, {"required": ["b"]}]}, "`allOf` with several subschemas at /"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "`pattern` together with"),
        ({"type": "number", "multipleOf": 0.5}, "`multipleOf` at / is supported only on integers"),
        ({"type": "integer", "multipleOf": 0.5}, "supported only on integers, by an integer"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "`oneOf` at / needs branches that cannot overlap"),
        ({"oneOf": [{"type": "string"}, {"const": "a"}]}, "`oneOf` at /"),
        ({"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]}, "`oneOf` at /"),
        ({"$defs": {"x": {"oneOf": [{}, {"type": "string"}]}}}, "`oneOf` at /$defs/x"),
        ({"type": "string", "pattern": "^[a-z]{1,255}$"}, "repeats up to 255 times"),
        ({"properties": {"a": {}}, "required": ["b"], "additionalProperties": False}, "names 'b', which"),
    ],
)
def test_what_the_grammar_cannot_enforce_is_refused_by_name(schema, message):
    with pytest.raises(UnenforceableSchema, match=message.replace("$", r"\$")):
        prepare_json_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": ["null", "boolean"]}]},
        {"oneOf": [{"const": "a"}, {"const": "b"}, {"enum": [1, 2]}]},
        {"oneOf": [{"type": "string"}, {"const": 3}]},
        {"allOf": [{"type": "object"}]},
        {"type": "integer", "multipleOf": 3},
        {"type": "string", "pattern": "^[a-z]{1,128}$"},
        {"type": "string", "maxLength": 500},
    ],
)
def test_what_the_grammar_enforces_passes_unchanged(schema):
    assert prepare_json_schema(schema) == schema


def test_required_names_missing_from_properties_are_declared():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    assert prepare_json_schema(schema)["properties"] == {"a": {"type": "integer"}, "b": {}}
    typed = {"type": "object", "required": ["x"], "additionalProperties": {"type": "string"}}
    assert prepare_json_schema(typed)["properties"] == {"x": {"type": "string"}}
    assert "properties" not in typed  # the caller's schema is left alone
