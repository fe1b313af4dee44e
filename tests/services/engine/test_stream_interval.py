"""Streaming granularity: `stream_interval` batches tokens per output, and a reader that
falls behind gets its backlog merged into one delta; neither changes what is generated."""

from __future__ import annotations

import asyncio

import pytest
from baton.services.engine import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from baton.services.engine.api.outputs import CompletionOutput, RequestOutput, merge_deltas


def greedy(max_tokens: int, kind=RequestOutputKind.DELTA, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind=kind, **kwargs)


@pytest.fixture(scope="module")
def every_four(llama_dir):
    engine = AsyncLLM.from_kwargs(str(llama_dir), num_kv_blocks=64, stream_interval=4)
    yield engine
    engine.shutdown()


async def collect(engine, request_id, prompt, params):
    return [out async for out in engine.generate(request_id, prompt, params)]


async def test_the_first_token_goes_at_once_then_every_interval(every_four, llama_dir):
    (offline,) = LLM(model=str(llama_dir), num_kv_blocks=64).generate(["def foo(x):"], greedy(18))
    outputs = await collect(every_four, "si-1", "def foo(x):", greedy(18))
    assert [len(o.token_ids) for o in outputs] == [1, 4, 4, 4, 4, 1]
    assert [t for o in outputs for t in o.token_ids] == offline.token_ids
    assert "".join(o.text for o in outputs) == offline.text
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])


async def test_cumulative_outputs_follow_the_interval_too(every_four):
    outputs = await collect(every_four, "si-2", "def foo(x):", greedy(10, RequestOutputKind.CUMULATIVE))
    assert [len(o.token_ids) for o in outputs] == [1, 5, 9, 10]


async def test_a_stop_string_inside_a_held_back_run_ends_the_stream_there(every_four, llama_dir):
    (free,) = LLM(model=str(llama_dir), num_kv_blocks=64).generate(["def foo(x):"], greedy(24))
    stop = free.text[len(free.text) // 2 :][:3]
    (offline,) = LLM(model=str(llama_dir), num_kv_blocks=64).generate(["def foo(x):"], greedy(24, stop=[stop]))
    assert offline.finish_reason == "stop"
    outputs = await collect(every_four, "si-3", "def foo(x):", greedy(24, stop=[stop]))
    assert "".join(o.text for o in outputs) == offline.text
    assert outputs[-1].finish_reason == "stop"


async def test_samples_of_one_request_share_the_interval(every_four):
    params = SamplingParams(
        n=2, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    outputs = await collect(every_four, "si-4", "def foo(x):", params)
    per_sample: dict[int, list[int]] = {0: [], 1: []}
    for output in outputs:
        for piece in output.outputs:
            per_sample[piece.index].extend(piece.token_ids)
    assert [len(tokens) for tokens in per_sample.values()] == [6, 6]
    assert len(outputs) < 12  # one output per step would be 6 per sample


def delta(tokens: list[int], text: str, finish: str | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput(
        "r", None, [1, 2], [CompletionOutput(index, text, tokens, None, None, finish)], finish is not None, 0
    )


def test_merged_deltas_concatenate_and_keep_the_latest_state():
    merged = merge_deltas([delta([5], "a"), delta([6, 7], "bc", index=1), delta([8], "d", "length")])
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in merged.outputs] == [
        (0, [5, 8], "ad", "length"),
        (1, [6, 7], "bc", None),
    ]
    assert merged.finished


async def test_a_reader_behind_the_engine_gets_its_backlog_as_one_delta(llama_dir):
    engine = AsyncLLM.from_kwargs(str(llama_dir), num_kv_blocks=64)
    try:
        (offline,) = LLM(model=str(llama_dir), num_kv_blocks=64).generate(["def foo(x):"], greedy(12))
        stream = engine.add_request("behind", "def foo(x):", greedy(12))
        for _ in range(1000):  # the engine runs ahead of a reader that does not read
            if stream._queue.qsize() == 12:
                break
            await asyncio.sleep(0.01)
        outputs = [out async for out in stream.merged(RequestOutputKind.DELTA)]
        assert len(outputs) == 1 and outputs[0].finished
        assert outputs[0].token_ids == offline.token_ids and outputs[0].text == offline.text
    finally:
        engine.shutdown()
