"""Speculative decoding with an EAGLE-1 drafter (built here in the public layout,
conftest.py): one that agrees with a cycle target is accepted; greedy output equals the plain
engine's token for token (mixed batches, prefix caching, chunked prefill, preemption), with
drafts accepted and rolled back; drafter K/V never reaches the prefix cache; seeded sampling
is reproducible and its token frequencies match the plain engine's; the target's and the
drafter's blocks add up after every test; a bad drafter fails at start naming the field."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_events import BlockStored, InMemoryKVEventPublisher
from testlib.chi_square import assert_same_token_frequencies
from testlib.hf import PROMPTS

REPEATING = ["a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2", "hello hello hello", "def foo(x): return foo(x)"]
K = 3


def eagle_kwargs(folder, **kwargs) -> dict:
    return {"speculative_method": "eagle", "heads": str(folder), "num_speculative_tokens": K, **kwargs}


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def assert_blocks_all_free(llm: LLM) -> None:
    """Target and drafter: free + used == total (check_integrity), and nothing left in use."""
    llm.core.check_integrity()
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == llm.core.num_kv_blocks and not kv.req_to_blocks
    pool = llm.core.speculator.drafter.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.request_ids()


@pytest.fixture(scope="module")
def random_drafter(llama_dir, tmp_path_factory, heads):
    return heads.write_eagle(tmp_path_factory.mktemp("eagle") / "drafter", llama_dir)


@pytest.fixture(scope="module")
def noisy_drafter(cycle_dir, tmp_path_factory, heads):
    """Agrees with the cycle target most of the time: drafts are accepted, cut and rolled back."""
    return heads.write_eagle(tmp_path_factory.mktemp("noisy") / "drafter", cycle_dir, agree_on_cycle=True, noise=0.03)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def plain_cycle(cycle_dir):
    return LLM(model=str(cycle_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def eagle(llama_dir, random_drafter):
    return LLM(model=str(llama_dir), num_kv_blocks=512, **eagle_kwargs(random_drafter))


@pytest.mark.parametrize(
    "layout", [pytest.param({}, id="shared-embedding"), pytest.param({"own_embed": True, "fc_bias": True}, id="own")]
)
def test_a_drafter_that_agrees_with_a_cycle_target_is_accepted(cycle_dir, plain_cycle, tmp_path, heads, layout):
    folder = heads.write_eagle(tmp_path / "drafter", cycle_dir, agree_on_cycle=True, **layout)
    prompts = REPEATING + PROMPTS[:2]
    expected = plain_cycle.generate(prompts, greedy(48))
    engine = LLM(model=str(cycle_dir), num_kv_blocks=256, **eagle_kwargs(folder, num_speculative_tokens=4))
    outputs = engine.generate(prompts, greedy(48))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    assert engine.core.stats().spec_mean_acceptance_length > 3
    assert_blocks_all_free(engine)


def test_mixed_batch_with_requests_that_do_not_speculate(plain, eagle):
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
    before = eagle.core.speculator.stats.num_draft_tokens
    outputs = eagle.generate(prompts, params)
    assert eagle.core.speculator.stats.num_draft_tokens > before
    for want, got in zip(expected[:4], outputs[:4]):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    for want_d, got_d in zip(expected[0].logprobs, outputs[0].logprobs):
        assert sorted(got_d) == sorted(want_d)
    assert_blocks_all_free(eagle)


@pytest.mark.parametrize("drafter", ["noisy", "random"])
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"enable_prefix_caching": True}, id="prefix-caching"),
        pytest.param({"max_num_batched_tokens": 24, "max_num_seqs": 4}, id="chunked-prefill-and-a-tight-budget"),
        pytest.param({"num_kv_blocks": 10, "max_model_len": 160}, id="preemption"),
    ],
)
def test_greedy_output_is_unchanged_under_scheduling_pressure(
    llama_dir, cycle_dir, plain, plain_cycle, random_drafter, noisy_drafter, drafter, engine_kwargs
):
    target, folder, reference = {
        "noisy": (cycle_dir, noisy_drafter, plain_cycle),
        "random": (llama_dir, random_drafter, plain),
    }[drafter]
    prompts = REPEATING + PROMPTS[:4]
    params = [greedy(n) for n in (40, 24, 32, 48, 16, 40, 28, 36)]
    expected = reference.generate(prompts, params)
    engine = LLM(model=str(target), **{"num_kv_blocks": 512, **engine_kwargs}, **eagle_kwargs(folder))
    first = engine.generate(prompts, params)
    assert_blocks_all_free(engine)
    again = engine.generate(prompts, params)  # with prefix caching: now from cached blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in expected]
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    if "max_model_len" in engine_kwargs:
        assert sum(o.metrics.num_preemptions for o in first) > 0, "the budget was meant to force preemption"
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "drafts were meant to be rejected"
    if drafter == "noisy":
        assert stats.num_accepted_tokens > 30, stats
    assert_blocks_all_free(engine)


def test_drafter_tokens_never_reach_the_prefix_cache(cycle_dir, noisy_drafter):
    engine = LLM(
        model=str(cycle_dir), num_kv_blocks=256, enable_prefix_caching=True, block_size=4, **eagle_kwargs(noisy_drafter)
    )
    publisher = engine.core.publisher = InMemoryKVEventPublisher()
    outputs = engine.generate(REPEATING, greedy(40))
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    real = set()
    for prompt, output in zip(REPEATING, outputs):
        real.update(hash_request_tokens([*engine.core.tokenizer.encode(prompt), *output.token_ids], 4, ()))
    stored = {h for event in publisher.events if isinstance(event, BlockStored) for h in event.block_hashes}
    assert stored and stored <= real, "a stored block's hash covers tokens that were never generated"
    assert_blocks_all_free(engine)


def test_sampled_token_frequencies_match_the_plain_engines(cycle_dir, plain_cycle, tmp_path, heads):
    """An agreeing drafter on the cycle target, sampled at temperature 1 with top-k: drafts
    are accepted and rejected; the first four tokens of 400 seeded requests pass a per-position
    chi-square homogeneity test against the plain engine at p > 1e-4; seeds reproduce."""
    folder = heads.write_eagle(tmp_path / "drafter", cycle_dir, agree_on_cycle=True)
    engine = LLM(model=str(cycle_dir), num_kv_blocks=512, enable_prefix_caching=False, **eagle_kwargs(folder))
    prompt = engine.core.tokenizer.encode(REPEATING[3])
    params = [SamplingParams(max_tokens=4, seed=s, ignore_eos=True, temperature=1.0, top_k=8) for s in range(400)]
    want = plain_cycle.generate([prompt] * len(params), params)
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
        ("layers", "speculative.heads .*an EAGLE-1 drafter has 1 layer, config.json says 2"),
        ("positions", "speculative.heads .* reaches 64 positions, fewer than max_model_len 128"),
        ("no-config", "speculative.heads .*config.json is missing"),
        ("no-weights", "speculative.heads .*no \\*.safetensors"),
        ("missing-tensor", "speculative.heads .*lacks tensors .*fc.weight"),
        ("no-folder", "heads: method 'eagle' needs the folder"),
    ],
)
def test_a_bad_drafter_fails_at_start_naming_the_field(llama_dir, tmp_path, heads, case, message):
    folder = tmp_path / "drafter"
    kwargs = eagle_kwargs(folder)
    overrides = {"hidden": {"hidden_size": 32}, "vocab": {"vocab_size": 512}, "layers": {"num_hidden_layers": 2}}
    overrides["positions"] = {"max_position_embeddings": 64}
    heads.write_eagle(folder, llama_dir, config_overrides=overrides.get(case))
    if case == "positions":
        kwargs["max_model_len"] = 128
    elif case == "no-config":
        (folder / "config.json").unlink()
    elif case == "no-weights":
        (folder / "model.safetensors").unlink()
    elif case == "missing-tensor":
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        del tensors["fc.weight"]
        save_file(tensors, folder / "model.safetensors")
    elif case == "no-folder":
        shutil.rmtree(folder)
        kwargs = {"speculative_method": "eagle"}
    assert case != "layers" or json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match=message):
        LLM(model=str(llama_dir), num_kv_blocks=64, **kwargs)


PATTERN = r"(ab|cd){6}x[0-9]{3}(ab){4}"


def test_structured_output_masks_every_draft_position(plain, eagle):
    """Drafts are drawn under the grammar's mask at their position; greedy output equals the
    plain engine's and sampled output still matches the pattern."""
    from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams

    def constrained(**kwargs) -> SamplingParams:
        return SamplingParams(
            max_tokens=60, structured_output=StructuredOutputParams(StructuredOutputKind.REGEX, PATTERN), **kwargs
        )

    before = eagle.core.speculator.stats.num_draft_tokens
    want = plain.generate(["Pattern:", REPEATING[0]], [constrained(temperature=0), greedy(30)])
    got = eagle.generate(["Pattern:", REPEATING[0]], [constrained(temperature=0), greedy(30)])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(PATTERN, got[0].text) and got[0].finish_reason == "stop"
    for out in eagle.generate(["Pattern:"] * 4, [constrained(temperature=1.0, seed=s) for s in range(4)]):
        assert re.fullmatch(PATTERN, out.text), out.text
    assert eagle.core.speculator.stats.num_draft_tokens > before + 10
    assert eagle.core.groups.num_constrained == 0
    assert_blocks_all_free(eagle)
