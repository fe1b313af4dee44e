"""Speculative decoding under a grammar: drafts the grammar refuses are cut, every verified
position is masked by the grammar after the drafts before it, and the matcher only ever
advances by the tokens accepted in the end. Outputs equal the plain engine's (greedy) and
still validate (sampled)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams

SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4}
# Repetition the grammar forces: n-gram drafts of it are right until the grammar lets the
# model choose, then cut or rejected.
PATTERN = r"(ab|cd){6}x[0-9]{3}(ab){4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 6, "maxItems": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["items", "n"],
    "additionalProperties": False,
}


def constrained(kind: StructuredOutputKind, spec: str, **kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "structured_output": StructuredOutputParams(kind, spec), **kwargs})


@pytest.fixture(scope="module")
def engines(llama_dir):
    plain = LLM(model=str(llama_dir), num_kv_blocks=256)
    speculative = LLM(model=str(llama_dir), num_kv_blocks=256, prompt_lookup_min=1, **SPEC)
    yield plain, speculative
    plain.shutdown()
    speculative.shutdown()


def test_greedy_constrained_output_equals_the_plain_engines(engines):
    plain, speculative = engines
    params = [
        constrained(StructuredOutputKind.REGEX, PATTERN, temperature=0),
        constrained(StructuredOutputKind.JSON, json.dumps(SCHEMA), temperature=0),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),  # unconstrained, same batch
    ]
    prompts = ["Pattern:", "Record:", "a b c a b c a b c"]
    want = plain.generate(prompts, params)
    before = speculative.core.speculator.stats.num_accepted_tokens
    got = speculative.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(PATTERN, got[0].text) and got[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got[1].text), SCHEMA)
    assert speculative.core.speculator.stats.num_accepted_tokens > before, "the grammar's repetition was drafted"
    speculative.core.check_integrity()
    assert speculative.core.groups.num_constrained == 0


def test_sampled_constrained_outputs_still_validate(engines):
    _, speculative = engines
    params = [constrained(StructuredOutputKind.REGEX, PATTERN, temperature=1.0, seed=s) for s in range(8)]
    params += [constrained(StructuredOutputKind.JSON, json.dumps(SCHEMA), temperature=1.0, seed=s) for s in range(8)]
    outs = speculative.generate(["Pattern:"] * 8 + ["Record:"] * 8, params)
    for out in outs[:8]:
        assert re.fullmatch(PATTERN, out.text), out.text
    for out in outs[8:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    again = speculative.generate(["Pattern:"] * 8 + ["Record:"] * 8, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: reproducible
    speculative.core.check_integrity()


def test_a_draft_the_grammar_refuses_is_never_verified(engines):
    _, speculative = engines
    grammar_of = {}
    original = speculative.core.speculator.propose

    def propose(requests):
        original(requests)
        for request in requests:
            if request.grammar is not None and request.spec_token_ids:
                grammar_of[request.request_id] = request
                probe = request.grammar.valid_drafts(request.spec_token_ids)
                assert probe == request.spec_token_ids  # already cut to what the grammar allows

    speculative.core.speculator.propose = propose
    try:
        speculative.generate(["Pattern:"], constrained(StructuredOutputKind.REGEX, PATTERN, temperature=0))
    finally:
        speculative.core.speculator.propose = original
    assert grammar_of, "drafts were meant to be proposed under the grammar"
