"""What the fuzz suites (test_fuzz_http.py, test_fuzz_grpc.py) share: their hypothesis
settings, a check that an error message leaks no internals, and JSON values of every wrong
shape, written out as the raw JSON text a client could send (NaN, Infinity, 1e400, escaped
lone surrogates: tokens Python's json module reads but a strict encoder never writes); and
protobuf messages with any field values, and encodings no message can have (a string field
that is not UTF-8, a corrupt end), from the messages' descriptors.

Each suite's example counts are fixed and derandomized, so CI runs the same requests every
time in about 20 s of requests each; BATON_FUZZ_SCALE=N runs N times as many (a longer, local
hunt: `BATON_FUZZ_SCALE=20 pytest tests/services/gateway/test_fuzz_*.py`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from .big_requests import varint

MODEL = "baton-tiny"
FIXED_PROMPT = "def fibonacci(n):"


def fuzz_settings(max_examples: int) -> settings:
    """Reproducible in CI: fixed example count, derandomized, no example database."""
    scale = float(os.environ.get("BATON_FUZZ_SCALE", "1"))
    return settings(
        max_examples=max(1, round(max_examples * scale)),
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # explaining reruns each line: slow here
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# What a message to a client must never carry: tracebacks and source locations, Python and
# pydantic class names and reprs, Ray's actor ids, pids and addresses.
_INTERNALS = re.compile(
    r"Traceback|File \"|\.py\b|, line \d+|site-packages|/work/|/usr/|/tmp/|/home/"
    r"|\b\w*(Error|Exception)\b|pydantic|errors\.pydantic\.dev|\{'type'|'loc'|<class |object at 0x"
    r"|\bActor(ID)?\b|actor_id|\bpid[=: ]\s*\d+|\bip=|\bnode_id|\b(?=\d*[a-f])[0-9a-f]{24,}\b|\b\d+\.\d+\.\d+\.\d+:\d+"
)


def internals_in(message: str) -> list[str]:
    """The pieces of `message` that look like internals (empty: none)."""
    return [m.group(0) for m in _INTERNALS.finditer(message)]


@dataclass(frozen=True, slots=True)
class Raw:
    """A JSON token written as is (NaN, 1e400, "\\ud800")."""

    text: str


def to_json(value: Any) -> str:
    """JSON text of `value`, with each `Raw` written verbatim; strings are \\u-escaped, so a
    lone surrogate goes out as JSON's escape for it."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{to_json(str(k))}: {to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


RAW_TOKENS = [
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e400"),
    Raw("-1e400"),
    Raw("-0"),
    Raw("1e-400"),
    Raw('"\\ud800"'),
    Raw('"a\\udfffb"'),
    Raw('"\\ud83d"'),
    Raw('"\\u0000"'),
    Raw("123456789012345678901234567890"),
]
BIG_INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, -1, -(2**31)]

# Integers that cost little wherever they land: negative, huge (refused), or small.
cheap_ints = st.one_of(
    st.integers(-(2**70), -1), st.integers(2**31, 2**70), st.integers(0, 6), st.sampled_from(BIG_INTS)
)
short_text = st.text(max_size=12)
leaf_junk = st.one_of(
    st.none(),
    st.booleans(),
    cheap_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    short_text,
    st.sampled_from(RAW_TOKENS),
)
junk = st.recursive(
    leaf_junk,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(short_text, inner, max_size=3),
    max_leaves=6,
)
# max_tokens never null or absent (that generates to the end of the context): small,
# out of range, or of a wrong type.
wrong_types = st.sampled_from([Raw("NaN"), Raw("1e400"), 2.5, "8", [4], {"n": 4}, True, None])
max_tokens_values = st.one_of(
    st.integers(1, 4),
    st.integers(-(2**40), 0),
    st.integers(300, 2**70),
    wrong_types.filter(lambda v: v is not None),
)
# Samples per request: few, over the engine's max_num_seqs (refused), or of a wrong type.
num_samples_values = st.one_of(
    st.integers(1, 3), st.integers(-(2**40), 0), st.integers(4, 2**70), st.sampled_from(BIG_INTS), wrong_types
)
unknown_names = st.from_regex(r"\Ax_fuzz_[a-z0-9_]{0,8}\Z") | short_text.map(lambda s: f"x-{s}")


def mutated(draw, body: dict, field_names: list[str], guarded: dict[str, st.SearchStrategy]) -> dict:
    """`body` with up to four fields set to junk (a schema field, a refused field or an
    unknown one), maybe one field dropped. A field in `guarded` only gets values from its
    strategy and is never dropped (it bounds how much generating costs)."""
    body = dict(body)
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.one_of(st.sampled_from(field_names), unknown_names))
        body[name] = draw(guarded.get(name, junk))
    droppable = [k for k in body if k not in guarded]
    if droppable and draw(st.integers(0, 5)) == 0:
        del body[draw(st.sampled_from(droppable))]
    return body


