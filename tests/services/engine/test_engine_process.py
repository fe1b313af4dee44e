"""The engine core in a process of its own (`runner.core_process`): the same outputs as on a
thread, errors and calls across the boundary, KV events forwarded, and a killed process on
either side fails loudly rather than hanging or leaking."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from baton.kernels import cpu_ops
from baton.services.engine import AsyncLLM, EngineDeadError, InvalidRequestError, SamplingParams
from baton.services.engine.config import EngineConfig
from baton.services.engine.core.kv_events import BlockStored, InMemoryKVEventPublisher, KVCacheSnapshot
from baton.services.engine.errors import EngineSleepingError
from testlib.models import tiny_model
from testlib.waiting import wait_until

NUM_BLOCKS = 64
PROMPTS = ["def foo(x):", "request number two", "a third prompt, longer than the others by a few words"]


def config(model_dir, **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model_dir), num_kv_blocks=NUM_BLOCKS, block_size=16, **kwargs)


class SnapshotPublisher(InMemoryKVEventPublisher):
    """Asks for a snapshot when `wanted` is set, as the router agent's publisher does."""

    def __init__(self) -> None:
        super().__init__()
        self.wanted = False
        self.snapshots: list[KVCacheSnapshot] = []

    def wants_snapshot(self) -> bool:
        return self.wanted

    def publish_snapshot(self, snapshot: KVCacheSnapshot) -> None:
        self.snapshots.append(snapshot)
        self.wanted = False


@pytest.fixture(scope="module")
def publisher():
    return SnapshotPublisher()


@pytest.fixture(scope="module")
def engine(llama_dir, publisher):
    engine = AsyncLLM(config(llama_dir, core_process=True), kv_event_publisher=publisher)
    yield engine
    engine.shutdown()


