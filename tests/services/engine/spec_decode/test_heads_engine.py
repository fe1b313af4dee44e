"""Speculative decoding with heads on the target's hidden states, Medusa heads and an
EAGLE-1 drafter, built here in their public layouts (conftest.py): heads that agree with a
cycle target are accepted; greedy output equals the plain engine's token for token (mixed
batches, structured output, prefix caching, chunked prefill, preemption), with noisy heads
whose drafts are accepted and rolled back and with random ones; drafter K/V never reaches the
prefix cache; seeded sampling is reproducible and its token frequencies match the plain
engine's; the target's and the drafter's blocks add up after every test; a bad head folder
fails at start naming the field."""

from __future__ import annotations

import re
import shutil

import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_events import BlockStored, InMemoryKVEventPublisher
from safetensors.torch import load_file, save_file
from testlib.chi_square import assert_same_token_frequencies
from testlib.hf import PROMPTS

REPEATING = ["a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2", "hello hello hello", "def foo(x): return foo(x)"]
METHODS = ["medusa", "eagle"]
K = 3
NOISE = {"medusa": 0.15, "eagle": 0.03}  # about half the drafts accepted on the cycle target


def head_kwargs(method: str, folder, **kwargs) -> dict:
    return {"speculative_method": method, "heads": str(folder), "num_speculative_tokens": K, **kwargs}


