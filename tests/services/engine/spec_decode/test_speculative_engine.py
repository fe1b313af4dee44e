"""Speculative decoding in the engine (n-gram drafts): greedy output equals the plain
engine's token for token in every setting that changes scheduling, seeded sampling has the
plain engine's distribution, and draft tokens never reach the prefix cache."""

from __future__ import annotations

import shutil

import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_events import BlockStored, InMemoryKVEventPublisher
from safetensors.torch import load_file, save_file
from testlib.chi_square import assert_same_token_frequencies
from testlib.hf import PROMPTS

# Prompts whose continuations repeat what came before: the random tiny model falls into
# loops under greedy decoding, and these prompts repeat n-grams from the start.
REPEATING = ["a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2", "hello hello hello", "def foo(x): return foo(x)"]
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4}


def greedy(max_tokens: int = 48, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def assert_blocks_all_free(llm: LLM) -> None:
    llm.core.check_integrity()
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == llm.core.num_kv_blocks and not kv.req_to_blocks


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def speculative(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=512, **SPEC)


def test_greedy_output_equals_the_plain_engines_and_drafts_were_accepted(plain, speculative):
    prompts = REPEATING + PROMPTS
    expected = plain.generate(prompts, greedy())
    before = speculative.core.speculator.stats.num_accepted_tokens
    outputs = speculative.generate(prompts, greedy())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.text for o in outputs] == [o.text for o in expected]
    stats = speculative.core.speculator.stats
    assert stats.num_accepted_tokens - before > 20, "the workload was meant to accept drafts"
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
    assert_blocks_all_free(speculative)


def test_mixed_batch_with_requests_that_cannot_speculate(plain, speculative):
    """Beam search, structured output and n > 1 requests beside speculating ones."""
    params = [
        greedy(),
        SamplingParams(max_tokens=16, use_beam_search=True, beam_width=2, temperature=0, ignore_eos=True),
        greedy(24),
        SamplingParams(n=2, max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
    ]
    prompts = REPEATING[:4]
    expected = plain.generate(prompts, params)
    outputs = speculative.generate(prompts, params)
    for want, got in zip(expected, outputs):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert_blocks_all_free(speculative)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"enable_prefix_caching": True}, id="prefix-caching"),
        pytest.param({"max_num_batched_tokens": 24, "max_num_seqs": 4}, id="chunked-prefill-and-a-tight-budget"),
        pytest.param({"num_kv_blocks": 10, "max_model_len": 160}, id="preemption"),
    ],
)
def test_greedy_output_is_unchanged_under_scheduling_pressure(llama_dir, plain, engine_kwargs):
    kwargs = {"num_kv_blocks": 512, **engine_kwargs}
    prompts = REPEATING + PROMPTS[:4]
    params = [greedy(n) for n in (40, 24, 32, 48, 16, 40, 28, 36)]
    expected = plain.generate(prompts, params)
    engine = LLM(model=str(llama_dir), **kwargs, **SPEC)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)  # with prefix caching: now from cached blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in expected]
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    if "max_model_len" in engine_kwargs:
        assert sum(o.metrics.num_preemptions for o in first) > 0, "the budget was meant to force preemption"
    assert engine.core.speculator.stats.num_accepted_tokens > 0
    assert_blocks_all_free(engine)