def greedy(max_tokens: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def collect(engine, request_id, prompt, params):
    return [out async for out in engine.generate(request_id, prompt, params)]


async def texts(engine, prefix: str) -> list[str]:
    results = await asyncio.gather(*(collect(engine, f"{prefix}-{i}", p, greedy(12)) for i, p in enumerate(PROMPTS)))
    return ["".join(o.text for o in outputs) for outputs in results]


async def free_blocks(engine) -> int:
    return await engine.run_in_engine(lambda core: (core.check_integrity(), core.scheduler.kv.num_free_blocks)[1])


async def test_outputs_equal_the_engine_on_a_thread(engine, llama_dir):
    on_thread = AsyncLLM(config(llama_dir))
    try:
        expected = await texts(on_thread, "thread")
    finally:
        on_thread.shutdown()
    assert await texts(engine, "process") == expected
    assert engine.is_running and (engine.max_model_len, engine.vocab_size) == (on_thread.max_model_len, 1024)
    assert await free_blocks(engine) == NUM_BLOCKS
    assert wait_until(lambda: engine.stats().num_free_kv_blocks == NUM_BLOCKS, what="stats after the requests")


def _kernel_pool_state(core) -> tuple[bool, str | None]:
    return cpu_ops.set_thread_pool(True), os.environ.get("OMP_WAIT_POLICY")  # on stays on


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ CPU kernels here")
async def test_the_engine_process_runs_the_kernels_on_their_own_thread_pool(engine):
    """With OpenMP's workers passive beside them (kernels/csrc/thread_pool.h says why); this
    process, a replica's, keeps OpenMP."""
    assert await engine.run_in_engine(_kernel_pool_state) == (True, "PASSIVE")
    was_on = cpu_ops.set_thread_pool(False)
    assert not was_on


async def test_every_output_carries_its_prompt(engine):
    """The prompt crosses from the engine's process once per request; each output has it."""
    ids = list(range(5, 40))
    outputs = await collect(engine, "prompt-ids", ids, greedy(5))
    assert len(outputs) == 5 and all(o.prompt_token_ids == ids for o in outputs)
    outputs = await collect(engine, "prompt-text", "def foo(x):", greedy(5))
    assert all(o.prompt == "def foo(x):" and o.prompt_token_ids == outputs[0].prompt_token_ids for o in outputs)
    assert outputs[0].prompt_token_ids and not engine._engine._prompts  # forgotten once finished


async def test_a_refused_request_ends_its_stream_with_the_error(engine):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        await collect(engine, "bad", "x" * 10, SamplingParams(max_tokens=1, stop_token_ids=[10**7]))
    outputs = await collect(engine, "after-bad", "hi", greedy(2))  # the engine goes on
    assert outputs[-1].finished
    stream = engine.add_request("dup", "hi", greedy(50))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", "hi", greedy(2))
    await stream.aclose()
    assert wait_until(lambda: not engine.has_request("dup"))


async def test_a_closed_stream_aborts_and_frees_its_blocks(engine):
    stream = engine.generate("cancel-me", "a long story", greedy(None))
    assert not (await stream.__anext__()).finished
    await stream.aclose()  # what a disconnecting client does
    for _ in range(200):
        if await free_blocks(engine) == NUM_BLOCKS:
            break
        await asyncio.sleep(0.01)
    assert await free_blocks(engine) == NUM_BLOCKS

    stream = engine.generate("abort-me", "a long story", greedy(None))
    await stream.__anext__()
    engine.abort("abort-me")
    assert [o async for o in stream][-1].finish_reason == "abort"


async def test_calls_cross_with_their_results_and_errors(engine):
    assert await engine.run_in_engine(lambda core: core.config.cache.block_size) == 16
    with pytest.raises(ZeroDivisionError):
        await engine.run_in_engine(lambda core: 1 / 0)
    with pytest.raises(RuntimeError, match="cannot be sent"):
        await engine.run_in_engine(lambda core: lambda: None)  # a result that does not pickle
    with pytest.raises(AttributeError, match="run_in_engine"):
        engine.core  # noqa: B018 - the core lives in the other process


async def test_kv_events_and_snapshots_reach_the_parents_publisher(engine, publisher):
    prompt = "a prompt long enough to fill more than one block of sixteen tokens, and then some more"
    start = len(publisher.events)
    await collect(engine, "events", prompt, greedy(4))
    stored = wait_until(lambda: [e for e in publisher.events[start:] if isinstance(e, BlockStored)], what="BlockStored")
    publisher.wanted = True  # the idle child hears it within its idle tick
    wait_until(lambda: publisher.snapshots, timeout_s=5, what="a snapshot")
    assert not publisher.wanted and len(publisher.snapshots) == 1
    cached = set(publisher.snapshots[0].block_hashes)
    assert {h for e in stored for h in e.block_hashes} <= cached


async def test_sleep_refuses_requests_and_wake_up_serves_again(engine):
    await engine.sleep(1)
    with pytest.raises(EngineSleepingError):
        await collect(engine, "asleep", "hi", greedy(2))
    await engine.wake_up()
    assert (await collect(engine, "awake", "hi", greedy(2)))[-1].finished
    assert await engine.reset_prefix_cache()


async def test_weight_updates_run_in_the_engine_process(tmp_path):
    old_dir, new_dir = tiny_model("llama"), tiny_model("llama", seed=1)
    engine = AsyncLLM(config(old_dir, core_process=True))
    try:
        before = await texts(engine, "old")
        assert engine.weight_version == "0"
        assert await engine.update_weights_from_disk(str(new_dir)) == "1"
        assert engine.weight_version == "1"
        after = await texts(engine, "new")
        assert after != before
        outputs = await collect(engine, "version", "hi", greedy(2))
        assert outputs[-1].weight_version == "1"
    finally:
        engine.shutdown()
    on_thread = AsyncLLM(config(new_dir))
    try:
        assert await texts(on_thread, "reference") == after
    finally:
        on_thread.shutdown()


async def test_a_killed_engine_process_fails_open_requests(llama_dir):
    engine = AsyncLLM(config(llama_dir, core_process=True))
    try:
        stream = engine.generate("doomed", "a long story", greedy(None))
        await stream.__anext__()
        os.kill(engine._engine.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.run_in_engine(lambda core: None)
        with pytest.raises(EngineDeadError):
            engine.add_request("late", "hi", greedy(2))
    finally:
        engine.shutdown()


def test_the_engine_process_dies_with_its_parent(llama_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        import time
        from baton.services.engine import AsyncLLM
        from baton.services.engine.config import EngineConfig
        engine = AsyncLLM(EngineConfig.from_kwargs(model={str(llama_dir)!r}, num_kv_blocks=16, core_process=True))
        print(engine._engine.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_until(lambda: not _alive(child), timeout_s=20, what="the orphaned engine process to exit")
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_core_that_fails_to_build_raises_from_the_constructor(tmp_path):
    with pytest.raises(Exception, match="config.json|No such file|not a directory|does not exist"):
        AsyncLLM(EngineConfig.from_kwargs(model=str(tmp_path / "missing-model"), core_process=True))


def test_tensor_parallel_engines_stay_on_a_thread(llama_dir):
    with pytest.raises(ValueError, match="core_process needs tensor_parallel_size 1 \\(it is 2\\)"):
        config(llama_dir, core_process=True, tensor_parallel_size=2)
    assert config(llama_dir, core_process=False, tensor_parallel_size=2).runner.core_process is False