def write_heads(heads, method: str, folder, target, **kwargs):
    if method == "medusa":
        return heads.write_medusa(folder, target, **kwargs)
    return heads.write_eagle(folder, target, **kwargs)


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def assert_blocks_all_free(llm: LLM) -> None:
    """Target and drafter (EAGLE's own blocks): free + used == total, nothing left in use."""
    llm.core.check_integrity()
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == llm.core.num_kv_blocks and not kv.req_to_blocks
    pool = llm.core.speculator.drafter.pool
    assert pool is None or (pool.num_free_blocks == pool.num_blocks and not pool.request_ids())


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def plain_cycle(cycle_dir):
    return LLM(model=str(cycle_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def folders(llama_dir, cycle_dir, tmp_path_factory, heads):
    """(method, kind) -> a head folder: random heads for the tiny model; noisy and agreeing
    ones for the cycle target."""
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for method in METHODS:
        out[method, "random"] = write_heads(heads, method, root / f"{method}-random", llama_dir)
        out[method, "noisy"] = write_heads(
            heads, method, root / f"{method}-noisy", cycle_dir, agree_on_cycle=True, noise=NOISE[method]
        )
        out[method, "agree"] = write_heads(heads, method, root / f"{method}-agree", cycle_dir, agree_on_cycle=True)
    return out


@pytest.fixture(scope="module", params=METHODS)
def random_engine(request, llama_dir, folders):
    return LLM(model=str(llama_dir), num_kv_blocks=512, **head_kwargs(request.param, folders[request.param, "random"]))


@pytest.mark.parametrize(
    "method,layout",
    [
        pytest.param("medusa", {"layout": "faster", "num_layers": 2}, id="medusa-fasterdecoding-names"),
        pytest.param("medusa", {"layout": "vllm"}, id="medusa-vllm-names"),
        pytest.param("eagle", {}, id="eagle-shared-embedding"),
        pytest.param("eagle", {"own_embed": True, "fc_bias": True}, id="eagle-own-embedding-fc-bias"),
    ],
)
def test_heads_that_agree_with_a_cycle_target_are_accepted(cycle_dir, plain_cycle, tmp_path, heads, method, layout):
    folder = write_heads(heads, method, tmp_path / "heads", cycle_dir, agree_on_cycle=True, **layout)
    prompts = REPEATING + PROMPTS[:2]
    expected = plain_cycle.generate(prompts, greedy(48))
    engine = LLM(model=str(cycle_dir), num_kv_blocks=256, **head_kwargs(method, folder, num_speculative_tokens=4))
    outputs = engine.generate(prompts, greedy(48))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    assert engine.core.stats().spec_mean_acceptance_length > 3
    assert_blocks_all_free(engine)


def test_mixed_batch_with_requests_that_do_not_speculate(plain, random_engine):
    """Beam search never speculates; greedy ones with logprobs, a stop string and EOS do;
    the sampled n = 2 request speculates and stays reproducible under its seed."""
    engine = random_engine
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
    before = engine.core.speculator.stats.num_draft_tokens
    outputs = engine.generate(prompts, params)
    assert engine.core.speculator.stats.num_draft_tokens > before
    for want, got in zip(expected[:4], outputs[:4]):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    for want_d, got_d in zip(expected[0].logprobs, outputs[0].logprobs):
        assert sorted(got_d) == sorted(want_d)
        for token, entry in want_d.items():
            assert got_d[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
    again = engine.generate(prompts[4:], params[4:])
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in outputs[4].outputs]
    assert_blocks_all_free(engine)


PATTERN = r"(ab|cd){6}x[0-9]{3}(ab){4}"


def test_structured_output_masks_every_draft_position(plain, random_engine):
    """Drafts are drawn under the grammar's mask at their position; greedy output equals the
    plain engine's and sampled output still matches the pattern."""
    engine = random_engine

    def constrained(**kwargs) -> SamplingParams:
        spec = StructuredOutputParams(StructuredOutputKind.REGEX, PATTERN)
        return SamplingParams(max_tokens=60, structured_output=spec, **kwargs)

    before = engine.core.speculator.stats.num_draft_tokens
    params = [constrained(temperature=0), greedy(30)]
    want = plain.generate(["Pattern:", REPEATING[0]], params)
    got = engine.generate(["Pattern:", REPEATING[0]], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(PATTERN, got[0].text) and got[0].finish_reason == "stop"
    for out in engine.generate(["Pattern:"] * 4, [constrained(temperature=1.0, seed=s) for s in range(4)]):
        assert re.fullmatch(PATTERN, out.text), out.text
    assert engine.core.speculator.stats.num_draft_tokens > before + 10
    assert engine.core.groups.num_constrained == 0
    assert_blocks_all_free(engine)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["noisy", "random"])
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"enable_prefix_caching": True}, id="prefix-caching"),
        pytest.param({"max_num_batched_tokens": 24, "max_num_seqs": 4}, id="chunked-prefill-and-a-tight-budget"),
        pytest.param({"num_kv_blocks": 10, "max_model_len": 160}, id="preemption"),
    ],
)
def test_greedy_output_is_unchanged_under_scheduling_pressure(
    llama_dir, cycle_dir, plain, plain_cycle, folders, method, kind, engine_kwargs
):
    target, reference = (cycle_dir, plain_cycle) if kind == "noisy" else (llama_dir, plain)
    prompts = REPEATING + PROMPTS[:4]
    params = [greedy(n) for n in (40, 24, 32, 48, 16, 40, 28, 36)]
    expected = reference.generate(prompts, params)
    engine = LLM(
        model=str(target), **{"num_kv_blocks": 512, **engine_kwargs}, **head_kwargs(method, folders[method, kind])
    )
    first = engine.generate(prompts, params)
    assert_blocks_all_free(engine)
    again = engine.generate(prompts, params)  # with prefix caching: now from cached blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in expected]
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    if "max_model_len" in engine_kwargs:
        assert sum(o.metrics.num_preemptions for o in first) > 0, "the budget was meant to force preemption"
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "drafts were meant to be rejected"
    if kind == "noisy":
        assert stats.num_accepted_tokens > 30, stats
    assert_blocks_all_free(engine)


