"""What a replica reports through Serve's `record_autoscaling_stats` hook: the engine worker
without Ray (its Serve methods called directly), and the meters on a fake clock."""

from __future__ import annotations

import pytest
from baton.services.autoscaling import signals
from baton.services.autoscaling.signals import ReplicaSignals
from baton.services.engine import SamplingParams
from baton.services.engine.api.handover import Handover
from baton.services.engine.api.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.services.engine.api.sampling_params import RequestOutputKind
from baton.services.engine.config import EngineConfig
from baton.services.worker_calls import DecodeCall, GenerateCall
from baton.services.workers.engine_worker import EngineWorker
from testlib.fake_clock import FakeClock

PROMPT = list(range(100, 164))


def output(request_id: str, num_tokens: int, finished: bool = False, preemptions: int = 0) -> RequestOutput:
    return RequestOutput(
        request_id,
        None,
        PROMPT,
        [CompletionOutput(0, "", list(range(num_tokens)), None, None)],
        finished,
        0,
        RequestMetrics(0.0, num_preemptions=preemptions),
    )


def test_prefill_rate_counts_busy_time_once_for_overlapping_prompts():
    clock = FakeClock(100.0)
    meter = ReplicaSignals(window_s=10.0, clock=clock)
    meter.prefill_started()
    meter.prefill_started()
    clock.now += 1.0
    meter.prefill_finished(300)
    clock.now += 1.0
    meter.prefill_finished(100)
    assert meter.prefill_tokens_per_s() == pytest.approx(200.0)  # 400 tokens in 2 busy seconds
    clock.now += 5.0  # idle time does not lower the capacity estimate
    assert meter.prefill_tokens_per_s() == pytest.approx(200.0)
    clock.now += 10.0  # past the window: unmeasured again
    assert meter.prefill_tokens_per_s() == 0.0


def test_tpot_and_preemptions_from_delta_outputs():
    clock = FakeClock(100.0)
    meter = ReplicaSignals(window_s=10.0, clock=clock)
    meter.output(output("a", 1))
    for _ in range(4):
        clock.now += 0.05
        meter.output(output("a", 1))
    clock.now += 0.3
    meter.output(output("a", 2, preemptions=1))  # a preemption: a slow gap carrying two tokens
    assert meter.tpot_s() == pytest.approx((4 * 0.05 + 0.3) / 6)
    report = meter.report(_stats(), num_queued=0)
    assert report[signals.PREEMPTIONS_PER_S] == pytest.approx(0.1)
    assert all(isinstance(v, float) for v in report.values())  # Serve disables anything else


def _stats():
    from baton.services.engine.stats import EngineStats

    return EngineStats(3, 2, 500, 64, 16, 0.75, 0, 0)


async def test_record_autoscaling_stats_of_a_prefill_and_a_decode_worker(llama_dir):
    def make(role):
        config = EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, block_size=16, role=role)
        return EngineWorker(role, config, "tiny", replica_id=f"{role}-test")

    prefill, decode = make("prefill"), make("decode")
    try:
        assert (await prefill.record_autoscaling_stats())[signals.PREFILL_TOKENS_PER_S] == 0.0
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        call = GenerateCall("r", PROMPT, params)
        first = await prefill.prefill(call)
        async for _ in decode.decode(DecodeCall(call, Handover.decode(first.token_ids, first.kv_transfer_params))):
            pass
        report = await prefill.record_autoscaling_stats()
        assert report[signals.PREFILL_TOKENS_PER_S] > 0
        assert report[signals.WAITING_PROMPT_TOKENS] == 0.0
        decoded = await decode.record_autoscaling_stats()
        assert decoded[signals.TPOT_S] > 0 and decoded[signals.KV_USAGE] >= 0.0
        assert set(decoded) == set(report)
    finally:
        prefill.shutdown()
        decode.shutdown()
