"""JSONSchemaBench's 160 real-world schemas (../shared/jsonschemabench, see its README) through
the engine: a schema the compiler refuses fails its request by name before any token; every
output that finishes parses and validates against its schema (jsonschema, the schema's own
draft, formats unchecked: xgrammar enforces some formats and jsonschema's checkers depend on
optional packages); every output cut by max_tokens is a prefix the grammar accepts.

Three seeded samples per schema, all in one batch. A schema that uses a keyword the grammar
cannot enforce is refused like one that does not compile (engine/structured_output/
json_schema_check.py), so validity is exact: every finished output is valid.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass

import pytest
import xgrammar
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams
from baton.services.engine.errors import InvalidRequestError
from testlib.jsonschemabench import bench_schemas, load_json, validator_for

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)
MAX_TOKENS = 512  # 80% of outputs finish inside it (the median in ~110 tokens)
PROMPT = "Return the JSON object:"
DRAFT_04 = "http://json-schema.org/draft-04/schema#"


def json_constraint(schema_text: str) -> StructuredOutputParams:
    return StructuredOutputParams(StructuredOutputKind.JSON, schema_text)


@dataclass
class BenchRun:
    schemas: dict[str, str]  # file (relative to BENCH_DIR) -> schema text
    grammars: dict[str, object]  # the compiled ones
    refused: dict[str, InvalidRequestError]  # the ones the compiler refuses
    outputs: list[tuple[str, object]]  # (file, completion output), SEEDS per compiled schema


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = LLM(model=str(llama_dir), num_kv_blocks=8192, block_size=16, max_num_seqs=256)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def run(llm) -> BenchRun:
    schemas = bench_schemas()
    futures = {name: llm.core.grammars.submit(json_constraint(text)) for name, text in schemas.items()}
    grammars, refused = {}, {}
    for name, future in futures.items():
        try:
            grammars[name] = future.result()
        except InvalidRequestError as error:
            refused[name] = error
    requests = [(name, seed) for name in grammars for seed in SEEDS]
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured_output=json_constraint(schemas[name])
        )
        for name, seed in requests
    ]
    outs = llm.generate([PROMPT] * len(requests), params)
    return BenchRun(schemas, grammars, refused, [(name, out.outputs[0]) for (name, _), out in zip(requests, outs)])


def test_refused_schemas_fail_by_name_before_any_token(llm, run):
    for name in run.refused:
        with pytest.raises(InvalidRequestError) as raised:
            llm.generate([PROMPT], SamplingParams(max_tokens=8, structured_output=json_constraint(run.schemas[name])))
        error = raised.value
        assert error.field == "structured_output.json", name
        assert len(error.message) > 25, (name, error.message)  # the compiler's or the check's reason
        print(f"refused {name}: {error.message}")
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3))[0].finish_reason == "length"
    llm.core.check_integrity()
    assert llm.core.stats().num_free_kv_blocks == llm.core.num_kv_blocks


def test_finished_outputs_validate(run):
    finished = [(name, out) for name, out in run.outputs if out.finish_reason == "stop"]
    for name, out in finished:
        errors = list(validator_for(json.loads(run.schemas[name])).iter_errors(load_json(out.text)))
        assert not errors, f"{name}: {errors[0].message[:300]}\noutput: {out.text[:1000]}"
    print(f"validity: {len(finished)}/{len(finished)} finished outputs valid (100%)")


def test_cut_outputs_are_prefixes_the_grammar_accepts(run):
    cut = [(name, out) for name, out in run.outputs if out.finish_reason == "length"]
    for name, out in cut:
        assert len(out.token_ids) == MAX_TOKENS
        matcher = xgrammar.GrammarMatcher(run.grammars[name])
        assert all(matcher.accept_token(t) for t in out.token_ids), name
        assert not matcher.is_terminated(), name
    assert all(out.finish_reason in ("stop", "length") for _, out in run.outputs)


def test_shares(run):
    num_schemas, num_outputs = len(run.schemas), len(run.outputs)
    compiled = len(run.grammars) / num_schemas
    finished = sum(out.finish_reason == "stop" for _, out in run.outputs) / num_outputs
    finished_by = collections.defaultdict(list)
    for name, out in run.outputs:
        finished_by[name].append(out.finish_reason == "stop")
    num_never = sum(not any(v) for v in finished_by.values())
    print(
        f"compiled: {len(run.grammars)}/{num_schemas} schemas ({compiled:.1%}); "
        f"finished within {MAX_TOKENS} tokens: {finished:.1%} of {num_outputs} outputs "
        f"({len(SEEDS)} seeds per schema; {num_never} schemas never finished)"
    )
    assert compiled >= 0.85  # 143 of 160 measured: the rest use keywords the grammar cannot enforce
    assert finished >= 0.7  # 80% measured


@pytest.mark.parametrize(
    "text, divisor, expected",
    [("0.07", 0.01, True), ("200700e938", 0.01, True), ("7e2497230020088", 0.5, True), ("7e2497230020088", 3, False)]
    + [("0.3", 0.5, False), ("1.5", 0.5, True), ("-6", 3, True), ("7e-99999", 0.01, False), ("0.0", 0.3, True)],
)
def test_exact_multiple_of(text, divisor, expected):
    errors = list(validator_for({"multipleOf": divisor}).iter_errors(load_json(text)))
    assert not errors if expected else errors