@pytest.mark.parametrize("method", METHODS)
def test_drafts_never_reach_the_prefix_cache(cycle_dir, folders, method):
    engine = LLM(
        model=str(cycle_dir),
        num_kv_blocks=256,
        enable_prefix_caching=True,
        block_size=4,
        **head_kwargs(method, folders[method, "noisy"]),
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


@pytest.mark.parametrize("method", METHODS)
def test_sampled_token_frequencies_match_the_plain_engines(cycle_dir, plain_cycle, folders, method):
    """Agreeing heads on the cycle target, sampled at temperature 1 with top-k: drafts are
    accepted and rejected; the first four tokens of 400 seeded requests pass a per-position
    chi-square homogeneity test against the plain engine at p > 1e-4; seeds reproduce."""
    engine = LLM(
        model=str(cycle_dir),
        num_kv_blocks=512,
        enable_prefix_caching=False,
        **head_kwargs(method, folders[method, "agree"]),
    )
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


def _drop_tensor(folder, file: str, name: str) -> None:
    tensors = load_file(folder / file)
    del tensors[name]
    save_file(tensors, folder / file)


BAD_FOLDERS = {
    # case: (method, how the folder is written and spoiled, the error)
    "medusa-hidden": ("medusa", {"hidden_size": 32}, "speculative.heads .* has hidden_size 32, the target 64"),
    "medusa-vocab": ("medusa", {"vocab_size": 512}, "speculative.heads .* has vocab_size 512, the target 1024"),
    "medusa-k": (
        "medusa",
        {"num_heads": 2},
        "num_speculative_tokens 3 exceeds the 2 Medusa heads of speculative.heads",
    ),
    "medusa-no-config": ("medusa", "config.json", "speculative.heads .*config.json is missing"),
    "medusa-no-weights": ("medusa", "medusa_lm_head.safetensors", "speculative.heads .*no \\*.safetensors"),
    "medusa-missing-head": (
        "medusa",
        ("medusa_lm_head.safetensors", "1.1.weight"),
        "speculative.heads .*lack tensors lm_heads.1.weight",
    ),
    "medusa-not-medusa": ("medusa", "a model", "speculative.heads .*lacks medusa_num_heads"),
    "eagle-hidden": ("eagle", {"config_overrides": {"hidden_size": 32}}, "has hidden_size 32, the target 64"),
    "eagle-vocab": ("eagle", {"config_overrides": {"vocab_size": 512}}, "has vocab_size 512, the target 1024"),
    "eagle-layers": ("eagle", {"config_overrides": {"num_hidden_layers": 2}}, "has 1 layer, config.json says 2"),
    "eagle-positions": (
        "eagle",
        {"config_overrides": {"max_position_embeddings": 64}},
        "reaches 64 positions, fewer than max_model_len 128",
    ),
    "eagle-no-config": ("eagle", "config.json", "speculative.heads .*config.json is missing"),
    "eagle-no-weights": ("eagle", "model.safetensors", "speculative.heads .*no \\*.safetensors"),
    "eagle-missing-fc": ("eagle", ("model.safetensors", "fc.weight"), "speculative.heads .*lacks tensors .*fc.weight"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_bad_head_folder_fails_at_start_naming_the_field(llama_dir, tmp_path, heads, case):
    method, spoil, message = BAD_FOLDERS[case]
    folder = tmp_path / "heads"
    kwargs = head_kwargs(method, folder, max_model_len=128)
    if spoil == "a model":
        shutil.copytree(llama_dir, folder)
    else:
        write_heads(heads, method, folder, llama_dir, **(spoil if isinstance(spoil, dict) else {}))
    if isinstance(spoil, str) and spoil != "a model":
        (folder / spoil).unlink()
    elif isinstance(spoil, tuple):
        _drop_tensor(folder, *spoil)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(llama_dir), num_kv_blocks=64, **kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"speculative_method": "medusa"}, "heads: method 'medusa' needs the folder"),
        ({"speculative_method": "eagle"}, "heads: method 'eagle' needs the folder"),
        ({"speculative_method": "ngram", "heads": "x"}, "heads is set but method is 'ngram'"),
        ({"speculative_method": "medusa", "heads": "x", "draft_num_kv_blocks": 8}, "draft_num_kv_blocks is set"),
    ],
)
def test_a_bad_speculative_section_fails_naming_the_field(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(llama_dir), num_kv_blocks=64, **kwargs)