def test_stops_max_tokens_and_logprobs_behave_as_without_speculation(plain, speculative):
    (free,) = plain.generate([REPEATING[0]], greedy(40))
    stop_text = free.text[len(free.text) // 2 :][:4]
    stop_token = free.token_ids[17]
    params = [
        greedy(40, stop=[stop_text]),
        greedy(40, stop_token_ids=[stop_token]),
        greedy(7),
        greedy(30, logprobs=3),
        SamplingParams(max_tokens=40, temperature=0),  # EOS not ignored
    ]
    prompts = [REPEATING[0]] * len(params)
    expected = plain.generate(prompts, params)
    outputs = speculative.generate(prompts, params)
    for want, got in zip(expected, outputs):
        assert (got.token_ids, got.text, got.finish_reason, got.outputs[0].stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.outputs[0].stop_reason,
        )
    want_lp, got_lp = expected[3].logprobs, outputs[3].logprobs
    assert [sorted(d) for d in got_lp] == [sorted(d) for d in want_lp]
    for want_d, got_d in zip(want_lp, got_lp):
        for token, entry in want_d.items():
            assert got_d[token].rank == entry.rank
            assert got_d[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert outputs[0].finish_reason == "stop" and outputs[1].finish_reason == "stop"
    assert_blocks_all_free(speculative)


def test_draft_tokens_never_reach_the_prefix_cache(llama_dir):
    engine = LLM(model=str(llama_dir), num_kv_blocks=256, enable_prefix_caching=True, block_size=4, **SPEC)
    publisher = engine.core.publisher = InMemoryKVEventPublisher()
    outputs = engine.generate(REPEATING, greedy(40))
    assert engine.core.speculator.stats.num_draft_tokens > engine.core.speculator.stats.num_accepted_tokens
    real = set()
    for prompt, output in zip(REPEATING, outputs):
        tokens = [*engine.core.tokenizer.encode(prompt), *output.token_ids]
        real.update(hash_request_tokens(tokens, 4, ()))
    stored = {h for event in publisher.events if isinstance(event, BlockStored) for h in event.block_hashes}
    assert stored and stored <= real, "a stored block's hash covers tokens that were never generated"
    assert_blocks_all_free(engine)


def test_seeded_sampling_is_reproducible(speculative):
    params = [SamplingParams(max_tokens=32, temperature=0.9, top_k=8, seed=s) for s in range(4)]
    first = speculative.generate(REPEATING, params)
    second = speculative.generate(REPEATING, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


@pytest.fixture(scope="module")
def peaked_dir(llama_dir, tmp_path_factory):
    """The tiny model with its logits scaled 8x: sampling mostly follows the argmax, so drafts
    of the greedy continuation are often accepted and sometimes rejected."""
    path = tmp_path_factory.mktemp("peaked") / "model"
    shutil.copytree(llama_dir, path)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 8
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


class GreedyContinuation:
    """Drafts the plain engine's greedy continuation of one prompt, whatever was sampled."""

    def __init__(self, num_prompt_tokens: int, continuation: list[int], k: int) -> None:
        self.num_prompt_tokens, self.continuation, self.k = num_prompt_tokens, continuation, k

    def propose(self, token_ids: list[int]) -> list[int]:
        done = len(token_ids) - self.num_prompt_tokens
        return self.continuation[done : done + self.k]


@pytest.mark.parametrize(
    "sampling",
    [
        pytest.param({"temperature": 1.0, "top_k": 4}, id="top-k"),
        pytest.param({"temperature": 1.0, "top_p": 0.9, "presence_penalty": 0.5}, id="top-p-and-penalty"),
        pytest.param({"temperature": 1.5, "min_p": 0.1, "repetition_penalty": 1.2}, id="min-p-and-penalty"),
    ],
)
def test_sampled_token_frequencies_match_the_plain_engines(peaked_dir, sampling):
    """The first five output tokens of 600 seeded requests, per position: a 2 x C chi-square
    homogeneity test against the plain engine at p > 1e-4. The drafts are the greedy
    continuation (the n-gram proposer has its own tests), so both the accepting and the
    rejecting branches of verification run at every position."""
    plain = LLM(model=str(peaked_dir), num_kv_blocks=512)
    speculative = LLM(model=str(peaked_dir), num_kv_blocks=512, **SPEC)
    prompt = plain.core.tokenizer.encode(REPEATING[3])
    (greedy_out,) = plain.generate([prompt], greedy(8))
    speculative.core.speculator.proposer = GreedyContinuation(len(prompt), greedy_out.token_ids, 4)
    params = [SamplingParams(max_tokens=5, seed=s, ignore_eos=True, **sampling) for s in range(600)]
    want = plain.generate([prompt] * len(params), params)
    got = speculative.generate([prompt] * len(params), params)
    stats = speculative.core.speculator.stats
    assert stats.num_accepted_tokens > 300 and stats.num_draft_tokens - stats.num_accepted_tokens > 300, stats
    assert_same_token_frequencies(want, got, speculative.core.arch.vocab_size, num_positions=5)
    assert_blocks_all_free(speculative)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"speculative_method": "medusa-ish"}, "method"),
    ],
)
def test_bad_speculative_config_names_the_field(llama_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=str(llama_dir), num_kv_blocks=64, **{"speculative_method": "ngram", **kwargs})


class Junk:
    """Drafts a token the model does not pick, every step."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, token_ids: list[int]) -> list[int]:
        return [self.token] * 3


def test_a_request_whose_drafts_do_not_pay_pauses_drafting(plain, llama_dir):
    from baton.services.engine.spec_decode import speculator as policy

    (expected,) = plain.generate([REPEATING[0]], greedy(96))
    junk = next(t for t in range(3, 1000) if t not in expected.token_ids)
    engine = LLM(model=str(llama_dir), num_kv_blocks=512, **SPEC)
    engine.core.speculator.proposer = Junk(junk)
    (output,) = engine.generate([REPEATING[0]], greedy(96))
    assert output.token_ids == expected.token_ids
    stats = engine.core.speculator.stats
    assert stats.num_accepted_tokens == 0
    # Windows of 8 drafted tokens (3 passes of 3), then pauses of 16, 32, 64 steps: about 4
    # windows in 96 steps, where drafting every step would make 95 passes.
    windows = -(-policy.WINDOW // 3)
    assert stats.num_drafts <= 4 * windows, stats
