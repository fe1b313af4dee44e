"""A draft model (speculative.method draft_model) across sleep and weight updates: sleep
frees the draft's KV-cache tensors with the target's (and every request's draft blocks),
wake_up brings them back and greedy output is what it was before; a target update keeps
the draft K/V of a running request valid (after an update that makes the target equal to
the draft, every draft is accepted). Target and draft blocks add up after every test."""

from __future__ import annotations

import pytest
from baton.services.engine import LLM, SamplingParams
from testlib.weight_updates import PROMPTS

K = 4
NUM_BLOCKS = 64
MAX_TOKENS = 24


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def speculative(target_dir, draft_dir) -> LLM:
    return LLM(
        model=str(target_dir),
        num_kv_blocks=NUM_BLOCKS,
        speculative_method="draft_model",
        draft_model=str(draft_dir),
        num_speculative_tokens=K,
    )


def assert_blocks_all_free(llm: LLM) -> None:
    """Target and draft: free + used == total, and nothing left in use."""
    llm.core.check_integrity()
    assert llm.core.scheduler.kv.num_free_blocks == llm.core.num_kv_blocks
    pool = llm.core.speculator.drafter.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.request_ids()


def draft_cache(llm: LLM) -> list:
    return llm.core.speculator.drafter.runner._runner.kv_caches


@pytest.fixture
def same(old_dir):
    """The draft is the target itself: every greedy draft is accepted."""
    llm = speculative(old_dir, old_dir)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_draft_cache_and_wake_up_restores_it(same, old_dir, level):
    ids = [same.tokenizer.encode(p) for p in PROMPTS]
    before = [o.token_ids for o in same.generate(ids, greedy())]
    runner = same.core.speculator.drafter.runner
    draft_bytes = runner.kv_cache_bytes
    assert draft_bytes > 0 and len(draft_cache(same)) == runner.arch.num_layers
    kv_bytes, weight_bytes = same.core.weights.memory_bytes()
    assert kv_bytes == draft_bytes + same.core.num_kv_blocks * same.core.executor.rank.runner.kv_block_bytes
    same.sleep(level)
    assert draft_cache(same) == [] and runner.kv_cache_bytes == 0
    assert same.core.weights.memory_bytes() == (0, weight_bytes if level == 1 else 0)
    same.wake_up()
    assert runner.kv_cache_bytes == draft_bytes
    assert all(not t.any() for t in draft_cache(same))  # zeroed: nothing of before the sleep is read
    if level == 2:
        same.update_weights_from_disk(str(old_dir))  # the target's weights back; the draft kept its own
    accepted = same.core.speculator.stats.num_accepted_tokens
    assert [o.token_ids for o in same.generate(ids, greedy())] == before
    assert same.core.speculator.stats.num_accepted_tokens > accepted  # the draft ran on its restored cache
    assert_blocks_all_free(same)


def test_sleep_after_an_abort_frees_the_aborted_requests_draft_blocks(same):
    """An abort by pause_generation ends requests between steps: their draft blocks are still
    held when sleep comes, and must go with the K/V they point at."""
    for i, prompt in enumerate(PROMPTS):
        same.core.add_request(f"r{i}", prompt, greedy(200))
    for _ in range(3):
        same.core.step()
    pool = same.core.speculator.drafter.pool
    assert pool.request_ids(), "the requests were meant to hold draft blocks"
    same.pause_generation("abort")
    assert not same.core.has_unfinished_requests()
    same.sleep(1)
    assert pool.num_free_blocks == pool.num_blocks and not pool.request_ids()
    same.wake_up()
    same.continue_generation()
    same.generate(PROMPTS[:1], greedy(8))
    assert_blocks_all_free(same)


def run_to_the_end(llm: LLM, request_id: str) -> list[int]:
    while llm.core.has_unfinished_requests():
        for output in llm.core.step():
            if output.request_id == request_id and output.finished:
                return output.token_ids
    raise AssertionError(f"{request_id} never finished")


def test_an_update_keeps_the_draft_state_of_a_running_request_valid(old_dir, new_dir):
    """The target starts on old weights with the new ones as its draft (little accepted), is
    paused with "keep" mid-request and updated to the new weights: the draft K/V the request
    holds (computed before the update) is still right, so every draft after it is accepted,
    and the tokens after the update are the new weights' greedy continuation."""
    llm = speculative(old_dir, new_dir)
    try:
        prompt_ids = llm.tokenizer.encode(PROMPTS[1])
        llm.core.add_request("r", prompt_ids, greedy(40))
        for _ in range(2):  # prefill + first drafts, then one verification: within pacing's first window
            llm.core.step()
        (running,) = llm.core.scheduler.running_requests()
        head = list(running.output_token_ids)
        drafter = llm.core.speculator.drafter
        assert drafter.pool.block_ids("r"), "the request was meant to hold draft K/V"
        llm.pause_generation("keep")
        llm.update_weights_from_disk(str(new_dir))
        llm.continue_generation()
        stats = llm.core.speculator.stats
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        tokens = run_to_the_end(llm, "r")
        assert stats.num_draft_tokens - drafted > 10
        assert stats.num_accepted_tokens - accepted == stats.num_draft_tokens - drafted
        assert_blocks_all_free(llm)
    finally:
        llm.shutdown()
    old = LLM(model=str(old_dir), num_kv_blocks=NUM_BLOCKS)
    new = LLM(model=str(new_dir), num_kv_blocks=NUM_BLOCKS)
    try:
        (before,) = old.generate([prompt_ids], greedy(40))
        (after,) = new.generate([prompt_ids + head], greedy(40 - len(head)))
    finally:
        old.shutdown()
        new.shutdown()
    assert tokens[: len(head)] == head == before.token_ids[: len(head)]
    assert tokens[len(head) :] == after.token_ids
