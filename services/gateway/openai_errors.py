"""What the HTTP API says about a body it cannot use: not JSON, not a JSON object, a field of
the wrong type, a string that is not valid Unicode. Each becomes a 400 in OpenAI's error
shape whose message a person can act on; the field is named by its path as the client wrote
it (`messages[0].content`, `param` null when no one field applies), without pydantic's
internals (error types, URLs, inputs, source lines).

    FastAPI could not read the body  ->  body_error(RequestValidationError)
    the body read, a string in it has a lone surrogate  ->  check_strings(body)
"""

from __future__ import annotations

import re
import typing
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from ..engine.api.prompt_checks import check_unicode
from ..engine.errors import InvalidRequestError
from ..serving_errors import MalformedRequestError

NOT_JSON = "the request body must be a JSON object, sent with Content-Type: application/json"


def body_error(error: RequestValidationError, model: type[BaseModel] | None) -> Exception:
    """The first problem FastAPI found reading the body into `model`, as the client's error."""
    errors = list(error.errors())
    if not errors:
        return MalformedRequestError("the request body could not be read")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return MalformedRequestError(_json_problem(error.body, tuple(first.get("loc", ())), first))
    loc = _body_loc(first)
    if not loc:
        return MalformedRequestError(_whole_body_problem(first.get("type", ""), error.body))
    path = _error_path(model, first)
    if not path:
        return MalformedRequestError(f"the request body is invalid: {_problem(first)}")
    # A union field fails once per member type: say what each would have taken.
    problems = [_problem(e) for e in errors if _error_path(model, e) == path]
    return InvalidRequestError(path, _either(list(dict.fromkeys(problems))))


def unreadable_body(cause: BaseException | None) -> str:
    """Why FastAPI could not parse a body (its HTTPException says only that it could not; the
    parser's error is the cause), without the parser's own wording."""
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to read"
    if isinstance(cause, ValueError) and not isinstance(cause, UnicodeDecodeError) and "digits" in str(cause):
        return "a number in the request body has too many digits"
    return "the request body could not be read as JSON: it must be UTF-8 JSON text"


def field_path(model: type[BaseModel] | None, loc: tuple) -> str:
    """`messages[0].content` for loc ("messages", 0, "content", "str"): walks the model's
    fields (by alias) and stops at the first step that is no field, such as a union's
    member tag. Without a model, the loc as given."""
    path, current = "", model
    for step in loc:
        if isinstance(step, int):
            path += f"[{step}]"
            continue
        if model is not None:
            fields = _fields_by_alias(current)
            if fields is None or step not in fields:
                break
            current = _inner_model(fields[step].annotation)
        path += f".{step}" if path else str(step)
    return path


def check_strings(value: Any, path: str = "") -> None:
    """Refuses any string (or key) of a parsed body that UTF-8 cannot encode, naming where."""
    if isinstance(value, BaseModel):
        value = value.model_dump(by_alias=True, exclude_unset=True)
    if isinstance(value, str):
        check_unicode(value, path or "body")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(str(key), f"{path} (a key)" if path else "body (a key)")
            check_strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_strings(item, f"{path}[{index}]")


def _error_path(model: type[BaseModel] | None, entry: dict) -> str:
    loc = _body_loc(entry)
    if entry.get("type") == "extra_forbidden" and loc:  # the unknown key is the point
        parent = field_path(model, loc[:-1])
        return f"{parent}.{loc[-1]}" if parent else str(loc[-1])
    return field_path(model, loc)


def _body_loc(entry: dict) -> tuple:
    loc = tuple(entry.get("loc", ()))
    return loc[1:] if loc[:1] == ("body",) else loc


def _json_problem(doc: Any, loc: tuple, entry: dict) -> str:
    reason = (entry.get("ctx") or {}).get("error", "not valid JSON")
    pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    if not isinstance(doc, str) or pos is None:
        return f"invalid JSON: {reason}"
    line = doc.count("\n", 0, pos) + 1
    column = pos - doc.rfind("\n", 0, pos)
    return f"invalid JSON at line {line} column {column}: {reason}"


def _whole_body_problem(kind: str, body: Any) -> str:
    if kind == "missing":
        return "the request body is empty; it must be a JSON object"
    if isinstance(body, bytes | bytearray):
        return NOT_JSON
    return f"the request body must be a JSON object, not {_json_kind(body)}"


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "that value"


# pydantic's wording, as a message about the field it follows ("Input should be" -> "must be").
_REWORDINGS = (
    (re.compile(r"^[A-Z][a-z]+ should "), "must "),
    (re.compile(r"^Field required"), "is required"),
    (re.compile(r"^Extra inputs are not permitted"), "is not a known field"),
    (re.compile(r"^(Value error|Assertion failed), "), ""),
    (re.compile(r" after validation"), ""),
)


def _problem(entry: dict) -> str:
    message = str(entry.get("msg") or "is invalid")
    for pattern, replacement in _REWORDINGS:
        message = pattern.sub(replacement, message, count=1)
    return message


def _either(problems: list[str]) -> str:
    """ "must be a valid string or a valid list" from the problems of each union member."""
    if len(problems) > 1 and all(p.startswith("must be ") for p in problems):
        rests = [p[len("must be ") :] for p in problems]
        return "must be " + ", ".join(rests[:-1]) + " or " + rests[-1]
    return " or ".join(problems)


def _fields_by_alias(model: Any) -> dict[str, Any] | None:
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    return {info.alias or name: info for name, info in model.model_fields.items()}


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, through Optional, unions and lists (None for plain values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None
