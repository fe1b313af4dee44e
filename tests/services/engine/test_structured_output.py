"""Structured output in the engine: sampled outputs match their JSON schema, regex, choice or
grammar; bad specs are refused by name before any token; n > 1, preemption, the P/D
handover and a grammar compiling beside the loop all keep outputs valid."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest
import xgrammar
from baton.services.engine import LLM, AsyncLLM, SamplingParams
from baton.services.engine.api.handover import Handover
from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore
from baton.services.engine.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def json_params(**kwargs) -> SamplingParams:
    constraint = StructuredOutputParams(StructuredOutputKind.JSON, json.dumps(SCHEMA))
    return SamplingParams(**{"max_tokens": 150, "temperature": 1.0, "structured_output": constraint, **kwargs})


def regex(pattern: str) -> StructuredOutputParams:
    return StructuredOutputParams(StructuredOutputKind.REGEX, pattern)


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = LLM(model=str(llama_dir), num_kv_blocks=256, block_size=16)
    yield engine
    engine.shutdown()


def check_clean(llm: LLM) -> None:
    llm.core.check_integrity()
    assert llm.core.stats().num_free_kv_blocks == llm.core.num_kv_blocks
    assert not llm.core.waiting_for_grammar
    assert llm.core.groups.num_constrained == 0  # the count that lets unconstrained steps skip the masks


def test_json_schema_outputs_validate(llm):
    outs = llm.generate(["Give me a record:"] * 12, [json_params(seed=i) for i in range(12)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    check_clean(llm)


def outside_strings(text: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', "", text)


def test_compact_json_unless_whitespace_is_allowed(llm):
    compact = llm.generate(["{"] * 6, [json_params(seed=i) for i in range(6)])
    assert all(not re.search(r"\s", outside_strings(o.text)) for o in compact)
    loose = StructuredOutputParams(StructuredOutputKind.JSON, json.dumps(SCHEMA), any_whitespace=True)
    spaced = llm.generate(
        ["{"] * 6, [SamplingParams(max_tokens=150, seed=i, structured_output=loose) for i in range(6)]
    )
    assert any(re.search(r"\s", outside_strings(o.text)) for o in spaced)


def test_a_length_limited_output_is_a_valid_prefix(llm, llama_dir):
    outs = llm.generate(["x"] * 6, [json_params(seed=i, max_tokens=6) for i in range(6)])
    compiled = llm.core.grammars.submit(json_params().structured_output).result()
    for out in outs:
        assert out.finish_reason == "length"
        matcher = xgrammar.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in out.token_ids)


def test_regex_choice_grammar_and_json_object(llm):
    pattern = r"[a-z]{2,5}-\d{3}"
    outs = llm.generate(
        ["x"] * 10, [SamplingParams(max_tokens=30, seed=i, structured_output=regex(pattern)) for i in range(10)]
    )
    assert all(o.finish_reason == "stop" and re.fullmatch(pattern, o.text) for o in outs), [o.text for o in outs]

    choices = ("red", "green", "blue sky", 'say "hi"')
    choice = StructuredOutputParams(StructuredOutputKind.CHOICE, choices=choices)
    outs = llm.generate(
        ["x"] * 10, [SamplingParams(max_tokens=30, seed=i, structured_output=choice) for i in range(10)]
    )
    assert all(o.finish_reason == "stop" and o.text in choices for o in outs)

    grammar = StructuredOutputParams(
        StructuredOutputKind.GRAMMAR, 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    )
    outs = llm.generate(["x"] * 6, [SamplingParams(max_tokens=60, seed=i, structured_output=grammar) for i in range(6)])
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.text)

    obj = StructuredOutputParams(StructuredOutputKind.JSON_OBJECT)
    outs = llm.generate(["x"] * 6, [SamplingParams(max_tokens=200, seed=i, structured_output=obj) for i in range(6)])
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
    check_clean(llm)


def test_n_samples_each_follow_the_grammar_and_the_seed(llm):
    pattern = r"(yes|no|maybe) [0-9]{2}"
    params = SamplingParams(n=3, max_tokens=20, seed=5, structured_output=regex(pattern))
    first, again = llm.generate(["Answer:"], params)[0], llm.generate(["Answer:"], params)[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    assert all(c.finish_reason == "stop" and re.fullmatch(pattern, c.text) for c in first.outputs)
    check_clean(llm)


@pytest.mark.parametrize(
    "constraint, reason",
    [
        (regex("[a-z]+("), "parenthesis is not closed"),
        (StructuredOutputParams(StructuredOutputKind.JSON, '{"type": "foo"}'), 'Unsupported type "foo"'),
        (StructuredOutputParams(StructuredOutputKind.JSON, "not json"), "is not valid JSON: Expecting value"),
        (
            StructuredOutputParams(StructuredOutputKind.JSON, '{"not": {"type": "string"}}'),
            "`not` at / is not supported",
        ),
        (StructuredOutputParams(StructuredOutputKind.GRAMMAR, "root ::= x"), 'Rule "x" is not defined'),
    ],
)
def test_a_bad_spec_is_refused_by_name_and_the_engine_serves_on(llm, constraint, reason):
    with pytest.raises(InvalidRequestError, match=re.escape(reason)) as raised:
        llm.generate(["x"], SamplingParams(structured_output=constraint))
    assert raised.value.field == constraint.field_name
    assert llm.generate(["x"], SamplingParams(max_tokens=3))[0].finish_reason == "length"
    check_clean(llm)


def test_spec_shapes_are_checked_when_built():
    with pytest.raises(InvalidRequestError, match="at least one choice"):
        StructuredOutputParams(StructuredOutputKind.CHOICE)
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        StructuredOutputParams(StructuredOutputKind.REGEX, "  ")
    with pytest.raises(InvalidRequestError, match="beam search cannot be combined"):
        SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4, structured_output=regex("a+"))


def test_a_grammar_that_compiles_too_slowly_fails_its_request(llama_dir):
    llm = LLM(model=str(llama_dir), num_kv_blocks=64, block_size=16, compile_timeout_s=1e-6)
    try:
        with pytest.raises(InvalidRequestError, match="did not compile in time"):
            llm.generate(["x"], SamplingParams(structured_output=regex("[a-z]{1,20}@[a-z]{1,20}")))
    finally:
        llm.shutdown()


def test_a_preempted_constrained_request_still_validates(llama_dir):
    tight = LLM(model=str(llama_dir), num_kv_blocks=12, block_size=16, max_num_seqs=4)
    try:
        outs = tight.generate(["A long prompt " * 6] * 4, [json_params(seed=i, max_tokens=80) for i in range(4)])
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the test needs a preemption"
        for out in outs:
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), SCHEMA)
        check_clean(tight)
    finally:
        tight.shutdown()


def test_min_tokens_yields_to_a_complete_grammar(llm):
    choice = StructuredOutputParams(StructuredOutputKind.CHOICE, choices=("ok",))
    outs = llm.generate(
        ["x"] * 3, [SamplingParams(max_tokens=10, min_tokens=5, seed=i, structured_output=choice) for i in range(3)]
    )
    assert all(o.text == "ok" and o.finish_reason == "stop" for o in outs)


def test_the_decode_side_resumes_the_grammar_from_the_handed_over_token(llama_dir):
    def engine(role: str) -> EngineCore:
        return EngineCore(EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, block_size=16, role=role))

    prefill, decode = engine("prefill"), engine("decode")
    try:
        prompt, params = list(range(100, 140)), json_params(seed=3)
        prepared = prefill.prepare("r", prompt, params, handover=Handover.prefill())
        prepared.wait_for_grammar()
        prefill.submit(prepared)
        first = run_until_finished([prefill], "r")
        assert first.kv_transfer_params is not None and first.token_ids == [json_token(prefill)]
        prepared = decode.prepare(
            "r", prompt, params, handover=Handover.decode(first.token_ids, first.kv_transfer_params)
        )
        prepared.wait_for_grammar()
        decode.submit(prepared)
        out = run_until_finished([decode, prefill], "r")
        assert out.finish_reason == "stop"  # its text follows the first token's, streamed by prefill
        jsonschema.validate(json.loads(first.text + out.text), SCHEMA)

        bad = decode.prepare("bad", prompt, params, handover=Handover.decode([5], first.kv_transfer_params))
        bad.wait_for_grammar()
        with pytest.raises(InvalidRequestError, match="tokens handed over do not match"):
            decode.submit(bad)
    finally:
        prefill.shutdown()
        decode.shutdown()


def json_token(engine: EngineCore) -> int:
    """A JSON object's only possible first token under compact output: '{'."""
    return engine.tokenizer.encode("{", add_special_tokens=False)[0]


def run_until_finished(engines: list[EngineCore], request_id: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for engine in engines:
            for output in engine.step():
                if output.finished and output.request_id == request_id:
                    return output
        time.sleep(0.001)  # the KV receive runs on the connector's threads
    raise AssertionError(f"{request_id} did not finish")


async def test_async_engine_compiles_beside_the_loop_and_reports_bad_grammars(llama_dir):
    engine = AsyncLLM(EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, block_size=16))
    try:
        good = engine.generate("g", "x", SamplingParams(max_tokens=30, seed=1, structured_output=regex(r"[0-9]{3}")))
        plain = engine.generate("p", "x", SamplingParams(max_tokens=4))

        async def collect(stream):
            return [o async for o in stream]

        good_out, plain_out = await asyncio.gather(collect(good), collect(plain))
        assert re.fullmatch(r"[0-9]{3}", good_out[-1].text) and good_out[-1].finish_reason == "stop"
        assert plain_out[-1].finish_reason == "length"
        with pytest.raises(InvalidRequestError, match="parenthesis is not closed"):
            await collect(engine.generate("b", "x", SamplingParams(structured_output=regex("("))))
        assert (await collect(engine.generate("after", "x", SamplingParams(max_tokens=2))))[-1].finished
        free = await engine.run_in_engine(lambda core: (core.check_integrity(), core.stats().num_free_kv_blocks)[1])
        assert free == 64
    finally:
        engine.shutdown()


def test_prefix_cache_hits_change_nothing(llm, llama_dir):
    prompt = "A shared prompt that fills more than one block of sixteen tokens, twice over. " * 2
    params = [json_params(seed=i) for i in range(4)]
    llm.generate([prompt], SamplingParams(max_tokens=1))  # its blocks now cached
    cached = llm.generate([prompt] * 4, params)
    assert all(o.num_cached_tokens > 0 for o in cached)
    uncached_llm = LLM(model=str(llama_dir), num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    try:
        uncached = uncached_llm.generate([prompt] * 4, params)
    finally:
        uncached_llm.shutdown()
    assert [o.text for o in cached] == [o.text for o in uncached]
