"""Speculative decoding with Medusa heads (built here in the public layouts, conftest.py):
heads that agree with a cycle target are accepted; greedy output equals the plain engine's
token for token with random heads (mixed batches, prefix caching, chunked prefill,
preemption); seeded sampling is reproducible and its token frequencies match the plain
engine's; blocks add up after every test; a bad head folder fails at start naming the field."""

from __future__ import annotations

import re
import shutil

import pytest
from baton.services.engine import LLM, SamplingParams
from testlib.chi_square import assert_same_token_frequencies
from testlib.hf import PROMPTS

REPEATING = ["a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2", "hello hello hello", "def foo(x): return foo(x)"]
K = 3


def medusa_kwargs(heads_dir, **kwargs) -> dict:
    return {"speculative_method": "medusa", "heads": str(heads_dir), "num_speculative_tokens": K, **kwargs}


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def assert_blocks_all_free(llm: LLM) -> None:
    llm.core.check_integrity()
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == llm.core.num_kv_blocks and not kv.req_to_blocks


@pytest.fixture(scope="module")
def random_heads(llama_dir, tmp_path_factory, heads):
    return heads.write_medusa(tmp_path_factory.mktemp("medusa") / "heads", llama_dir, num_heads=4, num_layers=1)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def medusa(llama_dir, random_heads):
    return LLM(model=str(llama_dir), num_kv_blocks=512, **medusa_kwargs(random_heads))


@pytest.mark.parametrize("layout", ["faster", "vllm"])
def test_heads_that_agree_with_a_cycle_target_are_accepted(cycle_dir, tmp_path, heads, layout):
    folder = heads.write_medusa(
        tmp_path / "h", cycle_dir, num_heads=4, num_layers=2, layout=layout, agree_on_cycle=True
    )
    prompts = REPEATING + PROMPTS[:2]
    expected = LLM(model=str(cycle_dir), num_kv_blocks=256).generate(prompts, greedy(48))
    engine = LLM(model=str(cycle_dir), num_kv_blocks=256, **medusa_kwargs(folder, num_speculative_tokens=4))
    outputs = engine.generate(prompts, greedy(48))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    assert engine.core.stats().spec_mean_acceptance_length > 3
    assert_blocks_all_free(engine)


def test_mixed_batch_with_requests_that_do_not_speculate(plain, medusa):
    (free,) = plain.generate([REPEATING[0]], greedy(40))
    params = [
        greedy(40, logprobs=2),
        SamplingParams(max_tokens=16, use_beam_search=True, beam_width=2, temperature=0, ignore_eos=True),
        greedy(30, stop=[free.text[len(free.text) // 2 :][:4]]),
        SamplingParams(max_tokens=40, temperature=0),  # EOS not ignored
        SamplingParams(n=2, max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
    ]
    prompts = [REPEATING[0], REPEATING[1], REPEATING[0], REPEATING[2], REPEATING[3]]
    expected = plain.generate(prompts, params)
    before = medusa.core.speculator.stats.num_draft_tokens
    outputs = medusa.generate(prompts, params)
    assert medusa.core.speculator.stats.num_draft_tokens > before
    for want, got in zip(expected[:4], outputs[:4]):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    for want_d, got_d in zip(expected[0].logprobs, outputs[0].logprobs):
        assert sorted(got_d) == sorted(want_d)
    again = medusa.generate(prompts[4:], params[4:])  # seeded: the same tokens again
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in outputs[4].outputs]
    assert_blocks_all_free(medusa)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"enable_prefix_caching": True}, id="prefix-caching"),
        pytest.param({"max_num_batched_tokens": 24, "max_num_seqs": 4}, id="chunked-prefill-and-a-tight-budget"),
        pytest.param({"num_kv_blocks": 10, "max_model_len": 160}, id="preemption"),
    ],
)
def test_greedy_output_is_unchanged_under_scheduling_pressure(llama_dir, plain, random_heads, engine_kwargs):
    prompts = REPEATING + PROMPTS[:4]
    params = [greedy(n) for n in (40, 24, 32, 48, 16, 40, 28, 36)]
    expected = plain.generate(prompts, params)
    engine = LLM(model=str(llama_dir), **{"num_kv_blocks": 512, **engine_kwargs}, **medusa_kwargs(random_heads))
    first = engine.generate(prompts, params)
    assert_blocks_all_free(engine)
    again = engine.generate(prompts, params)  # with prefix caching: now from cached blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in expected]
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    if "max_model_len" in engine_kwargs:
        assert sum(o.metrics.num_preemptions for o in first) > 0, "the budget was meant to force preemption"
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > 50, stats
    assert_blocks_all_free(engine)


