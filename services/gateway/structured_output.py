"""Output constraints as users write them, turned into the engine's `StructuredOutputParams`.

Both APIs build their constraints here, so a schema given as an object or as a JSON string,
an empty choice list or an empty pattern get the same checks and the same messages. Every
error names the field the user set (`response_format.json_schema.schema`, `guided_regex`,
gRPC `json_schema`, ...), not the engine's name for the kind. What the engine's compiler
refuses later (an unsupported schema feature, a regex that does not compile) is renamed the
same way by `GenerationService.stream`, through `Constraint.field`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams
from ..engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Constraint:
    field: str  # the API field the user set, for error messages
    params: StructuredOutputParams


def json_schema_constraint(field: str, schema: Any, any_whitespace: bool = False) -> Constraint:
    """A JSON schema given as an object, a boolean, or a JSON string of either; sent to the
    engine compactly serialised, so equal schemas hit the same compiled grammar."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(field, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(field, f"must be a JSON schema (an object or a boolean), got {_json_type(schema)}")
    spec = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return constraint_of_kind(field, StructuredOutputKind.JSON, spec=spec, any_whitespace=any_whitespace)


def constraint_of_kind(field: str, kind: StructuredOutputKind, **fields: Any) -> Constraint:
    """StructuredOutputParams of `kind`, its shape errors renamed to the user's field."""
    try:
        return Constraint(field, StructuredOutputParams(kind, **fields))
    except InvalidRequestError as e:
        raise InvalidRequestError(field, e.message) from None


def user_facing(error: BaseException, constraint_field: str | None) -> BaseException:
    """The engine names a constraint it cannot compile `structured_output.<kind>`; the user
    knows it by the field they set. Other errors pass unchanged (Ray-wrapped ones too)."""
    cause = getattr(error, "cause", None)
    cause = cause if isinstance(cause, BaseException) else error
    if (
        constraint_field is not None
        and isinstance(cause, InvalidRequestError)
        and cause.field.startswith("structured_output")
    ):
        return InvalidRequestError(constraint_field, cause.message)
    return error


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
