"""Speculative decoding with a draft model: greedy output equals the plain engine's token for
token (mixed batches, prefix caching, chunked prefill, preemption), a draft equal to the
target accepts every draft, sampled token frequencies match the plain engine's with a draft
that differs from the target, and the target's and the draft's blocks both add up after
every test."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.sampling_params import StructuredOutputKind, StructuredOutputParams
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_events import BlockStored, InMemoryKVEventPublisher
from baton.services.engine.core.request import Request
from safetensors.torch import load_file, save_file
from testlib.chi_square import assert_same_token_frequencies, chi_square_sf
from testlib.hf import PROMPTS
from testlib.models import tiny_model

REPEATING = ["a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2", "hello hello hello", "def foo(x): return foo(x)"]
K = 4


def draft_kwargs(draft_dir, **kwargs) -> dict:
    return {"speculative_method": "draft_model", "draft_model": str(draft_dir), "num_speculative_tokens": K, **kwargs}


def greedy(max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def assert_blocks_all_free(llm: LLM) -> None:
    """Target and draft: free + used == total (check_integrity), and nothing left in use."""
    llm.core.check_integrity()
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == llm.core.num_kv_blocks and not kv.req_to_blocks
    pool = llm.core.speculator.drafter.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.request_ids()


def copy_with_lm_head(src, dst, change) -> None:
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights["lm_head.weight"] = change(weights["lm_head.weight"])
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def small_draft_dir():
    """A smaller random model with the target's tokenizer: one layer, hidden 32, another seed."""
    return tiny_model(
        "llama", seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def noisy_draft_dir(llama_dir, tmp_path_factory):
    """The target with noise on its LM head: its greedy choice agrees with the target's about
    a third of the time, so drafts are accepted, cut and rolled back."""
    path = tmp_path_factory.mktemp("noisy") / "model"
    noise = torch.Generator().manual_seed(0)
    copy_with_lm_head(llama_dir, path, lambda w: w + 0.03 * torch.randn(w.shape, generator=noise))
    return path


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(model=str(llama_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def same(llama_dir):
    """The draft is the target itself: the mechanism's ceiling."""
    return LLM(model=str(llama_dir), num_kv_blocks=512, **draft_kwargs(llama_dir))


def test_a_draft_equal_to_the_target_accepts_every_greedy_draft(plain, same):
    prompts = REPEATING + PROMPTS
    expected = plain.generate(prompts, greedy(48))
    outputs = same.generate(prompts, greedy(48))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    stats = same.core.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens, stats
    engine_stats = same.core.stats()  # what the spec_decode_* metrics read
    assert engine_stats.spec_num_accepted_tokens == engine_stats.spec_num_draft_tokens == stats.num_draft_tokens
    assert engine_stats.spec_acceptance_rate == 1.0
    assert engine_stats.spec_mean_acceptance_length > 3
    assert_blocks_all_free(same)


def test_the_draft_sees_the_targets_logit_bias_and_penalties(plain, same):
    """With a draft equal to the target, any transform the draft missed would cost
    acceptance: it stays 1.0 under logit_bias and penalties (greedy)."""
    (free,) = plain.generate([REPEATING[2]], greedy(24))
    params = [
        greedy(24, logit_bias={free.token_ids[3]: 4.0, free.token_ids[5]: -100.0}),
        greedy(24, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
    ]
    expected = plain.generate([REPEATING[2]] * 2, params)
    before = same.core.speculator.stats
    drafted, accepted = before.num_draft_tokens, before.num_accepted_tokens
    outputs = same.generate([REPEATING[2]] * 2, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert expected[0].token_ids != free.token_ids, "the bias was meant to change the output"
    stats = same.core.speculator.stats
    assert stats.num_accepted_tokens - accepted == stats.num_draft_tokens - drafted > 10
    assert_blocks_all_free(same)


def test_mixed_batch_with_requests_that_do_not_speculate(plain, same):
    """Beam search never speculates; greedy ones with logprobs, a stop string and EOS do;
    the sampled n = 2 request speculates and stays reproducible under its seed."""
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
    outputs = same.generate(prompts, params)
    for want, got in zip(expected[:4], outputs[:4]):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    for want_d, got_d in zip(expected[0].logprobs, outputs[0].logprobs):
        assert sorted(got_d) == sorted(want_d)
        for token, entry in want_d.items():
            assert got_d[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
    again = same.generate(prompts[4:], params[4:])
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in outputs[4].outputs]
    assert all(len(c.token_ids) == 20 for c in outputs[4].outputs)
    assert_blocks_all_free(same)


@pytest.mark.parametrize("draft", ["noisy", "small"])
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"enable_prefix_caching": True}, id="prefix-caching"),
        pytest.param({"max_num_batched_tokens": 24, "max_num_seqs": 4}, id="chunked-prefill-and-a-tight-budget"),
        pytest.param({"num_kv_blocks": 10, "max_model_len": 160}, id="preemption"),
    ],
)
def test_greedy_output_is_unchanged_under_scheduling_pressure(
    llama_dir, plain, noisy_draft_dir, small_draft_dir, draft, engine_kwargs
):
    draft_dir = {"noisy": noisy_draft_dir, "small": small_draft_dir}[draft]
    prompts = REPEATING + PROMPTS[:4]
    params = [greedy(n) for n in (40, 24, 32, 48, 16, 40, 28, 36)]
    expected = plain.generate(prompts, params)
    engine = LLM(model=str(llama_dir), **{"num_kv_blocks": 512, **engine_kwargs}, **draft_kwargs(draft_dir))
    first = engine.generate(prompts, params)
    assert_blocks_all_free(engine)
    again = engine.generate(prompts, params)  # with prefix caching: now from cached blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in expected]
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    if "max_model_len" in engine_kwargs:
        assert sum(o.metrics.num_preemptions for o in first) > 0, "the budget was meant to force preemption"
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "drafts were meant to be rejected"
    if draft == "noisy":
        assert stats.num_accepted_tokens > 20, stats
    assert_blocks_all_free(engine)


def test_draft_tokens_never_reach_the_prefix_cache(llama_dir, noisy_draft_dir):
    engine = LLM(
        model=str(llama_dir),
        num_kv_blocks=256,
        enable_prefix_caching=True,
        block_size=4,
        **draft_kwargs(noisy_draft_dir),
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


@pytest.fixture(scope="module")
def peaked_dirs(llama_dir, tmp_path_factory):
    """The frequency test's target, the tiny model with its logits scaled 8x, and its draft,
    scaled 4x: the same argmax and a flatter q, so drafts are often accepted and often
    rejected."""
    root = tmp_path_factory.mktemp("peaked")
    copy_with_lm_head(llama_dir, root / "target", lambda w: w * 8)
    copy_with_lm_head(llama_dir, root / "draft", lambda w: w * 4)
    return root / "target", root / "draft"


@pytest.mark.parametrize(
    "sampling",
    [
        pytest.param({"temperature": 1.0, "top_k": 6, "presence_penalty": 0.5}, id="top-k-and-penalty"),
        pytest.param({"temperature": 1.3, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2}, id="top-p-min-p"),
    ],
)
def test_sampled_token_frequencies_match_the_plain_engines(peaked_dirs, sampling):
    """The first five output tokens of 500 seeded requests, per position: a 2 x C chi-square
    homogeneity test against the plain engine at p > 1e-4."""
    target, draft = peaked_dirs
    plain = LLM(model=str(target), num_kv_blocks=512)
    speculative = LLM(model=str(target), num_kv_blocks=512, **draft_kwargs(draft))
    prompt = plain.core.tokenizer.encode(REPEATING[3])
    params = [SamplingParams(max_tokens=5, seed=s, ignore_eos=True, **sampling) for s in range(500)]
    want = plain.generate([prompt] * len(params), params)
    got = speculative.generate([prompt] * len(params), params)
    stats = speculative.core.speculator.stats
    assert stats.num_accepted_tokens > 200 and stats.num_draft_tokens - stats.num_accepted_tokens > 200, stats
    assert_same_token_frequencies(want, got, speculative.core.arch.vocab_size, num_positions=5)
    assert_blocks_all_free(speculative)


def goodness_of_fit_p_value(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square of counts against expected counts, rare categories pooled."""
    observed, expected = observed.double(), expected.double()
    small = expected < min_expected
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert bool((observed[~keep] == 0).all()), "a draft was drawn where its q is zero"
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return chi_square_sf(stat, int(keep.sum()) - 1)


def test_drafts_are_drawn_from_the_q_they_report(peaked_dirs):
    """Exact verification needs q to be the distribution each draft was drawn from, after
    every transform: 400 requests on one prompt with other seeds; the first drafts' counts
    against q_0, the second drafts' against the sum of their q_1 rows (their contexts differ)."""
    target, draft = peaked_dirs
    engine = LLM(model=str(target), num_kv_blocks=512, **draft_kwargs(draft))
    drafter = engine.core.speculator.drafter
    prompt = engine.core.tokenizer.encode(REPEATING[1])
    params = SamplingParams(temperature=1.3, top_k=12, top_p=0.95, min_p=0.02, repetition_penalty=1.3)
    eos = frozenset(engine.core.arch.eos_token_ids)
    requests = [Request(f"r{s}", prompt, params, eos, max_tokens=8, seed=s) for s in range(400)]
    drafts = drafter.propose(requests, [2] * len(requests))
    q = torch.stack([drafter.draft_probs(r.request_id, 2) for r in requests])  # [400, 2, V]
    vocab = q.shape[-1]
    first = torch.bincount(torch.tensor([d[0] for d in drafts]), minlength=vocab)
    second = torch.bincount(torch.tensor([d[1] for d in drafts]), minlength=vocab)
    assert torch.allclose(q[:, 0], q[0, 0].expand_as(q[:, 0]), atol=1e-6), "one context, one q_0"
    assert int((q[0, 0] > 0).sum()) > 3, "q_0 was meant to spread over several tokens"
    assert goodness_of_fit_p_value(first, q[0, 0] * len(requests)) > 1e-4
    assert goodness_of_fit_p_value(second, q[:, 1].sum(dim=0)) > 1e-4
    drafter.retain(set())
    assert_blocks_all_free(engine)


PATTERN = r"(ab|cd){6}x[0-9]{3}(ab){4}"
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 3, "maxItems": 3}},
    "required": ["items"],
    "additionalProperties": False,
}


