"""A migrated request (`Handover.resume`): another worker streamed its first tokens and was
lost; this engine recomputes prompt + those tokens and continues. What it emits must be what
the undisturbed run emits after them: the same tokens (greedy), the same text, the same
finish, with max_tokens, min_tokens, penalties and the grammar counting the tokens before."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.handover import Handover, KVPath
from baton.services.engine.api.sampling_params import RequestOutputKind, StructuredOutputKind, StructuredOutputParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore
from baton.services.engine.errors import InvalidRequestError

PROMPT = "def handle(request):"
SCHEMA = {  # bounded: the tiny model ends it well within max_tokens
    "type": "object",
    "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 8, "maxItems": 8}},
    "required": ["flags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(llama_dir):
    engine = EngineCore(EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, block_size=16))
    yield engine
    engine.shutdown()


def run(engine: EngineCore, request_id: str, params: SamplingParams, handover: Handover | None = None):
    """Every delta of one request, then checks that all its blocks came back."""
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    prepared = engine.prepare(request_id, PROMPT, params, handover=handover)
    prepared.wait_for_grammar()
    engine.submit(prepared)
    deltas = []
    for _ in range(500):
        deltas += [o for o in engine.step() if o.request_id == request_id]
        if deltas and deltas[-1].finished:
            engine.check_integrity()
            return deltas
    raise AssertionError(f"{request_id} did not finish")


def joined(deltas) -> tuple[list[int], str]:
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "penalties": SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5
    ),
    "min_tokens": SamplingParams(temperature=0, max_tokens=24, min_tokens=20),
    "grammar": SamplingParams(
        temperature=0,
        max_tokens=200,
        structured_output=StructuredOutputParams(StructuredOutputKind.JSON, json.dumps(SCHEMA)),
    ),
}


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("num_streamed", [1, 5, 17])
def test_a_resumed_request_continues_the_undisturbed_one(engine, kind, num_streamed):
    params = PARAMS[kind]
    whole = run(engine, f"whole-{kind}-{num_streamed}", params)
    tokens, text = joined(whole)
    assert len(tokens) > num_streamed
    streamed = tokens[:num_streamed]
    resumed = run(engine, f"resumed-{kind}-{num_streamed}", params, Handover.resume(streamed))
    rest_tokens, rest_text = joined(resumed)
    assert streamed + rest_tokens == tokens
    assert text.endswith(rest_text) and rest_text
    assert resumed[-1].finish_reason == whole[-1].finish_reason
    assert resumed[-1].kv_path is KVPath.MIGRATED
    if kind == "grammar":
        jsonschema.validate(json.loads(text), SCHEMA)


def test_tokens_the_grammar_refuses_are_refused(engine):
    params = PARAMS["grammar"]
    not_json = engine.tokenizer.encode("nope", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="do not match"):
        run(engine, "bad-resume", params, Handover.resume(not_json))
    engine.check_integrity()


def test_tokens_at_the_context_limit_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="context limit"):
        engine.prepare("too-long", PROMPT, PARAMS["greedy"], handover=Handover.resume([5] * engine.max_model_len))


def test_several_samples_are_not_resumed(engine):
    with pytest.raises(InvalidRequestError, match="one sample"):
        engine.prepare("n2", PROMPT, SamplingParams(n=2), handover=Handover.resume([5]))
