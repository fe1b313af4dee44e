"""The engine worker without Ray: its Serve methods called directly, as the gateway calls them
(a prefill worker and a decode worker in one process hand a prompt's K/V over gloo)."""

from __future__ import annotations

import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.handover import Handover, KVPath
from baton.services.engine.api.sampling_params import RequestOutputKind
from baton.services.engine.config import EngineConfig
from baton.services.kv_transfer.config import FaultInjection
from baton.services.serving_errors import ServerOverloadedError
from baton.services.worker_calls import DecodeCall, GenerateCall
from baton.services.workers.admission import AdmissionLimits
from baton.services.workers.engine_worker import EngineWorker
from testlib.worker_stats import wait_for_stats as wait_for

PROMPT = list(range(100, 150))


def make_worker(llama_dir, role: str, **kwargs) -> EngineWorker:
    config = EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, block_size=16, role=role)
    return EngineWorker(role, config, "tiny", replica_id=f"{role}-test", **kwargs)


@pytest.fixture
def workers(llama_dir):
    made: list[EngineWorker] = []

    def make(role: str, **kwargs) -> EngineWorker:
        made.append(make_worker(llama_dir, role, **kwargs))
        return made[-1]

    yield make
    for worker in made:
        worker.shutdown()


def call(request_id: str, max_tokens: int = 6) -> GenerateCall:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    return GenerateCall(request_id, PROMPT, params)


async def collect(stream) -> list:
    return [output async for output in stream]


async def test_generate_streams_deltas_named_by_the_worker(workers):
    worker = workers("colocated")
    outputs = await collect(worker.generate(call("g")))
    assert outputs[-1].finished and sum(len(o.token_ids) for o in outputs) == 6
    assert {o.worker_id for o in outputs} == {worker.worker_id}
    stats = await worker.check_integrity()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_prefill_then_decode_equals_colocated(workers):
    colocated, prefill, decode = workers("colocated"), workers("prefill"), workers("decode")
    expected = [t for o in await collect(colocated.generate(call("c"))) for t in o.token_ids]

    first = await prefill.prefill(call("pd"))
    assert first.kv_transfer_params is not None and first.worker_id == prefill.worker_id
    rest = await collect(
        decode.decode(DecodeCall(call("pd"), Handover.decode(first.token_ids, first.kv_transfer_params)))
    )
    assert [*first.token_ids, *(t for o in rest for t in o.token_ids)] == expected
    assert rest[-1].kv_path is KVPath.TRANSFERRED and rest[-1].worker_id == decode.worker_id
    for worker in (prefill, decode):  # the lease ends once the send is reported; every block comes back
        stats = await wait_for(worker, lambda s: s.num_kv_leases == 0 and s.num_free_kv_blocks == s.num_kv_blocks)
        assert stats.num_kv_receiving == 0


async def test_a_one_token_request_ends_on_the_prefill_worker(workers):
    prefill = workers("prefill")
    first = await prefill.prefill(call("one", max_tokens=1))
    assert first.finished and first.finish_reason == "length" and first.kv_transfer_params is None
    assert (await prefill.check_integrity()).num_kv_leases == 0


async def test_a_full_queue_is_refused_with_the_numbers(workers):
    worker = workers("colocated", admission=AdmissionLimits(max_waiting_requests=0))
    with pytest.raises(ServerOverloadedError, match=r"has 0 requests waiting to start \(limit 0\)"):
        await collect(worker.generate(call("full")))
    assert (await worker.check_integrity()).num_running == 0


async def test_fault_injection_needs_a_connector(workers):
    worker = workers("colocated")
    with pytest.raises(RuntimeError, match="no KV connector"):
        await worker.set_kv_faults(FaultInjection(drop=True))


async def test_model_info_and_abort(workers):
    worker = workers("decode")
    info = await worker.model_info()
    assert (info.model, info.role, info.block_size, info.worker_id) == ("tiny", "decode", 16, worker.worker_id)
    assert await worker.abort("nothing") is False
    stream = worker.generate(call("a", max_tokens=50))
    first = await stream.__anext__()
    assert not first.finished
    assert await worker.abort("a") is True
    await stream.aclose()
    stats = await worker.check_integrity()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_a_one_rank_replica_runs_its_engine_core_in_a_process_of_its_own(workers, llama_dir):
    from baton.services.engine.api.engine_process import EngineProcess
    from baton.services.workers.engine_worker import _with_core_process

    assert isinstance(workers("colocated").llm._engine, EngineProcess)
    config = EngineConfig.from_kwargs(model=str(llama_dir))
    assert _with_core_process(config).runner.core_process is True
    kept = EngineConfig.from_kwargs(model=str(llama_dir), core_process=False)
    assert _with_core_process(kept).runner.core_process is False
    sharded = EngineConfig.from_kwargs(model=str(llama_dir), tensor_parallel_size=2)
    assert _with_core_process(sharded).runner.core_process is False