def constrained(kind: StructuredOutputKind, spec: str, **kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "structured_output": StructuredOutputParams(kind, spec), **kwargs})


def test_structured_output_masks_every_draft_position(plain, same):
    params = [
        constrained(StructuredOutputKind.REGEX, PATTERN, temperature=0),
        constrained(StructuredOutputKind.JSON, json.dumps(SCHEMA), temperature=0),
        greedy(30),
    ]
    prompts = ["Pattern:", "Record:", REPEATING[0]]
    want = plain.generate(prompts, params)
    before = same.core.speculator.stats.num_accepted_tokens
    got = same.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(PATTERN, got[0].text) and got[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got[1].text), SCHEMA)
    assert same.core.speculator.stats.num_accepted_tokens > before + 20
    sampled = [constrained(StructuredOutputKind.REGEX, PATTERN, temperature=1.0, seed=s) for s in range(6)]
    for out in same.generate(["Pattern:"] * 6, sampled):
        assert re.fullmatch(PATTERN, out.text), out.text
    assert same.core.groups.num_constrained == 0
    assert_blocks_all_free(same)


def test_a_draft_that_does_not_pay_pauses(plain, llama_dir, small_draft_dir):
    from baton.services.engine.spec_decode import speculator as policy

    (expected,) = plain.generate([REPEATING[0]], greedy(96))
    engine = LLM(model=str(llama_dir), num_kv_blocks=512, **draft_kwargs(small_draft_dir))
    (output,) = engine.generate([REPEATING[0]], greedy(96))
    assert output.token_ids == expected.token_ids
    stats = engine.core.speculator.stats
    assert stats.num_accepted_tokens <= 1, stats
    # Windows of 8 drafted tokens (2 passes of 4), then pauses of 16, 32, 64 steps: about 4
    # windows in 96 steps, where drafting every step would make 95 passes.
    windows = -(-policy.WINDOW // K)
    assert stats.num_drafts <= 4 * windows, stats
    assert_blocks_all_free(engine)


@pytest.fixture(scope="module")
def other_tokenizer_dir(llama_dir, tmp_path_factory):
    """The target with two of its tokenizer's ids swapped: same vocabulary size, other ids."""
    path = tmp_path_factory.mktemp("swapped") / "model"
    shutil.copytree(llama_dir, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "the", "and"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"speculative_method": "draft_model"}, "draft_model: method 'draft_model' needs"),
        ({"speculative_method": "ngram", "draft_model": "x"}, "draft_model is set but method is 'ngram'"),
        ({"draft": "vocab"}, "speculative.draft_model .* has vocab_size 512, the target 1024"),
        ({"draft": "tokenizer"}, "speculative.draft_model .* has another tokenizer"),
        ({"draft": "same", "max_model_len": 8192, "num_kv_blocks": 1024}, "fewer than max_model_len 8192"),
    ],
)
def test_a_bad_draft_fails_at_start_naming_the_field(llama_dir, other_tokenizer_dir, kwargs, message):
    kwargs = dict(kwargs)
    draft = kwargs.pop("draft", None)
    if draft is not None:
        draft_dir = {
            "vocab": lambda: tiny_model("llama", vocab_size=512),
            "tokenizer": lambda: other_tokenizer_dir,
            "same": lambda: llama_dir,
        }[draft]()
        kwargs = {**draft_kwargs(draft_dir), **kwargs}
    if draft == "same":  # a target that reaches further than the draft
        target = tiny_model("llama", max_position_embeddings=8192)
    else:
        target = llama_dir
    with pytest.raises(ValueError, match=message):
        LLM(model=str(target), **{"num_kv_blocks": 64, **kwargs})