def schema_fields(model: Any) -> list[str]:
    """A request model's field names as clients write them (aliases)."""
    return sorted(info.alias or name for name, info in model.model_fields.items())


# -- protobuf messages and their wire format -------------------------------------------

_UINT32 = st.one_of(st.integers(0, 8), st.integers(300, 2**32 - 1), st.just(2**32 - 1))
_SCALARS = {
    FieldDescriptor.TYPE_STRING: st.text(max_size=16),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_UINT32: _UINT32,
    FieldDescriptor.TYPE_INT32: st.one_of(st.integers(-8, 8), st.integers(-(2**31), 2**31 - 1)),
    FieldDescriptor.TYPE_UINT64: st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1)),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
}


@st.composite
def messages_of(draw, descriptor: Descriptor, overrides: dict[str, st.SearchStrategy], depth: int = 0) -> Any:
    """A message of `descriptor`'s type with any subset of its fields set to any value of
    their type (one member per oneof); `overrides` maps a field's full name to the strategy
    its values come from."""
    message = message_factory.GetMessageClass(descriptor)()
    for oneof in descriptor.oneofs:  # real and proto3-optional ones: at most one member each
        members = list(oneof.fields)
        chosen = draw(st.sampled_from([None, *members]))
        for field in members:
            if field is chosen:
                _set(draw, message, field, overrides, depth)
    for field in descriptor.fields:
        if field.containing_oneof is None and draw(st.booleans()):
            _set(draw, message, field, overrides, depth)
    return message


def _set(draw, message: Any, field: FieldDescriptor, overrides: dict, depth: int) -> None:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if depth >= 2:
            return
        values = draw(st.lists(messages_of(field.message_type, overrides, depth + 1), min_size=1, max_size=2))
        if field.message_type.GetOptions().map_entry:
            target = getattr(message, field.name)
            for entry in values:
                target[entry.key] = entry.value
        elif field.is_repeated:
            getattr(message, field.name).extend(values)
        else:
            getattr(message, field.name).CopyFrom(values[0])
        return
    strategy = overrides.get(field.full_name, _SCALARS.get(field.type, st.integers(0, 3)))
    if field.is_repeated:
        getattr(message, field.name).extend(draw(st.lists(strategy, max_size=3)))
    else:
        setattr(message, field.name, draw(strategy))


def length_delimited(field_number: int, payload: bytes) -> bytes:
    return varint(field_number << 3 | 2) + varint(len(payload)) + payload


def string_paths(descriptor: Descriptor, depth: int = 0) -> list[tuple[int, ...]]:
    """Field-number paths to every string field, through nested messages."""
    paths = []
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            paths.append((field.number,))
        elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < 2:
            paths += [(field.number, *rest) for rest in string_paths(field.message_type, depth + 1)]
    return paths


NOT_UTF8 = [b"\xff\xfe", b"\xc3\x28", b"a\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"]
# Ends no message of any type can have: a truncated varint or tag, wire types 6 and 7, a
# group that never ends or ends unopened, a field number 0, a length past the end.
CORRUPT_ENDS = [
    b"\x08",
    b"\x80",
    b"\x0e",
    b"\x0f",
    b"\x0b",
    b"\x0c",
    b"\x00",
    b"\x0a\x05ab",
    b"\x12\xff\xff\xff\xff\x0f",
]


def in_string_field(path: tuple[int, ...], payload: bytes) -> bytes:
    for number in reversed(path):
        payload = length_delimited(number, payload)
    return payload


@st.composite
def unparseable(draw, descriptor: Descriptor, valid: st.SearchStrategy[bytes]) -> bytes:
    """Bytes that are no message of `descriptor`'s type: a valid encoding followed by a string
    field that is not UTF-8, or by a corrupt end."""
    prefix = draw(valid)
    paths = string_paths(descriptor)
    if paths and draw(st.booleans()):
        return prefix + in_string_field(draw(st.sampled_from(paths)), draw(st.sampled_from(NOT_UTF8)))
    return prefix + draw(st.sampled_from(CORRUPT_ENDS))


@st.composite
def mutated_bytes(draw, data: bytes) -> bytes:
    """`data` truncated, with a byte changed, with bytes inserted, or with junk appended."""
    kind = draw(st.sampled_from(["truncate", "flip", "insert", "append"]))
    at = draw(st.integers(0, len(data)))
    if kind == "truncate":
        return data[:at]
    if kind == "flip" and data:
        at = min(at, len(data) - 1)
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    junk_bytes = draw(st.binary(min_size=1, max_size=8))
    return data[:at] + junk_bytes + data[at:] if kind == "insert" else data + junk_bytes
