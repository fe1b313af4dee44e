"""The async engine: streaming, concurrency, abort on cancel, errors up front."""

from __future__ import annotations

import asyncio

import pytest
from baton.services.engine import LLM, AsyncLLM, InvalidRequestError, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_dir):
    engine = AsyncLLM.from_kwargs(str(llama_dir), num_kv_blocks=128)
    yield engine
    engine.shutdown()


def greedy(max_tokens: int | None, kind=RequestOutputKind.DELTA) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind=kind)


async def collect(engine, request_id, prompt, params):
    return [out async for out in engine.generate(request_id, prompt, params)]


async def test_streamed_deltas_equal_offline_output(engine, llama_dir):
    (offline,) = LLM(model=str(llama_dir), num_kv_blocks=64).generate(["def foo(x):"], greedy(20))
    outputs = await collect(engine, "stream-1", "def foo(x):", greedy(20))
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert [t for o in outputs for t in o.token_ids] == offline.token_ids
    assert "".join(o.text for o in outputs) == offline.text
    assert outputs[0].metrics.first_token_time is not None


async def test_concurrent_requests_are_independent(engine):
    prompts = [f"request number {i}" for i in range(12)]
    results = await asyncio.gather(
        *(collect(engine, f"conc-{i}", p, greedy(8 + i, RequestOutputKind.CUMULATIVE)) for i, p in enumerate(prompts))
    )
    for i, outputs in enumerate(results):
        assert len(outputs[-1].token_ids) == 8 + i


async def test_cancelled_stream_aborts_and_frees_blocks(engine):
    # None: to the end of the context (a max_tokens past it is refused, no longer capped).
    stream = engine.generate("cancel-me", "a long story", greedy(None))
    first = await stream.__anext__()
    assert not first.finished
    await stream.aclose()  # what a disconnecting client does

    async def free_blocks():
        return await engine.run_in_engine(
            lambda core: (core.scheduler.kv.num_free_blocks, core.has_unfinished_requests())
        )

    for _ in range(100):
        free, busy = await free_blocks()
        if free == 128 and not busy:
            break
        await asyncio.sleep(0.02)
    assert (free, busy) == (128, False)
    await engine.run_in_engine(lambda core: core.check_integrity())


async def test_abort_by_id_finishes_with_abort(engine):
    stream = engine.generate("abort-me", "a long story", greedy(None))
    await stream.__anext__()
    engine.abort("abort-me")
    outputs = [o async for o in stream]
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"


async def test_invalid_request_raises_before_streaming(engine):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.add_request("bad", "x" * 10, SamplingParams(max_tokens=1, stop_token_ids=[10**7]))
    outputs = await collect(engine, "dup", "hi", greedy(2))
    assert outputs[-1].finished
    stream = engine.add_request("dup2", "hi", greedy(50))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup2", "hi", greedy(2))
    await stream.aclose()


def test_the_engine_thread_builds_the_core(llama_dir, monkeypatch):
    """The thread that loads the model is the one that runs it: one OpenMP team per process
    (services/model/cpu_tuning.py says why)."""
    import threading

    from baton.services.engine import engine_core

    built_on = []
    original = engine_core.EngineCore.__init__

    def record(self, *args, **kwargs):
        built_on.append(threading.current_thread().name)
        original(self, *args, **kwargs)

    monkeypatch.setattr(engine_core.EngineCore, "__init__", record)
    engine = AsyncLLM.from_kwargs(str(llama_dir), num_kv_blocks=32)
    try:
        assert built_on == ["baton-engine"]
    finally:
        engine.shutdown()


def test_a_core_that_fails_to_build_raises_from_the_constructor(tmp_path):
    import threading

    before = set(threading.enumerate())
    with pytest.raises(Exception, match="config.json|No such file|not a directory|does not exist"):
        AsyncLLM.from_kwargs(str(tmp_path / "missing-model"))
    assert not [t for t in set(threading.enumerate()) - before if t.name == "baton-engine"]
