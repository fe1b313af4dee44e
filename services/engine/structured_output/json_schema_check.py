"""What a JSON schema asks that the grammar cannot enforce, found before compiling.

xgrammar 0.2.8 compiles some keywords without enforcing them (it only logs a warning), so
outputs would be valid JSON that breaks the schema. A schema that uses one is refused
instead, naming the keyword and where it is; generation never silently ignores a rule.

    refused                                     why
    allOf with several subschemas               compiled as any JSON
    oneOf whose branches may overlap            compiled as anyOf (exactly one is not enforced)
    not, if/then/else, dependencies,            ignored
      dependentRequired, dependentSchemas,
      uniqueItems, contains, propertyNames,
      unevaluatedProperties, unevaluatedItems
    pattern with minLength / maxLength          the lengths are dropped
    multipleOf beside a non-integer type        dropped (on integers it holds)
    a pattern repeating over 128 times          fails inside the compiler with an internal check
      ({1,255})

One gap is closed rather than refused: a `required` name missing from `properties` never
appears, since undeclared names are not generated; it is declared here with the schema
that `additionalProperties` gives it (any value when that is absent).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

_IGNORED_KEYWORDS = (
    "not",
    "if",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
# A subschema's place in its parent: keywords holding one schema, a list, or a name -> schema map.
_ONE = ("additionalProperties", "items", "additionalItems", "not", "if", "then", "else", "contains")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_MAX_PATTERN_REPEAT = 128
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_TYPES_OF_VALUE = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


class UnenforceableSchema(ValueError):
    """The schema uses a keyword the grammar would ignore; the message says which and where."""


def prepare_json_schema(schema: Any) -> Any:
    """A copy of `schema` the grammar enforces exactly; raises UnenforceableSchema otherwise."""
    schema = copy.deepcopy(schema)
    for path, node in _subschemas(schema, ""):
        _check(node, path or "/")
        _declare_required(node)
    return schema


def _check(node: dict, path: str) -> None:
    for keyword in _IGNORED_KEYWORDS:
        if keyword in node:
            raise UnenforceableSchema(f"`{keyword}` at {path} is not supported (it cannot be enforced)")
    if node.get("uniqueItems") is True:
        raise UnenforceableSchema(f"`uniqueItems` at {path} is not supported (it cannot be enforced)")
    if len(node.get("allOf", ())) > 1:
        raise UnenforceableSchema(f"`allOf` with several subschemas at {path} is not supported")
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        raise UnenforceableSchema(f"`pattern` together with `minLength`/`maxLength` at {path} is not supported")
    if isinstance(node.get("pattern"), str) and _max_repeat(node["pattern"]) > _MAX_PATTERN_REPEAT:
        raise UnenforceableSchema(
            f"`pattern` at {path} repeats up to {_max_repeat(node['pattern'])} times; at most "
            f"{_MAX_PATTERN_REPEAT} is supported (use maxLength without a pattern for longer strings)"
        )
    if "multipleOf" in node and (node.get("type") != "integer" or not float(node["multipleOf"]).is_integer()):
        raise UnenforceableSchema(f"`multipleOf` at {path} is supported only on integers, by an integer")
    if "oneOf" in node and not _disjoint(node["oneOf"]):
        raise UnenforceableSchema(
            f"`oneOf` at {path} needs branches that cannot overlap (distinct `type`s, or distinct `const`/`enum` "
            "values); use `anyOf` if more than one may match"
        )


def _max_repeat(pattern: str) -> int:
    bounds = [int(n) for m in _REPEAT.finditer(pattern) for n in m.groups() if n]
    return max(bounds, default=0)


def _declare_required(node: dict) -> None:
    required = node.get("required")
    if not isinstance(required, list):
        return
    properties = node.setdefault("properties", {})
    extra = node.get("additionalProperties", True)
    for name in required:
        if name in properties:
            continue
        if extra is False:
            raise UnenforceableSchema(
                f"`required` names {name!r}, which `properties` and `additionalProperties` forbid"
            )
        properties[name] = extra if isinstance(extra, dict) else {}


def _disjoint(branches: list) -> bool:
    """Whether at most one branch can match any instance: all branches constants with no value
    in common, or each branch's possible JSON types apart from every other's."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    values = [_values(b) for b in branches]
    if all(v is not None for v in values):
        return _pairwise_apart(values)
    types = [_types(b) for b in branches]
    return all(t is not None for t in types) and _pairwise_apart(types)


def _pairwise_apart(sets: list[set]) -> bool:
    return all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])


def _values(branch: dict) -> set[str] | None:
    if "const" in branch:
        return {json.dumps(branch["const"], sort_keys=True)}
    if isinstance(branch.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in branch["enum"]}
    return None


def _types(branch: dict) -> set[str] | None:
    """The JSON types a branch allows (None: not declared); integer and number overlap."""
    if "const" in branch or isinstance(branch.get("enum"), list):
        constants = [branch["const"]] if "const" in branch else branch["enum"]
        types = {_TYPES_OF_VALUE.get(type(v), "null") for v in constants}
    elif "type" in branch:
        declared = branch["type"]
        types = {declared} if isinstance(declared, str) else set(declared)
    else:
        return None
    if types & {"integer", "number"}:
        types |= {"integer", "number"}
    return types


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for keyword in _ONE:
        child = node.get(keyword)
        if isinstance(child, dict):
            yield from _subschemas(child, f"{path}/{keyword}")
    for keyword in _LIST:
        children = node.get(keyword)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{path}/{keyword}/{i}")
    for keyword in _MAP:
        children = node.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _subschemas(child, f"{path}/{keyword}/{name}")
