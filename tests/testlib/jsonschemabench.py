"""JSONSchemaBench's schemas (../shared/jsonschemabench) and how the tests validate outputs
against them: each schema's own draft, with an exact multipleOf."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import jsonschema
from jsonschema.exceptions import ValidationError

BENCH_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "jsonschemabench"


def bench_schemas() -> dict[str, str]:
    """file (relative to BENCH_DIR) -> schema text; fails, naming the path, without them."""
    if not BENCH_DIR.is_dir():
        raise AssertionError(
            f"JSONSchemaBench schemas not found at {BENCH_DIR}: the repository must sit next to shared/"
        )
    schemas = {str(p.relative_to(BENCH_DIR)): p.read_text() for p in sorted(BENCH_DIR.glob("*/*.json"))}
    assert len(schemas) == 160, f"{BENCH_DIR} holds {len(schemas)} schemas, its README says 160"
    return schemas


def validator_for(schema: dict) -> jsonschema.protocols.Validator:
    """The schema's own draft (2020-12 when it names none; none of those use a keyword whose
    meaning changed between drafts), with an exact multipleOf."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return jsonschema.validators.extend(cls, {"multipleOf": exact_multiple_of})(schema)


class JsonFloat(float):
    """A parsed JSON number that keeps its text: 7e2497 is finite and exact in JSON."""

    text: str


def parse_float(text: str) -> JsonFloat:
    number = JsonFloat(text)
    number.text = text
    return number


def load_json(text: str):
    return json.loads(text, parse_float=parse_float)


_NUMBER = re.compile(r"-?(\d+)(?:\.(\d+))?(?:[eE]([+-]?\d+))?")


def exact_multiple_of(validator, divisor, instance, schema) -> Iterator[ValidationError]:
    """jsonschema's float multipleOf says 0.07 is no multiple of 0.01 and crashes on numbers
    that overflow a float; this decides on the number's text, any exponent."""
    if not validator.is_type(instance, "number"):
        return
    whole, fraction, exponent = _NUMBER.fullmatch(getattr(instance, "text", str(instance))).groups()
    digits = int(whole + (fraction or ""))
    power = int(exponent or 0) - len(fraction or "")  # instance = ±digits * 10**power
    ratio = Fraction(str(divisor))
    n, p = digits * ratio.denominator, ratio.numerator  # a multiple iff n * 10**power / p is whole
    if power >= 0:
        is_multiple = n * pow(10, power, p) % p == 0
    else:
        is_multiple = n == 0 or (-power < len(str(n)) and n % (p * 10**-power) == 0)
    if not is_multiple:
        yield ValidationError(f"{instance!r} is not a multiple of {divisor}")