def test_sampled_token_frequencies_match_the_plain_engines(cycle_dir, tmp_path, heads):
    """Heads that agree with the cycle target, sampled at temperature 1 with top-k: drafts
    are accepted and rejected; the first four tokens of 400 seeded requests pass a per-position
    chi-square homogeneity test against the plain engine at p > 1e-4."""
    folder = heads.write_medusa(tmp_path / "h", cycle_dir, num_heads=3, agree_on_cycle=True)
    plain = LLM(model=str(cycle_dir), num_kv_blocks=512)
    engine = LLM(model=str(cycle_dir), num_kv_blocks=512, **medusa_kwargs(folder))
    prompt = plain.core.tokenizer.encode(REPEATING[3])
    params = [SamplingParams(max_tokens=4, seed=s, ignore_eos=True, temperature=1.0, top_k=8) for s in range(400)]
    want = plain.generate([prompt] * len(params), params)
    got = engine.generate([prompt] * len(params), params)
    stats = engine.core.speculator.stats
    assert stats.num_accepted_tokens > 50 and stats.num_draft_tokens - stats.num_accepted_tokens > 50, stats
    assert_same_token_frequencies(want, got, engine.core.arch.vocab_size, num_positions=4)
    again = engine.generate([prompt] * 8, params[:8])
    assert [o.token_ids for o in again] == [o.token_ids for o in got[:8]]
    assert_blocks_all_free(engine)


@pytest.mark.parametrize(
    "case,message",
    [
        ("hidden", "speculative.heads .* has hidden_size 32, the target 64"),
        ("vocab", "speculative.heads .* has vocab_size 512, the target 1024"),
        ("k", "num_speculative_tokens 3 exceeds the 2 Medusa heads of speculative.heads"),
        ("no-config", "speculative.heads .*config.json is missing"),
        ("no-weights", "speculative.heads .*no \\*.safetensors"),
        ("not-medusa", "speculative.heads .*lacks medusa_num_heads"),
        ("no-folder", "heads: method 'medusa' needs the folder"),
        ("wrong-method", "heads is set but method is 'ngram'"),
    ],
)
def test_a_bad_head_folder_fails_at_start_naming_the_field(llama_dir, tmp_path, heads, case, message):
    folder = tmp_path / "h"
    write_medusa = heads.write_medusa
    kwargs = medusa_kwargs(folder)
    if case == "hidden":
        write_medusa(folder, llama_dir, hidden_size=32)
    elif case == "vocab":
        write_medusa(folder, llama_dir, vocab_size=512)
    elif case == "k":
        write_medusa(folder, llama_dir, num_heads=2)
    elif case == "no-config":
        write_medusa(folder, llama_dir)
        (folder / "config.json").unlink()
    elif case == "no-weights":
        write_medusa(folder, llama_dir)
        (folder / "medusa_lm_head.safetensors").unlink()
    elif case == "not-medusa":
        shutil.copytree(llama_dir, folder)
    elif case == "no-folder":
        kwargs = {"speculative_method": "medusa"}
    elif case == "wrong-method":
        kwargs = {"speculative_method": "ngram", "heads": str(folder)}
    with pytest.raises(ValueError, match=message):
        LLM(model=str(llama_dir), num_kv_blocks=64, **kwargs)


PATTERN = r"(ab|cd){6}x[0-9]{3}(ab){4}"


def test_structured_output_masks_every_draft_position(plain, medusa):
    """Drafts are drawn under the grammar's mask at their position; greedy output equals the
    plain engine's and sampled output still matches the pattern."""
    from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams

    def constrained(**kwargs) -> SamplingParams:
        return SamplingParams(
            max_tokens=60, structured_output=StructuredOutputParams(StructuredOutputKind.REGEX, PATTERN), **kwargs
        )

    before = medusa.core.speculator.stats.num_draft_tokens
    want = plain.generate(["Pattern:", REPEATING[0]], [constrained(temperature=0), greedy(30)])
    got = medusa.generate(["Pattern:", REPEATING[0]], [constrained(temperature=0), greedy(30)])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(PATTERN, got[0].text) and got[0].finish_reason == "stop"
    for out in medusa.generate(["Pattern:"] * 4, [constrained(temperature=1.0, seed=s) for s in range(4)]):
        assert re.fullmatch(PATTERN, out.text), out.text
    assert medusa.core.speculator.stats.num_draft_tokens > before + 10
    assert medusa.core.groups.num_constrained == 0
    assert_blocks_all_free(medusa)
