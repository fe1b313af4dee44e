"""pause_generation with requests in flight, through `AsyncLLM`: "abort" ends them, "wait"
finishes them, "keep" holds them across an update (they continue on the new weights);
requests that arrive while paused wait for continue_generation. No block leaks."""

from __future__ import annotations

import asyncio

import pytest
from baton.services.engine import AsyncLLM, SamplingParams
from baton.services.engine.api.sampling_params import RequestOutputKind
from testlib.hf import hf_greedy
from testlib.weight_updates import PROMPTS

NUM_BLOCKS = 128


@pytest.fixture
async def engine(old_dir):
    engine = AsyncLLM.from_kwargs(str(old_dir), num_kv_blocks=NUM_BLOCKS)
    yield engine
    engine.shutdown()


def params(max_tokens: int | None = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, output_kind=RequestOutputKind.DELTA)


async def collect(engine, request_id: str, prompt, sp: SamplingParams) -> list:
    return [out async for out in engine.generate(request_id, prompt, sp)]


async def started(engine, request_ids: list[str]) -> None:
    """Returns once every request has produced a token."""
    while True:
        counts = await engine.run_in_engine(
            lambda c: [r.num_output_tokens for r in c.scheduler.running_requests() if r.request_id in request_ids]
        )
        if len(counts) == len(request_ids) and all(counts):
            return
        await asyncio.sleep(0.005)


async def assert_no_leak(engine) -> None:
    def check(core):
        core.check_integrity()
        return core.scheduler.kv.num_free_blocks, core.has_unfinished_requests()

    assert await engine.run_in_engine(check) == (NUM_BLOCKS, False)


async def test_abort_ends_requests_in_flight_and_holds_new_ones(engine):
    tasks = [asyncio.create_task(collect(engine, f"a{i}", PROMPTS[i], params(None))) for i in range(3)]
    await started(engine, ["a0", "a1", "a2"])
    await engine.pause_generation("abort")
    for outputs in await asyncio.gather(*tasks):
        assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
        assert outputs[-1].weight_version == "0"
    late = asyncio.create_task(collect(engine, "late", PROMPTS[0], params(8)))
    await asyncio.sleep(0.3)
    assert not late.done()  # held while paused
    await assert_no_leak(engine)
    await engine.continue_generation()
    outputs = await late
    assert outputs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outputs) == 8
    await assert_no_leak(engine)


async def test_wait_finishes_requests_in_flight_first(engine):
    tasks = [asyncio.create_task(collect(engine, f"w{i}", PROMPTS[i], params(30 + i))) for i in range(3)]
    await started(engine, ["w0", "w1", "w2"])
    await engine.pause_generation("wait")
    for task in tasks:  # done by the time pause_generation returned
        assert task.done()
    for i, outputs in enumerate(await asyncio.gather(*tasks)):
        assert outputs[-1].finish_reason in ("length", "stop")
        assert outputs[-1].finish_reason == "stop" or sum(len(o.token_ids) for o in outputs) == 30 + i
    late = asyncio.create_task(collect(engine, "late", PROMPTS[1], params(4)))
    await asyncio.sleep(0.3)
    assert not late.done()
    await engine.continue_generation()
    assert (await late)[-1].finished
    await assert_no_leak(engine)


async def test_keep_continues_on_the_new_weights(engine, old_dir, new_dir):
    """Tokens before the pause are the old model's (version "0"); after the update the
    request recomputes its K/V and its remaining tokens are the new model's greedy
    continuation of prompt + tokens so far (version "1")."""
    prompt = engine.tokenizer.encode(PROMPTS[1])
    total = 40
    task = asyncio.create_task(collect(engine, "k", prompt, params(total)))
    await started(engine, ["k"])
    await engine.pause_generation("keep")
    await asyncio.sleep(0.1)
    assert not task.done()
    assert await engine.update_weights_from_disk(str(new_dir)) == "1"
    await engine.continue_generation()
    outputs = await task
    old_tokens = [t for o in outputs if o.weight_version == "0" for t in o.token_ids]
    new_tokens = [t for o in outputs if o.weight_version == "1" for t in o.token_ids]
    assert old_tokens and new_tokens
    assert [o.weight_version for o in outputs] == sorted(o.weight_version for o in outputs)  # never back
    assert old_tokens == hf_greedy(old_dir, prompt, len(old_tokens))[0]
    assert new_tokens == hf_greedy(new_dir, prompt + old_tokens, total - len(old_tokens))[0]
    await assert_no_leak(engine)


async def test_an_update_with_requests_running_recomputes_them(engine, old_dir, new_dir):
    """No pause at all: the update still lands between steps, and running requests
    recompute on the new weights rather than read K/V of the old ones."""
    prompt = engine.tokenizer.encode(PROMPTS[0])
    task = asyncio.create_task(collect(engine, "u", prompt, params(40)))
    await started(engine, ["u"])
    await engine.update_weights_from_disk(str(new_dir))
    outputs = await task
    old_tokens = [t for o in outputs if o.weight_version == "0" for t in o.token_ids]
    new_tokens = [t for o in outputs if o.weight_version == "1" for t in o.token_ids]
    assert old_tokens == hf_greedy(old_dir, prompt, len(old_tokens))[0]
    assert new_tokens == hf_greedy(new_dir, prompt + old_tokens, 40 - len(old_tokens))[0]
    await assert_no_leak(engine)


async def test_an_abort_of_a_held_request_ends_it(engine):
    await engine.pause_generation("keep")
    stream = engine.add_request("held", PROMPTS[0], params(8))
    await asyncio.sleep(0.1)
    engine.abort("held")
    outputs = [o async for o in stream]
    assert outputs[-1].finish_reason == "abort"
    await engine.continue_generation()
    await assert_no_leak(engine)
